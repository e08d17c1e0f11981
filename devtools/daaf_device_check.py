"""Device check of the Hopper DAAF kernels (gpu/daaf_hopper.cu) on one H200; about 3 minutes.

    python3 devtools/daaf_device_check.py --out $OUT        # from the repository root

Stages, each guarded (an error is recorded with its traceback and the run goes on):

1. build: the compile groups of gpu/daaf_hopper.py in parallel processes (NVRTC, sm_90a; nvcc when
   NVRTC fails); registers and local (spill) bytes of every kernel.
2. unit (child process): the wgmma unit kernel, one D[64x128] = A[64x128] B[128x128] product through
   the attention kernel's shared-memory layouts and descriptors: 128-byte swizzle and unswizzled,
   B K-major (the K tile of Q K^T) and MN-major (the V tile of P V), A from shared memory (Q) and
   from registers (P); PASS/FAIL with the max error, the first mismatching indices and, on a
   failure, which rows/columns of the reference the result's rows/columns match (layout hints).
3. probe (one child process per kernel, so a faulting kernel cannot poison the others): each
   kernel against the float64 reference on fresh random inputs (T in {1, 63, 64, 65, 200, 700},
   W in {0, 1, 16, 128}, key regions none / first block / scattered / all / spans), output
   poisoned with NaN first. Only kernels that pass are timed.
4. timing: B = 1, H = 16, D = 128, bf16, T = 8k / 32k / 128k, plans w128, w128+first4096,
   w128+8x512; CUDA events, warm-up, median of --reps back-to-back calls; beside FlexAttention
   (compiled, the same mask; its block mask built with _compile=True) and the existing tc2 kernel
   (gpu/daaf.py); outputs cross-checked against both. Useful TFLOP/s = 4 x allowed pairs x H x D / t.
   The window-only kernels (hwin*) are timed on the plan without key regions only (their probes use
   window-only plans).
5. per (T, plan) MET/MISS against the issue's targets (t / t_flex <= 1.0 with key regions, moonshot 0.7;
   <= 0.8 for the window alone) for the best kernel and for the pick of choose_impl (the auto rule), the
   AUTO_IMPLS this run's timings suggest, a table last, and $OUT/daaf_device_check.json with every record,
   the environment and the seed.

Flags pick the variants (--impls, --scheds, --seqs, --plans, --reps; --quick, --no-flex, --no-tc2,
--skip-probe, --skip-timing; --sanitize racecheck,synccheck runs a few small cases of --sanitize-impls under
compute-sanitizer after the probes). Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hpczeco.base import bf16  # noqa: E402
from hpczeco.drivers.gpu_daaf_model import bench_plans, daaf_pairs, key_regions, make_flex  # noqa: E402
from hpczeco.gpu import daaf_hopper as dh  # noqa: E402

from hpczeco.daaf.reference import attention_reference  # noqa: E402

RESULT_FILE = "daaf_device_check.json"
TOL = {"bf16": 1e-2, "f16": 5e-3}
UNIT_TOL = 1e-4
FLEX_DIFF_TOL = 2e-2
# the new kernels (warp-specialised hws*, window-only hwin*) beside the best two of the first run (hwg3, hwg64)
DEFAULT_IMPLS = "hws,hwsp,hws64,hws3,hws3p,hwin,hwin2,hwg3,hwg64"
W_BENCH = 128


# --------------------------------------------------------------------------- records


class Recorder:
    """PASS/FAIL/INFO lines and records (appended to a JSON-lines file when ``path`` is set)."""

    def __init__(self, path: Path | None = None):
        self.records: list[dict] = []
        self.path = path

    def add(self, rec: dict) -> None:
        self.records.append(rec)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec, default=_jsonable) + "\n")

    def check(self, stage: str, name: str, value: float, tol: float, detail: str = "", **data) -> bool:
        ok = bool(np.isfinite(value)) and value <= tol
        print(f"{'PASS' if ok else 'FAIL'}  {stage}: {name}: {detail}{value:.3g} {'<=' if ok else '>'} {tol:.3g}",
              flush=True)
        self.add({"kind": "check", "stage": stage, "name": name, "ok": ok, "value": float(value), "tol": tol,
                  "detail": detail, **data})
        return ok

    def error(self, stage: str, name: str, exc: BaseException, **data) -> None:
        print(f"FAIL  {stage}: {name}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
        self.add({"kind": "check", "stage": stage, "name": name, "ok": False, "value": None, "tol": None,
                  "detail": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)[-4000:],
                  **data})

    def info(self, stage: str, name: str, text: str = "", **data) -> None:
        if text:
            print(f"INFO  {stage}: {name}: {text}", flush=True)
        self.add({"kind": "info", "stage": stage, "name": name, "text": text, **data})

    @property
    def n_fail(self) -> int:
        return sum(1 for r in self.records if r.get("kind") == "check" and not r["ok"])


def _jsonable(x: Any):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))


# --------------------------------------------------------------------------- plans


def device_plan(cp, g: np.ndarray, W: int):
    """The DevicePlan fields the kernels read (global_idx, gmask, n_global, local_window, T)."""
    T = len(g)
    gidx = cp.asarray(np.flatnonzero(g).astype(np.int32))
    return SimpleNamespace(global_idx=gidx, _gidx_arg=gidx if gidx.size else cp.zeros(1, dtype=np.int32),
                           gmask=cp.asarray(g.astype(np.uint8)), n_global=int(gidx.size),
                           local_window=min(int(W), T), T=T)


# --------------------------------------------------------------------------- stage 2: wgmma unit (child)


def _match_map(x: np.ndarray, ref: np.ndarray, axis: int, n: int = 16) -> list[int]:
    """For the first n rows (axis 0) / columns (axis 1) of x: the index of the closest one of ref."""
    xs = x if axis == 0 else x.T
    rs = ref if axis == 0 else ref.T
    return [int(np.argmin(np.abs(rs - xs[i][None, :]).sum(axis=1))) for i in range(min(n, xs.shape[0]))]


def child_unit(rec: Recorder, seed: int) -> None:
    import cupy as cp

    rng = np.random.default_rng(seed)
    for elem, swz in (("bf16", True), ("bf16", False), ("f16", True)):
        for mode in (0, 1, 2, 3):
            if elem == "f16" and mode in (1, 2):
                continue
            what = f"{elem} {'sw128' if swz else 'nosw'} mode {mode} (B {'MN' if mode & 1 else 'K'}-major, " \
                   f"A from {'registers' if mode & 2 else 'smem'})"
            try:
                a = rng.standard_normal((64, 128)).astype(np.float32)
                b = rng.standard_normal((128, 128)).astype(np.float32)
                if elem == "bf16":
                    ha, hb = bf16.to_bits(a), bf16.to_bits(b)
                    fa, fb = bf16.from_bits(ha), bf16.from_bits(hb)
                else:
                    ha, hb = a.astype(np.float16).view(np.uint16), b.astype(np.float16).view(np.uint16)
                    fa, fb = ha.view(np.float16).astype(np.float32), hb.view(np.float16).astype(np.float32)
                d = cp.asnumpy(dh.wgmma_unit(ha, hb, mode, elem, swz))
                cp.cuda.runtime.deviceSynchronize()
                fa, fb = fa.astype(np.float64), fb.astype(np.float64)
                ref = fa @ (fb if mode & 1 else fb.T)
                err = rel_err(d, ref)
                extra: dict[str, Any] = {}
                if not err <= UNIT_TOL:
                    bad = np.argwhere(~(np.abs(d - ref) <= 1e-3 * np.abs(ref).max()))
                    extra["first_mismatches"] = [(int(i), int(j), float(d[i, j]), float(ref[i, j]))
                                                 for i, j in bad[:6]]
                    extra["n_mismatch"] = int(len(bad))
                    extra["nan"] = int(np.isnan(d).sum())
                    alt = fa @ (fb.T if mode & 1 else fb)
                    extra["err_if_B_major_swapped"] = rel_err(d, alt)
                    if np.isfinite(d).all():
                        extra["row_map"] = _match_map(d, ref, 0)
                        extra["col_map"] = _match_map(d, ref, 1)
                    print(f"      {what}: {extra}", flush=True)
                rec.check("unit", what, err, UNIT_TOL, detail="max rel err ", elem=elem, swizzle=swz, mode=mode,
                          **extra)
            except Exception as exc:
                rec.error("unit", what, exc)


# --------------------------------------------------------------------------- stage 3: probe (child)


def probe_cases(quick: bool) -> list[tuple[int, int, str]]:
    cases = []
    ts = (1, 63, 64, 65, 200, 700)
    ws = (0, 1, 16, 128)
    plans = ("none", "first", "scattered", "all", "regions")
    i = 0
    for T in ts:
        for plan in plans:
            W = ws[i % len(ws)]
            i += 1
            cases.append((T, W, plan))
    if quick:
        cases = cases[::3]
    return cases


def child_probe(rec: Recorder, impl: str, seed: int, quick: bool) -> None:
    import cupy as cp

    rng = np.random.default_rng(seed)
    v = dh.VARIANTS[impl]
    for elem in v.elems:
        for D in v.dims:
            for T, W, plan in probe_cases(quick or (elem, D) != ("bf16", 128)):
                plan = "none" if v.kind == "win" else plan  # the window kernels take window-only plans
                name = f"{impl} {elem} D={D} T={T} W={W} {plan}"
                try:
                    g = key_regions(T, plan, rng)
                    B, H = (2, 2) if T <= 200 else (1, 2)
                    x = [rng.standard_normal((B, T, H, D)).astype(np.float32) * s for s in (1.5, 1.0, 1.0)]
                    if elem == "bf16":
                        bits = [bf16.to_bits(y) for y in x]
                        vals = [bf16.from_bits(y) for y in bits]
                        storage = "bfloat16"
                    else:
                        bits = [y.astype(np.float16).view(np.uint16) for y in x]
                        vals = [y.view(np.float16).astype(np.float32) for y in bits]
                        storage = "float16"
                    dq, dk, dv = (cp.asarray(y) for y in bits)
                    out = cp.full(dq.shape, 0x7FC0 if elem == "bf16" else 0x7E00, dtype=cp.uint16)  # NaN
                    for sched in (1, 2):
                        p = dh.prepare(dq, dk, dv, device_plan(cp, g, W), impl=impl, storage=storage, out=out,
                                       sched=sched)
                        p()
                        cp.cuda.runtime.deviceSynchronize()
                        o = cp.asnumpy(out)
                        of = bf16.from_bits(o) if elem == "bf16" else o.view(np.float16).astype(np.float32)
                        ref = attention_reference(*vals, g, local_window=W)
                        rec.check("probe", f"{name} sched={sched}", rel_err(of, ref), TOL[elem],
                                  detail="max rel err ", impl=impl, elem=elem, D=D, T=T, W=W, plan=plan)
                        out.fill(0x7FC0 if elem == "bf16" else 0x7E00)
                except Exception as exc:
                    rec.error("probe", name, exc, impl=impl)


def child_path(out: str, what: str, impl: str = "", tag: str = "") -> Path:
    return Path(out) / f"child-{what}{'-' + tag if tag else ''}{'-' + impl if impl else ''}.jsonl"


def run_child(rec: Recorder, args, what: str, impl: str = "", timeout: float = 300, prefix: tuple[str, ...] = (),
              tag: str = "") -> bool:
    """Run a child stage in its own process (under ``prefix``, e.g. compute-sanitizer); its records are merged
    into ``rec``. True if all passed."""
    path = child_path(args.out, what, impl, tag)
    path.unlink(missing_ok=True)
    cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), "--child", what, "--out", args.out, "--seed",
           str(args.seed)] + (["--impls", impl] if impl else []) + (["--quick"] if args.quick else []) + \
        (["--tag", tag] if tag else [])
    t0 = time.perf_counter()
    proc_ok = False
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        sys.stdout.write(r.stdout if not prefix else "".join(
            x for x in r.stdout.splitlines(keepends=True) if not x.startswith("=========")))
        proc_ok = r.returncode in (0, 1)  # 1: some check failed (recorded by the child)
        if not proc_ok:
            tail = (r.stdout[-2000:] if prefix else "") + r.stderr[-2000:]
            rec.add({"kind": "check", "stage": what, "name": f"{what} {tag} {impl} child process", "ok": False,
                     "value": None, "tol": None, "detail": f"exit {r.returncode}: {tail}"})
            print(f"FAIL  {what}: {tag} {impl} child process exit {r.returncode}: {tail[-1500:]}", flush=True)
    except subprocess.TimeoutExpired as exc:
        rec.error(what, f"{what} {tag} {impl} child process", exc)
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    for x in recs:
        rec.records.append(x)
    ok = proc_ok and bool(recs) and all(x["ok"] for x in recs if x.get("kind") == "check")
    rec.info(what, f"{(tag + ' ') if tag else ''}{impl or what} child", f"{len(recs)} records, "
             f"{'all passed' if ok else 'FAILED'}, {time.perf_counter() - t0:.1f} s")
    return ok


def sanitizer() -> str | None:
    """compute-sanitizer on PATH or in the CUDA toolkit (seen working on the Firecracker machines only)."""
    import shutil  # noqa: PLC0415

    found = shutil.which("compute-sanitizer")
    for c in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if found is None and Path(c).exists():
            found = c
    return found


def sanitize(rec: Recorder, args, impls: list[str]) -> None:
    """Stage 3b (--sanitize TOOLS): the small probe of each of ``impls`` under compute-sanitizer (racecheck:
    shared-memory races, e.g. a stage refilled while read; synccheck: barrier misuse), exit code 3 on any
    error it reports."""
    exe = sanitizer()
    if exe is None:
        rec.info("sanitize", "compute-sanitizer", "not found: skipped")
        return
    for tool in [t for t in args.sanitize.split(",") if t]:
        for impl in impls:
            run_child(rec, args, "small", impl, timeout=300, tag=tool,
                      prefix=(exe, "--tool", tool, "--error-exitcode", "3"))


def child_small(rec: Recorder, impl: str, seed: int) -> None:
    """A few small cases of ``impl`` against the reference (the probe, for runs under compute-sanitizer)."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    window_only = dh.VARIANTS[impl].kind == "win"
    for T, W, plan in ((200, 16, "regions"), (130, 128, "none")):
        plan = "none" if window_only else plan
        name = f"{impl} T={T} W={W} {plan}"
        try:
            g = key_regions(T, plan, rng)
            x = [rng.standard_normal((1, T, 1, 128)).astype(np.float32) for _ in range(3)]
            bits = [bf16.to_bits(y) for y in x]
            dq, dk, dv = (cp.asarray(y) for y in bits)
            out = cp.full(dq.shape, 0x7FC0, dtype=cp.uint16)
            dh.prepare(dq, dk, dv, device_plan(cp, g, W), impl=impl, storage="bfloat16", out=out)()
            cp.cuda.runtime.deviceSynchronize()
            ref = attention_reference(*(bf16.from_bits(y) for y in bits), g, local_window=W)
            rec.check("small", name, rel_err(bf16.from_bits(cp.asnumpy(out)), ref), TOL["bf16"],
                      detail="max rel err ", impl=impl, T=T, W=W, plan=plan)
        except Exception as exc:
            rec.error("small", name, exc, impl=impl)


# --------------------------------------------------------------------------- stage 4: timing


def time_cuda(torch, fn, reps: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    ts = np.array([ev[i].elapsed_time(ev[i + 1]) for i in range(reps)])
    q1, med, q3 = np.percentile(ts, [25, 50, 75])
    return {"median_ms": float(med), "min_ms": float(ts.min()), "iqr_ms": float(q3 - q1), "reps": reps}


def timings(rec: Recorder, args, impls: list[str]) -> list[dict]:
    import cupy as cp
    import torch

    rows: list[dict] = []
    H, D = args.heads, args.dim
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 7)
    scheds = [int(s) for s in args.scheds.split(",")]
    for T in [int(s) for s in args.seqs.split(",")]:
        stage = "timing"
        try:
            q, k, v = (torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
            out_t = torch.empty_like(q)
            cq, ck, cv, co = (cp.from_dlpack(x.view(torch.int16)) for x in (q, k, v, out_t))
            stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            flex = block_mask = None
            if not args.no_flex:
                try:
                    t0 = time.perf_counter()
                    flex, block_mask = make_flex(T, W_BENCH)
                    rec.info(stage, f"T={T} flex setup", seconds=time.perf_counter() - t0)
                except Exception as exc:
                    rec.error(stage, f"T={T} FlexAttention import", exc)
            heads_major = [x.transpose(1, 2).contiguous() for x in (q, k, v)] if flex is not None else []
            for pname, g in bench_plans(T).items():
                if args.plans and pname not in args.plans.split(","):
                    continue
                pairs = daaf_pairs(g, W_BENCH)
                flops = 4.0 * pairs * H * D
                outs: dict[str, Any] = {}
                plan = device_plan(cp, g, W_BENCH)
                for impl in impls:
                    if dh.VARIANTS[impl].kind == "win" and g.any():
                        continue  # window-only kernels: plans without key regions
                    for sched in scheds:
                        method = f"{impl}/s{sched}"
                        try:
                            with stream:
                                p = dh.prepare(cq, ck, cv, plan, impl=impl, storage="bfloat16", out=co, sched=sched)

                            def call(p=p, stream=stream):
                                with stream:
                                    p()

                            t = time_cuda(torch, call, args.reps, args.warmup)
                            outs[method] = out_t.clone()
                            rows.append({"T": T, "plan": pname, "method": method, **t, "pairs": pairs,
                                         "tflops": flops / t["median_ms"] / 1e9, "n_global": int(g.sum())})
                            print(f"INFO  {stage}: T={T} {pname} {method} {t['median_ms']:.3f} ms "
                                  f"({flops / t['median_ms'] / 1e9:.0f} TFLOP/s)", flush=True)
                        except Exception as exc:
                            rec.error(stage, f"T={T} {pname} {method}", exc)
                if not args.no_tc2:
                    try:
                        from hpczeco.gpu import daaf as gd

                        with stream:
                            gp = gd.device_plan(plan.global_idx, W_BENCH, T, plan.gmask, validate=False)
                            p2 = gd.prepare(cq, ck, cv, None, W_BENCH, impl="tc2", storage="bfloat16", plan=gp)

                        def call2(p2=p2, stream=stream):
                            with stream:
                                p2()

                        t = time_cuda(torch, call2, args.reps, args.warmup)
                        outs["tc2"] = torch.from_dlpack(p2.out).view(torch.bfloat16).clone()
                        rows.append({"T": T, "plan": pname, "method": "tc2", **t, "pairs": pairs,
                                     "tflops": flops / t["median_ms"] / 1e9, "n_global": int(g.sum())})
                        print(f"INFO  {stage}: T={T} {pname} tc2 {t['median_ms']:.3f} ms", flush=True)
                    except Exception as exc:
                        rec.error(stage, f"T={T} {pname} tc2", exc)
                fo = None
                if flex is not None:
                    try:
                        t0 = time.perf_counter()
                        bm = block_mask(g)
                        fo = flex(*heads_major, block_mask=bm)
                        torch.cuda.synchronize()
                        setup = time.perf_counter() - t0
                        t = time_cuda(torch, lambda bm=bm, f=flex, x=heads_major: f(*x, block_mask=bm), args.reps,
                                      args.warmup)
                        rows.append({"T": T, "plan": pname, "method": "flex", **t, "pairs": pairs,
                                     "tflops": flops / t["median_ms"] / 1e9, "n_global": int(g.sum()),
                                     "first_call_s": setup})
                        print(f"INFO  {stage}: T={T} {pname} flex {t['median_ms']:.3f} ms "
                              f"(block mask + compile {setup:.1f} s)", flush=True)
                        fo = fo.transpose(1, 2)
                    except Exception as exc:
                        rec.error(stage, f"T={T} {pname} FlexAttention", exc)
                base, base_name = (fo, "flex") if fo is not None else (outs.get("tc2"), "tc2")
                if base is not None:
                    bf = base.float()
                    den = float(bf.abs().max())
                    for m, o in outs.items():
                        if m == base_name:
                            continue
                        diff = float((o.float() - bf).abs().max()) / den
                        rec.check(stage, f"T={T} {pname} {m} vs {base_name} output", diff, FLEX_DIFF_TOL,
                                  detail="max rel diff (both bf16) ")
                del outs
            del q, k, v, out_t, heads_major
            torch.cuda.empty_cache()
        except Exception as exc:
            rec.error(stage, f"T={T}", exc)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'T':>7} {'plan':<15} {'method':<14} {'ms':>9} {'TFLOP/s':>8} {'t/t_flex':>9}"]
    for r in rows:
        flex = [x for x in rows if x["T"] == r["T"] and x["plan"] == r["plan"] and x["method"] == "flex"]
        ratio = f"{r['median_ms'] / flex[0]['median_ms']:.2f}" if flex and r["method"] != "flex" else ""
        lines.append(f"{r['T']:>7} {r['plan']:<15} {r['method']:<14} {r['median_ms']:>9.3f} {r['tflops']:>8.0f} "
                     f"{ratio:>9}")
    return "\n".join(lines)


def auto_pick(pname: str, T: int, dim: int) -> str | None:
    """choose_impl's kernel for a benchmark plan (from its host metadata, as gpu/daaf.py would call it)."""
    g = bench_plans(T)[pname]
    return dh.choose_impl(SimpleNamespace(n_global=int(g.sum()), local_window=W_BENCH, T=T), D=dim)


def targets(rec: Recorder, rows: list[dict], dim: int = 128) -> list[str]:
    """The issue's targets per (T, plan): Hopper kernel / Flex <= 1.0 with key regions (moonshot 0.7), <= 0.8
    alone, for the best kernel of the run and for the auto rule's pick; then the AUTO_IMPLS the run suggests
    (per plan kind, the kernel with the lowest geometric-mean ratio to Flex over the T it was timed at).
    Returns the lines it printed (main prints them again after the table, last)."""
    ratios: dict[tuple[str, str], list[float]] = {}
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for T, pname in sorted({(r["T"], r["plan"]) for r in rows}):
        flex = [r for r in rows if r["T"] == T and r["plan"] == pname and r["method"] == "flex"]
        ours = [r for r in rows if r["T"] == T and r["plan"] == pname and r["method"] not in ("flex", "tc2")]
        if not flex or not ours:
            continue
        tf = flex[0]["median_ms"]
        kind = "window" if pname == "w128" else "key_regions"
        for r in ours:
            ratios.setdefault((kind, r["method"]), []).append(r["median_ms"] / tf)
        tol = 0.8 if pname == "w128" else 1.0
        moon = ", moonshot 0.7" if tol == 1.0 else ""
        best = min(ours, key=lambda r: r["median_ms"])
        pick = auto_pick(pname, T, dim)
        picked = sorted((r for r in ours if r["method"].split("/")[0] == pick), key=lambda r: r["median_ms"])
        for label, r in (("best", best), (f"auto={pick}", picked[0] if picked else None)):
            if r is None:
                say(f"INFO  target: T={T} {pname}: {label} was not timed")
                continue
            ratio = r["median_ms"] / tf
            rec.add({"kind": "target", "T": T, "plan": pname, "which": label, "method": r["method"], "ratio": ratio,
                     "met": ratio <= tol, "moonshot": tol == 1.0 and ratio <= 0.7})
            say(f"{'MET ' if ratio <= tol else 'MISS'}  target: T={T} {pname}: {label} {r['method']} "
                f"{r['median_ms']:.3f} ms = {ratio:.2f} x Flex (target <= {tol}{moon})")
    for kind in ("window", "key_regions"):
        n = max((len(v) for (k, _), v in ratios.items() if k == kind), default=0)
        cand = {m: float(np.exp(np.mean(np.log(v)))) for (k, m), v in ratios.items() if k == kind and len(v) == n}
        if cand:
            m = min(cand, key=cand.get)
            rec.add({"kind": "suggest", "plan_kind": kind, "method": m, "geomean_ratio": cand[m]})
            say(f"INFO  auto: measured best for {kind} plans: {m} (geometric mean {cand[m]:.2f} x Flex); "
                f"AUTO_IMPLS[{kind!r}] is {dh.AUTO_IMPLS[kind]!r}")
    return lines


# --------------------------------------------------------------------------- main


def environment() -> dict:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import cupy as cp

        env["cupy"] = cp.__version__
        props = cp.cuda.runtime.getDeviceProperties(0)
        env["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        env["sm_count"] = int(props["multiProcessorCount"])
        env["cc"] = cp.cuda.Device(0).compute_capability
        env["driver"] = cp.cuda.runtime.driverGetVersion()
        env["runtime"] = cp.cuda.runtime.runtimeGetVersion()
    except Exception as exc:
        env["cupy_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch

        env["torch"] = torch.__version__
    except Exception as exc:
        env["torch_error"] = str(exc)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Hopper DAAF kernels: build, unit check, probes, timings vs Flex.")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma list of {', '.join(dh.IMPLS)}")
    ap.add_argument("--scheds", default="3", help="sched values to time (bit 0 reverse, bit 1 heads fastest; 3 beat 1 "
                    "in the first run, and the model of docs/benchmarks/daaf_hopper_design.md says why)")
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--plans", default="", help="subset of w128,w128+first4096,w128+8x512 (default all)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="fewer probe cases")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-tc2", action="store_true")
    ap.add_argument("--skip-probe", action="store_true", help="time without the probes (and the unit check)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--sanitize", default="", help="compute-sanitizer tools (e.g. racecheck,synccheck) to run a few "
                    "small cases of --sanitize-impls under, after the probes (skipped where it is missing)")
    ap.add_argument("--sanitize-impls", default="hws,hwsp,hws3p,hwin")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.seed is None:
        args.seed = int(np.random.SeedSequence().entropy % (2**31))
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in dh.VARIANTS:
            ap.error(f"unknown impl {i!r}; choose from {dh.IMPLS}")

    if args.child:
        rec = Recorder(child_path(args.out, args.child, impls[0] if args.child != "unit" else "", args.tag))
        if args.child == "unit":
            child_unit(rec, args.seed)
        elif args.child == "small":
            child_small(rec, impls[0], args.seed + dh.IMPLS.index(impls[0]))
        else:
            child_probe(rec, impls[0], args.seed + dh.IMPLS.index(impls[0]), args.quick)
        return 0 if rec.n_fail == 0 else 1

    t_start = time.perf_counter()
    rec = Recorder()
    print(f"INFO  seed {args.seed}; impls {impls}; out {args.out}", flush=True)
    env = environment()
    rec.info("env", "environment", json.dumps(env), **env)

    # 1. build
    groups = sorted({dh.GROUPS[dh.kernel_name(i, e, d)] for i in impls for e in dh.VARIANTS[i].elems
                     for d in dh.VARIANTS[i].dims} | {dh.GROUPS[dh.unit_kernel_name()]})
    try:
        t0 = time.perf_counter()
        built = dh.prebuild(groups)
        for g, path, how, sec in built:
            rec.info("build", f"group {g}", f"{how} {sec:.1f} s", path=path)
        rec.info("build", "all groups", f"{time.perf_counter() - t0:.1f} s wall")
        for name, d in dh.kernel_info().items():
            if d["impl"] in impls:
                rec.info("build", name, f"{d['num_regs']} registers, {d['local_size_bytes']} local bytes, "
                         f"{d['dynamic_smem_bytes']} dynamic smem bytes", **d)
    except Exception as exc:
        rec.error("build", "compile", exc)

    # 2-3. unit check and probes (child processes)
    passing = list(impls)
    if not args.skip_probe:
        unit_ok = run_child(rec, args, "unit", timeout=240)
        if not unit_ok:
            print("INFO  unit: the wgmma unit check failed: the wgmma kernels are probed anyway, timed only if "
                  "their probe passes", flush=True)
        passing = [i for i in impls if run_child(rec, args, "probe", i, timeout=300)]
    rec.info("probe", "passing", ",".join(passing))
    if args.sanitize:
        sanitize(rec, args, [i for i in args.sanitize_impls.split(",") if i in dh.VARIANTS])

    # 4. timings
    rows: list[dict] = []
    if not args.skip_timing and passing:
        rows = timings(rec, args, passing)
    summary = targets(rec, rows, args.dim) if rows else []
    n_checks = sum(1 for r in rec.records if r.get("kind") == "check")
    res = {"env": env, "seed": args.seed, "args": vars(args), "rows": rows, "records": rec.records,
           "n_fail": rec.n_fail, "n_checks": n_checks, "seconds": time.perf_counter() - t_start}
    with open(Path(args.out) / RESULT_FILE, "w") as f:
        json.dump(res, f, indent=1, default=_jsonable)
    print(f"\n{n_checks - rec.n_fail} of {n_checks} checks passed, {time.perf_counter() - t_start:.0f} s; "
          f"{Path(args.out) / RESULT_FILE}", flush=True)
    if rows:
        print(table(rows), flush=True)
    if summary:
        print("\n".join(summary), flush=True)
    return 0 if rec.n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
