"""Compile flash-linear-attention's Triton kernels before a benchmark times them: one process per case, in parallel.

fla's ``chunk_gla`` autotunes its Triton kernels on the first forward+backward of each case (head size, head count,
initial state or not): 150-400 s in one process, almost all of it compiling configurations on the host's CPU (at
K = 256, V = 512 it outlasted a 390 s device call). :func:`precompile` runs that first call of every case the
benchmark will need in a process of its own, ``jobs`` at once, so the compiles overlap on the host's cores and land
in Triton's on-disk cache (``$TRITON_CACHE_DIR``, default ``~/.triton/cache``). The children keep no autotune
choices (``FLA_CACHE_RESULTS=0``: they time configurations on a GPU they share), so the benchmark process still
makes its own, alone on the GPU; from the cache that costs it the timing of the configurations only. Worth it with
a cold Triton cache and several cases (each child re-times its configurations every time: with a warm cache, or one
case, it only adds time); ``hpczeco bench gpu-gla --fla-jobs N`` asks for it.

A case is a string: ``shape:B,T,H,K,V`` (forward, then forward+backward; no initial state, no final state: what
``hpczeco bench gpu-gla`` times) or ``grid:K,V:T1,T2,...`` (forward+backward with an initial state and the final
state, B = H = 2, each length in turn: its ``--grid``). ``python -m hpczeco.drivers.fla_precompile CASE`` runs one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# the children compile; their autotune choices (made on a GPU they share) are neither kept nor read
CHILD_ENV = {"FLA_CACHE_RESULTS": "0", "TRITON_CACHE_AUTOTUNING": "0"}
TAIL_CHARS = 600


def cases(shapes: Iterable[Sequence[int]], grid_kv: Iterable[Sequence[int]] = (),
          grid_t: Sequence[int] = ()) -> list[str]:  # fmt: skip
    """The cases of a run, each once: one per shape ``(B, T, H, K, V)``, one per grid ``(K, V)`` over ``grid_t``."""
    out = [f"shape:{','.join(str(int(x)) for x in s)}" for s in shapes]
    if grid_t:
        ts = ",".join(str(int(t)) for t in grid_t)
        out += [f"grid:{int(k)},{int(v)}:{ts}" for k, v in grid_kv]
    return list(dict.fromkeys(out))


def parse_case(case: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """``(kind, dims, lengths)`` of a case string; ValueError names what is wrong."""
    kind, _, rest = case.partition(":")
    try:
        if kind == "shape":
            dims = tuple(int(x) for x in rest.split(","))
            if len(dims) == 5 and min(dims) >= 1:
                return kind, dims, ()
        elif kind == "grid":
            kv, _, ts = rest.partition(":")
            dims, lengths = tuple(int(x) for x in kv.split(",")), tuple(int(x) for x in ts.split(","))
            if len(dims) == 2 and min(dims) >= 1 and lengths and min(lengths) >= 1:
                return kind, dims, lengths
    except ValueError:
        pass
    raise ValueError(f"not a precompile case: {case!r} (expected 'shape:B,T,H,K,V' or 'grid:K,V:T1,T2,...')")


@dataclass
class Result:
    case: str
    seconds: float
    status: str  # "ok", "exit N", "timed out"
    tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def child_argv(case: str) -> list[str]:
    return [sys.executable, "-m", "hpczeco.drivers.fla_precompile", case]


def _stop(proc: subprocess.Popen) -> None:
    """Kill a child and everything it started (its compilers: it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def precompile(todo: Sequence[str], jobs: int, timeout_s: float, say: Callable[[str], None] = print,
               argv_of: Callable[[str], list[str]] = child_argv, poll_s: float = 0.5) -> list[Result]:  # fmt: skip
    """Run every case (each once) in its own process, at most ``jobs`` at once; a process past ``timeout_s`` (counted
    from its start) is killed with the processes it started and reported as timed out. Never raises for a case: the
    benchmark then compiles what is left itself; on any exception here (an interrupt too) the running children are
    killed before it propagates. Returns one :class:`Result` per distinct case, in the order given."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    todo = list(dict.fromkeys(todo))
    env = {**os.environ, **CHILD_ENV}
    pending, running, done = list(todo), {}, {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                case = pending.pop(0)
                log = tempfile.TemporaryFile()  # not a pipe: a chatty child must never block on a full one
                proc = subprocess.Popen(argv_of(case), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
                running[case] = (proc, time.monotonic(), log)
            time.sleep(poll_s)
            for case, (proc, t0, log) in list(running.items()):
                killed = False
                if proc.poll() is None:
                    if time.monotonic() - t0 <= timeout_s:
                        continue
                    _stop(proc)
                    killed = True
                proc.wait()
                secs = time.monotonic() - t0
                log.seek(max(0, log.seek(0, os.SEEK_END) - 4 * TAIL_CHARS))
                out = log.read().decode(errors="replace")
                log.close()
                del running[case]
                status = "timed out" if killed else ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
                done[case] = Result(case, round(secs, 1), status, out[-TAIL_CHARS:])
                say(f"fla precompile {case}: {status} in {secs:.0f} s")
    finally:
        for proc, _, log in running.values():  # only after an exception: no child outlives the call
            _stop(proc)
            proc.wait()
            log.close()
    return [done[c] for c in todo]


def run_case(case: str) -> None:
    """The first forward+backward of one case on the GPU (the compiles are what it is for)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from fla.ops.gla import chunk_gla  # noqa: PLC0415

    kind, dims, lengths = parse_case(case)
    dev, bf = "cuda", torch.bfloat16
    if kind == "shape":
        B, T, H, K, V = dims
        q, k = (torch.randn(B, T, H, K, device=dev, dtype=bf) for _ in range(2))
        v, do = (torch.randn(B, T, H, V, device=dev, dtype=bf) for _ in range(2))
        g = F.logsigmoid(torch.randn(B, T, H, K, device=dev) + 2).to(bf)
        with torch.no_grad():
            chunk_gla(q, k, v, g, scale=K**-0.5, output_final_state=False)
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
        o, _ = chunk_gla(*xs, scale=K**-0.5, output_final_state=False)
        o.backward(do)
    else:
        (K, V), B, H = dims, 2, 2
        for T in lengths:
            xs = [torch.rand(B, T, H, n, device=dev).to(bf).requires_grad_(True) for n in (K, K, V)]
            g = F.logsigmoid(torch.rand(B, T, H, K, device=dev)).to(bf).requires_grad_(True)
            h0 = torch.rand(B, H, K, V, device=dev, requires_grad=True)
            o, ht = chunk_gla(*xs, g, scale=K**-0.5, initial_state=h0, output_final_state=True)
            torch.autograd.backward((o, ht), (torch.randn_like(o), torch.randn_like(ht)))
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\nusage: python -m hpczeco.drivers.fla_precompile CASE", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        parse_case(args[0])
    except ValueError as exc:
        print(f"fla_precompile: {exc}", file=sys.stderr)
        return 2
    t0 = time.time()
    run_case(args[0])
    print(f"fla_precompile {args[0]}: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
