"""DAAF on one GPU: the per-call attention API against the prepared launch, and the device planner's time.

    python3 devtools/daaf_api_check.py [--T 8192 32768 131072] [--reps 20] [--out DIR]

For each T and key-region layout (``w128``: window 128 only; ``w128+first4096``; ``w128+8x512``: 8 scattered
regions of 512) and each per-call form, the median of ``reps`` calls (after 3 warm-up calls) by CUDA events,
two ways:

* ``stream``: calls queued back to back, an event between each two, one synchronisation at the end (the GPU
  time of a call: host overhead hidden while the GPU is busy, a host synchronisation inside a call is not);
* ``synced``: the device synchronised before each call (the host's overhead before the launch shows too);

plus ``host_ms``: wall time per call of the back-to-back loop. Ratios are against ``prepared`` (the same
launch from ``prepare(...)``). Then the device planner (:func:`hpczeco.daaf.device_planner.plan`, one host read
included) at each T, checked against the CPU planner. B=1, H=16, D=128, bf16 (raw bits for the CuPy forms; float16 for
``hpczeco.daaf.attention``, which needs a floating CuPy dtype). Writes ``daaf_api_check.json`` to ``--out``,
else ``$HPCZECO_RESULTS``, else ``$OUT``, else the current folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ("w128", "w128+first4096", "w128+8x512")
W = 128


def key_mask(T: int, layout: str, rng: np.random.Generator) -> np.ndarray:
    g = np.zeros(T, bool)
    if layout == "w128+first4096":
        g[: min(4096, T)] = True
    elif layout == "w128+8x512":
        starts = np.sort(rng.choice(T // 512, 8, replace=False)) * 512
        for s in starts:
            g[s : s + 512] = True
    return g


def time_calls(fn: Callable[[], Any], reps: int, warmup: int = 3) -> dict:
    """``stream`` / ``synced`` medians (ms, CuPy events on the current stream) and host ms per call."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    ev = [cupy.cuda.Event() for _ in range(reps + 1)]
    t0 = time.perf_counter()
    ev[0].record()
    for i in range(reps):
        fn()
        ev[i + 1].record()
    ev[-1].synchronize()
    host = (time.perf_counter() - t0) * 1e3 / reps
    stream = [cupy.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(reps)]
    synced = []
    for _ in range(reps):
        cupy.cuda.Device().synchronize()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        synced.append(cupy.cuda.get_elapsed_time(a, b))
    return {"stream_ms": float(np.median(stream)), "synced_ms": float(np.median(synced)), "host_ms": host,
            "reps": reps}


def time_per_call_vs_prepared(T: int, layout: str, reps: int = 20, seed: int = 0, H: int = 16) -> list[dict]:
    """Rows ``{T, layout, form, stream_ms, synced_ms, host_ms, stream_ratio, synced_ratio, same_output}`` for
    every per-call form against its prepared launch (B=1, D=128)."""
    import cupy
    from hpczeco.gpu import daaf as gd

    import hpczeco.daaf as daaf

    rng = np.random.default_rng(seed)
    B, D = 1, 128
    g = key_mask(T, layout, rng)
    gidx = np.flatnonzero(g).astype(np.int32)
    plan = daaf.plan_from_mask(g, W)
    g_dev, gi_dev = cupy.asarray(g), cupy.asarray(gidx)
    x = [cupy.asarray(rng.standard_normal((B, T, H, D), dtype=np.float32)).astype(cupy.float16) for _ in range(3)]
    bits = [cupy.asarray((a.astype(cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)) for a in x]
    rows: list[dict] = []

    def add(form: str, fn, base: dict, base_out) -> None:
        try:
            t = time_calls(fn, reps)
            same = bool(cupy.array_equal(fn(), base_out))
            rows.append({"T": T, "layout": layout, "n_global": int(gidx.size), "form": form, **t,
                         "stream_ratio": t["stream_ms"] / base["stream_ms"],
                         "synced_ratio": t["synced_ms"] / base["synced_ms"], "same_output": same})
        except Exception as exc:  # noqa: BLE001 - a report, not a test
            rows.append({"T": T, "layout": layout, "form": form, "error": f"{type(exc).__name__}: {exc}"})
        r = rows[-1]
        print(f"T={T:6d} {layout:15s} {form:40s} " + (f"stream {r['stream_ms']:8.3f} ms ({r['stream_ratio']:.2f}x)  "
              f"synced {r['synced_ms']:8.3f} ms ({r['synced_ratio']:.2f}x)  host {r['host_ms']:.3f} ms  "
              f"same={r['same_output']}" if "error" not in r else r["error"]), flush=True)

    # bf16 bits: hpczeco.gpu.daaf forms
    q, k, v = bits
    prep = gd.prepare(q, k, v, gidx, W, storage="bfloat16")
    base_out = prep().copy()
    base = time_calls(prep, reps)
    rows.append({"T": T, "layout": layout, "n_global": int(gidx.size), "form": "prepared (bf16)", **base,
                 "stream_ratio": 1.0, "synced_ratio": 1.0, "same_output": True})
    print(f"T={T:6d} {layout:15s} {'prepared (bf16)':40s} stream {base['stream_ms']:8.3f} ms  "
          f"synced {base['synced_ms']:8.3f} ms  host {base['host_ms']:.3f} ms", flush=True)
    sb = dict(storage="bfloat16")
    add("gd.attention(host gidx)", lambda: gd.attention(q, k, v, gidx, W, **sb), base, base_out)
    add("gd.attention(host gidx, host mask)", lambda: gd.attention(q, k, v, gidx, W, None, g, **sb), base, base_out)
    add("gd.attention(plan=Plan)", lambda: gd.attention(q, k, v, None, W, plan=plan, **sb), base, base_out)
    add("gd.attention(device gidx, validate=False)",
        lambda: gd.attention(q, k, v, gi_dev, W, validate=False, **sb), base, base_out)
    add("gd.attention(device gidx+mask, validate)",
        lambda: gd.attention(q, k, v, gi_dev, W, None, g_dev, **sb), base, base_out)

    # float16: hpczeco.daaf.attention (CuPy arrays + Plan)
    q, k, v = x
    prep16 = gd.prepare(q, k, v, gidx, W)
    out16 = prep16().copy()
    base16 = time_calls(prep16, reps)
    rows.append({"T": T, "layout": layout, "n_global": int(gidx.size), "form": "prepared (f16)", **base16,
                 "stream_ratio": 1.0, "synced_ratio": 1.0, "same_output": True})
    add("daaf.attention(plan, check=False)", lambda: daaf.attention(q, k, v, plan, check=False), base16, out16)
    add("daaf.attention(plan) [NaN checks]", lambda: daaf.attention(q, k, v, plan), base16, out16)

    # torch bf16: attention_torch
    try:
        import torch
    except ImportError:
        return rows
    tq, tk, tv = (torch.from_dlpack(b).view(torch.bfloat16) for b in bits)
    tg = torch.from_numpy(g).cuda()
    ptorch = gd.prepare_torch(tq, tk, tv, gidx, W)
    tout = ptorch().clone()
    tbase = time_calls(ptorch, reps)
    rows.append({"T": T, "layout": layout, "n_global": int(gidx.size), "form": "prepare_torch (bf16)", **tbase,
                 "stream_ratio": 1.0, "synced_ratio": 1.0, "same_output": True})

    def add_t(form, fn):
        add(form, lambda: cupy.from_dlpack(fn().view(torch.int16)), tbase, cupy.from_dlpack(tout.view(torch.int16)))

    add_t("attention_torch(host gidx, torch mask)", lambda: gd.attention_torch(tq, tk, tv, gidx, W, None, tg))
    add_t("attention_torch(plan=Plan)", lambda: gd.attention_torch(tq, tk, tv, None, W, plan=plan))
    dp = gd.device_plan(gidx, W, T)
    add_t("attention_torch(plan=DevicePlan)", lambda: gd.attention_torch(tq, tk, tv, None, W, plan=dp))
    return rows


def synthetic_tokens(T: int, rng: np.random.Generator, vocab: int = 2**17) -> np.ndarray:
    """Low-entropy background (16 ids) with high-entropy 512-token regions at 5 depths and one of 2048."""
    tok = rng.integers(0, 16, T)
    for d in (0.1, 0.3, 0.5, 0.7, 0.9):
        s = int(d * T) // 512 * 512
        tok[s : s + 512] = rng.integers(16, vocab, min(512, T - s))
    s = T // 5 // 512 * 512
    tok[s : s + 2048] = rng.integers(16, vocab, min(2048, T - s))
    return tok.astype(np.int64)


def time_planners(T: int, reps: int = 20, seed: int = 0) -> list[dict]:
    """The device planner (one read back included) at ``T`` tokens."""
    import cupy

    from hpczeco.daaf import device_planner as dpl
    from hpczeco.daaf import planner

    tok = synthetic_tokens(T, np.random.default_rng(seed))
    cpu = planner.plan(tok, 512, 0.8, W, vocab_size=2**17)
    tok_d = cupy.asarray(tok)
    rows = []

    def new():
        return dpl.plan(tok_d, 512, 0.8, W, vocab_size=2**17)

    for name, fn in (("device_planner.plan (CuPy kernels)", new),):
        try:
            t = time_calls(fn, reps)
            dp = fn()
            same = bool(np.array_equal(cupy.asnumpy(dp.gmask).astype(bool), cpu.global_mask))
            rows.append({"T": T, "planner": name, **t, "same_mask_as_cpu": same, "n_global": dp.n_global,
                         "cpu_policy": cpu.policy, "cpu_n_global": cpu.n_global})
            print(f"planner T={T:6d} {name:42s} stream {t['stream_ms']:.3f} ms  synced {t['synced_ms']:.3f} ms  "
                  f"host {t['host_ms']:.3f} ms  same mask as CPU: {same} (G={dp.n_global})", flush=True)
        except Exception as exc:  # noqa: BLE001
            rows.append({"T": T, "planner": name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"planner T={T} {name}: {type(exc).__name__}: {exc}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--H", type=int, default=16, help="heads (16; fewer for a dry run)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import cupy

    out_dir = args.out or Path(os.environ.get("HPCZECO_RESULTS") or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    res: dict[str, Any] = {"device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                           "cupy": cupy.__version__, "B": 1, "H": args.H, "D": 128, "W": W, "calls": [], "planner": []}
    for T in args.T:
        for layout in args.layouts:
            res["calls"] += time_per_call_vs_prepared(T, layout, args.reps, H=args.H)
        res["planner"] += time_planners(T, args.reps)
    path = out_dir / "daaf_api_check.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    worst = [r for r in res["calls"] if "stream_ratio" in r and r["stream_ratio"] > 1.1]
    print(f"per-call forms above 1.1x (stream): {len(worst)}; planner rows: {len(res['planner'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
