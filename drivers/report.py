"""`hpczeco report`: a Markdown report of ring All-Scan vs tree vs the baselines, with plots.

Reads every ``scan_P*.json`` written by ``hpczeco bench scan`` in ``--in`` (runs at several P may share the folder);
each is checked whole before anything is written (a file that cannot be read, is not a bench scan result of P >= 2
ranks, or holds a timing that is not a finite positive number stops the report with its name and the reason: nothing
is skipped). With none there it first runs a short bench itself (``mpiexec -n P`` for each ``--np``; sizes
``--sizes``) into a new folder under ``--out`` (``--in`` is never written). Writes ``report.md`` with one table per
P (measured median vs cost model, the model recomputed from the run's calibration with the current formulas), the
fastest topology per size, ring/tree crossovers, the ring-vs-baseline ratios at 1 MiB, a measured/model table with
the accuracy targets (states <= 64 KiB within 3x, the ring at >= 1 MiB within 1.5x), the model refit to the
measurements (``alpha``, ``beta``, ``overhead``) with its residual, the ring's per-piece cost (``piece``: from the
calibration, or for runs calibrated before it existed estimated from the run's own ring points at two piece counts)
with measured/model before and after it, and PNG plots: time vs state size (one panel per P) and time vs P at a few
sizes, where the model curves continue past the measured P (to ``--model-max-p``) with the calibration of the
largest run that was not oversubscribed (an extrapolation: it assumes the calibrated link and per-call costs do not
change with P). A calibration measured with more ranks than cores on a node times the sharing of cores, not the
link: the report never extrapolates from one; with only oversubscribed runs it draws the model over the measured P
only and says so. At scale (:mod:`.report_sim`): the crossover P of every
link preset (the model: from which P ptree or the tree beats the ring, at 16 KiB, 1 MiB, 16 MiB), a figure per
preset, and, with ``--sim`` results of ``hpczeco simulate``, the simulated GPU cluster beside its model and the
paper's Table 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpczeco.drivers import report_sim
from hpczeco.drivers.bench_scan import fmt_size
from hpczeco.drivers.options import as_text, int_list, int_range, size_list

#: largest scan_P*.json read (bench scan writes a few hundred KiB)
MAX_RESULT_BYTES = 64 << 20


def build_parser(prog: str) -> argparse.ArgumentParser:
    from hpczeco.drivers.helpfmt import HelpFormatter, split_doc

    description, epilog = split_doc(__doc__)
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)
    ap.add_argument("--in", dest="inp", default="runs/bench_scan", help="folder with scan_P*.json files")
    ap.add_argument("--out", default="runs/report", help="folder for report.md and the PNGs")
    ap.add_argument("--np", default="2,4", type=int_list(2, 1024),
                    help="rank counts (>= 2) of the short bench run when --in has no results")
    ap.add_argument("--sizes", default="4K,64K,1M", type=as_text(size_list()), help="state sizes of that short bench")
    ap.add_argument("--model-max-p", type=int_range(2, 1 << 24), default=256, help="model curves up to this P")
    ap.add_argument("--mpiexec", default=None, help="mpiexec to use for the short bench (default: found on PATH)")
    ap.add_argument("--sim", default="runs/simulate",
                    help="folder of `hpczeco simulate` results (simulate.json) drawn beside the model, if present")
    return ap


def load(folder: Path) -> list[dict[str, Any]]:
    """Every ``scan_P*.json`` in ``folder``, checked whole (:func:`load_run`), sorted by P. ``ValueError`` naming
    the first file that does not pass: nothing is skipped."""
    runs = [load_run(f) for f in sorted(folder.glob("scan_P*.json"))]
    return sorted(runs, key=lambda d: d["P"])


def load_run(f: Path) -> dict[str, Any]:
    """One result of ``hpczeco bench scan``: read with a bound (a regular file of at most
    :data:`MAX_RESULT_BYTES`), then checked (:func:`check_run`). ``ValueError`` naming the file and the reason."""
    from hpczeco.drivers.files import read_bounded

    m = re.fullmatch(r"scan_P(\d+)\.json", f.name)
    if m is None:
        raise ValueError(f"{f}: named like a bench scan result but not scan_P<ranks>.json; rename or remove it")
    try:
        data = json.loads(read_bounded(str(f), MAX_RESULT_BYTES, "--in",
                                       too_large=" (bench scan writes far less): not a bench scan result"))
    except OSError as exc:
        raise ValueError(f"{f}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{f}: not a bench scan result (not UTF-8 text: {exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{f}: not a bench scan result (not JSON: {exc})") from None
    check_run(data, str(f), int(m.group(1)))
    data["_file"] = f.name
    return data


def _positive_time(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_run(data: Any, name: str, P: int | None = None) -> None:
    """``ValueError`` unless ``data`` is a bench scan result the report can use: ``bench == "scan"``, ``P`` (the file
    name's) >= 2, link parameters the cost model accepts, and results whose labels, topologies, sizes, shapes and
    median times are what bench scan writes (times finite and positive: a NaN would rank first everywhere)."""
    from hpczeco.collectives import costmodel as cm
    from hpczeco.collectives.names import ALGORITHMS

    def bad(why: str) -> ValueError:
        return ValueError(f"{name}: {why}")

    if not isinstance(data, dict) or data.get("bench") != "scan":
        raise bad("not a bench scan result (no \"bench\": \"scan\")")
    p = data.get("P")
    if isinstance(p, bool) or not isinstance(p, int):
        raise bad(f"P is {p!r}, not a rank count")
    if P is not None and p != P:
        raise bad(f"holds a run of P = {p} ranks but is named for P = {P}")
    if p < 2:
        raise bad(f"a one-rank run (P = {p}): nothing is scanned over ranks, and the model and its fit need P >= 2; "
                  "rerun bench scan under mpiexec -n 2 or more, or remove the file")
    try:
        cm.LinkParams(**data["params"])
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"its link parameters are not usable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data.get("machine"), dict) or not isinstance(data.get("dtype"), str):
        raise bad("has no machine description or dtype")
    if data.get("exscan_algorithm", "recursive_doubling") not in ("recursive_doubling", "linear"):
        raise bad(f"exscan_algorithm {data.get('exscan_algorithm')!r} is not recursive_doubling or linear")
    results = data.get("results")
    if not isinstance(results, list) or not results:
        raise bad("holds no results")
    for i, r in enumerate(results):
        where = f"result {i}" + (f" ({r.get('label')} at {r.get('nbytes')} bytes)" if isinstance(r, dict) else "")
        if not isinstance(r, dict):
            raise bad(f"{where} is not an object")
        shape = r.get("shape")
        nbytes = r.get("nbytes")
        blocks = r.get("blocks")
        if not isinstance(r.get("label"), str) or r.get("topology") not in ALGORITHMS:
            raise bad(f"{where}: label {r.get('label')!r} / topology {r.get('topology')!r} is not one of {ALGORITHMS}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise bad(f"{where}: nbytes {nbytes!r} is not a positive int")
        if not (isinstance(shape, list) and len(shape) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)):
            raise bad(f"{where}: shape {shape!r} is not [H, K, V] of positive ints")
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks):
            raise bad(f"{where}: blocks {blocks!r} is not a positive int or null")
        if not _positive_time(r.get("median_s")):
            raise bad(f"{where}: median_s is {r.get('median_s')!r}, not a finite positive time (a failed or "
                      "corrupted measurement); rerun that bench")


def _find_mpiexec(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def check_mpiexec(explicit: str | None) -> str:
    """The launcher of the short bench, checked before anything is launched: found, executable, and answering
    ``--version`` (``/bin/false`` does not). ``ValueError`` with the reason otherwise."""
    exe = _find_mpiexec(explicit)
    if exe is None:
        raise ValueError("no mpiexec found for the short bench (give --mpiexec, or --in a folder of bench scan "
                         "results of 2 or more ranks)")
    path = shutil.which(exe)
    if path is None:
        raise ValueError(f"--mpiexec {exe}: not found, or not an executable file")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--mpiexec {exe}: cannot be run ({exc})") from None
    if out.returncode != 0:
        raise ValueError(f"--mpiexec {exe}: `{exe} --version` ended with status {out.returncode}: not an mpiexec?")
    return path


def run_short_bench(folder: Path, nps: list[int], sizes: str, mpiexec: str) -> None:
    """``mpiexec -n P python -m hpczeco bench scan`` (short) for each P, writing into ``folder`` (a new one).
    ``ValueError`` naming the command when one fails."""
    common = ["--sizes", sizes, "--repeats", "5", "--warmup", "2", "--time-limit", "1", "--blocks", "4",
              "--ring-big", "0", "--out", str(folder)]  # a short bench: no 16 MiB calibration ring
    from hpczeco.drivers.mpienv import launch_env

    env = launch_env()  # a short single-node bench: oversubscribed, possibly as root
    for P in nps:
        cmd = [mpiexec, "-n", str(P), sys.executable, "-m", "hpczeco", "bench", "scan", *common]
        print("report: " + " ".join(cmd), flush=True)
        try:
            done = subprocess.run(cmd, env=env, timeout=900)
        except subprocess.TimeoutExpired:
            raise ValueError(f"the short bench did not end within 900 s: {' '.join(cmd)}") from None
        except OSError as exc:
            raise ValueError(f"the short bench cannot be launched ({exc}): {' '.join(cmd)}") from None
        if done.returncode != 0:
            raise ValueError(f"the short bench failed (status {done.returncode}; its output is above): "
                             f"{' '.join(cmd)}")


def _new_bench_folder(out: Path) -> Path:
    """A new folder under ``out`` for the short bench (never an existing one: nothing is overwritten)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        folder = out / (f"bench_scan-{stamp}" + (f"-{i}" if i else ""))
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise ValueError(f"cannot make a new folder for the short bench under {out}")


def _by(run: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["label"], r["nbytes"]): r for r in run["results"]}


def remodel(run: dict[str, Any]) -> None:
    """Recompute every row's ``model_s`` from the run's calibration with the current cost model (in place)."""
    from hpczeco.collectives import costmodel as cm

    params = cm.LinkParams(**run["params"])
    alg = run.get("exscan_algorithm", "recursive_doubling")
    for r in run["results"]:
        _, K, V = r["shape"]
        r["model_s"] = cm.predict(r["topology"], run["P"], r["nbytes"], params, blocks=r["blocks"], K=K, V=V,
                                  exscan_algorithm=alg)


def _points(runs: list[dict[str, Any]]) -> list[tuple[str, int, float, float]]:
    pts = []
    for run in runs:
        for r in run["results"]:
            fixed = r["topology"] in ("ring", "ptree") and r.get("blocks") is not None  # None: one whole message
            topo = f"{r['topology']}/k={r['blocks']}" if fixed else r["topology"]
            pts.append((topo, run["P"], float(r["nbytes"]), float(r["median_s"])))
    return pts


def accuracy_md(runs: list[dict[str, Any]]) -> list[str]:
    """Measured/model per (P, size, topology) and the targets: <= 64 KiB within 3x, ring >= 1 MiB within 1.5x,
    every topology at 16 KiB, 1 MiB and 16 MiB within 1.3x, ``auto`` within 10% of the fastest."""
    lines = ["| P | state | " + " | ".join(ACCURACY_TOPOLOGIES) + " |",
             "|---|---|" + "---|" * len(ACCURACY_TOPOLOGIES)]
    worst_small = (0.0, "")
    worst_ring = (0.0, "")
    worst_all = (0.0, "")
    for run in runs:
        by = _by(run)
        for s in sorted({r["nbytes"] for r in run["results"]}):
            cells = []
            for t in ACCURACY_TOPOLOGIES:
                r = by.get((t, s))
                if r is None or r["model_s"] <= 0:
                    cells.append("-")
                    continue
                q = r["median_s"] / r["model_s"]
                cells.append(f"{q:.2f}")
                where = f"{t} at {fmt_size(s)}, P={run['P']}"
                if s in (16 << 10, 1 << 20, 16 << 20) and max(q, 1 / q) > worst_all[0]:
                    worst_all = (max(q, 1 / q), where)
                if s <= 64 << 10 and q > worst_small[0]:
                    worst_small = (q, where)
                if t == "ring" and s >= 1 << 20 and max(q, 1 / q) > worst_ring[0]:
                    worst_ring = (max(q, 1 / q), where)
            lines.append(f"| {run['P']} | {fmt_size(s)} | " + " | ".join(cells) + " |")
    lines += ["", f"- states <= 64 KiB: worst measured/model {worst_small[0]:.2f} ({worst_small[1]}); target <= 3: "
              + ("met" if worst_small[0] <= 3 else "**not met**"),
              f"- ring at >= 1 MiB: worst factor between measured and model {worst_ring[0]:.2f} ({worst_ring[1]}); "
              "target <= 1.5: " + ("met" if worst_ring[0] <= 1.5 else "**not met**")]
    if worst_all[1]:
        lines.append(f"- every topology at 16 KiB, 1 MiB, 16 MiB: worst factor between measured and model "
                     f"{worst_all[0]:.2f} ({worst_all[1]}); target <= 1.3: "
                     + ("met" if worst_all[0] <= 1.3 else "**not met**"))
    lines += auto_md(runs)
    return lines


#: the columns of the measured/model table
ACCURACY_TOPOLOGIES = ("ring", "ptree", "tree", "allgather", "serial", "exscan")


def auto_md(runs: list[dict[str, Any]]) -> list[str]:
    """``auto`` (the calibrated model's pick, when the run measured it) against the fastest topology measured at
    the same size: the target "auto within 10% of the best"."""
    lines = []
    for run in runs:
        by = _by(run)
        for s in sorted({r["nbytes"] for r in run["results"]}):
            rows = [r for r in run["results"] if r["nbytes"] == s and r["label"] != "auto"]
            if not rows:
                continue
            best = min(rows, key=lambda r: r["median_s"])
            auto = by.get(("auto", s))
            if auto is None:
                continue
            q = auto["median_s"] / best["median_s"]
            lines.append(f"- auto at {fmt_size(s)}, P={run['P']}: {auto['topology']}"
                         + (f" k={auto['blocks']}" if auto.get("blocks") else "")
                         + f" {auto['median_s'] * 1e3:.3f} ms vs fastest {best['label']} {best['median_s'] * 1e3:.3f} "
                         f"ms = {q:.2f}x; target <= 1.10: " + ("met" if q <= 1.10 else "**not met**"))
    return lines


def refit_md(runs: list[dict[str, Any]]) -> list[str]:
    """Per run: the RMS of log(model/measured) under its calibration, and the model refit to its measurements
    (alpha, beta, overhead free; gamma, delta as calibrated) with the refit's residual and worst point."""
    from hpczeco.collectives import costmodel as cm

    from . import costfit

    lines = ["| P | calibration RMS log (x) | refit | refit RMS log (x) | refit's worst point |",
             "|---|---|---|---|---|"]
    for run in runs:
        start = cm.LinkParams(**run["params"])
        pts = _points([run])
        alg = run.get("exscan_algorithm", "recursive_doubling")
        res = costfit.residuals(pts, start, exscan_algorithm=alg)
        rms_cal = math.sqrt(sum(math.log(p / m) ** 2 for *_, m, p in res) / len(res))
        fitted, rms = costfit.fit(pts, start, ("alpha", "beta", "overhead"), exscan_algorithm=alg, name="refit")
        t, P, m, meas, pred = max(costfit.residuals(pts, fitted, exscan_algorithm=alg),
                                  key=lambda x: abs(math.log(x[4] / x[3])))
        desc = fitted.describe().split(": ", 1)[1].split(", gamma")[0] + f", overhead={fitted.overhead * 1e6:.1f} us"
        lines.append(f"| {run['P']} | {rms_cal:.3f} ({math.exp(rms_cal):.2f}x) | {desc} | {rms:.3f} "
                     f"({math.exp(rms):.2f}x) | {t} {fmt_size(m)}: {meas * 1e3:.3f} vs {pred * 1e3:.3f} ms |")
    return lines


def piece_md(runs: list[dict[str, Any]]) -> list[str]:
    """Per run: the ring's per-piece cost above the eager size and where it comes from (the run's calibration,
    or estimated from the run's ring points at two piece counts when the calibration predates it), the RMS log
    residual of all points and measured/model of the ring at >= 1 MiB without the term and with it."""
    from dataclasses import replace

    from hpczeco.collectives import costmodel as cm

    from . import costfit

    lines = ["| P | piece (us) above eager | from | RMS log without -> with | ring >= 1 MiB measured/model "
             "without -> with | model's k at 1 MiB without -> with |", "|---|---|---|---|---|---|"]
    for run in runs:
        cal = cm.LinkParams(**run["params"])
        pts = _points([run])
        alg = run.get("exscan_algorithm", "recursive_doubling")
        if "piece" in run["params"]:
            src, with_p = "calibration", cal
        else:
            est = costfit.estimate_piece(pts, cal)
            if est is None:
                lines.append(f"| {run['P']} | - | not calibrated; no pair of ring points above the eager size | "
                             "- | - | - |")
                continue
            pairs = ", ".join(f"k={k1}/{k2} at {fmt_size(m)}" for _, m, k1, k2 in est[1])
            src, with_p = f"estimated from this run's ring ({pairs})", replace(cal, piece=est[0])
        without = replace(with_p, piece=0.0, ring_beta=0.0, ring_beta_big=0.0)  # the model before the ring terms

        def rms(p: cm.LinkParams, pts: list = pts, alg: str = alg) -> float:
            res = costfit.residuals(pts, p, exscan_algorithm=alg)
            return math.sqrt(sum(math.log(x[4] / x[3]) ** 2 for x in res) / len(res))

        big = [x for x in pts if x[0].startswith("ring/") and x[2] >= 1 << 20]
        q0 = [x[3] / costfit.residuals([x], without)[0][4] for x in big]
        q1 = [x[3] / costfit.residuals([x], with_p)[0][4] for x in big]
        cells = ", ".join(f"{x[0].split('=')[1]}@{fmt_size(x[2])}: {a:.2f} -> {b:.2f}" for x, a, b in zip(big, q0, q1))
        K = next((r["shape"][1] for r in run["results"]), 128)
        ks = f"{cm.best_blocks(run['P'], 1 << 20, K, without)} -> {cm.best_blocks(run['P'], 1 << 20, K, with_p)}"
        stage = f"; ring stage {with_p.ring_beta * 1e9:.3f} ns/B" if with_p.ring_beta > 0 else ""
        if with_p.ring_beta_big > 0:
            stage += (f" at {fmt_size(with_p.ring_bytes)}, {with_p.ring_beta_big * 1e9:.3f} at "
                      f"{fmt_size(with_p.ring_big)}")
        lines.append(f"| {run['P']} | {with_p.piece * 1e6:.1f} above {with_p.eager / 1024:g} KiB{stage} | {src} | "
                     f"{rms(without):.3f} -> {rms(with_p):.3f} | {cells or '-'} | {ks} |")
    return lines


def table_md(run: dict[str, Any]) -> list[str]:
    res = run["results"]
    labels = list(dict.fromkeys(r["label"] for r in res))
    sizes = sorted({r["nbytes"] for r in res})
    by = _by(run)
    fastest = "fastest (oversubscribed: not a ranking)" if run.get("oversubscribed") else "fastest"
    lines = ["| state | " + " | ".join(labels) + f" | {fastest} |", "|---|" + "---|" * (len(labels) + 1)]
    for s in sizes:
        cells = []
        for lab in labels:
            r = by.get((lab, s))
            if r is None:
                cells.append("-")
            else:
                k = f" (k={r['blocks']})" if r["topology"] in ("ring", "ptree") and lab == r["topology"] else ""
                cells.append(f"{r['median_s'] * 1e3:.3f} / {r['model_s'] * 1e3:.3f}{k}")
        best = min((r for r in res if r["nbytes"] == s), key=lambda r: r["median_s"])["label"]
        lines.append(f"| {fmt_size(s)} | " + " | ".join(cells) + f" | {best} |")
    return lines


def crossover(run: dict[str, Any], a: str = "tree", b: str = "ring") -> str:
    """Largest size at which ``a`` is still faster than ``b`` (measured)."""
    by = _by(run)
    sizes = sorted({r["nbytes"] for r in run["results"]})
    wins = [s for s in sizes if (a, s) in by and (b, s) in by and by[(a, s)]["median_s"] < by[(b, s)]["median_s"]]
    if not wins:
        return f"{a} never faster than {b}"
    return f"{a} faster than {b} at " + ", ".join(fmt_size(s) for s in wins)


def ratios(run: dict[str, Any], size: int = 1 << 20) -> str:
    from hpczeco.collectives.names import ALGORITHMS

    by = _by(run)
    ring = by.get(("ring", size))
    if ring is None:
        return "no 1 MiB point"
    parts = [f"ring {ring['median_s'] * 1e3:.3f} ms (model {ring['model_s'] * 1e3:.3f}, "
             f"measured/model {ring['median_s'] / ring['model_s']:.2f})" if ring["model_s"] > 0 else ""]
    for other in (t for t in ALGORITHMS if t != "ring"):
        r = by.get((other, size))
        if r:
            parts.append(f"{other}/ring {r['median_s'] / ring['median_s']:.2f}x")
    return "; ".join(p for p in parts if p)


def plot_sizes(runs: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    cols = min(3, n)
    rws = -(-n // cols)
    fig, axes = plt.subplots(rws, cols, figsize=(5.5 * cols, 4 * rws), squeeze=False)
    for ax, run in zip(axes.flat, runs):
        res = run["results"]
        for i, lab in enumerate(dict.fromkeys(r["label"] for r in res)):
            rows = sorted((r for r in res if r["label"] == lab), key=lambda r: r["nbytes"])
            x = [r["nbytes"] for r in rows]
            ax.plot(x, [r["median_s"] * 1e3 for r in rows], "o-", color=f"C{i % 10}", label=lab, ms=3)
            ax.plot(x, [r["model_s"] * 1e3 for r in rows], "--", color=f"C{i % 10}", alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"P={run['P']}" + (" (oversubscribed)" if run.get("oversubscribed") else ""), fontsize=10)
        ax.set_xlabel("state bytes per rank")
        ax.set_ylabel("ms per scan")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("exclusive scan: measured (solid) vs cost model (dashed)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def model_reference(runs: list[dict[str, Any]], max_p: int) -> tuple[dict[str, Any], int, str | None]:
    """``(run, model_max_p, caveat)``: the run whose calibration draws the model curves over P, how far they
    go, and why they stop short. The largest run that was not oversubscribed is the reference and the curves
    go to ``max_p`` (a run calibrated with ``--no-calibrate --link`` uses its preset, oversubscribed or not); when
    every run was oversubscribed its calibration measured ranks waiting for a core, not
    the link, so the curves stop at the largest measured P (no extrapolation) and ``caveat`` says so."""
    def measured_sharing(run: dict[str, Any]) -> bool:  # a calibration (not a --link preset) of an oversubscribed run
        return bool(run.get("oversubscribed")) and run.get("calibrated", True)

    fair = [run for run in runs if not measured_sharing(run)]
    if fair:
        ref = fair[-1]
        skipped = [run["P"] for run in runs if measured_sharing(run)]
        caveat = (f"the calibrations of the oversubscribed run(s) P = {', '.join(map(str, skipped))} are not used "
                  f"for the model curves (that of P = {ref['P']} is)") if skipped else None
        return ref, max_p, caveat
    ref = runs[-1]
    largest = max(run["P"] for run in runs)
    return ref, largest, (f"every run was oversubscribed (more ranks than cores on a node), so its calibration "
                          f"measured ranks waiting for cores, not the link: no extrapolation past P = {largest} "
                          "(rerun `hpczeco bench scan` with ranks <= cores per node, or with --no-calibrate "
                          "--link PRESET)")


def plot_over_p(runs: list[dict[str, Any]], png: Path, max_p: int) -> list[int]:
    """Time vs P at a few state sizes: measured points and model lines to ``max_p`` (less when
    :func:`model_reference` refuses to extrapolate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hpczeco.collectives import costmodel as cm
    from hpczeco.collectives.names import ALGORITHMS

    all_sizes = sorted({r["nbytes"] for run in runs for r in run["results"]})
    wanted = [s for s in (16 << 10, 1 << 20, 16 << 20) if s in all_sizes]
    wanted = wanted or all_sizes[:: max(1, len(all_sizes) // 3)][:3]
    ref, max_p, _ = model_reference(runs, max_p)
    params = cm.LinkParams(**ref["params"])
    alg = ref.get("exscan_algorithm", "recursive_doubling")
    topos = ALGORITHMS
    Pmod = sorted({2 ** i for i in range(1, max(2, max_p).bit_length())} | {run["P"] for run in runs})
    Pmod = [P for P in Pmod if P <= max(max_p, max(run["P"] for run in runs))]
    fig, axes = plt.subplots(1, len(wanted), figsize=(5.5 * len(wanted), 4), squeeze=False)
    for ax, size in zip(axes.flat, wanted):
        shape = next(r["shape"] for run in runs for r in run["results"] if r["nbytes"] == size)
        K, V = shape[1], shape[2]
        for i, t in enumerate(topos):
            pts = [(run["P"], _by(run).get((t, size))) for run in runs]
            pts = [(P, r["median_s"] * 1e3) for P, r in pts if r is not None]
            if pts:
                ax.plot(*zip(*pts), "o", color=f"C{i}", label=f"{t} measured")
            ax.plot(Pmod, [cm.predict(t, P, size, params, K=K, V=V, exscan_algorithm=alg) * 1e3 for P in Pmod],
                    "--", color=f"C{i}", alpha=0.7, label=f"{t} model")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P")
        ax.set_ylabel("ms per scan")
        ax.set_title(f"state {fmt_size(size)} per rank", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    over = " (OVERSUBSCRIBED: not extrapolated)" if ref.get("oversubscribed") else ""
    import textwrap

    fig.suptitle(textwrap.fill(f"scan time over P; model with the P={ref['P']} calibration{over} "
                               f"({params.describe()})", 200), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return wanted


def write_report(runs: list[dict[str, Any]], out: Path, max_p: int, sim_dir: Path | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plot_sizes(runs, out / "scan_sizes.png")
    sizes_over_p = plot_over_p(runs, out / "scan_over_p.png", max_p)
    m = runs[-1]["machine"]
    lines = [
        "# Exclusive scan over ranks: ring All-Scan vs tree vs baselines",
        "",
        f"Machine: {m.get('host')} ({m.get('cpu', '?')}, {m.get('cpus')} CPUs), {m.get('mpi')}, "
        f"Python {m.get('python')}; runs from {', '.join(sorted({r['machine'].get('date', '?') for r in runs}))}.",
        "",
        "Times are the median over repeats of the slowest rank (barrier-synchronised start), in ms, as "
        "`measured / model`; the model uses the link parameters calibrated in the same run.",
        "",
        "| P | oversubscribed | dtype | calibration | exscan modelled as |",
        "|---|---|---|---|---|",
    ]
    from hpczeco.collectives import costmodel as cm

    for run in runs:
        desc = cm.LinkParams(**run["params"]).describe()
        lines.append(f"| {run['P']} | {run.get('oversubscribed')} | {run['dtype']} | {desc} | "
                     f"{run.get('exscan_algorithm')} |")
    for run in runs:
        load = run.get("load_at_start")
        where = run["machine"].get("netns")
        rate = f", rate {where['rate']} per NIC" if where and where.get("rate") else ""
        head = (f"## P = {run['P']}" + (f" (namespace hosts over TCP{rate})" if where else "")
                + (" (oversubscribed)" if run.get("oversubscribed") else ""))
        lines += ["", head, ""]
        if load:
            lines += [f"Load average at start / end: {load[0]:.1f} / {run['machine']['load'][0]:.1f} "
                      f"({run['machine'].get('cpus')} CPUs); {run['machine'].get('date')}.", ""]
        lines += table_md(run)
        lines += ["", f"- {crossover(run)}", f"- at 1 MiB: {ratios(run)}"]
    _, _, caveat = model_reference(runs, max_p)
    if any(run.get("oversubscribed") for run in runs):
        lines += ["", "**Oversubscribed runs** (more ranks than usable cores on a node: "
                  + ", ".join(f"P = {run['P']}" for run in runs if run.get("oversubscribed"))
                  + "): ranks wait for a core, so their times and their \"fastest\" column rank the sharing of "
                  "cores, not the algorithms."]
    if caveat:
        lines += ["", f"**Model over P:** {caveat}."]
    lines += ["", "## Measured / model", ""] + accuracy_md(runs)
    lines += ["", "## Refit", ""] + refit_md(runs)
    lines += ["", "## The ring's per-piece cost", "",
              "A ring piece above the eager size pays a per-message cost (`piece`) that the calibrated `alpha` "
              "(tiny messages) and `beta` (whole states) do not show; estimated values (for runs calibrated "
              "before it was measured) come from the same points they are compared with.", ""] + piece_md(runs)
    ref, _, _ = model_reference(runs, max_p)  # its calibration joins the presets, unless it measured sharing
    extra = {} if ref.get("oversubscribed") and ref.get("calibrated", True) else {
        f"calibrated (P = {ref['P']})": cm.LinkParams(**ref["params"])}
    lines += [""] + report_sim.section(out, max_p, sim_dir, extra)
    lines += [
        "",
        "## Plots",
        "",
        "![time vs state size](scan_sizes.png)",
        "",
        f"![time vs P at {', '.join(fmt_size(s) for s in sizes_over_p)}](scan_over_p.png)",
        "",
    ]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    return md


def main(argv: list[str] | None = None, prog: str = "hpczeco report") -> int:
    args = build_parser(prog).parse_args(argv)
    from hpczeco.drivers.files import check_output_dir
    from hpczeco.drivers.mpienv import launched_size

    inp, out = Path(args.inp), Path(args.out)
    if inp.exists() and not inp.is_dir():
        raise ValueError(f"--in {inp} is not a folder")
    if inp.is_dir() and out.exists() and out.resolve() == inp.resolve():
        raise ValueError(f"--out {out} is the --in folder: the report never writes among its inputs; give another")
    check_output_dir(out, "--out")  # before any work
    files = sorted(inp.glob("scan_P*.json")) if inp.is_dir() else []
    if files:
        runs = load(inp)  # every file checked; the first that does not pass stops the report
    else:
        if launched_size() > 1:
            raise ValueError(f"no scan_P*.json in {inp}, and the short bench launches its own mpiexec: run "
                             "`hpczeco report` as one process, or `mpiexec -n P hpczeco bench scan --out DIR` and "
                             "then `hpczeco report --in DIR`")
        exe = check_mpiexec(args.mpiexec)  # before anything is launched
        bench = _new_bench_folder(out)
        print(f"report: no scan_P*.json in {inp}; running a short bench into {bench} first (--in is not written)",
              flush=True)
        run_short_bench(bench, args.np, args.sizes, exe)
        runs = load(bench)
        if not runs:
            raise ValueError(f"the short bench wrote no results into {bench}")
    for run in runs:
        remodel(run)
    _, _, caveat = model_reference(runs, args.model_max_p)
    if caveat:
        print(f"{prog}: warning: {caveat}", flush=True)
    md = write_report(runs, out, args.model_max_p, Path(args.sim))
    print(f"wrote {md} with {len(runs)} run(s): P = {', '.join(str(r['P']) for r in runs)} "
          f"(from {', '.join(r['_file'] for r in runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
