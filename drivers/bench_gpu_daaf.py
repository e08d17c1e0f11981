"""`hpczeco bench gpu-daaf`: DAAF attention kernels, the per-call API and time to first token on one GPU.

1. **kernels**: at each T of ``--seqs`` (8k, 32k, 128k), B=1, H=``--heads``, D=``--dim``, bf16, window 128
   alone, + the first 4096 tokens as key region, + 8 regions of 512 (:func:`gpu_daaf_model.bench_plans`):
   every DAAF kernel of ``--impls`` (``auto``: what ``impl="auto"`` picks, named in the row; the Hopper
   kernels of :mod:`hpczeco.gpu.daaf_hopper` with each schedule of ``--scheds``, on compute capability 9.0
   only) through ``prepare_torch``, FlexAttention compiled with the same mask (the outputs' difference
   recorded beside), exact causal SDPA (flash). CUDA events, warm-up excluded, median of ``--reps`` calls
   queued back to back; useful TFLOP/s = 4 * allowed pairs * H * D / time.
2. **api** (issue 15 item 2): per-call forms (``attention_torch`` with a host index and torch mask, with a
   :class:`hpczeco.daaf.Plan`, with a :class:`~hpczeco.gpu.daaf.DevicePlan`; ``hpczeco.daaf.attention``
   on CuPy float16 arrays) against the prepared launch of the same kernel: "stream" (calls queued back to
   back: GPU time) and "synced" (the device synchronised before each call: host overhead shows), and the
   device planner (:func:`hpczeco.daaf.device_planner.plan_torch`, its one host read included).
3. **ttft**: time to first token of random-weight decoders (``--models``): ``small`` (``--layers`` layers,
   d_model = heads x dim, GELU MLP of ``--mlp-ratio``) and ``7b`` (the attention share of a common 7-8B
   decoder: d_model 4096, 32 heads of 128, SwiGLU MLP ``--big-ffn``; ``--big-layers`` layers, since the
   share per layer is what sets the bound). Exact = SDPA flash in every layer; DAAF = the device planner once
   per prefill (``plan_torch(tokens, 512, 0.8, 128)``, inside the timed prefill) and ``attention_torch(q, k,
   v, None, 128, impl=--ttft-impl, plan=dp)`` in each layer (no check or host read per layer). Beside each
   speedup: the Amdahl bound ``1 / (1 - f)``, ``f`` = the share of the exact TTFT spent in attention
   (layers x SDPA time / exact TTFT), and the speedup as a fraction of it; the planner's time; the relative
   error of the final hidden states; needle retrieval in key regions (needles planted at several depths).

``--check`` (Hopper GPUs) runs the kernels' device checks first (:mod:`hpczeco.drivers.gpu_daaf_checks`: registers
and spills, the wgmma unit check, each Hopper kernel of ``--impls`` against the float64 reference in a process of its
own, ``--sanitize`` runs under compute-sanitizer), times only the kernels whose checks passed, checks the timed
outputs against FlexAttention's, and ends with exit status 1 if a check failed. After the table, the targets per
(T, plan) for the best kernel and the auto rule's pick (MET/MISS) and the ``AUTO_IMPLS`` the timings suggest.

Every measurement is guarded (a failure is recorded and the run goes on); a shape that does not fit in
the GPU's free memory is skipped with a message. Targets (recorded, not asserted): kernels <= 0.7x Flex
with key regions (0.75x at 8k), <= 0.4x window alone; per-call <= 1.1x prepared (host time per call in the api
table); TTFT >= 90 % of the bound at 32k and 128k, >= 1.0x at 8k. Correctness is checked by
``pytest -m gpu tests/test_gpu_daaf*.py``. Results: ``--out``/gpu_daaf.json,
gpu_daaf_{timings,api,ttft,targets,device_checks}.csv (rewritten after every row) and gpu_daaf.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import benchkit, gpu_daaf_checks
from .gpu_daaf_model import (
    TinyModel,
    bench_plans,
    flash_backend,
    make_flex,
    needle_rates,
    sdpa_causal,
    synthetic_tokens,
)
from .options import float_range, int_range

STEM = "gpu_daaf"
W = 128  # the local window of every timed plan
PLAN_WINDOW, PLAN_THRESHOLD = 512, 0.8  # the device planner's entropy window and threshold in the TTFT runs
TARGET_OF_BOUND = 0.9  # TTFT speedup / Amdahl bound aimed for at T >= 32768
TARGET_PER_CALL = 1.1  # per-call time / prepared time aimed for
MODELS = {  # the TTFT models (--models) and their shapes
    "small": "d_model = heads x dim, GELU MLP (--mlp-ratio), --layers layers",
    "7b": "d_model 4096 = 32 heads x 128, SwiGLU MLP --big-ffn, --big-layers layers",
}
DEFAULT_IMPLS = "auto,tc2,hwg,hwg64,hwg3,hfa2,hws,hfa3,hfa3p,hfa3s3"
#: x FlexAttention aimed for (issue 32): window alone; key regions at 8k; key regions from 32k on
TARGET_VS_FLEX = gpu_daaf_checks.TARGET_VS_FLEX  # the issue's targets, one table


def build_parser(prog: str) -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_daaf"), help="output folder")
    ap.add_argument("--seqs", default="8192,32768,131072", help="sequence lengths (all sections)")
    ap.add_argument("--reps", type=int_range(1), default=20, help="timed repetitions per kernel or call form (median)")
    ap.add_argument("--heads", type=int_range(1), default=16, help="heads of the kernel timings and of the small model")
    ap.add_argument("--dim", type=int_range(1), default=128,
                    help="head dim of the kernel timings and of the small model")
    ap.add_argument("--impls", default=DEFAULT_IMPLS,
                    help="DAAF kernels to time: auto and any of tc, tc2, tc3, simple and the Hopper kernels "
                         "(hpczeco.gpu.daaf.impl_names())")
    ap.add_argument("--scheds", default="3", help="schedules of the Hopper kernels to time (bits: 1 longest rows "
                                                  "first, 2 heads fastest)")
    ap.add_argument("--plans", default="", help="restrict the kernel timings to these plans: a comma list of "
                                                "w128, w128+first4096, w128+8x512 (default all)")
    ap.add_argument("--ttft-impl", default="auto", help="DAAF kernel of the TTFT runs and needles")
    ap.add_argument("--models", default="small,7b",
                    help=f"TTFT models: {'; '.join(f'{k}: {v}' for k, v in MODELS.items())}")
    ap.add_argument("--layers", type=int_range(1), default=4, help="layers of the small TTFT model")
    ap.add_argument("--mlp-ratio", type=float_range(0, lo_open=True), default=4.0,
                    help="MLP width / d_model of the small TTFT model")
    ap.add_argument("--big-layers", type=int_range(1), default=2, help="layers of the 7b-shaped TTFT model")
    ap.add_argument("--big-ffn", type=int_range(1), default=11008,
                    help="SwiGLU width of the 7b-shaped model (14336: Llama 3)")
    ap.add_argument("--seed", type=int_range(0), default=None, help="random seed (default: from the clock, printed)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel timings")
    ap.add_argument("--no-api", action="store_true", help="skip the per-call vs prepared table and the planner")
    ap.add_argument("--no-ttft", "--no-model", dest="no_ttft", action="store_true",
                    help="skip the TTFT models and the needles")
    ap.add_argument("--check", action="store_true",
                    help="first the Hopper kernels' device checks (hpczeco.drivers.gpu_daaf_checks: registers and "
                         "spills of each kernel, the wgmma unit check, each Hopper kernel of --impls against float64 "
                         "in a process of its own); only kernels whose checks passed are timed, and the timed outputs "
                         "against FlexAttention's become checks; exit status 1 if a check fails")
    ap.add_argument("--quick", action="store_true", help="with --check: a third of the probe cases")
    ap.add_argument("--sanitize", default="", help="with --check: compute-sanitizer tools (e.g. racecheck,synccheck) "
                                                   "to run the small cases of --sanitize-impls under")
    ap.add_argument("--sanitize-impls", default="hws,hwsp,hws3p,hwin", help="the kernels --sanitize runs")
    return ap


def main(argv: list[str] | None = None, prog: str = "hpczeco bench gpu-daaf") -> int:
    args = build_parser(prog).parse_args(argv)
    reason = benchkit.gpu_missing(needs=("torch",))
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    from .files import check_output_dir

    check_output_dir(args.out, "--out")  # before the work
    return run(args)


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def amdahl(attn_fraction: float) -> float:
    """The speedup bound when the attention share ``attn_fraction`` of the time becomes free: 1 / (1 - f)."""
    return 1.0 / max(1e-9, 1.0 - attn_fraction)


def tflops(pairs: int, H: int, D: int, ms: float) -> float:
    """Useful TFLOP/s of an attention over ``pairs`` allowed (query, key) pairs: QK^T and PV, 2 flops each."""
    return 4.0 * pairs * H * D / ms / 1e9


def run(args) -> int:
    import torch  # noqa: PLC0415
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415

    seed = args.seed if args.seed is not None else int(time.time_ns() % (2**31))
    rec = benchkit.Recorder(args.out, STEM, info=benchkit.environment(("numpy", "cupy", "numba", "torch", "triton"),
                                                                      gpu=True))
    rec.info.update(seed=seed, args={k: str(v) for k, v in vars(args).items()})
    if not torch.cuda.is_available():
        print("bench gpu-daaf: torch sees no CUDA device", file=sys.stderr)
        return 2
    cc = gd.compute_capability()
    rec.info["compute_capability"] = cc
    rec.say(f"bench gpu-daaf: seed {seed}; compute capability {cc}; {rec.info}")
    seqs = [int(s) for s in _csv(args.seqs)]
    impls = _csv(args.impls)
    scheds = [int(s) for s in _csv(args.scheds)]
    known = gd.impl_names()
    for i in [*impls, args.ttft_impl]:
        if i not in known:
            print(f"bench gpu-daaf: unknown impl {i!r}; choose from {known}", file=sys.stderr)
            return 2
    hopper = [i for i in impls if i not in gd.IMPLS]
    if hopper and cc != gd.HOPPER_CC:
        rec.say(f"compute capability {cc}, not 9.0: the Hopper kernels {hopper} are skipped")
        impls = [i for i in impls if i in gd.IMPLS]
    if cc == gd.HOPPER_CC:
        _prebuild(rec)
    if args.check:
        impls = _device_checks(rec, args, impls, cc == gd.HOPPER_CC, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    if not args.no_kernels:
        for T in seqs:
            try:
                _timings_at(rec, impls, scheds, T, args.reps, args.heads, args.dim, not args.no_flex, gen,
                            _csv(args.plans))
            except Exception as exc:  # noqa: BLE001 - record and go on with the next length
                rec.failed(f"T={T} timings", exc)
            torch.cuda.empty_cache()
    if not args.no_api:
        for T in seqs:
            try:
                _api_at(rec, T, args.reps, args.heads, args.dim, seed)
            except Exception as exc:  # noqa: BLE001
                rec.failed(f"T={T} per-call API", exc, table="api")
            torch.cuda.empty_cache()
    if args.check:
        gpu_daaf_checks.flex_checks(rec, rec.tables.get("timings", []))
    if not args.no_ttft:
        _ttft(rec, args, seqs, seed)
    summary = gpu_daaf_checks.targets(rec, rec.tables.get("timings", []), args.dim)
    rec.finish(text="\n".join([table(rec.tables), *summary, *check_lines(rec.tables)]), plot=plot)
    if args.check:
        return 1 if any(not c["ok"] for c in rec.tables.get(gpu_daaf_checks.TABLE, [])) else 0
    return 0


def _device_checks(rec, args, impls: list[str], hopper: bool, seed: int) -> list[str]:
    """``--check``: the Hopper kernels' registers and spills, the wgmma unit check, each Hopper kernel of ``impls``
    probed (each in a process of its own), the sanitizer runs; returns ``impls`` without the Hopper kernels whose
    probe failed."""
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415

    kernels = [i for i in impls if i not in gd.IMPLS]
    if not hopper:
        rec.say("--check: not a Hopper GPU (compute capability 9.0): no device checks of the Hopper kernels")
        return impls
    from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

    try:
        rec.info["hopper_kernels"] = {n: d for n, d in dh.kernel_info().items() if d["impl"] in kernels}
        for name, d in rec.info["hopper_kernels"].items():
            rec.say(f"INFO  build: {name}: {d['num_regs']} registers, {d['local_size_bytes']} local (spill) bytes, "
                    f"{d['dynamic_smem_bytes']} dynamic smem bytes")
    except Exception as exc:  # noqa: BLE001
        gpu_daaf_checks.failed(rec, "build", "kernel_info", exc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not gpu_daaf_checks.run_child(rec, out, "unit", seed, timeout=240):
        rec.say("INFO  unit: the wgmma unit check failed: the kernels are probed anyway, timed only if their "
                "probe passes")
    failing = [i for i in kernels if not gpu_daaf_checks.run_child(rec, out, "probe", seed + dh.IMPLS.index(i), i,
                                                                   args.quick, timeout=300)]
    if args.sanitize:
        exe = gpu_daaf_checks.sanitizer()
        if exe is None:
            rec.say("INFO  sanitize: compute-sanitizer not found: skipped")
        for tool in [t for t in args.sanitize.split(",") if t and exe]:
            for impl in [i for i in _csv(args.sanitize_impls) if i in dh.VARIANTS]:
                gpu_daaf_checks.run_child(rec, out, "small", seed, impl, timeout=300, tag=tool,
                                          prefix=(exe, "--tool", tool, "--error-exitcode", "3"))
    if failing:
        rec.say(f"--check: not timed (probe failed): {', '.join(failing)}")
    return [i for i in impls if i not in failing]


def check_lines(tables: dict[str, list[dict]]) -> list[str]:
    """The device checks' count and each failure (``--check``), as text lines."""
    rows = tables.get(gpu_daaf_checks.TABLE, [])
    if not rows:
        return []
    bad = [r for r in rows if not r["ok"]]
    lines = ["", f"device checks (--check): {len(rows) - len(bad)} of {len(rows)} passed"]
    lines += [f"  FAIL {r['stage']}: {r['check']}: {str(r.get('detail', ''))[:200]}" for r in bad]
    return lines


def _prebuild(rec) -> None:
    """Build the Hopper cubins in parallel (cached on disk by source hash) before the first launch needs them."""
    try:
        from hpczeco.gpu import daaf_fa3  # noqa: PLC0415
        from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

        t0 = time.perf_counter()
        built = dh.prebuild() + [(f"fa3/{g}", p, how, s) for g, p, how, s in daaf_fa3.prebuild()]
        rec.info["hopper_build"] = [{"group": g, "how": how, "s": round(s, 2)} for g, _, how, s in built]
        rec.say(f"Hopper cubins: {len(built)} groups in {time.perf_counter() - t0:.1f} s "
                f"({', '.join(sorted({how for _, _, how, _ in built}))})")
    except Exception as exc:  # noqa: BLE001 - the first launch builds them then
        rec.say(f"Hopper prebuild failed ({type(exc).__name__}: {exc}); kernels build on first use")


# --------------------------------------------------------------------------- 1. kernels


def _event_ms(fn, reps: int, warmup: int = 3) -> dict:
    return benchkit.cuda_event_time(lambda i: fn(), reps, warmup, queued=True, events="torch")


def _timings_at(rec, impls: list[str], scheds: list[int], T: int, reps: int, H: int, D: int, use_flex: bool,
                gen, plans: list[str] | None = None) -> None:
    import torch  # noqa: PLC0415
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415

    from hpczeco.daaf import attention_pairs  # noqa: PLC0415

    q, k, v = (torch.randn(1, T, H, D, device="cuda", generator=gen, dtype=torch.float32).to(torch.bfloat16)
               for _ in range(3))
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, T, D] for flex and SDPA
    causal_pairs = T * (T + 1) // 2
    try:  # exact causal SDPA (flash)
        with flash_backend():
            t = _event_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True), reps)
        rec.record({"T": T, "plan": "causal", "method": "sdpa-flash", **t, "pairs": causal_pairs,
                    "tflops": tflops(causal_pairs, H, D, t["median_ms"])})
    except Exception as exc:  # noqa: BLE001
        rec.failed(f"T={T} SDPA causal", exc)
    flex = block_mask = None
    if use_flex:
        try:
            t0 = time.perf_counter()
            flex, block_mask = make_flex(T, W)
            rec.info.setdefault("flex_setup_s", {})[str(T)] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            rec.failed(f"T={T} FlexAttention import", exc)
    runs = [(i, None) for i in impls if i in gd.IMPLS] + [(i, s) for i in impls if i not in gd.IMPLS for s in scheds]
    for pname, g in bench_plans(T).items():
        if plans and pname not in plans:
            continue
        pairs = attention_pairs(g, W)
        gidx = np.flatnonzero(g).astype(np.int32)
        gt = torch.from_numpy(g).cuda()
        outs, rows = {}, {}
        for impl, sched in runs:
            if impl == "simple" and (T > 8192 or g.any()):
                continue  # the warp-per-row kernel is the reference: far too slow for long key-region rows
            label = f"daaf-{impl}" + (f"/s{sched}" if sched is not None else "")
            try:
                p = gd.prepare_torch(q, k, v, gidx, W, None, gt, impl=impl, sched=sched)
                t = _event_ms(p, reps)
                outs[label] = p().clone()
                rows[label] = {"T": T, "plan": pname, "method": label, **t, "pairs": pairs,
                               "tflops": tflops(pairs, H, D, t["median_ms"]), "n_global": int(g.sum()),
                               "kernel": p.name, "choice": f"{p.impl}" + (f"/s{p.sched}" if p.sched is not None
                                                                          else "")}
            except Exception as exc:  # noqa: BLE001
                rec.failed(f"T={T} {pname} {label}", exc)
        ref = outs.get("daaf-tc2")
        if ref is not None:  # two DAAF kernels on the same inputs: bf16 rounding apart
            for label, o in outs.items():
                rows[label]["max_rel_diff_vs_tc2"] = float((o.float() - ref.float()).abs().max()
                                                           / ref.float().abs().max())
        if flex is not None:
            try:
                t0 = time.perf_counter()
                bm = block_mask(g)
                fo = flex(qh, kh, vh, block_mask=bm)
                torch.cuda.synchronize()
                setup = time.perf_counter() - t0
                t = _event_ms(lambda bm=bm: flex(qh, kh, vh, block_mask=bm), reps)
                fo = fo.transpose(1, 2).float()
                for label, o in outs.items():  # both bf16: how far apart the two outputs are
                    rows[label]["max_rel_diff_vs_flex"] = float((o.float() - fo).abs().max() / fo.abs().max())
                rows["flex"] = {"T": T, "plan": pname, "method": "flex", **t, "pairs": pairs,
                                "tflops": tflops(pairs, H, D, t["median_ms"]), "n_global": int(g.sum()),
                                "first_call_s": setup}
            except Exception as exc:  # noqa: BLE001
                rec.failed(f"T={T} {pname} FlexAttention", exc)
        for row in rows.values():
            if "flex" in rows and row["method"] != "flex":
                row["vs_flex"] = row["median_ms"] / rows["flex"]["median_ms"]  # < 1: faster than Flex
                row["target_vs_flex"] = gpu_daaf_checks.target_vs_flex(T, bool(row["n_global"]))
            rec.record(row)


# --------------------------------------------------------------------------- 2. per-call API vs prepared


def _both(fn, reps: int, events: str) -> dict:
    """``stream_ms`` (queued back to back) and ``synced_ms`` (synchronised before each call) medians, and
    ``host_us``: host time per call, ``reps`` calls queued without a synchronisation (the best of 3 rounds)."""
    s = benchkit.cuda_event_time(lambda i: fn(), reps, 3, queued=True, events=events)
    y = benchkit.cuda_event_time(lambda i: fn(), reps, 1, queued=False, events=events)
    if events == "torch":
        import torch  # noqa: PLC0415

        sync = torch.cuda.synchronize
    else:
        import cupy  # noqa: PLC0415

        sync = cupy.cuda.Device().synchronize
    host = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host.append((time.perf_counter() - t0) / reps * 1e6)
    sync()
    return {"stream_ms": s["median_ms"], "synced_ms": y["median_ms"], "host_us": min(host)}


def _api_at(rec, T: int, reps: int, H: int, D: int, seed: int) -> None:
    import cupy  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from hpczeco.daaf import device_planner as dpl  # noqa: PLC0415

    gen = torch.Generator(device="cuda").manual_seed(seed + 2 + T)
    tqkv = [torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3)]
    cqkv = [cupy.from_dlpack(x.to(torch.float16)) for x in tqkv]
    for pname, g in bench_plans(T).items():
        _api_forms(rec, T, pname, g, tqkv, cqkv, reps)
    try:  # the device planner on the TTFT runs' synthetic text
        tok_np, _ = synthetic_tokens(T, np.random.default_rng(seed + T))
        tok = torch.from_numpy(tok_np).cuda()
        dpp = dpl.plan_torch(tok, PLAN_WINDOW, PLAN_THRESHOLD, W)
        t = _both(lambda: dpl.plan_torch(tok, PLAN_WINDOW, PLAN_THRESHOLD, W), reps, "torch")
        rec.record({"T": T, "plan": "planner", "form": f"device_planner.plan_torch(tokens, {PLAN_WINDOW}, "
                    f"{PLAN_THRESHOLD}, {W})", **t, "n_global": dpp.n_global, "n_regions": dpp.n_regions,
                    "target_ms_32k": 0.3 if T == 32768 else None}, table="api")
    except Exception as exc:  # noqa: BLE001
        rec.failed(f"T={T} device planner", exc, table="api")


def _api_forms(rec, T: int, pname: str, g: np.ndarray, tqkv: list, cqkv: list, reps: int) -> None:
    """The per-call rows of one key-region layout ``g`` (bool ``[T]``): torch bf16 and CuPy float16 forms."""
    import cupy  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415

    import hpczeco.daaf as daaf  # noqa: PLC0415

    tq, tk, tv = tqkv
    cq, ck, cv = cqkv
    gidx = np.flatnonzero(g).astype(np.int32)
    tg = torch.from_numpy(g).cuda()
    plan = daaf.plan_from_mask(g, W)
    dp = gd.device_plan(gidx, W, T)

    def add(form: str, fn, base: dict | None, same, events: str, choice: str) -> dict | None:
        try:
            t = _both(fn, reps, events)
            row = {"T": T, "plan": pname, "form": form, "impl": choice, **t, "same_output": bool(same())}
            if base is not None:
                row["stream_ratio"] = t["stream_ms"] / base["stream_ms"]
                row["synced_ratio"] = t["synced_ms"] / base["synced_ms"]
                row["target"] = TARGET_PER_CALL
            rec.record(row, table="api")
            return t
        except Exception as exc:  # noqa: BLE001
            rec.failed(f"T={T} {pname} {form}", exc, table="api")
            return None

    def choice_of(p) -> str:
        return p.impl + (f"/s{p.sched}" if p.sched is not None else "")

    # torch bf16: attention_torch against prepare_torch (the same kernel: impl="auto" on the same plan; and hfa3,
    # the FA3-design kernel, on compute capability 9.0)
    for impl in ("auto", "hfa3") if gd.compute_capability() == gd.HOPPER_CC else ("auto",):
        tag = "" if impl == "auto" else f", impl={impl}"
        try:
            p = gd.prepare_torch(tq, tk, tv, gidx, W, None, tg, impl=impl)
            want = p().clone()
            base = add(f"prepare_torch(...{tag})() [prepared]", p, None, lambda: True, "torch", choice_of(p))
            forms = {
                f"attention_torch(host gidx{tag})": lambda i=impl: gd.attention_torch(tq, tk, tv, gidx, W, impl=i),
                f"attention_torch(host gidx, torch mask{tag})": lambda i=impl: gd.attention_torch(
                    tq, tk, tv, gidx, W, None, tg, impl=i),
                f"attention_torch(plan=Plan{tag})": lambda i=impl: gd.attention_torch(tq, tk, tv, None, W, plan=plan,
                                                                                      impl=i),
                f"attention_torch(plan=DevicePlan{tag})": lambda i=impl: gd.attention_torch(tq, tk, tv, None, W,
                                                                                            plan=dp, impl=i)}
            for form, fn in forms.items():
                if base is not None:
                    add(form, fn, base, lambda fn=fn, want=want: torch.equal(fn(), want), "torch", choice_of(p))
        except Exception as exc:  # noqa: BLE001
            rec.failed(f"T={T} {pname} torch forms {impl}", exc, table="api")
    try:  # CuPy float16: hpczeco.daaf.attention against prepare
        p16 = gd.prepare(cq, ck, cv, gidx, W)
        want16 = p16().copy()
        base = add("prepare(cupy f16)() [prepared]", p16, None, lambda: True, "cupy", choice_of(p16))
        forms = {"daaf.attention(cupy, plan, check=False)": lambda: daaf.attention(cq, ck, cv, plan, check=False),
                 "daaf.attention(cupy, plan) [NaN/Inf checks: 1 wait]": lambda: daaf.attention(cq, ck, cv, plan)}
        for form, fn in forms.items():
            if base is not None:
                add(form, fn, base, lambda fn=fn: bool(cupy.array_equal(fn(), want16)), "cupy", choice_of(p16))
    except Exception as exc:  # noqa: BLE001
        rec.failed(f"T={T} {pname} CuPy forms", exc, table="api")


# --------------------------------------------------------------------------- 3. time to first token


def _model_shapes(args) -> dict[str, dict]:
    return {
        "small": dict(layers=args.layers, H=args.heads, D=args.dim, mlp="gelu",
                      ffn=int(args.mlp_ratio * args.heads * args.dim)),
        "7b": dict(layers=args.big_layers, H=32, D=128, mlp="swiglu", ffn=args.big_ffn),
    }


def _ttft(rec, args, seqs: list[int], seed: int) -> None:
    import torch  # noqa: PLC0415

    shapes = _model_shapes(args)
    rng = np.random.default_rng(seed)
    needles_done: set[int] = set()
    for name in _csv(args.models):
        if name not in shapes:
            rec.say(f"unknown TTFT model {name!r} (choose from {list(shapes)}): skipped")
            continue
        s = shapes[name]
        try:
            model = TinyModel(s["layers"], s["H"], s["D"], 0.0, 32000, seed, mlp=s["mlp"], ffn=s["ffn"])
        except Exception as exc:  # noqa: BLE001
            rec.failed(f"{name} model", exc, table="ttft")
            continue
        for T in seqs:
            need = TinyModel.activation_bytes(T, model.d, model.ffn) + 4 * T * model.d * 2
            free = torch.cuda.mem_get_info()[0]
            if need > 0.9 * free:
                rec.say(f"TTFT {name} T={T}: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free: skipped")
                rec.record({"model": name, "T": T, "skipped": f"needs ~{need / 2**30:.1f} GiB of "
                            f"{free / 2**30:.1f} GiB free"}, table="ttft")
                continue
            try:
                row, regions = _ttft_at(model, name, args.ttft_impl, T, args.reps, rng)
                if T not in needles_done:  # attention-level needles, once per T (they do not depend on the model)
                    needles_done.add(T)
                    try:
                        row.update(needle_rates(T, regions, args.ttft_impl, args.heads, args.dim, W))
                    except Exception as exc:  # noqa: BLE001
                        row["needle_error"] = f"{type(exc).__name__}: {exc}"[:200]
                rec.record(row, table="ttft")
            except torch.cuda.OutOfMemoryError as exc:
                rec.record({"model": name, "T": T, "skipped": f"out of memory: {str(exc)[:120]}"}, table="ttft")
            except Exception as exc:  # noqa: BLE001
                rec.failed(f"{name} T={T} prefill", exc, table="ttft")
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


def _ttft_at(model: TinyModel, name: str, impl: str, T: int, reps: int, rng: np.random.Generator
             ) -> tuple[dict, list]:
    import torch  # noqa: PLC0415
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415

    from hpczeco.daaf import device_planner as dpl  # noqa: PLC0415

    tok_np, regions = synthetic_tokens(T, rng, vocab=model.vocab)
    tok = torch.from_numpy(tok_np).cuda()
    n_prefill = 3 if T > 65536 else 5
    n_attn = max(3, reps // 4) if T > 65536 else reps  # exact attention at 128k: ~0.1-0.3 s a call
    holder: dict[str, Any] = {}

    def plan():
        return dpl.plan_torch(tok, PLAN_WINDOW, PLAN_THRESHOLD, W)

    def daaf_attn(q, k, v):
        return gd.attention_torch(q, k, v, None, W, impl=impl, plan=holder["plan"])

    def run_exact():
        with flash_backend():
            return model.prefill(tok, sdpa_causal)

    def run_daaf():
        holder["plan"] = plan()  # planning is part of the time to first token
        return model.prefill(tok, daaf_attn)

    res = {}
    with torch.no_grad():
        for label, fn in (("exact", run_exact), ("daaf", run_daaf)):
            out = fn()  # warm-up (first launches, cubin loads)
            torch.cuda.synchronize()
            times = []
            for _ in range(n_prefill):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn()
                out[1].argmax().item()  # the first token, on the host
                times.append((time.perf_counter() - t0) * 1e3)
            res[label] = (float(np.median(times)), out)
        dp = plan()
        t_plan = benchkit.cuda_event_time(lambda i: plan(), n_attn, 1, queued=False, events="torch")["median_ms"]
        gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
        q1, k1, v1 = (torch.randn(1, T, model.H, model.D, device="cuda", generator=gen).to(torch.bfloat16)
                      for _ in range(3))
        p = gd.prepare_torch(q1, k1, v1, None, W, impl=impl, plan=dp)
        t_attn_daaf = _event_ms(p, n_attn)["median_ms"]
        with flash_backend():
            t_attn_exact = _event_ms(lambda: sdpa_causal(q1, k1, v1), n_attn, warmup=1)["median_ms"]
    (t_ex, (h_ex, l_ex)), (t_da, (h_da, l_da)) = res["exact"], res["daaf"]
    L = model.n_layers
    f = min(1.0, L * t_attn_exact / t_ex)
    bound = amdahl(f)
    speedup = t_ex / t_da
    # what the measured parts predict: exact TTFT with each layer's attention swapped, plus the planner
    predicted = t_ex / max(1e-9, t_ex - L * (t_attn_exact - t_attn_daaf) + t_plan)
    row = {"model": name, "T": T, "layers": L, "d_model": model.d, "heads": model.H, "mlp": model.mlp,
           "ffn": model.ffn, "impl": p.impl + (f"/s{p.sched}" if p.sched is not None else ""),
           "ttft_exact_ms": t_ex, "ttft_daaf_ms": t_da, "speedup": speedup, "amdahl_bound": bound,
           "of_bound": speedup / bound, "attn_fraction_exact": f, "attn_exact_ms_per_layer": t_attn_exact,
           "attn_daaf_ms_per_layer": t_attn_daaf, "plan_ms": t_plan, "predicted_speedup": predicted,
           "n_global": dp.n_global, "n_regions": dp.n_regions,
           "hidden_rel_err": float((h_da.float() - h_ex.float()).norm() / h_ex.float().norm()),
           "logits_cosine": float(torch.nn.functional.cosine_similarity(l_da.float(), l_ex.float(), dim=0)),
           "same_first_token": bool(l_da.argmax().item() == l_ex.argmax().item())}
    row["target"] = f">= {TARGET_OF_BOUND:.0%} of bound" if T >= 32768 else ">= 1.0x"
    row["meets_target"] = bool(row["of_bound"] >= TARGET_OF_BOUND) if T >= 32768 else bool(speedup >= 1.0)
    return row, regions


# --------------------------------------------------------------------------- report


def table(tables: dict[str, list[dict]]) -> str:
    """The kernel timings (ratio to FlexAttention), the per-call table and the TTFT rows as text."""
    lines: list[str] = []
    timing_rows = tables.get("timings", [])
    if timing_rows:
        lines.append("attention forward, B=1, bf16 (median ms; useful TFLOP/s = 4 * pairs * H * D / time; "
                     "vs flex < 1: faster)")
        lines.append(f"{'T':>7} {'plan':<16} {'method':<14} {'choice':<10} {'ms':>9} {'TFLOP/s':>8} {'vs flex':>8}")
        for r in timing_rows:
            if "method" not in r:
                lines.append(f"{'':>7} {r.get('name', '?')}: {r.get('error', '')}")
                continue
            ratio = f"{r['vs_flex']:.2f}x" if "vs_flex" in r else ""
            lines.append(f"{r['T']:>7} {r['plan']:<16} {r['method']:<14} {r.get('choice', ''):<10} "
                         f"{r['median_ms']:>9.3f} {r['tflops']:>8.1f} {ratio:>8}")
    api_rows = tables.get("api", [])
    if api_rows:
        lines.append("")
        lines.append(f"per-call API vs the prepared launch (median ms; ratio: / prepared; target <= "
                     f"{TARGET_PER_CALL}x)")
        lines.append(f"{'T':>7} {'plan':<16} {'form':<52} {'impl':<9} {'stream':>8} {'ratio':>6} {'synced':>8} "
                     f"{'ratio':>6} {'host us':>8}")
        for r in api_rows:
            if "form" not in r:
                lines.append(f"{'':>7} {r.get('name', '?')}: {r.get('error', '')}")
                continue
            sr = f"{r['stream_ratio']:.2f}" if "stream_ratio" in r else ""
            yr = f"{r['synced_ratio']:.2f}" if "synced_ratio" in r else ""
            hu = f"{r['host_us']:.1f}" if "host_us" in r else ""
            lines.append(f"{r['T']:>7} {r['plan']:<16} {r['form'][:52]:<52} {r.get('impl', ''):<9} "
                         f"{r['stream_ms']:>8.3f} {sr:>6} {r['synced_ms']:>8.3f} {yr:>6} {hu:>8}")
    ttft_rows = tables.get("ttft", [])
    if ttft_rows:
        lines.append("")
        lines.append("time to first token (ms), random-weight decoders (7b: a few layers of a 7-8B decoder's shape: "
                     "the attention share per layer sets the bound);")
        lines.append("bound = 1/(1 - attention share of exact TTFT); of bd = speedup / bound; needle: % retrieved in "
                     "key regions")
        lines.append(f"{'model':<6} {'T':>7} {'impl':<9} {'exact':>9} {'DAAF':>9} {'speedup':>8} {'bound':>6} "
                     f"{'of bd':>6} {'attn %':>6} {'plan':>6} {'hid.err':>8} {'needle':>7}")
        for r in ttft_rows:
            if "skipped" in r:
                lines.append(f"{r['model']:<6} {r['T']:>7} skipped: {r['skipped']}")
                continue
            if "ttft_exact_ms" not in r:
                lines.append(f"{'':<6} {r.get('name', '?')}: {r.get('error', '')}")
                continue
            lines.append(f"{r['model']:<6} {r['T']:>7} {r['impl']:<9} {r['ttft_exact_ms']:>9.2f} "
                         f"{r['ttft_daaf_ms']:>9.2f} {r['speedup']:>7.2f}x {r['amdahl_bound']:>5.2f}x "
                         f"{r['of_bound']:>5.0%} {100 * r['attn_fraction_exact']:>5.0f}% {r['plan_ms']:>6.2f} "
                         f"{r['hidden_rel_err']:>8.3f} {r.get('needle_daaf_key_pct', float('nan')):>6.0f}%")
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
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / f"{STEM}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
