"""What the torch glue costs on a GPU: :func:`hpczeco.torch.chunk_gla` (autograd) against the bare kernel calls.

For each shape, on torch's current stream, CUDA events around each call, the median of ``repeats`` calls
after ``warmup`` (never a timed assertion; run it with ``python -m hpczeco.torch --bench``):

- ``bare fwd``: :func:`hpczeco.gpu.gla.chunk_gla` on CuPy views made beforehand;
- ``torch fwd``: :func:`hpczeco.torch.chunk_gla` on tensors that require grad (the graph is recorded);
- ``bare fwd+bwd``: that forward, then :func:`hpczeco.gpu.gla.chunk_gla_bwd`;
- ``torch fwd+bwd``: the autograd forward, then ``torch.autograd.grad(o, (q, k, v, g), do)``;
- ``fla fwd`` / ``fla fwd+bwd``: flash-linear-attention's ``chunk_gla`` on the same tensors, when it imports
  (and ``with_fla``);
- ``... in a row``: the same calls ``repeats`` times back to back between one pair of events, per call, the
  median of 5 such blocks: the host queues the next call while the GPU runs this one, as in a training loop;
- ``host ...``: the host's time per call (``time.perf_counter``, no synchronisation): the Python work alone.

The ratios ``torch / bare`` are the glue's cost (target: <= 1.05). Events bracket the host work too, so in the
one-call timings a gap where the GPU waits for the Python glue counts; in the in-a-row timings it counts only
where the host falls behind the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ._arrays import cuda_stream, device_index, to_device
from .chunk import chunk_gla

__all__ = ["time_cuda", "time_cuda_in_a_row", "bench_chunk_gla", "profile_glue", "main"]

SHAPES = ((1, 32768, 16, 128, 128), (8, 4096, 16, 128, 128), (1, 32768, 32, 64, 64))


def time_cuda(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` between CUDA events on torch's current stream (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def time_cuda_in_a_row(
    fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, blocks: int = 5
) -> tuple[float, float]:
    """``(GPU seconds per call, host seconds per call)``, medians over ``blocks`` blocks of ``repeats`` calls of
    ``fn()`` back to back between one pair of CUDA events (after ``warmup`` calls): the host enqueues while the
    GPU works, as in a training loop."""
    for _ in range(warmup):
        fn()
    gpu, host = [], []
    for _ in range(blocks):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        host.append((time.perf_counter() - t0) / repeats)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e-3 / repeats)
    return statistics.median(gpu), statistics.median(host)


def _fla() -> Callable | None:
    try:
        from fla.ops.gla import chunk_gla as fla_chunk_gla  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - fla absent or broken: its columns stay empty
        return None
    return fla_chunk_gla


def _inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """``[q, k, v, g, do]`` on the current CUDA device (q, k, v, g require grad; g a log gate, logsigmoid / 16)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q, k = rnd(B, T, H, K).to(dtype), rnd(B, T, H, K).to(dtype)
    v, do = rnd(B, T, H, V).to(dtype), rnd(B, T, H, V).to(dtype)
    g = (torch.nn.functional.logsigmoid(rnd(B, T, H, K)) / 16).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g)] + [do]


def bench_chunk_gla(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.bfloat16,
                    repeats: int = 20, warmup: int = 3, seed: int = 0, with_fla: bool = True) -> dict[str, Any]:
    """Median seconds per call of the variants above for one shape ``[B, T, H, K]`` / ``[B, T, H, V]``."""
    from ..gpu import gla as gpu_gla  # noqa: PLC0415

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
    with cuda_stream(device_index(dev)):
        res["bare fwd"] = time_cuda(bare_fwd, repeats, warmup)
        res["bare fwd+bwd"] = time_cuda(bare_fwd_bwd, repeats, warmup)
    res["torch fwd"] = time_cuda(torch_fwd, repeats, warmup)
    res["torch fwd+bwd"] = time_cuda(torch_fwd_bwd, repeats, warmup)
    with cuda_stream(device_index(dev)):
        res["bare fwd in a row"], res["host bare fwd"] = time_cuda_in_a_row(bare_fwd, repeats, warmup)
        res["bare fwd+bwd in a row"], res["host bare fwd+bwd"] = time_cuda_in_a_row(bare_fwd_bwd, repeats, warmup)
    res["torch fwd in a row"], res["host torch fwd"] = time_cuda_in_a_row(torch_fwd, repeats, warmup)
    res["torch fwd+bwd in a row"], res["host torch fwd+bwd"] = time_cuda_in_a_row(torch_fwd_bwd, repeats, warmup)
    fla = _fla() if with_fla else None
    if fla is not None:
        def fla_fwd():
            fla(*inputs)

        def fla_fwd_bwd():
            o, _ = fla(*inputs)
            torch.autograd.grad(o, inputs, do)

        res["fla fwd"] = time_cuda(fla_fwd, repeats, warmup)
        res["fla fwd+bwd"] = time_cuda(fla_fwd_bwd, repeats, warmup)
    res["glue ratio fwd"] = res["torch fwd"] / res["bare fwd"]
    res["glue ratio fwd+bwd"] = res["torch fwd+bwd"] / res["bare fwd+bwd"]
    res["glue ratio fwd in a row"] = res["torch fwd in a row"] / res["bare fwd in a row"]
    res["glue ratio fwd+bwd in a row"] = res["torch fwd+bwd in a row"] / res["bare fwd+bwd in a row"]
    return res


def profile_glue(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.bfloat16, calls: int = 20) -> str:
    """cProfile's table (by own time) of ``calls`` synchronised torch fwd+bwd calls: where the host time goes."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpczeco.torch",
                                 description="GPU benchmark of the torch glue (hpczeco.torch.chunk_gla vs the bare "
                                             "kernel calls, and fla when it imports)")
    ap.add_argument("--bench", action="store_true", help="run the benchmark (needs a CUDA GPU and CuPy)")
    ap.add_argument("--shape", action="append", default=None,
                    help="B,T,H,K,V (repeatable; default: " + "; ".join(",".join(map(str, s)) for s in SHAPES) + ")")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-fla", action="store_true", help="leave flash-linear-attention out (its first call at a new "
                                                            "shape autotunes for minutes)")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's 25 costliest functions (own time) "
                                                             "of 20 torch fwd+bwd calls at the first shape")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not args.bench:
        ap.print_help()
        return 0
    if not torch.cuda.is_available():
        print("python -m hpczeco.torch --bench: no CUDA device")
        return 2
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    rows = []
    print(f"{'shape B,T,H,K,V':>24} {'bare fwd':>9} {'torch fwd':>9} {'ratio':>6} {'bare f+b':>9} {'torch f+b':>9} "
          f"{'ratio':>6} {'fla fwd':>8} {'fla f+b':>8}  (ms, median of {args.repeats}, {args.dtype})")
    for shape in shapes:
        r = bench_chunk_gla(*shape, dtype=getattr(torch, args.dtype), repeats=args.repeats, warmup=args.warmup,
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
    if args.profile:
        print(profile_glue(*shapes[0], dtype=getattr(torch, args.dtype)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 0
