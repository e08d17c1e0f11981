"""`hpczeco bench torch`: what the torch glue costs on a GPU, :func:`hpczeco.torch.chunk_gla` (autograd) against the
bare kernel calls.

For each shape, on torch's current stream, CUDA events around each call, the median of ``--repeats`` calls
after ``--warmup``:

- ``bare fwd``: :func:`hpczeco.gpu.gla.chunk_gla` on CuPy views made beforehand;
- ``torch fwd``: :func:`hpczeco.torch.chunk_gla` on tensors that require grad (the graph is recorded);
- ``bare fwd+bwd``: that forward, then :func:`hpczeco.gpu.gla.chunk_gla_bwd`;
- ``torch fwd+bwd``: the autograd forward, then ``torch.autograd.grad(o, (q, k, v, g), do)``;
- ``fla fwd`` / ``fla fwd+bwd``: flash-linear-attention's ``chunk_gla`` on the same tensors, when it imports
  (and ``with_fla``);
- ``glue ratio ... paired``: the median of the ratios of each torch call to the bare call timed beside it;
- ``ours vs fla``: the relative differences of o and the four gradients between the two on the same tensors;
- ``... in a row``: the same calls ``repeats`` times back to back between one pair of events, per call, the
  median of 5 such blocks: the host queues the next call while the GPU runs this one, as in a training loop;
- ``host ...``: the host's time per call (``time.perf_counter``, no synchronisation): the Python work alone.

The ratios ``torch / bare`` are the glue's cost (target: <= 1.05). Events bracket the host work too, so in the
one-call timings a gap where the GPU waits for the Python glue counts; in the in-a-row timings it counts only
where the host falls behind the GPU. The compared calls are interleaved (:func:`time_cuda`), so that a drift of
the host's speed between blocks of calls does not land on one side of a ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import benchkit
from .options import int_range

if TYPE_CHECKING:
    import torch

__all__ = ["time_cuda", "time_cuda_samples", "time_cuda_in_a_row", "bench_chunk_gla", "host_breakdown",
           "alone_breakdown", "profile_glue", "main"]

SHAPES = ((1, 32768, 16, 128, 128), (8, 4096, 16, 128, 128), (1, 32768, 32, 64, 64))


def time_cuda_samples(fns: dict[str, Callable[[], Any]], repeats: int = 20, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of each ``fn()`` timed alone between CUDA events on torch's current stream, with a
    synchronisation before each call (after ``warmup`` calls of each). The calls are interleaved -- repeat ``r``
    runs every ``fn`` once, in forward order for even ``r`` and reversed for odd ``r`` -- so that the compared
    calls see the same state of the host (whose speed drifts between blocks of calls on a shared machine)."""
    import torch  # noqa: PLC0415

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(repeats):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e-3)
    return times


def time_cuda(fns: dict[str, Callable[[], Any]], repeats: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each ``fn()`` of :func:`time_cuda_samples`."""
    return {name: statistics.median(t) for name, t in time_cuda_samples(fns, repeats, warmup).items()}


def time_cuda_in_a_row(fns: dict[str, Callable[[], Any]], repeats: int = 20, warmup: int = 3,
                       blocks: int = 5) -> dict[str, tuple[float, float]]:
    """Per ``fn``: ``(GPU seconds per call, host seconds per call)``, medians over ``blocks`` blocks of ``repeats``
    calls of ``fn()`` back to back between one pair of CUDA events (after ``warmup`` calls): the host enqueues
    while the GPU works, as in a training loop. The blocks of the ``fns`` alternate (as in :func:`time_cuda`)."""
    import torch  # noqa: PLC0415

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    gpu: dict[str, list[float]] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for b in range(blocks):
        for name, fn in order if b % 2 == 0 else order[::-1]:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            host[name].append((time.perf_counter() - t0) / repeats)
            end.record()
            end.synchronize()
            gpu[name].append(start.elapsed_time(end) * 1e-3 / repeats)
    return {name: (statistics.median(gpu[name]), statistics.median(host[name])) for name in fns}


def _fla() -> Callable | None:
    try:
        from fla.ops.gla import chunk_gla as fla_chunk_gla  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - fla absent or broken: its columns stay empty
        return None
    return fla_chunk_gla


def _dtype(dtype: Any) -> torch.dtype:
    """A torch dtype from its name (``"bfloat16"``) or itself."""
    import torch  # noqa: PLC0415

    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _inputs(B: int, T: int, H: int, K: int, V: int, dtype: Any, seed: int = 0) -> list[torch.Tensor]:
    """``[q, k, v, g, do]`` on the current CUDA device (q, k, v, g require grad; g a log gate, logsigmoid / 16)."""
    import torch  # noqa: PLC0415

    dtype = _dtype(dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k = rnd(B, T, H, K).to(dtype), rnd(B, T, H, K).to(dtype)
    v, do = rnd(B, T, H, V).to(dtype), rnd(B, T, H, V).to(dtype)
    g = (torch.nn.functional.logsigmoid(rnd(B, T, H, K)) / 16).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g)] + [do]


def compare_with(other: Callable, inputs: list[torch.Tensor], do: torch.Tensor) -> dict[str, float]:
    """Relative L2 differences ``|ours - other| / |other|`` of o and of the gradients of q, k, v, g, with
    :func:`hpczeco.torch.chunk_gla` and ``other`` (fla's ``chunk_gla``) called through autograd on the same tensors."""
    import torch  # noqa: PLC0415

    from hpczeco.torch import chunk_gla  # noqa: PLC0415

    outs = []
    for fn in (chunk_gla, other):
        o, _ = fn(*inputs)
        outs.append([o, *torch.autograd.grad(o, inputs, do)])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double(), b.detach().double()
        return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))

    return {name: rel(a, b) for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), *outs)}


def bench_chunk_gla(B: int, T: int, H: int, K: int, V: int, dtype: Any = "bfloat16",
                    repeats: int = 20, warmup: int = 3, seed: int = 0, with_fla: bool = True) -> dict[str, Any]:
    """Median seconds per call of the variants above for one shape ``[B, T, H, K]`` / ``[B, T, H, V]``
    (``dtype``: a torch dtype or its name)."""
    import torch  # noqa: PLC0415
    from hpczeco.gpu import gla as gpu_gla  # noqa: PLC0415

    from hpczeco.torch import chunk_gla  # noqa: PLC0415
    from hpczeco.torch._arrays import cuda_stream, device_index, to_device  # noqa: PLC0415

    dtype = _dtype(dtype)

    dev = torch.device("cuda", torch.cuda.current_device())
    *inputs, do = _inputs(B, T, H, K, V, dtype, seed)
    q, k, v, g = inputs
    with cuda_stream(device_index(dev)):
        cq, ck, cv, cg, cdo = (to_device(x) for x in (q, k, v, g, do))
    scale = K**-0.5

    def bare_fwd():  # timed inside cuda_stream: a CuPy caller is on its stream already
        gpu_gla.chunk_gla(cq, ck, cv, cg, scale=scale, chunk_size=64)

    def bare_fwd_bwd():
        gpu_gla.chunk_gla(cq, ck, cv, cg, scale=scale, chunk_size=64)
        gpu_gla.chunk_gla_bwd(cq, ck, cv, cg, cdo, scale=scale, chunk_size=64)

    def torch_fwd():
        chunk_gla(*inputs)

    def torch_fwd_bwd():
        o, _ = chunk_gla(*inputs)
        torch.autograd.grad(o, inputs, do)

    res: dict[str, Any] = {"shape": [B, T, H, K, V], "dtype": str(dtype).removeprefix("torch."), "repeats": repeats}
    fla = _fla() if with_fla else None
    fwd = {"bare fwd": bare_fwd, "torch fwd": torch_fwd}
    fwd_bwd = {"bare fwd+bwd": bare_fwd_bwd, "torch fwd+bwd": torch_fwd_bwd}
    with cuda_stream(device_index(dev)):  # torch's stream as CuPy's, as a CuPy caller of the bare kernels has it
        for group, pair in ((fwd, "fwd"), (fwd_bwd, "fwd+bwd")):
            samples = time_cuda_samples(group, repeats, warmup)
            res.update({name: statistics.median(t) for name, t in samples.items()})
            res[f"glue ratio {pair} paired"] = statistics.median(  # one torch call over the bare call beside it
                t / b for t, b in zip(samples[f"torch {pair}"], samples[f"bare {pair}"]))
        for name, (gpu, host) in time_cuda_in_a_row({**fwd, **fwd_bwd}, repeats, warmup).items():
            res[f"{name} in a row"], res[f"host {name}"] = gpu, host
    if fla is not None:  # timed on its own: the interleaving pairs the two calls whose ratio is the glue's cost
        res.update(time_cuda({"fla fwd": lambda: fla(*inputs)}, repeats, warmup))
        res.update(time_cuda({"fla fwd+bwd": lambda: torch.autograd.grad(fla(*inputs)[0], inputs, do)}, repeats,
                             warmup))
        res["ours vs fla"] = compare_with(fla, inputs, do)
    res["glue ratio fwd"] = res["torch fwd"] / res["bare fwd"]
    res["glue ratio fwd+bwd"] = res["torch fwd+bwd"] / res["bare fwd+bwd"]
    res["glue ratio fwd in a row"] = res["torch fwd in a row"] / res["bare fwd in a row"]
    res["glue ratio fwd+bwd in a row"] = res["torch fwd+bwd in a row"] / res["bare fwd+bwd in a row"]
    return res


def alone_breakdown(B: int, T: int, H: int, K: int, V: int, dtype: Any = "bfloat16",
                    repeats: int = 20, warmup: int = 3) -> dict[str, dict[str, float]]:
    """Each call timed alone (as :func:`time_cuda`), layer by layer: per variant the medians (ms) of the GPU time
    between the events, the host time from the call to its first kernel launch, and the host time of the call.

    Variants: the bare forward on CuPy views; the views made in the call, then that; ``_cuda_forward`` (the views
    and the stream, no autograd, no torch checks); :func:`chunk_gla` on tensors without grad; on tensors with grad;
    the bare backward, and ``torch.autograd.grad`` of a :func:`chunk_gla` output (each after its forward, untimed).
    """
    import torch  # noqa: PLC0415
    from hpczeco.gpu import gla as gpu_gla  # noqa: PLC0415
    from hpczeco.gpu import gla_common  # noqa: PLC0415

    from hpczeco.torch import chunk as chunk_mod  # noqa: PLC0415
    from hpczeco.torch import chunk_gla  # noqa: PLC0415
    from hpczeco.torch._arrays import cuda_stream, device_index, to_device  # noqa: PLC0415

    *inputs, _ = _inputs(B, T, H, K, V, dtype)
    q, k, v, g = inputs
    plain = [x.detach() for x in inputs]
    dev = device_index(q.device)
    scale = K**-0.5
    with cuda_stream(dev):
        views = [to_device(x) for x in inputs]

    def bare():
        with cuda_stream(dev):
            gpu_gla.chunk_gla(*views, scale=scale, chunk_size=64)

    def views_then_bare():
        with cuda_stream(dev):
            gpu_gla.chunk_gla(*(to_device(x) for x in plain), scale=scale, chunk_size=64)

    cdo = None
    state: dict[str, Any] = {}

    def bare_bwd_setup():
        with cuda_stream(dev):
            gpu_gla.chunk_gla(*views, scale=scale, chunk_size=64)

    def bare_bwd():
        with cuda_stream(dev):
            gpu_gla.chunk_gla_bwd(*views, cdo, scale=scale, chunk_size=64)

    def torch_bwd_setup():
        state["o"] = chunk_gla(*inputs)[0]

    def torch_bwd():
        torch.autograd.grad(state.pop("o"), inputs, do)

    *_, do = _inputs(B, T, H, K, V, dtype, seed=1)
    with cuda_stream(dev):
        cdo = to_device(do)
    setups = {"bare bwd (after a bare fwd)": bare_bwd_setup, "autograd.grad (after a torch fwd)": torch_bwd_setup}
    variants = {
        "bare fwd (views made before)": bare,
        "views in the call + bare fwd": views_then_bare,
        "_cuda_forward (no autograd)": lambda: chunk_mod._cuda_forward(q, k, v, g, None, scale, False, None, []),
        "chunk_gla, tensors without grad": lambda: chunk_gla(*plain),
        "chunk_gla, tensors with grad": lambda: chunk_gla(*inputs),
        "bare bwd (after a bare fwd)": bare_bwd,
        "autograd.grad (after a torch fwd)": torch_bwd,
    }
    rt = gla_common.RUNTIME.get()
    first: list[float] = []
    own = vars(rt).get("launch")  # an instance attribute to put back, if the runtime has one
    launch = rt.launch

    def timed_launch(*args: Any, **kwargs: Any) -> None:
        if not first:
            first.append(time.perf_counter())
        launch(*args, **kwargs)

    rt.launch = timed_launch
    res = {}
    try:
        for name, fn in variants.items():
            setup = setups.get(name, lambda: None)
            for _ in range(warmup):
                setup()
                fn()
            gpu, to_first, host = [], [], []
            for _ in range(repeats):
                setup()  # the forward a backward needs, untimed
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                first.clear()
                start.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end))
                to_first.append((first[0] - t0) * 1e3 if first else float("nan"))
                host.append((t1 - t0) * 1e3)
            res[name] = {"gpu ms": statistics.median(gpu), "host to 1st launch ms": statistics.median(to_first),
                         "host ms": statistics.median(host)}
    finally:
        if own is None:
            del rt.launch  # the class's method again
        else:
            rt.launch = own
    return res


def profile_glue(B: int, T: int, H: int, K: int, V: int, dtype: Any = "bfloat16", calls: int = 20) -> str:
    """cProfile's table (by own time) of ``calls`` synchronised torch fwd+bwd calls: where the host time goes."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from hpczeco.torch import chunk_gla  # noqa: PLC0415

    q, k, v, g, do = _inputs(B, T, H, K, V, dtype)

    def step():
        o, _ = chunk_gla(q, k, v, g)
        torch.autograd.grad(o, (q, k, v, g), do)
        torch.cuda.synchronize()

    step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def host_breakdown(B: int = 1, T: int = 4096, H: int = 4, K: int = 128, V: int = 128,
                   dtype: Any = "bfloat16", calls: int = 2000) -> dict[str, float]:
    """Host microseconds per call of each piece of the glue (``time.perf_counter`` over ``calls`` calls, the
    median of 5 such loops; no GPU work is waited for): what the autograd forward adds before its first launch."""
    import torch  # noqa: PLC0415

    from hpczeco.torch import _arrays, _checks  # noqa: PLC0415
    from hpczeco.torch._arrays import cuda_stream, device_index, to_device  # noqa: PLC0415

    cupy = _arrays.cupy_module()
    q, k, v, g, _ = _inputs(B, T, H, K, V, dtype)
    dev = device_index(q.device)

    class _Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g, h0, scale, want, cu):
            return q.detach(), None

        @staticmethod
        def backward(ctx, do, dht):
            return (do,) + (None,) * 7

    def stream_enter():
        with cuda_stream(dev):
            pass

    def views():
        with cuda_stream(dev):
            for x in (q, k, v, g):
                to_device(x)

    with cuda_stream(dev):
        out = cupy.empty(tuple(q.shape), cupy.uint16)
    pieces: dict[str, Callable[[], Any]] = {
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "current_stream_ptr": lambda: _arrays.current_stream_ptr(dev),
        "cuda_stream enter+exit": stream_enter,
        "cuda_stream + 4 to_device": views,
        "from_device (bf16 bits)": lambda: _arrays.from_device(out, torch.bfloat16),
        "check_tensors": lambda: _checks.check_tensors(q=q, k=k, v=v, g=g, initial_state=None),
        "autograd.Function.apply (no-op)": lambda: _Noop.apply(q, k, v, g, None, 1.0, False, None),
        "apply + autograd.grad (no-op)": lambda: torch.autograd.grad(_Noop.apply(q, k, v, g, None, 1.0, False,
                                                                               None)[0], q, q),
    }
    res = {}
    for name, fn in pieces.items():
        fn()
        loops = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            loops.append((time.perf_counter() - t0) / calls * 1e6)
        res[name] = statistics.median(loops)
    return res


def build_parser(prog: str) -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter, split_doc  # noqa: PLC0415

    description, _ = split_doc(__doc__)
    ap = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    ap.add_argument("--shape", action="append", default=None,
                    help="B,T,H,K,V (repeatable; default: " + "; ".join(",".join(map(str, s)) for s in SHAPES) + ")")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="dtype of q, k, v, g, do")
    ap.add_argument("--repeats", type=int_range(1), default=20, help="timed calls per variant (median)")
    ap.add_argument("--warmup", type=int_range(0), default=3, help="untimed calls before the timed ones")
    ap.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out (its first call at a new "
                                                            "shape autotunes for minutes)")
    ap.add_argument("--profile", action="store_true", help="also print the host time of each piece of the glue and "
                                                             "cProfile's 25 costliest functions (own time) of 20 torch "
                                                             "fwd+bwd calls at the first shape")
    ap.add_argument("--json", default="runs/bench_torch/torch_glue.json", help="write the results here")
    return ap


def main(argv: list[str] | None = None, prog: str = "hpczeco bench torch") -> int:
    args = build_parser(prog).parse_args(argv)
    reason = benchkit.gpu_missing(needs=("torch",))
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    from .files import check_output_file

    check_output_file(args.json, "--json")  # before the work
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print(f"{prog}: torch sees no CUDA device", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    rows = []
    print(f"{'shape B,T,H,K,V':>24} {'bare fwd':>9} {'torch fwd':>9} {'ratio':>6} {'bare f+b':>9} {'torch f+b':>9} "
          f"{'ratio':>6} {'fla fwd':>8} {'fla f+b':>8}  (ms, median of {args.repeats}, {args.dtype})")
    for shape in shapes:
        r = bench_chunk_gla(*shape, dtype=args.dtype, repeats=args.repeats, warmup=args.warmup,
                            with_fla=not args.no_fla)
        rows.append(r)
        ms = lambda key, r=r: f"{r[key] * 1e3:9.3f}" if key in r else f"{'-':>9}"
        print(f"{','.join(map(str, shape)):>24} {ms('bare fwd')} {ms('torch fwd')} {r['glue ratio fwd']:6.3f} "
              f"{ms('bare fwd+bwd')} {ms('torch fwd+bwd')} {r['glue ratio fwd+bwd']:6.3f} "
              f"{ms('fla fwd')[1:]} {ms('fla fwd+bwd')[1:]}")
        print(f"{'in a row:':>24} {ms('bare fwd in a row')} {ms('torch fwd in a row')} "
              f"{r['glue ratio fwd in a row']:6.3f} {ms('bare fwd+bwd in a row')} {ms('torch fwd+bwd in a row')} "
              f"{r['glue ratio fwd+bwd in a row']:6.3f}")
        print(f"{'host per call:':>24} {ms('host bare fwd')} {ms('host torch fwd')} {'':6} "
              f"{ms('host bare fwd+bwd')} {ms('host torch fwd+bwd')}")
        print(f"{'paired ratio:':>24} {'':9} {'':9} {r['glue ratio fwd paired']:6.3f} {'':9} {'':9} "
              f"{r['glue ratio fwd+bwd paired']:6.3f}")
        if "ours vs fla" in r:
            print(f"{'|ours - fla| / |fla|:':>24} " + "  ".join(f"{n} {e:.2e}" for n, e in r["ours vs fla"].items()))
    breakdown: dict[str, Any] | None = None
    if args.profile:
        breakdown = host_breakdown(dtype=args.dtype)
        print("host us per call of each piece of the glue (median of 5 loops of 2000):")
        for name, us in breakdown.items():
            print(f"{name:>36} {us:8.2f}")
        for shape in shapes:
            alone = alone_breakdown(*shape, dtype=args.dtype, repeats=args.repeats)
            breakdown[f"alone {','.join(map(str, shape))}"] = alone
            print(f"each call alone at {shape}, medians (ms):  GPU (events)  host to 1st launch  host")
            for name, r in alone.items():
                print(f"{name:>36} {r['gpu ms']:12.3f} {r['host to 1st launch ms']:19.3f} {r['host ms']:6.3f}")
        print(profile_glue(*shapes[0], dtype=args.dtype))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "host_breakdown_us": breakdown}, fh, indent=1)
    return 0
