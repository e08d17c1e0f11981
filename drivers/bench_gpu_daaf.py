"""`hpczeco bench gpu-daaf`: DAAF attention kernels and time to first token on one GPU.

1. Kernel timings (CUDA events, warm-up excluded, median of ``--reps``) at each T of ``--seqs``
   (8k, 32k, 128k), H=``--heads``, D=``--dim``, bf16: DAAF (:mod:`hpczeco.gpu.daaf`, each kernel
   family of ``--impls``) with window 128 alone, + the first 4096 tokens global, + 8 regions of 512;
   FlexAttention compiled with the same masks (its output difference from DAAF recorded beside its
   time); exact causal SDPA (flash).
2. Time to first token of a small random-weight model (:class:`hpczeco.drivers.gpu_daaf_model.TinyModel`):
   DAAF (planning on the device included) vs exact SDPA, the relative error of the final hidden
   states and last-token logits, and needle retrieval at the attention level (needles planted at
   several depths inside key regions, and control needles in the background).

The correctness of the kernels, the device planning and the needle retrieval is checked by
``pytest -m gpu tests/test_gpu_daaf*.py``. Results: ``--out``/gpu_daaf.json, gpu_daaf_timings.csv,
gpu_daaf_ttft.csv (rewritten after every row) and gpu_daaf.png.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import benchkit
from .gpu_daaf_model import (
    TinyModel,
    bench_plans,
    daaf_pairs,
    make_flex,
    needle_rates,
    sdpa_causal,
    synthetic_tokens,
)

STEM = "gpu_daaf"
TTFT_SPEEDUP_TARGET_32K = 2.1  # the time-to-first-token speedup aimed for at T = 32768 (recorded as "target")


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_daaf"), help="output folder")
    ap.add_argument("--seqs", default="8192,32768,131072", help="sequence lengths for timings and TTFT")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per kernel (median reported)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--impls", default="simple,tc,tc2,tc3", help="DAAF kernel families to time")
    ap.add_argument("--layers", type=int, default=4, help="layers of the TTFT model")
    ap.add_argument("--mlp-ratio", type=float, default=4.0, help="MLP width / d_model of the TTFT model")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--no-model", action="store_true", help="skip the TTFT model and needles")
    return ap


def main(argv: list[str] | None = None, prog: str = "hpczeco bench gpu-daaf") -> int:
    args = build_parser(prog).parse_args(argv)
    reason = benchkit.gpu_missing(needs=("torch",))
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    return run(args)


def run(args) -> int:
    import torch  # noqa: PLC0415

    seed = args.seed if args.seed is not None else int(time.time_ns() % (2**31))
    rec = benchkit.Recorder(args.out, STEM, info=benchkit.environment(("numpy", "cupy", "numba", "torch", "triton"),
                                                                      gpu=True))
    rec.info.update(seed=seed, args={k: str(v) for k, v in vars(args).items()})
    rec.say(f"bench gpu-daaf: seed {seed}; {rec.info}")
    if not torch.cuda.is_available():
        print("bench gpu-daaf: torch sees no CUDA device", file=sys.stderr)
        return 2
    seqs = [int(s) for s in args.seqs.split(",") if s.strip()]
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    for T in seqs:
        try:
            _timings_at(rec, impls, T, args.reps, args.heads, args.dim, not args.no_flex, gen)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next length
            rec.failed(f"T={T} timings", exc)
        torch.cuda.empty_cache()
    if not args.no_model:
        _ttft(rec, impls, seqs, args, seed)
    rec.finish(text=table(rec.tables.get("timings", []), rec.tables.get("ttft", [])), plot=plot)
    return 0


def _timings_at(rec, impls: list[str], T: int, reps: int, H: int, D: int, use_flex: bool, gen) -> None:
    import torch  # noqa: PLC0415
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415

    W = 128
    time_ = lambda fn: benchkit.cuda_event_time(lambda i: fn(), reps, queued=True, events="torch")
    q, k, v = (torch.randn(1, T, H, D, device="cuda", generator=gen, dtype=torch.float32).to(torch.bfloat16)
               for _ in range(3))
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, T, D] for flex and SDPA
    causal_pairs = T * (T + 1) // 2
    try:  # exact causal SDPA (flash)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

            ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        except Exception:  # noqa: BLE001
            ctx = contextlib.nullcontext()
        with ctx:
            t = time_(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True))
        rec.record({"T": T, "plan": "causal", "method": "sdpa-flash", **t, "pairs": causal_pairs,
                    "tflops": 4 * causal_pairs * H * D / t["median_ms"] / 1e9})
    except Exception as exc:  # noqa: BLE001
        rec.failed(f"T={T} SDPA causal", exc)
    flex = block_mask = None
    if use_flex:
        try:
            t0 = time.perf_counter()
            flex, block_mask = make_flex(T)
            rec.info.setdefault("flex_setup_s", {})[str(T)] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            rec.failed(f"T={T} FlexAttention import", exc)
    for pname, g in bench_plans(T).items():
        pairs = daaf_pairs(g, W)
        gidx = np.flatnonzero(g).astype(np.int32)
        gt = torch.from_numpy(g).cuda()
        outs, rows = {}, {}
        for impl in impls:
            if impl == "simple" and (T > 8192 or g.any()):
                continue  # the warp-per-row kernel is the reference: far too slow for long key-region rows
            try:
                p = gd.prepare_torch(q, k, v, gidx, W, None, gt, impl=impl)
                t = time_(p)
                outs[impl] = p().clone()
                rows[impl] = {"T": T, "plan": pname, "method": f"daaf-{impl}", **t, "pairs": pairs,
                              "tflops": 4 * pairs * H * D / t["median_ms"] / 1e9, "n_global": int(g.sum())}
            except Exception as exc:  # noqa: BLE001
                rec.failed(f"T={T} {pname} daaf-{impl}", exc)
        if flex is not None:
            try:
                t0 = time.perf_counter()
                bm = block_mask(g)
                fo = flex(qh, kh, vh, block_mask=bm)
                torch.cuda.synchronize()
                setup = time.perf_counter() - t0
                t = time_(lambda bm=bm: flex(qh, kh, vh, block_mask=bm))
                fo = fo.transpose(1, 2).float()
                for impl, o in outs.items():  # both bf16: how far apart the two outputs are
                    rows[impl]["max_rel_diff_vs_flex"] = float((o.float() - fo).abs().max() / fo.abs().max())
                rows["flex"] = {"T": T, "plan": pname, "method": "flex", **t, "pairs": pairs,
                                "tflops": 4 * pairs * H * D / t["median_ms"] / 1e9, "n_global": int(g.sum()),
                                "first_call_s": setup}
            except Exception as exc:  # noqa: BLE001
                rec.failed(f"T={T} {pname} FlexAttention", exc)
        for row in rows.values():
            if "flex" in rows and row["method"] != "flex":
                row["vs_flex"] = rows["flex"]["median_ms"] / row["median_ms"]
            rec.record(row)


def _ttft(rec, impls: list[str], seqs: list[int], args, seed: int) -> None:
    import torch  # noqa: PLC0415

    tc = [i for i in ("tc", "tc2", "tc3") if i in impls]
    # the fastest tensor-core variant measured at 32k with key regions (else the first one asked for)
    timed = [r for r in rec.tables.get("timings", []) if r.get("T") == 32768 and r.get("plan") == "w128+8x512"
             and r.get("method", "")[5:] in tc]
    impl = min(timed, key=lambda r: r["median_ms"])["method"][5:] if timed else (tc[0] if tc else None)
    rec.info["ttft_impl"] = impl
    if impl is None:
        rec.say("no tensor-core DAAF kernel in --impls: TTFT skipped")
        return
    model = TinyModel(args.layers, args.heads, args.dim, args.mlp_ratio, 32768, seed)
    rng = np.random.default_rng(seed)
    for T in seqs:
        try:
            row, regions = _ttft_at(model, impl, T, args, rng)
            row.update(needle_rates(T, regions, impl, args.heads, args.dim))
            rec.record(row, table="ttft")
        except Exception as exc:  # noqa: BLE001
            rec.failed(f"T={T} model prefill", exc, table="ttft_errors")
        torch.cuda.empty_cache()


def _ttft_at(model: TinyModel, impl: str, T: int, args, rng: np.random.Generator) -> tuple[dict, list]:
    import cupy as cp  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415
    from hpczeco.gpu import daaf_numba as dn  # noqa: PLC0415

    W = 128
    tok_np, regions = synthetic_tokens(T, rng)
    tok = torch.from_numpy(tok_np).cuda()
    reps = 3 if T > 65536 else 5
    holder: dict[str, Any] = {}

    def plan_device():
        tp = dn.threshold_plan(cp.from_dlpack(tok), 512, 0.8, W)
        return gd.device_plan(tp["global_idx"], W, T, tp["global_mask"], validate=False)

    def daaf_attn(q, k, v):
        return gd.attention_torch(q, k, v, None, W, None, None, impl=impl, validate=False, plan=holder["plan"])

    def run_daaf():
        holder["plan"] = plan_device()  # planning is part of the time to first token
        return model.prefill(tok, daaf_attn)

    dp = plan_device()
    n_global = int(cp.asnumpy(dp.gmask).astype(bool).sum())
    res = {}
    with torch.no_grad():
        for name, fn in (("exact", lambda: model.prefill(tok, sdpa_causal)), ("daaf", run_daaf)):
            out = fn()  # warm-up (and the first compile of the Numba/CuPy kernels)
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn()
                out[1].argmax().item()  # the first token, on the host
                times.append((time.perf_counter() - t0) * 1e3)
            res[name] = (float(np.median(times)), out)
        ev = lambda fn, warmup=3: benchkit.cuda_event_time(lambda i: fn(), reps, warmup, queued=True,
                                                           events="torch")["median_ms"]
        tp = ev(plan_device, warmup=1)
        q1 = torch.randn(1, T, args.heads, args.dim, device="cuda", dtype=torch.bfloat16)
        ta = ev(lambda: gd.attention_torch(q1, q1, q1, None, W, None, None, impl=impl, validate=False, plan=dp))
        te = ev(lambda: sdpa_causal(q1, q1, q1))
    (t_ex, (h_ex, l_ex)), (t_da, (h_da, l_da)) = res["exact"], res["daaf"]
    attn_frac = args.layers * te / t_ex
    row = {"T": T, "impl": impl, "ttft_exact_ms": t_ex, "ttft_daaf_ms": t_da, "speedup": t_ex / t_da,
           "plan_ms": tp, "attn_exact_ms_per_layer": te, "attn_daaf_ms_per_layer": ta,
           "attn_fraction_exact": attn_frac, "amdahl_bound": 1.0 / max(1e-9, 1.0 - attn_frac),
           "hidden_rel_err": float((h_da.float() - h_ex.float()).norm() / h_ex.float().norm()),
           "logits_cosine": float(torch.nn.functional.cosine_similarity(l_da.float(), l_ex.float(), dim=0)),
           "same_first_token": bool(l_da.argmax().item() == l_ex.argmax().item()), "n_global": n_global,
           "layers": args.layers, "d_model": args.heads * args.dim, "mlp_ratio": args.mlp_ratio}
    if T == 32768:
        row["target"] = TTFT_SPEEDUP_TARGET_32K
    return row, regions


def table(timing_rows: list[dict], ttft_rows: list[dict]) -> str:
    """The kernel timings (with the ratio to FlexAttention) and the TTFT rows as text."""
    lines = []
    if timing_rows:
        lines.append("attention forward, B=1, bf16 (median ms; useful TFLOP/s = 4 * pairs * H * D / time)")
        lines.append(f"{'T':>7} {'plan':<16} {'method':<12} {'ms':>9} {'TFLOP/s':>8} {'vs flex':>8}")
        for r in timing_rows:
            if "method" not in r:
                lines.append(f"{'':>7} {r.get('name', '?')}: {r.get('error', '')}")
                continue
            ratio = f"{r['vs_flex']:.2f}x" if "vs_flex" in r else ""
            lines.append(f"{r['T']:>7} {r['plan']:<16} {r['method']:<12} {r['median_ms']:>9.3f} {r['tflops']:>8.1f} "
                         f"{ratio:>8}")
    if ttft_rows:
        lines.append("")
        lines.append("time to first token (ms), small random model; needles: % retrieved in key regions")
        lines.append(f"{'T':>7} {'exact':>9} {'DAAF':>9} {'speedup':>8} {'bound':>6} {'plan':>6} {'hid.err':>8} "
                     f"{'needle':>7}")
        for r in ttft_rows:
            lines.append(f"{r['T']:>7} {r['ttft_exact_ms']:>9.2f} {r['ttft_daaf_ms']:>9.2f} {r['speedup']:>7.2f}x "
                         f"{r['amdahl_bound']:>5.2f}x {r['plan_ms']:>6.2f} {r['hidden_rel_err']:>8.3f} "
                         f"{r.get('needle_daaf_key_pct', float('nan')):>6.0f}%")
    return "\n".join(lines)


def plot(tables: dict[str, list[dict]], out: Path) -> str | None:
    """Median ms against T per (plan, method), log-log, into ``out``/gpu_daaf.png."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in tables.get("timings", []) if "method" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for plan_name, method in sorted({(r["plan"], r["method"]) for r in rows}):
        pts = sorted((r["T"], r["median_ms"]) for r in rows if r["plan"] == plan_name and r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{method} {plan_name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("ms (median)")
    ax.set_title("DAAF attention vs FlexAttention vs exact SDPA (bf16)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{STEM}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
