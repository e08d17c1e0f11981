"""The device checks of the Hopper DAAF kernels (``hpczeco bench gpu-daaf --check``) and the targets summary.

Checks, each recorded as one row of the bench's ``device_checks`` table (``stage``, ``check``, ``value``, ``tol``,
``ok``) and printed as a PASS/FAIL line:

1. ``unit`` (:func:`unit`): the wgmma unit kernel, one ``D[64x128] = A[64x128] B[128x128]`` product through the
   attention kernels' shared-memory layouts and descriptors (128-byte swizzle and unswizzled, B K-major and MN-major,
   A from shared memory and from registers) against float64; on a failure, the first mismatches and which rows /
   columns of the reference the result's rows / columns match (layout hints);
2. ``probe`` (:func:`probe`): each kernel (each element type and head dim it has, both schedules) against the
   float64 reference :func:`hpczeco.daaf.reference.attention_reference` on fresh random inputs over
   :func:`probe_cases` (T in {1, 63, 64, 65, 200, 700}, window in {0, 1, 16, 128}, key regions none / first / scattered
   / all / spans), the output poisoned with NaN first; max relative error <= :data:`TOL`;
3. ``small`` (:func:`small`): two small cases per kernel, what ``--sanitize`` runs under compute-sanitizer.

The bench runs the unit check and each kernel's probe in a process of its own (:func:`run_child`: a faulting kernel
cannot poison the others' CUDA context) and times only the kernels whose probe passed. :func:`flex_checks` turns
the timed outputs' distance to FlexAttention (both bf16) into checks; :func:`targets` prints, per (T, plan), MET or
MISS against the targets (kernel / Flex <= 1.0 with key regions, moonshot 0.7; <= 0.8 for the window alone) for the
best kernel and for the auto rule's pick, and the ``AUTO_IMPLS`` the run's timings suggest.

Without a GPU the stages run in-process on the CPU emulation with the numpy stand-in for CuPy
(``tests/test_daaf_hopper_emu.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from hpczeco.base import bf16

from .gpu_daaf_model import bench_plans, key_regions
from .options import int_range

__all__ = ["TOL", "UNIT_TOL", "FLEX_DIFF_TOL", "rel_err", "check", "failed", "unit", "probe", "probe_cases", "small",
           "run_child", "sanitizer", "flex_checks", "targets", "main"]

TOL = {"bf16": 1e-2, "f16": 5e-3}
UNIT_TOL = 1e-4
FLEX_DIFF_TOL = 2e-2
TABLE = "device_checks"
#: a child's exit status when it ran and some check failed (recorded); 3 is compute-sanitizer's on an error
CHECK_FAILED = 4
#: T, window, key-region layout of the small cases (:func:`small`)
SMALL_CASES = ((200, 16, "regions"), (130, 128, "none"))


# --------------------------------------------------------------------------- records


def _add(rec: Any, row: dict[str, Any], line: str) -> None:
    rec.tables.setdefault(TABLE, []).append(row)
    rec.say(line)
    rec.save()


def check(rec: Any, stage: str, name: str, value: float, tol: float, detail: str = "", **data: Any) -> bool:
    """Record one check (``value <= tol``; NaN fails) in ``rec``'s ``device_checks`` table; True if it passed."""
    ok = bool(np.isfinite(value)) and value <= tol
    _add(rec, {"stage": stage, "check": name, "ok": ok, "value": float(value), "tol": tol, "detail": detail, **data},
         f"{'PASS' if ok else 'FAIL'}  {stage}: {name}: {detail}{value:.3g} {'<=' if ok else '>'} {tol:.3g}")
    return ok


def failed(rec: Any, stage: str, name: str, exc: BaseException, **data: Any) -> None:
    """Record a check that raised ``exc`` (a failure, with its traceback)."""
    _add(rec, {"stage": stage, "check": name, "ok": False, "value": None, "tol": None,
               "detail": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)[-4000:], **data},
         f"FAIL  {stage}: {name}: {type(exc).__name__}: {str(exc)[:600]}")


def rel_err(out: Any, ref: Any) -> float:
    """``max |out - ref| / max |ref|`` in float64 (inf when ``out`` is not finite)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def _plan(cp: Any, g: np.ndarray, W: int) -> Any:
    """The :class:`~hpczeco.gpu.daaf.DevicePlan` of key-region mask ``g`` ``[T]`` and window ``W``."""
    from hpczeco.gpu.daaf import DevicePlan  # noqa: PLC0415

    T = len(g)
    return DevicePlan(cp.asarray(np.flatnonzero(g).astype(np.int32)), cp.asarray(g.astype(np.uint8)), T, min(W, T))


def _bits(x: np.ndarray, elem: str) -> tuple[np.ndarray, np.ndarray]:
    """``(16-bit patterns, their float32 values)`` of float32 ``x`` in ``elem`` ("bf16" or "f16")."""
    if elem == "bf16":
        b = bf16.to_bits(x)
        return b, bf16.from_bits(b)
    b = x.astype(np.float16).view(np.uint16)
    return b, b.view(np.float16).astype(np.float32)


def _values(bits: np.ndarray, elem: str) -> np.ndarray:
    return bf16.from_bits(bits) if elem == "bf16" else bits.view(np.float16).astype(np.float32)


# --------------------------------------------------------------------------- 1. wgmma unit


def _match_map(x: np.ndarray, ref: np.ndarray, axis: int, n: int = 16) -> list[int]:
    """For the first n rows (axis 0) / columns (axis 1) of x: the index of the closest one of ref."""
    xs = x if axis == 0 else x.T
    rs = ref if axis == 0 else ref.T
    return [int(np.argmin(np.abs(rs - xs[i][None, :]).sum(axis=1))) for i in range(min(n, xs.shape[0]))]


def unit(rec: Any, cp: Any, seed: int) -> None:
    """Stage 1: the wgmma unit kernel in every layout mode (see the module docstring)."""
    from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    for elem, swz in (("bf16", True), ("bf16", False), ("f16", True)):
        for mode in (0, 1, 2, 3):
            if elem == "f16" and mode in (1, 2):
                continue
            what = (f"{elem} {'sw128' if swz else 'nosw'} mode {mode} (B {'MN' if mode & 1 else 'K'}-major, "
                    f"A from {'registers' if mode & 2 else 'smem'})")
            try:
                ha, fa = _bits(rng.standard_normal((64, 128)).astype(np.float32), elem)
                hb, fb = _bits(rng.standard_normal((128, 128)).astype(np.float32), elem)
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
                    extra["err_if_B_major_swapped"] = rel_err(d, fa @ (fb.T if mode & 1 else fb))
                    if np.isfinite(d).all():
                        extra["row_map"] = _match_map(d, ref, 0)
                        extra["col_map"] = _match_map(d, ref, 1)
                    rec.say(f"      {what}: {extra}")
                check(rec, "unit", what, err, UNIT_TOL, detail="max rel err ", elem=elem, swizzle=swz, mode=mode,
                      **extra)
            except Exception as exc:  # noqa: BLE001 - recorded, the next mode runs
                failed(rec, "unit", what, exc)


# --------------------------------------------------------------------------- 2. probe, 3. small


def probe_cases(quick: bool) -> list[tuple[int, int, str]]:
    """``(T, window, key-region layout)`` of the probe: 30 cases, every third with ``quick``."""
    cases = []
    ws = (0, 1, 16, 128)
    i = 0
    for T in (1, 63, 64, 65, 200, 700):
        for layout in ("none", "first", "scattered", "all", "regions"):
            cases.append((T, ws[i % len(ws)], layout))
            i += 1
    return cases[::3] if quick else cases


def _run_case(rec: Any, cp: Any, stage: str, name: str, impl: str, elem: str, B: int, T: int, H: int, D: int, W: int,
              g: np.ndarray, rng: np.random.Generator, scheds: tuple[int | None, ...], **data: Any) -> None:
    """One kernel call per schedule on fresh inputs, its output poisoned with NaN first, against float64."""
    from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

    from hpczeco.daaf.reference import attention_reference  # noqa: PLC0415

    x = [rng.standard_normal((B, T, H, D)).astype(np.float32) * s for s in (1.5, 1.0, 1.0)]
    bits = [_bits(y, elem)[0] for y in x]
    ref = attention_reference(*(_values(b, elem) for b in bits), g, local_window=W)
    dq, dk, dv = (cp.asarray(b) for b in bits)
    nan = 0x7FC0 if elem == "bf16" else 0x7E00
    out = cp.full(dq.shape, nan, dtype=cp.uint16)
    plan = _plan(cp, g, W)
    storage = "bfloat16" if elem == "bf16" else "float16"
    for sched in scheds:
        kw = {} if sched is None else {"sched": sched}
        dh.prepare(dq, dk, dv, plan, impl=impl, storage=storage, out=out, **kw)()
        cp.cuda.runtime.deviceSynchronize()
        label = name if sched is None else f"{name} sched={sched}"
        check(rec, stage, label, rel_err(_values(cp.asnumpy(out), elem), ref), TOL[elem], detail="max rel err ",
              impl=impl, elem=elem, D=D, T=T, W=W, **data)
        out.fill(nan)


def probe(rec: Any, cp: Any, impl: str, seed: int, quick: bool = False,
          cases: list[tuple[int, int, str]] | None = None) -> None:
    """Stage 2: kernel ``impl`` over ``cases`` (default :func:`probe_cases`; ``quick`` too except at bf16 D=128),
    each element type and head dim it has, schedules 1 and 2."""
    from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    v = dh.VARIANTS[impl]
    for elem in v.elems:
        for D in v.dims:
            todo = cases if cases is not None else probe_cases(quick or (elem, D) != ("bf16", 128))
            for T, W, layout in todo:
                layout = "none" if v.kind == "win" else layout  # the window kernels take window-only plans
                name = f"{impl} {elem} D={D} T={T} W={W} {layout}"
                try:
                    B, H = (2, 2) if T <= 200 else (1, 2)
                    _run_case(rec, cp, "probe", name, impl, elem, B, T, H, D, W, key_regions(T, layout, rng), rng,
                              (1, 2), plan=layout)
                except Exception as exc:  # noqa: BLE001
                    failed(rec, "probe", name, exc, impl=impl)


def small(rec: Any, cp: Any, impl: str, seed: int) -> None:
    """Stage 3: :data:`SMALL_CASES` of ``impl`` (bf16, D = 128, the default schedule) against float64."""
    from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    for T, W, layout in SMALL_CASES:
        layout = "none" if dh.VARIANTS[impl].kind == "win" else layout
        name = f"{impl} T={T} W={W} {layout}"
        try:
            _run_case(rec, cp, "small", name, impl, "bf16", 1, T, 1, 128, W, key_regions(T, layout, rng), rng,
                      (None,), plan=layout)
        except Exception as exc:  # noqa: BLE001
            failed(rec, "small", name, exc, impl=impl)


# --------------------------------------------------------------------------- child processes


def _child_stem(what: str, impl: str, tag: str) -> str:
    return "-".join(x for x in ("child", what, tag, impl) if x)


def run_child(rec: Any, out: Path, what: str, seed: int, impl: str = "", quick: bool = False, timeout: float = 300,
              prefix: tuple[str, ...] = (), tag: str = "") -> bool:
    """Run stage ``what`` ("unit", "probe" or "small") of ``impl`` in a process of its own (under ``prefix``, e.g.
    compute-sanitizer) and merge its records into ``rec``; True if it ran and every check passed. A child that
    crashes or times out is a failed check."""
    stem = _child_stem(what, impl, tag)
    path = Path(out) / f"{stem}.json"
    path.unlink(missing_ok=True)
    import hpczeco  # noqa: PLC0415

    root = str(Path(hpczeco.__file__).resolve().parents[1])  # where hpczeco imports from (a checkout's root)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = [*prefix, sys.executable, "-m", "hpczeco.drivers.gpu_daaf_checks", what, "--out", str(out), "--seed",
           str(seed), "--stem", stem] + (["--impl", impl] if impl else []) + (["--quick"] if quick else [])
    t0 = time.perf_counter()
    label = " ".join(x for x in (what, tag, impl) if x)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        r = None
        failed(rec, what, f"{label} child process", exc)
    rows = json.loads(path.read_text()).get(TABLE, []) if path.exists() else []
    rec.tables.setdefault(TABLE, []).extend(rows)
    rec.save()
    if r is not None:
        sys.stdout.write(r.stdout if not prefix else "".join(
            x for x in r.stdout.splitlines(keepends=True) if not x.startswith("=========")))
        if r.returncode not in (0, CHECK_FAILED) or not rows:  # crashed, killed, a sanitizer error, or no checks
            tail = (r.stdout[-2000:] if prefix else "") + r.stderr[-2000:]
            _add(rec, {"stage": what, "check": f"{label} child process", "ok": False, "value": None, "tol": None,
                       "detail": f"exit {r.returncode}, {len(rows)} checks recorded: {tail}"},
                 f"FAIL  {what}: {label} child process exit {r.returncode}, {len(rows)} checks: {tail[-1500:]}")
    ok = r is not None and r.returncode == 0 and bool(rows) and all(x["ok"] for x in rows)
    rec.say(f"INFO  {what}: {label} child: {len(rows)} checks, {'all passed' if ok else 'FAILED'}, "
            f"{time.perf_counter() - t0:.1f} s")
    return ok


def sanitizer() -> str | None:
    """compute-sanitizer on PATH or in the CUDA toolkit, else None."""
    found = shutil.which("compute-sanitizer")
    for c in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if found is None and Path(c).exists():
            found = c
    return found


def main(argv: list[str] | None = None) -> int:
    """The child process of :func:`run_child`: one stage, its records in ``--out``/``--stem``.json."""
    from . import benchkit  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m hpczeco.drivers.gpu_daaf_checks",
                                 description="one stage of the Hopper DAAF kernels' device checks (a child process "
                                             "of hpczeco bench gpu-daaf --check)")
    ap.add_argument("stage", choices=("unit", "probe", "small"), help="which checks")
    ap.add_argument("--impl", default="", help="the kernel (probe, small)")
    ap.add_argument("--out", required=True, help="folder of the records")
    ap.add_argument("--stem", required=True, help="file name stem of the records")
    ap.add_argument("--seed", type=int_range(0), required=True, help="random seed")
    ap.add_argument("--quick", action="store_true", help="fewer probe cases")
    a = ap.parse_args(argv)
    import cupy as cp  # noqa: PLC0415

    rec = benchkit.Recorder(a.out, a.stem)
    if a.stage == "unit":
        unit(rec, cp, a.seed)
    elif a.stage == "probe":
        probe(rec, cp, a.impl, a.seed, a.quick)
    else:
        small(rec, cp, a.impl, a.seed)
    rec.save()
    rows = rec.tables.get(TABLE, [])
    return 0 if rows and all(r["ok"] for r in rows) else CHECK_FAILED


# --------------------------------------------------------------------------- timings: flex, targets


def flex_checks(rec: Any, rows: list[dict]) -> None:
    """The timed kernels' outputs against FlexAttention's on the same inputs (both bf16; against the ``tc2``
    kernel where Flex did not run): a check each, max relative difference <= :data:`FLEX_DIFF_TOL`."""
    for r in rows:
        if "max_rel_diff_vs_flex" in r:
            value, base = r["max_rel_diff_vs_flex"], "flex"
        elif "max_rel_diff_vs_tc2" in r and r.get("method") != "daaf-tc2":
            value, base = r["max_rel_diff_vs_tc2"], "tc2"
        else:
            continue
        check(rec, "timing", f"T={r['T']} {r['plan']} {r['method']} vs {base} output", value, FLEX_DIFF_TOL,
              detail="max rel diff (both bf16) ")


def _kernel(method: str) -> str:
    """The kernel of a timing row's method ("daaf-hws/s3" -> "hws")."""
    return method.removeprefix("daaf-").split("/")[0]


def auto_pick(layout: str, T: int, dim: int, window: int = 128) -> str | None:
    """:func:`~hpczeco.gpu.daaf_hopper.choose_impl`'s kernel for a benchmark plan (its host metadata only)."""
    from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

    g = bench_plans(T)[layout]
    return dh.choose_impl(SimpleNamespace(n_global=int(g.sum()), local_window=window, T=T), D=dim)


#: kernel time over FlexAttention's (same process, same mask): the window alone, key regions at T <= 8192, longer
TARGET_VS_FLEX = {"window": 0.4, "key_regions_8k": 0.75, "key_regions": 0.7}
#: the moonshot with key regions
MOONSHOT_VS_FLEX = 0.6


def target_vs_flex(T: int, key_regions: bool) -> float:
    """The target of :data:`TARGET_VS_FLEX` for a plan of ``T`` tokens with or without key regions."""
    if not key_regions:
        return TARGET_VS_FLEX["window"]
    return TARGET_VS_FLEX["key_regions_8k" if T <= 8192 else "key_regions"]


def targets(rec: Any, rows: list[dict], dim: int = 128) -> list[str]:
    """The targets per (T, plan) for the best DAAF kernel timed and for the auto rule's pick, MET or MISS:
    kernel / Flex within :func:`target_vs_flex` (moonshot :data:`MOONSHOT_VS_FLEX` with key regions); then the
    ``AUTO_IMPLS`` the
    run suggests (per plan kind, the Hopper kernel with the lowest geometric-mean ratio to Flex over the T it was
    timed at). Rows: the bench's ``timings`` (``method`` "flex" or "daaf-IMPL[/sS]"); "daaf-auto" is a pick, not a
    kernel. Records ``target`` / ``suggest`` rows in ``rec``'s ``targets`` table and returns the lines."""
    from hpczeco.gpu import daaf_fa3  # noqa: PLC0415
    from hpczeco.gpu import daaf_hopper as dh  # noqa: PLC0415

    hopper_kernels = (*dh.IMPLS, *daaf_fa3.IMPLS)  # the kernels AUTO_IMPLS may name
    ratios: dict[tuple[str, str], list[float]] = {}
    lines: list[str] = []

    def say(line: str, row: dict) -> None:
        lines.append(line)
        rec.tables.setdefault("targets", []).append(row)
        rec.say(line)

    timed = [r for r in rows if "method" in r and r.get("median_ms")]
    for T, layout in sorted({(r["T"], r["plan"]) for r in timed}):
        flex = [r for r in timed if r["T"] == T and r["plan"] == layout and r["method"] == "flex"]
        ours = [r for r in timed if r["T"] == T and r["plan"] == layout and r["method"].startswith("daaf-")
                and r["method"] != "daaf-auto"]
        if not flex or not ours:
            continue
        tf = flex[0]["median_ms"]
        kind = "window" if layout == "w128" else "key_regions"
        for r in ours:
            if _kernel(r["method"]) in hopper_kernels:
                ratios.setdefault((kind, r["method"]), []).append(r["median_ms"] / tf)
        tol = target_vs_flex(T, kind == "key_regions")
        moon = f", moonshot {MOONSHOT_VS_FLEX}" if kind == "key_regions" else ""
        best = min(ours, key=lambda r: r["median_ms"])
        pick = auto_pick(layout, T, dim)
        picked = sorted((r for r in ours if _kernel(r["method"]) == pick), key=lambda r: r["median_ms"])
        for label, r in (("best", best), (f"auto={pick}", picked[0] if picked else None)):
            if r is None:
                say(f"INFO  target: T={T} {layout}: {label} was not timed", {"T": T, "plan": layout, "which": label})
                continue
            ratio = r["median_ms"] / tf
            say(f"{'MET ' if ratio <= tol else 'MISS'}  target: T={T} {layout}: {label} {r['method']} "
                f"{r['median_ms']:.3f} ms = {ratio:.2f} x Flex (target <= {tol}{moon})",
                {"T": T, "plan": layout, "which": label, "method": r["method"], "ratio": ratio, "met": ratio <= tol,
                 "moonshot": kind == "key_regions" and ratio <= MOONSHOT_VS_FLEX})
    for kind in ("window", "key_regions"):
        n = max((len(v) for (k, _), v in ratios.items() if k == kind), default=0)
        cand = {m: float(np.exp(np.mean(np.log(v)))) for (k, m), v in ratios.items() if k == kind and len(v) == n}
        if cand:
            m = min(cand, key=cand.get)
            say(f"INFO  auto: measured best for {kind} plans: {m} (geometric mean {cand[m]:.2f} x Flex); "
                f"AUTO_IMPLS[{kind!r}] is {dh.AUTO_IMPLS[kind]!r}",
                {"plan_kind": kind, "suggest": m, "geomean_ratio": cand[m]})
    rec.save()
    return lines


if __name__ == "__main__":
    sys.exit(main())
