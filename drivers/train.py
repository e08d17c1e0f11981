"""`hpczeco train`: train a small byte-level GLA language model with ZeCO sequence parallelism.

Each step draws one long sequence (``--seq`` tokens, ``--batch`` of them) from the corpus; every rank
holds a contiguous slice of it and runs the model on that slice, the GLA layers exchanging their
states with ``hpczeco.ZeCOGLA`` (All-Scan). Each rank predicts the next token of its slice (the target
of its last token is the first token of the next rank's slice: every rank reads the same global
window). Parameters are replicated; gradients are summed over ranks in rank order (deterministic,
identical on every rank) and Adam updates every replica the same way.

Run it as ``mpiexec -n 4 hpczeco train --steps 20`` (or ``srun``). Rank 0 shows a progress bar with
tokens/s, writes a JSON-lines log (``--log``) and checkpoints (``--ckpt-dir``, every ``--ckpt-every``
steps and at the end). ``--resume`` continues from the newest valid checkpoint: with the same rank
count the result equals an uninterrupted run bitwise on the CPU; on another rank count it equals it
within floating-point tolerance (the slices, hence the sums, are split differently).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .checkpoint import CheckpointWriter, load_latest
from .data import VOCAB, Sampler, corpus_id, load_corpus, slice_bounds
from .lm import GLALM, LMConfig, init_params, make_mixers, param_shapes

#: fault injection for the reliability tests: ``RANK:STEP`` -- that rank SIGKILLs itself in the middle of
#: that step (after its forward/backward, before the gradient allreduce). Not for production use.
FAULT_KILL_ENV = "HPCZECO_FAULT_KILL"
#: fault injection: ``RANK:STEP`` -- that rank SIGSTOPs itself in that step (where FAULT_KILL would kill it): the
#: others must end within the collective timeout, naming it. Not for production use.
FAULT_STOP_ENV = "HPCZECO_FAULT_STOP"
#: fault injection: ``RANK:STEP`` -- that rank raises an internal error (RuntimeError) in that step: the job must
#: end at once (the CLI aborts it), with the rank's traceback. Not for production use.
FAULT_RAISE_ENV = "HPCZECO_FAULT_RAISE"
#: ``N``: every rank prints one ``soak:`` line (VmRSS, scan handles in flight, pooled buffers) to stderr
#: after step N and after the last step (leak checks in the reliability tests).
SOAK_REPORT_ENV = "HPCZECO_SOAK_REPORT"
#: with --ckpt-dir, this signal (sent by a batch script before the walltime, e.g. Slurm's --signal=B:USR1@120
#: forwarded to the ranks) makes every rank finish its step, write a checkpoint and stop.
CHECKPOINT_SIGNAL = signal.SIGUSR1


class _SignalFlag:
    """Sets ``raised`` when ``signum`` arrives (installed from the main thread only; else inert)."""

    def __init__(self, signum: int):
        self.signum: int | None = signum
        self.raised = False
        try:
            self._old = signal.signal(signum, self._handler)
        except ValueError:  # not the main thread
            self.signum = None

    def _handler(self, signum, frame) -> None:
        self.raised = True

    def restore(self) -> None:
        if self.signum is not None:
            signal.signal(self.signum, self._old)


def _fault_at(name: str = FAULT_KILL_ENV) -> tuple[int, int] | None:
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        r, s = env.split(":")
        return int(r), int(s)
    except ValueError:
        raise ValueError(f"${name} must be RANK:STEP, got {env!r}") from None


def _rss_kb() -> int:
    """This process's resident set size (kB) from /proc/self/status (-1 where unavailable)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _soak_line(comm, step: int) -> str:
    from hpczeco.collectives.scan import scan_stats

    st = scan_stats(comm)
    return (f"soak: rank {comm.Get_rank()} step {step} rss_kb {_rss_kb()} inflight {st['inflight']} "
            f"started {st['started']} pooled {st['pooled']} pooled_bytes {st['pooled_bytes']}\n")

__all__ = ["build_parser", "run", "main", "TrainResult", "allreduce_sum", "FlatParams"]

SCANS = ("ring", "tree", "allgather", "serial", "exscan", "auto")


def build_parser(prog: str = "hpczeco train") -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    d = ap.add_argument_group("data")
    d.add_argument("--text", default=None, help="training text file (default: this Python's stdlib *.py sources)")
    d.add_argument("--corpus-bytes", type=int, default=8 << 20, help="read at most this many bytes (default 8 MiB)")
    d.add_argument("--seq", type=int, default=1024, help="tokens per sequence, split over the ranks (default 1024)")
    d.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    m = ap.add_argument_group("model")
    m.add_argument("--d-model", type=int, default=64, help="model width (embedding and GLA layers)")
    m.add_argument("--layers", type=int, default=2, help="GLA layers")
    m.add_argument("--heads", type=int, default=2, help="GLA heads per layer (must divide --d-model)")
    m.add_argument("--d-ff", type=int, default=0, help="MLP width (default 0: 4 x d_model)")
    m.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="parameters and activations")
    m.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="cpu (numpy) or gpu (CuPy; one rank per GPU by local rank; the GLA state exchange uses "
                   "HPCZECO_TRANSPORT: cuda-aware | staged | nccl | auto)")
    o = ap.add_argument_group("optimiser")
    o.add_argument("--steps", type=int, default=20, help="train up to this step (default 20)")
    o.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    o.add_argument("--warmup", type=int, default=0, help="linear warm-up steps (default 0)")
    o.add_argument("--beta1", type=float, default=0.9, help="Adam first-moment decay")
    o.add_argument("--beta2", type=float, default=0.99, help="Adam second-moment decay")
    o.add_argument("--eps", type=float, default=1e-8, help="Adam epsilon")
    o.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW style)")
    o.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    o.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data order")
    p = ap.add_argument_group("parallelism")
    p.add_argument("--mixer", choices=("auto", "zeco", "chunk", "recurrent"), default="auto",
                   help="GLA implementation: zeco (hpczeco.ZeCOGLA, any rank count; 'auto' picks it), "
                   "chunk/recurrent (one rank)")
    p.add_argument("--topology", dest="scan", choices=SCANS, default="ring",
                   help="ZeCO state scan (default ring All-Scan)")
    p.add_argument("--blocks", type=int, default=None, help="ring pipeline blocks (default: cost model)")
    p.add_argument("--chunk-size", type=int, default=64, help="GLA chunk length (tokens)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="BLAS threads per rank (default 1: ranks already fill the cores; 0: leave as is)")
    p.add_argument("--allreduce", choices=("ordered", "mpi"), default="ordered",
                   help="gradient sum: 'ordered' (allgather + sum in rank order: deterministic, identical on "
                   "every rank; P copies of the gradient in memory) or 'mpi' (MPI_Allreduce)")
    c = ap.add_argument_group("output")
    c.add_argument("--log", default=None, help="JSON-lines log file (rank 0)")
    c.add_argument("--ckpt-dir", default=None, help="checkpoint folder (none: no checkpoints)")
    c.add_argument("--ckpt-every", type=int, default=0,
                   help="checkpoint every N steps (0: only at the end); with --ckpt-dir there is always one at the end")
    c.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    c.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --ckpt-dir")
    c.add_argument("--no-progress", action="store_true",
                   help="no progress bar (batch jobs; the bar is shown only when stdout is a terminal)")
    c.add_argument("--print-every", type=int, default=10,
                   help="without a progress bar, print a line every N steps (0: never; default 10)")
    c.add_argument("--quiet", action="store_true", help="print only the summary")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("seq", "batch", "d_model", "layers", "heads", "chunk_size", "keep"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("steps", "warmup", "ckpt_every", "d_ff"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "clip"):
        if not math.isfinite(getattr(args, name)):
            ap.error(f"--{name.replace('_', '-')} must be a finite number, got {getattr(args, name)}")
    if args.lr <= 0 or not 0 <= args.beta1 < 1 or not 0 <= args.beta2 < 1 or args.eps <= 0 or args.clip < 0:
        ap.error("need --lr > 0, 0 <= --beta1, --beta2 < 1, --eps > 0, --clip >= 0")
    if args.weight_decay < 0:
        ap.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.resume and not args.ckpt_dir:
        ap.error("--resume needs --ckpt-dir")
    if args.device == "gpu" and args.dtype == "float64":
        ap.error("--device gpu takes --dtype float32 (the GPU GLA kernels have no float64); use the CPU for float64")
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")


@dataclass
class TrainResult:
    """What a run produced (identical on every rank)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> loss, steps run by this invocation
    params: dict[str, np.ndarray] = field(default_factory=dict)
    step: int = 0
    start_step: int = 0
    tokens_per_s: float = 0.0  # median over steps (the first excluded when there are several), rank 0's clock
    wall_s: float = 0.0  # the whole loop, checkpoints included
    checkpoint: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    stopped_by: str | None = None  # "SIGUSR1" when CHECKPOINT_SIGNAL ended the run early (after a checkpoint)


class FlatParams:
    """Parameters (and Adam moments) as one flat vector with named views into it."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: np.dtype):
        self.shapes = shapes
        self.sizes = {n: int(np.prod(s)) for n, s in shapes.items()}
        self.size = sum(self.sizes.values())
        self.flat = np.zeros(self.size, dtype=dtype)
        self.views: dict[str, np.ndarray] = {}
        off = 0
        for n, s in shapes.items():
            self.views[n] = self.flat[off:off + self.sizes[n]].reshape(s)
            off += self.sizes[n]

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        missing = [n for n in self.shapes if n not in arrays]
        if missing:
            raise ValueError(f"missing arrays {missing[:4]}")
        for n, s in self.shapes.items():
            if tuple(arrays[n].shape) != tuple(s):
                raise ValueError(f"array {n} has shape {arrays[n].shape}, expected {s}")
            self.views[n][...] = arrays[n]

    def pack(self, grads: dict[str, Any]) -> np.ndarray:
        """Gradients (numpy or CuPy) as one flat host vector in parameter order."""
        from hpczeco.base.backend import get_array_module, to_numpy

        xp = get_array_module(grads[next(iter(self.shapes))])
        flat = xp.concatenate([grads[n].reshape(-1) for n in self.shapes])
        return to_numpy(flat).astype(self.flat.dtype, copy=False)

    def on_device(self) -> dict[str, Any]:
        """A CuPy copy of the parameters (one host->device copy), as named views of one device vector."""
        import cupy

        flat = cupy.asarray(self.flat)
        out, off = {}, 0
        for n, s in self.shapes.items():
            out[n] = flat[off:off + self.sizes[n]].reshape(s)
            off += self.sizes[n]
        return out


def select_gpu(comm) -> str:
    """Use GPU ``local rank % visible GPUs`` (one rank per GPU; with ``--gpus-per-task=1`` every rank
    sees only its own GPU, as device 0). Collective over ``comm``. Returns a description."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    lrank, lsize = local.Get_rank(), local.Get_size()
    local.Free()
    err, n = None, 0
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            err = "no CUDA device visible"
    except Exception as exc:  # noqa: BLE001 - reported collectively
        err = f"CuPy/CUDA unavailable ({type(exc).__name__}: {exc})"
    from hpczeco.collectives.agree import collective_check

    collective_check(comm, "--device gpu", ValueError(err) if err else None)
    dev = lrank % n
    cupy.cuda.Device(dev).use()
    share = f" (shared by {lsize // n + (1 if lsize % n else 0)} ranks)" if lsize > n else ""
    return f"GPU {dev} of {n}{share}"


def set_blas_threads(n: int) -> str:
    """Limit the BLAS behind numpy to ``n`` threads (``threadpoolctl`` if installed, else OpenBLAS's own
    ``*_set_num_threads`` through ctypes). Several ranks per node each spawning a thread per core
    oversubscribes the cores: small matmuls then run 10-100x slower. Returns what was done."""
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415

        threadpool_limits(n, user_api="blas")
        return f"threadpoolctl: {n}"
    except ImportError:
        pass
    import ctypes
    import glob

    libdirs = [os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs"), os.path.dirname(np.__file__)]
    for path in sorted(p for d in libdirs for p in glob.glob(os.path.join(d, "*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn(int(n))
                return f"{os.path.basename(path)}: {n}"
    return "unchanged (no OpenBLAS found; set OMP_NUM_THREADS/OPENBLAS_NUM_THREADS)"


def _terminal_width() -> int:
    """Columns of the terminal on stdout; 0 when stdout is not a terminal (a log file, a pipe) or has no size."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (AttributeError, OSError, ValueError):
        return 0


def allreduce_sum(comm, x: np.ndarray, how: str = "ordered") -> np.ndarray:
    """Sum of ``x`` (1-D) over ranks, the same on every rank. 'ordered': allgather and add in rank
    order (bitwise reproducible for a fixed rank count); 'mpi': ``MPI_Allreduce``. The exchange
    honours ``$HPCZECO_COLLECTIVE_TIMEOUT`` (:mod:`hpczeco.collectives.timed`)."""
    from hpczeco.collectives import timed

    P = comm.Get_size()
    if P == 1:
        return x.copy()
    if how == "mpi":
        from mpi4py import MPI

        out = x.copy()
        timed.Allreduce(comm, out, MPI.SUM, "gradient sum")
        return out
    buf = np.empty((P, x.size), dtype=x.dtype)
    timed.Allgather(comm, np.ascontiguousarray(x), buf, "gradient sum")
    acc = buf[0].copy()
    for r in range(1, P):
        acc += buf[r]
    return acc


def open_outputs(args: argparse.Namespace, comm) -> Any:
    """Check every output path before the first collective and open the log: the same ``ValueError`` on
    every rank when one is unusable (a missing folder, a directory as ``--log``, a file as ``--ckpt-dir``).

    Only rank 0 writes the log and the checkpoint files, so rank 0 checks them -- it opens ``--log`` for
    appending and creates ``--ckpt-dir`` -- and broadcasts its verdict (collective over ``comm``, honouring
    the collective timeout). Returns the open log on rank 0 (None elsewhere or without ``--log``)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    log, err = None, None
    if rank == 0:
        try:
            if args.log:
                if os.path.isdir(args.log):
                    raise ValueError(f"--log {args.log} is a directory; give a file name")
                parent = os.path.dirname(os.path.abspath(args.log))
                if not os.path.isdir(parent):
                    raise ValueError(f"--log {args.log}: the folder {parent} does not exist")
                log = open(args.log, "a")  # noqa: SIM115 - closed by run()
            if args.ckpt_dir:
                if os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
                    raise ValueError(f"--ckpt-dir {args.ckpt_dir} exists and is not a folder")
                os.makedirs(args.ckpt_dir, exist_ok=True)
                if not os.access(args.ckpt_dir, os.W_OK | os.X_OK):
                    raise ValueError(f"--ckpt-dir {args.ckpt_dir} is not writable")
        except ValueError as exc:
            err = str(exc)
        except OSError as exc:
            err = f"cannot use {exc.filename or 'an output path'}: {exc.strerror or exc}"
    if size > 1:
        from hpczeco.collectives import timed

        err = timed.bcast(comm, err, 0, "hpczeco train (output paths)")
    if err:
        if log is not None:
            log.close()
        raise ValueError(err)
    return log


def resume_checks(shapes: dict[str, tuple[int, ...]], dtype: np.dtype, n_tokens: int, seq: int, batch: int):
    """``(expect_arrays, validate)`` for :func:`~.checkpoint.load_latest`: the exact arrays of this model
    (parameters and both Adam moments, their shapes and ``dtype``) and the model-level checks of a candidate
    checkpoint -- ``adam_t`` an int in ``[0, step]``, a sampler state this corpus can continue from, every
    array finite, the second moments non-negative -- so a checkpoint that fails them is skipped (with the
    reason) in favour of an older one instead of ending the run."""
    expect = {f"{prefix}{n}": (tuple(s), dtype) for prefix in ("params/", "adam/m/", "adam/v/")
              for n, s in shapes.items()}

    def validate(step: int, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        t = attrs.get("adam_t")
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"attribute adam_t is {type(t).__name__} {t!r}, expected an int")
        if not 0 <= t <= step:
            raise ValueError(f"attribute adam_t = {t} is outside [0, step {step}]")
        state = attrs.get("sampler")
        try:
            if not isinstance(state, dict):
                raise TypeError(f"a {type(state).__name__}, expected a dict")
            drawn = state.get("drawn")
            if isinstance(drawn, bool) or not isinstance(drawn, int) or drawn < 0:
                raise ValueError(f"drawn = {drawn!r}, expected an int >= 0")
            Sampler(n_tokens, seq, batch, seed=0).set_state(state)
        except Exception as exc:  # noqa: BLE001 - any malformed state
            raise ValueError(f"attribute sampler is not a valid sampler state ({type(exc).__name__}: {exc})") from None
        for name, a in arrays.items():
            if not np.isfinite(a).all():
                raise ValueError(f"array {name!r} holds NaN or Inf")
            if name.startswith("adam/v/") and (a < 0).any():
                raise ValueError(f"array {name!r} (Adam second moment) holds negative values")

    return expect, validate


def run(argv: list[str] | None, comm, prog: str = "hpczeco train") -> TrainResult:
    """Parse ``argv`` and train on ``comm`` (collective). Returns the same :class:`TrainResult` on every rank."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    check_args(ap, args)
    P = comm.Get_size()
    if args.seq < P:
        ap.error(f"--seq {args.seq} is shorter than the number of ranks {P}")
    log = open_outputs(args, comm)
    try:
        return _train(ap, args, comm, log, argv)
    finally:
        if log is not None and not log.closed:
            log.close()


def _train(ap: argparse.ArgumentParser, args: argparse.Namespace, comm, log: Any,
           argv: list[str] | None) -> TrainResult:
    rank, P = comm.Get_rank(), comm.Get_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 and not args.quiet else (lambda *a: None)
    dtype = np.dtype(args.dtype)
    if args.blas_threads > 0:
        set_blas_threads(args.blas_threads)

    tokens, desc = load_corpus(comm, args.text, args.corpus_bytes)
    cfg = LMConfig(vocab=VOCAB, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, d_ff=args.d_ff)
    config = {
        "model": cfg.to_dict(), "seq": args.seq, "batch": args.batch, "dtype": args.dtype, "seed": args.seed,
        "lr": args.lr, "warmup": args.warmup, "beta1": args.beta1, "beta2": args.beta2, "eps": args.eps,
        "weight_decay": args.weight_decay, "clip": args.clip, "corpus": corpus_id(tokens),
        "corpus_tokens": int(tokens.size),
    }  # fmt: skip
    sampler = Sampler(tokens.size, args.seq, args.batch, seed=args.seed + 1)
    shapes = param_shapes(cfg)
    params, adam_m, adam_v = FlatParams(shapes, dtype), FlatParams(shapes, dtype), FlatParams(shapes, dtype)
    params.load(init_params(cfg, args.seed, dtype))
    adam_t = 0
    step0 = 0
    if args.resume:
        expect, validate = resume_checks(shapes, dtype, int(tokens.size), args.seq, args.batch)
        found = load_latest(args.ckpt_dir, comm, expect_config=config, expect_arrays=expect, validate=validate)
        if found is None:
            say(f"resume: no checkpoint in {args.ckpt_dir}; starting from step 0")
        else:
            step0, arrays, attrs = found
            params.load({n: arrays[f"params/{n}"] for n in shapes})
            adam_m.load({n: arrays[f"adam/m/{n}"] for n in shapes})
            adam_v.load({n: arrays[f"adam/v/{n}"] for n in shapes})
            adam_t = int(attrs["adam_t"])
            sampler.set_state(attrs["sampler"])
            say(f"resume: step {step0} from {args.ckpt_dir} (written by {attrs['nranks']} rank(s), now {P})")
    if args.device == "gpu":
        where = select_gpu(comm)
        say(f"  device: {where} on rank 0; gradients summed and Adam applied on the host")
    mixers = make_mixers(args.mixer, cfg.n_layers, comm, scan=args.scan, blocks=args.blocks, chunk_size=args.chunk_size)
    model = GLALM(cfg, mixers)
    writer = CheckpointWriter(args.ckpt_dir, comm, keep=args.keep) if args.ckpt_dir else None

    def emit(rec: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    def save(step: int, loss: float) -> str:
        arrays = {f"params/{n}": a for n, a in params.views.items()}
        arrays.update({f"adam/m/{n}": a for n, a in adam_m.views.items()})
        arrays.update({f"adam/v/{n}": a for n, a in adam_v.views.items()})
        attrs = {
            "config": config, "adam_t": adam_t, "sampler": sampler.state(), "data_pos": sampler.drawn,
            "tokens_seen": sampler.drawn * args.seq, "loss": loss,
            "run": {"ranks": P, "scan": args.scan, "blocks": args.blocks, "chunk_size": args.chunk_size,
                    "mixer": args.mixer, "allreduce": args.allreduce},
        }  # fmt: skip
        path = str(writer.save(step, arrays, attrs))
        emit({"event": "checkpoint", "step": step, "path": path})
        return path

    start, stop = slice_bounds(args.seq, P, rank)
    n_total = args.batch * args.seq
    result = TrainResult(start_step=step0, step=step0, config=config)
    say(f"hpczeco train: {P} rank(s), {sum(params.sizes.values())} parameters ({args.dtype}), "
        f"seq {args.seq} x batch {args.batch}, mixer {type(mixers[0]).__name__} scan {args.scan}")
    say(f"  corpus: {desc}")
    if args.log:
        say(f"  log: {os.path.abspath(args.log)}")
    if args.ckpt_dir:
        when = f"every {args.ckpt_every} steps and at the end" if args.ckpt_every else "at the end"
        say(f"  checkpoints: {os.path.abspath(args.ckpt_dir)} ({when})")
    from .console import compile_notice, warn_oversubscribed

    warn_oversubscribed(comm, ap.prog, say)  # collective
    emit({"event": "start", "step": step0, "ranks": P, "config": config, "argv": list(argv or [])})
    if args.steps > step0 and args.device == "cpu" and not args.quiet:
        compile_notice(rank, say)

    bar = None
    # the bar shares stdout with every other line of rank 0 (so the summary never lands inside it), and only on
    # a terminal: in a log file or a pipe its carriage-return redraws would pile up as copies of the bar
    if rank == 0 and not args.no_progress and not args.quiet and args.steps > step0 and _terminal_width() > 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=step0, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    b1, b2 = args.beta1, args.beta2
    loss = float("nan")
    t_run = time.perf_counter()
    rates: list[float] = []
    last_saved = step0 if args.resume else -1
    fault, sigstop_at, bug = _fault_at(FAULT_KILL_ENV), _fault_at(FAULT_STOP_ENV), _fault_at(FAULT_RAISE_ENV)
    soak_at = int(os.environ.get(SOAK_REPORT_ENV, "0") or 0)
    stop_flag = _SignalFlag(CHECKPOINT_SIGNAL) if writer is not None else None
    try:
        for step in range(step0 + 1, args.steps + 1):
            t0 = time.perf_counter()
            seqs = sampler.batch_tokens(tokens)  # [B, seq + 1], the same on every rank
            x, y = seqs[:, start:stop], seqs[:, start + 1:stop + 1]
            if args.device == "gpu":
                import cupy

                weights, x, y = params.on_device(), cupy.asarray(x), cupy.asarray(y)
            else:
                weights = params.views
            part, grads = model.loss_and_grads(weights, x, y, n_total)
            if fault is not None and fault == (rank, step):
                sys.stderr.write(f"hpczeco train: fault injection: rank {rank} SIGKILLs itself in step {step} "
                                 f"at t={time.time():.3f}\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if sigstop_at is not None and sigstop_at == (rank, step):
                sys.stderr.write(f"hpczeco train: fault injection: rank {rank} SIGSTOPs itself in step {step} "
                                 f"at t={time.time():.3f}\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
            if bug is not None and bug == (rank, step):
                sys.stderr.write(f"hpczeco train: fault injection: rank {rank} raises in step {step} "
                                 f"at t={time.time():.3f}\n")
                sys.stderr.flush()
                raise RuntimeError(f"fault injection: rank {rank} raises in step {step}")
            g = allreduce_sum(comm, params.pack(grads), args.allreduce)
            # the loss and "did any rank get CHECKPOINT_SIGNAL" in one reduction: all ranks stop at the same step
            raised = float(stop_flag is not None and stop_flag.raised)
            reduced = allreduce_sum(comm, np.array([part, raised], np.float64), args.allreduce)
            loss, signalled = float(reduced[0]), bool(reduced[1] > 0)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr")
            gnorm = float(np.sqrt(np.dot(g.astype(np.float64), g.astype(np.float64))))
            if args.clip and gnorm > args.clip:
                g *= dtype.type(args.clip / gnorm)
            adam_t += 1
            lr = args.lr * (min(1.0, adam_t / args.warmup) if args.warmup else 1.0)
            m, v, w = adam_m.flat, adam_v.flat, params.flat
            m *= dtype.type(b1)
            m += dtype.type(1 - b1) * g
            v *= dtype.type(b2)
            v += dtype.type(1 - b2) * (g * g)
            mhat = m / dtype.type(1 - b1**adam_t)
            vhat = v / dtype.type(1 - b2**adam_t)
            upd = mhat / (np.sqrt(vhat) + dtype.type(args.eps))
            if args.weight_decay:
                upd += dtype.type(args.weight_decay) * w
            w -= dtype.type(lr) * upd
            dt = time.perf_counter() - t0
            result.losses[step] = loss
            result.step = step
            rate = n_total / dt if dt > 0 else float("inf")
            emit({"event": "step", "step": step, "loss": loss, "grad_norm": gnorm, "lr": lr, "tokens": n_total,
                  "tokens_seen": sampler.drawn * args.seq, "step_s": dt, "tokens_per_s": rate, "ranks": P})
            rates.append(rate)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                bar.update(1)
            elif args.print_every and (step % args.print_every == 0 or step in (step0 + 1, args.steps)):
                say(f"  step {step:6d}/{args.steps}  loss {loss:.4f}  grad norm {gnorm:.3g}  {rate:,.0f} tokens/s")
            if writer is not None and args.ckpt_every and step % args.ckpt_every == 0:
                result.checkpoint = save(step, loss)
                last_saved = step
            if soak_at and (step == soak_at or step == args.steps):
                sys.stderr.write(_soak_line(comm, step))
                sys.stderr.flush()
            if signalled:
                result.stopped_by = signal.Signals(CHECKPOINT_SIGNAL).name
                say(f"hpczeco train: {result.stopped_by} received: checkpoint at step {step}, then stop "
                    "(continue with --resume)")
                break
        result.wall_s = time.perf_counter() - t_run
        result.tokens_per_s = float(np.median(rates[1:] if len(rates) > 1 else rates)) if rates else 0.0
        if writer is not None and last_saved != result.step:
            result.checkpoint = save(result.step, loss)
    finally:
        if stop_flag is not None:
            stop_flag.restore()
        if bar is not None:
            bar.close()
    result.params = {n: a.copy() for n, a in params.views.items()}
    emit({"event": "end", "step": result.step, "loss": loss, "tokens_per_s": result.tokens_per_s,
          "wall_s": result.wall_s, "checkpoint": result.checkpoint, "stopped_by": result.stopped_by})
    if log is not None:
        log.close()
    if rank == 0:
        if result.losses:
            first, last = result.losses[min(result.losses)], result.losses[max(result.losses)]
            ckpt = f", checkpoint {result.checkpoint}" if result.checkpoint else ""
            print(f"hpczeco train: steps {step0 + 1}..{result.step} on {P} rank(s): loss {first:.4f} -> {last:.4f}, "
                  f"{result.tokens_per_s:,.0f} tokens/s (median step), {result.wall_s:.1f} s{ckpt}", flush=True)
        else:
            print(f"hpczeco train: already at step {step0} (--steps {args.steps}); nothing to do", flush=True)
    return result


def main(argv: list[str] | None = None, prog: str = "hpczeco train") -> int:
    from mpi4py import MPI

    from .checkpoint import CheckpointError
    from .mpienv import launcher_mismatch

    mismatch = launcher_mismatch(MPI.COMM_WORLD.Get_size())
    if mismatch:  # refuse: each process would train alone on the whole sequence
        print(f"{prog}: error: {mismatch}", file=sys.stderr, flush=True)
        return 2
    try:
        run(argv, MPI.COMM_WORLD, prog=prog)
    except (CheckpointError, ValueError, FloatingPointError) as exc:  # raised on every rank alike
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

