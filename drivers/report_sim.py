"""The parts of `hpczeco report` about scale: the crossover P of every link preset (cost model), the simulated GPU
cluster of `hpczeco simulate` beside its model and the paper's Table 2, and the figure of both.

* :func:`crossovers`: for each link preset (:data:`hpczeco.collectives.costmodel.PRESETS`, the two-level
  ``nvlink4`` inside nodes of 8 with ``ib-ndr`` between them, and any calibration given) and state size, the
  model's time of ring, ptree, tree and allgather at P = 2, 4, ..., ``max_p`` and the crossover P: the smallest P
  from which a tree (ptree or recursive doubling) beats the ring at every larger P of the range.
* :func:`sim_md`: the simulated times (``simulate.json``) per topology and P, simulator / model, the paper's
  columns, and the simulation's own crossover.
* :func:`plot_presets`: one panel per preset at 1 MiB (model curves, crossover marked), the simulated points on
  the two-level panel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .bench_scan import fmt_size

#: topologies compared over P (serial and exscan are never faster than ring and tree in the model)
OVER_P = ("ring", "ptree", "tree", "allgather")
#: a tree that can beat the ring at scale
TREES = ("ptree", "tree")
#: the two-level preset: nvlink4 inside nodes of this many GPUs, ib-ndr between them
HIER_PER_NODE = 8


def _powers(max_p: int) -> list[int]:
    return [1 << i for i in range(1, max(2, max_p).bit_length()) if (1 << i) <= max_p]


def model_curves(params: Any, nbytes: int, Ps: list[int], K: int = 128, V: int = 128,
                 hier: tuple[Any, int] | None = None) -> dict[str, list[float]]:
    """``{topology: [seconds per P]}`` under ``params`` (or, with ``hier = (inter, per_node)``, two-level)."""
    from hpczeco.collectives import costmodel as cm

    out: dict[str, list[float]] = {}
    for t in OVER_P:
        if hier is None:
            out[t] = [cm.predict(t, P, nbytes, params, K=K, V=V) for P in Ps]
        else:
            out[t] = [cm.predict_hier(t, P, nbytes, params, hier[0], hier[1], K=K, V=V)[0] for P in Ps]
    return out


def crossover_of(Ps: list[int], curves: dict[str, list[float]]) -> tuple[int | None, str | None]:
    """``(P, tree)``: the smallest P from which ``tree`` (the faster of :data:`TREES` at the largest P) beats the ring
    at every larger P, or ``(None, None)`` when the ring is fastest at the largest P."""
    best_tree = min(TREES, key=lambda t: curves[t][-1])
    cross = None
    for i in range(len(Ps) - 1, -1, -1):
        if min(curves[t][i] for t in TREES) < curves["ring"][i]:
            cross = Ps[i]
        else:
            break
    return (cross, best_tree) if cross is not None else (None, None)


def presets(extra: dict[str, Any] | None = None) -> list[tuple[str, Any, tuple[Any, int] | None]]:
    """``(label, params, hier)`` of every flat preset, the two-level one, and ``extra`` (label -> params)."""
    from hpczeco.collectives import costmodel as cm

    rows: list[tuple[str, Any, tuple[Any, int] | None]] = [(n, p, None) for n, p in cm.PRESETS.items()]
    rows.append((f"nvlink4 x{HIER_PER_NODE} + ib-ndr", cm.PRESETS["nvlink4"], (cm.PRESETS["ib-ndr"], HIER_PER_NODE)))
    for name, p in (extra or {}).items():
        rows.append((name, p, None))
    return rows


def crossovers(max_p: int = 1024, sizes: tuple[int, ...] = (16 << 10, 1 << 20, 16 << 20),
               extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per preset and size: the crossover P and the fastest topology at ``max_p`` (module docstring)."""
    Ps = _powers(max_p)
    rows = []
    for label, params, hier in presets(extra):
        for m in sizes:
            curves = model_curves(params, m, Ps, hier=hier)
            cross, tree = crossover_of(Ps, curves)
            last = min(OVER_P, key=lambda t: curves[t][-1])
            rows.append({"preset": label, "nbytes": m, "crossover_P": cross, "tree": tree, "fastest_at_max": last,
                         "max_P": Ps[-1]})
    return rows


def crossover_md(rows: list[dict[str, Any]]) -> list[str]:
    sizes = sorted({r["nbytes"] for r in rows})
    labels = list(dict.fromkeys(r["preset"] for r in rows))
    by = {(r["preset"], r["nbytes"]): r for r in rows}
    max_p = rows[0]["max_P"] if rows else 0
    lines = ["| link | " + " | ".join(fmt_size(s) for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for lab in labels:
        cells = []
        for s in sizes:
            r = by[(lab, s)]
            if r["crossover_P"] is None:
                cells.append(f"ring up to P = {max_p}")
            else:
                cells.append(f"**P = {r['crossover_P']}** ({r['tree']}; fastest at {max_p}: {r['fastest_at_max']})")
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    lines += ["", f"Crossover P: the smallest power of two from which ptree or the recursive-doubling tree is faster "
              f"than the ring (with its best piece count) at every larger P up to {max_p}, by the cost model."]
    return lines


def load_sim(folder: Path) -> dict[str, Any] | None:
    f = folder / "simulate.json"
    if not f.exists():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def sim_md(sim: dict[str, Any]) -> list[str]:
    """The simulated times beside the model and the paper (ms), and the simulation's summary lines."""
    rows = [r for r in sim["results"] if "time_s" in r and not r["topology"].startswith("verify:")]
    topos = [t for t in ("ring", "ptree", "tree", "allgather", "serial") if any(r["topology"] == t for r in rows)]
    Ps = sorted({r["P"] for r in rows})
    by = {(r["topology"], r["P"]): r for r in rows}
    paper = sim.get("paper", {})
    lines = [f"Platform: {sim['platform']['describe']}; software costs: {sim.get('software', '?')}; state "
             f"{sim['state_bytes'] / 2**20:g} MiB per GPU. Cells: simulated / model ms (k = pieces).", "",
             "| P | " + " | ".join(topos) + " | paper All-Scan / AllGather |", "|---|" + "---|" * (len(topos) + 1)]
    for P in Ps:
        cells = []
        for t in topos:
            r = by.get((t, P))
            if r is None:
                cells.append("-")
                continue
            k = f" (k={r['k']})" if t in ("ring", "ptree") else ""
            cells.append(f"{r['time_s'] * 1e3:.3f} / {r['model_s'] * 1e3:.3f}{k}")
        pr = (paper.get(str(P)) or paper.get(P)) if abs(sim["state_bytes"] / (1 << 20) - 1) < 0.01 else None
        cells.append(f"{pr['ring']:.3f} / {pr['allgather']:.3f}" if pr else "-")
        lines.append(f"| {P} | " + " | ".join(cells) + " |")
    verify = [r for r in sim["results"] if r["topology"].startswith("verify:") and "max_error" in r]
    lines.append("")
    lines += ["- " + x.strip() for x in sim.get("summary", {}).get("lines", []) if x.strip()]
    if verify:
        worst = max(r["max_error"] for r in verify)
        lines.append(f"- simulated data path (ring and ptree carrying real float64 pieces, {len(verify)} runs at "
                     f"P = {min(r['P'] for r in verify)} .. {max(r['P'] for r in verify)}): worst |error| against "
                     f"the fold {worst:.1e}")
    return lines


def plot_presets(png: Path, max_p: int = 1024, nbytes: int = 1 << 20, extra: dict[str, Any] | None = None,
                 sim: dict[str, Any] | None = None) -> None:
    """One panel per preset: model time over P per topology at ``nbytes``, the crossover marked; on the two-level
    panel the simulated points (``sim``, when its state is ``nbytes`` per rank up to 1%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = presets(extra)
    Ps = _powers(max_p)
    n = len(rows)
    cols = min(3, n)
    rws = -(-n // cols)
    fig, axes = plt.subplots(rws, cols, figsize=(5.2 * cols, 3.9 * rws), squeeze=False)
    for ax, (label, params, hier) in zip(axes.flat, rows):
        curves = model_curves(params, nbytes, Ps, hier=hier)
        for i, t in enumerate(OVER_P):
            ax.plot(Ps, [v * 1e3 for v in curves[t]], "-", color=f"C{i}", label=f"{t} model")
        cross, tree = crossover_of(Ps, curves)
        if cross is not None:
            ax.axvline(cross, color="grey", ls=":", lw=1.2)
            ax.text(cross, max(curves["ring"]) * 1e3 * 0.5, f" crossover\n P={cross} ({tree})", fontsize=7,
                    color="grey")
        if hier is not None and sim is not None and abs(sim["state_bytes"] / nbytes - 1) < 0.01:
            srows = [r for r in sim["results"] if "time_s" in r and not r["topology"].startswith("verify:")]
            for i, t in enumerate(OVER_P):
                pts = sorted((r["P"], r["time_s"] * 1e3) for r in srows if r["topology"] == t)
                if pts:
                    ax.plot(*zip(*pts), "o", color=f"C{i}", ms=4, label=f"{t} simulated")
            paper = sim.get("paper", {}) if nbytes == 1 << 20 else {}  # Table 2 is for 1 MiB
            pp = sorted((int(P), v["ring"]) for P, v in paper.items())
            if pp:
                ax.plot(*zip(*pp), "k*", ms=8, label="paper All-Scan")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{label}, {fmt_size(nbytes)} per rank", fontsize=9)
        ax.set_xlabel("ranks P")
        ax.set_ylabel("ms per scan")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("cost model per link preset (lines), simulated GPU fat tree (points), crossover P (dotted)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def section(out: Path, max_p: int, sim_dir: Path | None, extra: dict[str, Any] | None = None) -> list[str]:
    """The report's scale section: crossover table, the presets figure and, with a simulation, its table."""
    max_p = max(max_p, 1024)
    sim = load_sim(sim_dir) if sim_dir is not None else None
    lines = ["## Crossover P per link preset (model)", ""] + crossover_md(crossovers(max_p, extra=extra))
    plot_presets(out / "scan_presets.png", max_p, extra=extra, sim=sim)
    lines += ["", "![model per link preset and crossover P](scan_presets.png)"]
    if sim is not None:
        lines += ["", f"## Simulated GPU cluster (`hpczeco simulate`, {sim_dir})", ""] + sim_md(sim)
        if (sim_dir / "simulate.png").exists():
            (out / "simulate.png").write_bytes((sim_dir / "simulate.png").read_bytes())
            lines += ["", "![simulated vs model vs paper](simulate.png)"]
    elif sim_dir is not None:
        lines += ["", f"(no simulate.json in {sim_dir}: run `hpczeco simulate --out {sim_dir}`)"]
    return lines
