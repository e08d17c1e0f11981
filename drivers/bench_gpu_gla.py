"""`hpczeco bench gpu-gla`: timings of the GLA GPU kernels (:mod:`hpczeco.gpu.gla`) on one GPU.

At B=1, T=``--T`` (32768), H=16, K=V=128, bf16, two input sets alternating, CUDA events, warm-up
excluded, median of ``--repeats``: the NVRTC build of each kernel group; a 1 GiB device copy (the
bandwidth ceiling) beside the memory floor; our forward per tensor-core build (``HPCZECO_TC_VARIANT``),
the fastest build that agrees with the simt forward at this shape at several chunks per segment
(``--nc``) and the automatic choice, the simt forward, forward+backward; flash-linear-attention's
``chunk_gla`` forward and forward+backward beside them (when ``fla`` imports; its backward autotunes
on first use, so it goes last); the pieces a ZeCO rank adds (prepare, finish, decay cumsum, state
correction, initial-state gradient), the device value checks of the inputs, and each stage of the
backward alone.

The correctness of these kernels is checked by ``pytest -m gpu tests/test_gpu_gla*.py``. Results:
``--out``/gpu_gla.json and gpu_gla_timings.csv, rewritten after every row.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

from . import benchkit

STEM = "gpu_gla"


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_gla", help="folder for the JSON/CSV results")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median)")
    p.add_argument("--T", type=int, default=32768, help="tokens of the timed shape")
    p.add_argument("--nc", type=int, nargs="*", default=[8, 16, 32, 64], help="tensor-core chunks per segment to time")
    p.add_argument("--quick", action="store_true", help="build only the bf16 kernel groups (the only ones timed)")
    return p


def main(argv: list[str] | None = None, prog: str = "hpczeco bench gpu-gla") -> int:
    args = build_parser(prog).parse_args(argv)
    reason = benchkit.gpu_missing()
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    return run(args)


def _bf16_inputs(rng, cp, B: int, T: int, H: int, K: int, V: int) -> dict[str, Any]:
    """q, k, v, do ~ N(0, 1), g = logsigmoid(N(0, 1) + 2), as bf16 bit patterns on the device."""
    from hpczeco.base import bf16  # noqa: PLC0415

    x = {n: rng.standard_normal((B, T, H, K if n in ("q", "k") else V)).astype(np.float32)
         for n in ("q", "k", "v", "do")}
    x["g"] = np.log(1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H, K)) - 2.0))).astype(np.float32)
    return {n: cp.asarray(bf16.to_bits(a)) for n, a in x.items()}


def _guarded(rec: benchkit.Recorder, name: str, fn, derived=None, **extra: Any) -> float | None:
    """``rec.timing(name, fn(), **extra, **derived(ms))`` (ms); a failure is recorded with its reason instead."""
    try:
        ms = fn()
    except Exception as exc:  # noqa: BLE001 - record and go on
        rec.failed(name, exc, **extra)
        return None
    rec.timing(name, ms, **extra, **(derived(ms) if derived else {}))
    return ms


def run(args) -> int:
    import cupy as cp  # noqa: PLC0415
    from hpczeco.base import bf16  # noqa: PLC0415
    from hpczeco.gpu import gla as G  # noqa: PLC0415
    from hpczeco.gpu import gla_tc  # noqa: PLC0415

    seed = int(args.seed if args.seed is not None else time.time_ns() % 2**31)
    rng = np.random.default_rng(seed)
    rec = benchkit.Recorder(args.out, STEM, info=benchkit.environment(("numpy", "cupy", "numba"), gpu=True))
    rec.info["seed"] = seed
    rec.say(f"bench gpu-gla: seed {seed}  {rec.info}")
    reps = args.repeats
    ev = lambda fn, r=reps, **kw: benchkit.cuda_event_time(fn, r, **kw)["median_ms"]

    # the NVRTC build of each kernel group (the first use builds one RawModule per .cu file and group)
    groups = ("common", "bf16") if args.quick else ("common", "bf16", "float", "f16")
    for file in G._KERNEL_FILES:
        for group in groups:
            names = [n for n in G.kernel_names(file) if G.kernel_group(n) == group]
            if names:
                def build(names=names):
                    t = time.perf_counter()
                    for n in names:
                        G._runtime().fn(n)
                    return (time.perf_counter() - t) * 1e3

                _guarded(rec, f"compile {file} [{group}] (NVRTC, -std=c++17)", build, kernels=len(names))

    B, T, H, K, V = 1, args.T, 16, 128, 128
    fl = G.memory_floor(B, T, H, K, V, itemsize=2, bandwidth=4.3e12)
    flops = B * H * (-(-T // 64)) * (2 * 64 * 64 * K + 2 * 64 * 64 * V + 2 * 64 * K * V * 2)
    rec.info.update(bench_shape=dict(B=B, T=T, H=H, K=K, V=V, dtype="bf16"), memory_floor=fl,
                    flops_forward_chunked=flops)
    rec.say(f"memory floor (q,k,v,g,o bf16 once, 4.3 TB/s): {fl['bytes'] / 1e6:.1f} MB -> {fl['seconds'] * 1e3:.3f} "
            f"ms; forward matmul work {flops / 1e9:.1f} GFLOP")
    floor_ms = fl["seconds"] * 1e3
    sets = [_bf16_inputs(rng, cp, B, T, H, K, V) for _ in range(2)]
    s0 = sets[0]
    scale = K**-0.5

    try:  # device copy: the achieved bandwidth ceiling
        bufs = [cp.full(1 << 30, 7, dtype=cp.uint8), cp.empty(1 << 30, dtype=cp.uint8)]
        ms = ev(lambda i: cp.copyto(bufs[1], bufs[0]), 10)
        rec.timing("device copy 1 GiB (read+write)", ms, GBps=round(2 * (1 << 30) / ms / 1e6, 1))
        rec.info["copy_GBps"] = 2 * (1 << 30) / ms / 1e6
        bufs.clear()
    except Exception as exc:  # noqa: BLE001
        rec.failed("device copy 1 GiB (read+write)", exc)

    # which tensor-core builds agree with the simt forward at this shape (only those are used below)
    o_si, h_si = G.chunk_gla(s0["q"], s0["k"], s0["v"], s0["g"], scale=scale, output_final_state=True, impl="simt")
    ref_o, ref_h = bf16.from_bits(o_si.get()).astype(np.float64), h_si.get().astype(np.float64)
    del o_si, h_si
    chosen = os.environ.get("HPCZECO_TC_VARIANT", gla_tc.DEFAULT_VARIANT)
    variant_err: dict[str, float] = {}
    for var in gla_tc.VARIANTS:
        os.environ["HPCZECO_TC_VARIANT"] = var
        try:
            o_tc, h_tc = G.chunk_gla(s0["q"], s0["k"], s0["v"], s0["g"], scale=scale, output_final_state=True,
                                     impl="tc")
            a = bf16.from_bits(o_tc.get()).astype(np.float64)
            errs = [np.linalg.norm(a - ref_o) / np.linalg.norm(ref_o),
                    np.linalg.norm(h_tc.get() - ref_h) / np.linalg.norm(ref_h)]
            variant_err[var] = float(max(errs)) if np.isfinite(a).all() else float("inf")
        except Exception as exc:  # noqa: BLE001
            variant_err[var] = float("inf")
            rec.say(f"tensor-core build {var!r} failed: {type(exc).__name__}: {exc}")
    variant_ok = {v: bool(e <= 1e-2) for v, e in variant_err.items()}
    rec.info.update(tc_variant_rel_vs_simt=variant_err, tc_variant_ok=variant_ok)

    fla = torch = None
    try:
        import fla as fla_mod  # noqa: PLC0415
        import torch  # noqa: PLC0415
        from fla.ops.gla import chunk_gla as fla  # noqa: PLC0415

        rec.info["fla"] = getattr(fla_mod, "__version__", "?")
        rec.info["torch"] = torch.__version__
    except Exception as exc:  # noqa: BLE001
        rec.info["fla"] = f"import failed: {type(exc).__name__}: {exc}"
        rec.say(f"flash-linear-attention not available ({exc}); continuing without it")
    tsets = [{n: torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16) for n, a in s.items()} for s in sets] \
        if fla is not None else []

    def fwd_tc(i):
        G.chunk_gla(sets[i]["q"], sets[i]["k"], sets[i]["v"], sets[i]["g"], scale=scale, impl="tc")

    # every tensor-core build at the automatic NC; the fastest agreeing one is used from here on
    var_ms = {}
    for var in gla_tc.VARIANTS:
        os.environ["HPCZECO_TC_VARIANT"] = var
        ms = _guarded(rec, f"ours fwd tc[{var}] (auto NC)", lambda: ev(fwd_tc, sets=2), correct=variant_ok[var],
                      derived=lambda ms: {"x_floor": round(ms / floor_ms, 2)})
        if ms is not None:
            var_ms[var] = ms
    fastest = [v for v in sorted(var_ms, key=var_ms.get) if variant_ok.get(v)]
    chosen = fastest[0] if fastest else chosen
    os.environ["HPCZECO_TC_VARIANT"] = chosen
    rec.info["tc_variant_used"] = chosen
    rec.say(f"tensor-core build used for the rest: {chosen!r}")
    rate = lambda ms: {"Mtok_s": round(B * T / ms / 1e3, 1), "x_floor": round(ms / floor_ms, 2)}
    for nc in args.nc:
        os.environ["HPCZECO_TC_NC"] = str(nc)
        _guarded(rec, f"ours fwd tc[{chosen}] (NC={nc})", lambda: ev(fwd_tc, sets=2), derived=rate)
    os.environ.pop("HPCZECO_TC_NC", None)
    rec.info["auto_NC"] = gla_tc.chunks_per_segment(G._runtime(), B * H, -(-T // 64))
    fwd_auto = lambda i: G.chunk_gla(sets[i]["q"], sets[i]["k"], sets[i]["v"], sets[i]["g"], scale=scale)
    best_ms = _guarded(rec, f"ours fwd auto (NC={rec.info['auto_NC']})", lambda: ev(fwd_auto, sets=2), derived=rate)
    if best_ms is not None:
        _guarded(rec, "ours fwd auto (repeat, for spread)", lambda: ev(fwd_auto, sets=2))
    _guarded(rec, "ours fwd simt", lambda: ev(lambda i: G.chunk_gla(
        sets[i]["q"], sets[i]["k"], sets[i]["v"], sets[i]["g"], scale=scale, impl="simt"), max(5, reps // 4), sets=2))

    def ours_fb(i):
        s = sets[i]
        G.chunk_gla(s["q"], s["k"], s["v"], s["g"], scale=scale)
        G.chunk_gla_bwd(s["q"], s["k"], s["v"], s["g"], s["do"], scale=scale)

    rec.info["ours_fwd_bwd_ms"] = _guarded(rec, "ours fwd+bwd",
                                           lambda: ev(ours_fb, max(5, reps // 2), warmup=2, sets=2))

    if fla is not None:
        t_start = time.time()
        ms = _guarded(rec, "fla 0.6 chunk_gla fwd", lambda: ev(lambda i: fla(
            tsets[i]["q"], tsets[i]["k"], tsets[i]["v"], tsets[i]["g"], scale=scale, output_final_state=False),
            warmup=3, sets=2), derived=lambda ms: {"warm_s": round(time.time() - t_start, 1)})
        if ms is not None:
            if best_ms is not None:
                rec.info["fwd_speedup_vs_fla"] = ms / best_ms

    _zeco_pieces(rec, G, cp, rng, sets, scale, reps)
    _value_checks(rec, sets, reps)
    _backward_stages(rec, G, cp, s0, scale, reps, ours_fb)
    if fla is not None:  # last: FLA's backward autotunes its Triton kernels on first use (minutes)
        _fla_backward(rec, fla, torch, cp, tsets, scale, reps)
    rec.finish()
    return 0


def _zeco_pieces(rec, G, cp, rng, sets, scale: float, reps: int) -> None:
    """The pieces a ZeCO rank adds to the single-GPU work (bench shape, bf16)."""
    s0 = sets[0]
    B, T, H, K = s0["q"].shape
    V = s0["v"].shape[-1]
    S0 = cp.asarray(rng.standard_normal((B, H, K, V)).astype(np.float32))
    few = max(5, reps // 2)
    pieces = {
        "fwd prepare (local pass)": lambda i: G.chunk_gla_prepare(
            sets[i]["q"], sets[i]["k"], sets[i]["v"], sets[i]["g"], scale=scale),
        "fwd with initial_state": lambda i: G.chunk_gla(
            sets[i]["q"], sets[i]["k"], sets[i]["v"], sets[i]["g"], scale=scale, initial_state=S0),
        "bwd prepare (state passes)": lambda i: G.chunk_gla_bwd_prepare(
            sets[i]["q"], sets[i]["k"], sets[i]["v"], sets[i]["g"], sets[i]["do"], scale=scale),
        "decay_cumsum (G, fp32)": lambda i: G.decay_cumsum(sets[i]["g"]),
        "initial_state_grad (U)": lambda i: G.initial_state_grad(sets[i]["q"], sets[i]["g"], sets[i]["do"],
                                                                 scale=scale),
    }
    for name, fn in pieces.items():
        _guarded(rec, f"piece: {name}", lambda fn=fn: benchkit.cuda_event_time(fn, few, warmup=2, sets=2)["median_ms"])
    try:
        plan = G.chunk_gla_prepare(s0["q"], s0["k"], s0["v"], s0["g"], scale=scale)
        rec.timing("piece: fwd finish(initial_state)",
                   benchkit.cuda_event_time(lambda i: plan.finish(S0), few)["median_ms"])
        bplan = G.chunk_gla_bwd_prepare(s0["q"], s0["k"], s0["v"], s0["g"], s0["do"], scale=scale)
        rec.timing("piece: bwd finish(initial_state, dht)",
                   benchkit.cuda_event_time(lambda i: bplan.finish(S0, S0), few)["median_ms"])
        Gc = G.decay_cumsum(s0["g"])
        o_tmp = s0["v"].copy()
        rec.timing("piece: state_correction (o += (q e^G) S_in)", benchkit.cuda_event_time(
            lambda i: G.state_correction(o_tmp, s0["q"], Gc, S0, scale=scale), few)["median_ms"])
    except Exception as exc:  # noqa: BLE001
        rec.failed("piece: finish / correction", exc)


def _value_checks(rec, sets, reps: int) -> None:
    """The layer's input validation on device arrays (fused bit-pattern reductions, one synchronisation)."""
    try:
        from hpczeco.gla import validate_gla_inputs  # noqa: PLC0415

        bfs = [{n: sets[i][n].view("bfloat16") for n in ("q", "k", "v", "g", "do")} for i in range(2)]
        rec.timing("validate_gla_inputs q,k,v,g,do (bf16 device, fused)", benchkit.cuda_event_time(
            lambda i: validate_gla_inputs(*(bfs[i][n] for n in ("q", "k", "v", "g")), do=bfs[i]["do"]),
            max(5, reps // 2), sets=2)["median_ms"])
    except Exception as exc:  # noqa: BLE001
        rec.failed("validate_gla_inputs", exc)


def _backward_stages(rec, G, cp, s0, scale: float, reps: int, ours_fb) -> None:
    """Where the backward's time goes (bench shape, bf16): each stage of ``chunk_gla_bwd`` alone."""
    i32, f32 = np.int32, np.float32
    try:
        rt = G._runtime()
        q_, k_, v_, g_, do_ = (s0[n] for n in ("q", "k", "v", "g", "do"))
        B, T, H, K = q_.shape
        V = v_.shape[-1]
        C, NT, BH, t_ = 64, -(-T // 64), B * H, "bf16"
        geo = (i32(B), i32(T), i32(H), i32(K), i32(V), i32(C), i32(NT))
        st0, gt0 = G._local_states(rt, k_, v_, g_, t_, B, T, H, K, V, C, NT, 0, 1.0)
        ds0, _ = G._local_states(rt, q_, do_, g_, t_, B, T, H, K, V, C, NT, 1, scale)
        A_ = cp.empty((BH, NT, 64, 64), dtype=cp.float32)
        dA_ = cp.empty_like(A_)
        dq_, dk_, dv_ = cp.empty_like(q_), cp.empty_like(k_), cp.empty_like(v_)
        dG_ = cp.empty((B, T, H, K), dtype=cp.float32)
        stages = {
            "chunk_outer k^T v (states)": lambda i: G._local_states(rt, k_, v_, g_, t_, B, T, H, K, V, C, NT, 0, 1.0),
            "chunk_outer q^T do (d-states)": lambda i: G._local_states(rt, q_, do_, g_, t_, B, T, H, K, V, C, NT, 1,
                                                                       scale),
            "state scan over chunks": lambda i: G._scan(rt, st0, gt0, None, NT, K, V, BH, reverse=False),
            "bwd_scores (A, dA)": lambda i: rt.launch(f"gla_bwd_scores<{t_}>", (NT, BH), (256,),
                                                      (q_, k_, v_, g_, do_, A_, dA_) + geo),
            "bwd_dqdk": lambda i: rt.launch(
                f"gla_bwd_dqdk<{t_}>", (NT, BH, -(-K // 32)), (256,),
                (q_, k_, v_, g_, do_, st0, ds0, dA_, dq_, dk_, dG_, f32(scale)) + geo + (None, None, None, None)),
            "bwd_dv": lambda i: rt.launch(f"gla_bwd_dv<{t_}>", (NT, BH, -(-V // 64)), (256,),
                                          (k_, g_, do_, A_, ds0, dv_, f32(scale)) + geo + (None, None)),
            "dg reverse cumsum": lambda i: G._cumsum_T(rt, dG_, "float", t_, q_.dtype, B, T, H, K, C, reverse=True),
            "simt forward output kernel": lambda i: rt.launch(
                f"gla_chunk_output<{t_}>", (NT, BH, -(-V // 64)), (256,),
                (q_, k_, v_, g_, st0, dv_, f32(scale)) + geo + (None, None)),
        }
        few = max(5, reps // 4)
        for name, fn in stages.items():
            rec.timing(f"bwd stage: {name}", benchkit.cuda_event_time(fn, few, warmup=1)["median_ms"])
        os.environ["HPCZECO_TC_STATES"] = "1"  # the opt-in tensor-core state pass, for comparison
        try:
            for name in ("chunk_outer k^T v (states)", "chunk_outer q^T do (d-states)"):
                rec.timing(f"bwd stage: {name} [tensor cores]",
                           benchkit.cuda_event_time(stages[name], few, warmup=1)["median_ms"])
            rec.timing("ours fwd+bwd [HPCZECO_TC_STATES=1]",
                       benchkit.cuda_event_time(ours_fb, max(5, reps // 2), warmup=2, sets=2)["median_ms"])
        finally:
            os.environ.pop("HPCZECO_TC_STATES", None)
    except Exception as exc:  # noqa: BLE001
        rec.failed("bwd stages", exc)


def _fla_backward(rec, fla, torch, cp, tsets, scale: float, reps: int) -> None:
    """flash-linear-attention's forward+backward (autograd); its first call compiles and autotunes."""
    try:
        gsets = []
        for ts in tsets:
            d = {n: ts[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g")}
            d["do"] = ts["do"]
            gsets.append(d)

        def fla_fb(i):
            d = gsets[i]
            o, _ = fla(d["q"], d["k"], d["v"], d["g"], scale=scale, output_final_state=False)
            torch.autograd.backward(o, d["do"])

        t_start = time.time()
        fla_fb(0)
        cp.cuda.Device().synchronize()
        first_s = round(time.time() - t_start, 1)
        ms = benchkit.cuda_event_time(fla_fb, max(5, reps // 2), warmup=2, sets=2)["median_ms"]
        rec.timing("fla 0.6 chunk_gla fwd+bwd", ms, first_call_s=first_s)
        if rec.info.get("ours_fwd_bwd_ms"):
            rec.info["fwd_bwd_ours_over_fla"] = rec.info["ours_fwd_bwd_ms"] / ms
    except Exception as exc:  # noqa: BLE001
        rec.failed("fla 0.6 chunk_gla fwd+bwd", exc)
