"""`hpczeco bench zeco`: ZeCO GLA layer weak scaling (run under ``mpiexec -n P``).

Every rank holds ``--tokens`` tokens (fixed tokens per rank: weak scaling, as in the paper's
tables). For each scan topology it times one layer's forward+backward (``ZeCOGLA``), beside the
**ideal**: every rank computing its slice alone (chunked GLA forward with a final state, and its
backward), no communication. Variants are interleaved repeat by repeat, so drift hits all alike;
the time of a repeat is the slowest rank's forward+backward (every rank starts at a barrier), the
figure is the median over repeats after warm-up. The table also shows the sum of the slowest forward
and the slowest backward (``sum-max``, the figure before 2026-12-01): for the layer it counts the
forward's rank skew twice, since an early rank waits for the late ones in the backward's agreement.

Set ``OMP_NUM_THREADS`` (e.g. 1) so that P ranks do not oversubscribe the BLAS threads.
Rank 0 prints a table and writes ``zeco_P{P}.json``, ``zeco_P{P}.csv`` and ``zeco.png`` (which
also plots the other ``zeco_P*.json`` files in the folder: ratio to the ideal over P). A weak-scaling
curve keeps the tokens per rank fixed: runs with different ``--tokens`` in one folder are drawn as
separate curves, one per tokens/rank, each labelled, and oversubscribed runs (more ranks than cores on a
node) are marked.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def _parser(prog: str) -> argparse.ArgumentParser:
    from hpczeco.collectives.names import ALGORITHMS, TOPOLOGIES

    from .helpfmt import HelpFormatter, topology_list
    from .options import int_range

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--tokens", type=int_range(1), default=4096,
                    help="tokens per rank (fixed as P grows: weak scaling; the paper's runs use 16384)")
    ap.add_argument("--B", type=int_range(1), default=1, help="batch")
    ap.add_argument("--H", type=int_range(1), default=4, help="heads")
    ap.add_argument("--K", type=int_range(1), default=64, help="key dim")
    ap.add_argument("--V", type=int_range(1), default=64, help="value dim")
    ap.add_argument("--chunk-size", type=int_range(1), default=64, help="GLA chunk length (tokens)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="q, k, v, g element type")
    ap.add_argument("--topologies", default=",".join(ALGORITHMS), type=topology_list,
                    help=f"comma list of {','.join(TOPOLOGIES)}")
    ap.add_argument("--blocks", type=int_range(1), default=None, help="ring blocks (default: cost model's choice)")
    ap.add_argument("--repeats", type=int_range(1), default=7, help="timed repeats (median reported)")
    ap.add_argument("--warmup", type=int_range(0), default=2, help="untimed repeats first")
    ap.add_argument("--out", default="runs/bench_zeco", help="output folder")
    ap.add_argument("--seed", type=int_range(0), default=0, help="input seed (rank r uses seed + r)")
    return ap


def _time_ideal(q, k, v, g, do, chunk_size):
    from hpczeco.gla import chunk_gla, chunk_gla_bwd

    t0 = time.perf_counter()
    chunk_gla(q, k, v, g, output_final_state=True, chunk_size=chunk_size)
    t1 = time.perf_counter()
    chunk_gla_bwd(q, k, v, g, do, chunk_size=chunk_size)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, {}


def _time_layer(layer, q, k, v, g, do):
    t0 = time.perf_counter()
    layer.forward(q, k, v, g)
    t1 = time.perf_counter()
    layer.backward(do)
    t2 = time.perf_counter()
    tm = {f"fwd_{k_}": v_ for k_, v_ in layer.timings.fwd.items()}
    tm.update({f"bwd_{k_}": v_ for k_, v_ in layer.timings.bwd.items()})
    return t1 - t0, t2 - t1, tm


def main(argv: list[str] | None = None, prog: str = "hpczeco bench zeco") -> int:
    args = _parser(prog).parse_args(argv)
    from hpczeco.collectives import timed
    from hpczeco.collectives.lifeline import guard
    from mpi4py import MPI

    from hpczeco import ZeCOGLA

    from .console import compile_notice, warn_core_sharing, warn_oversubscribed
    from .files import check_output_dir, rank0_verdict
    from .mpienv import launcher_mismatch

    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    mismatch = launcher_mismatch(P)
    if mismatch:  # each process would benchmark alone, as rank 0 of its own world
        raise ValueError(mismatch)
    if args.blocks is not None and args.blocks > args.K:
        raise ValueError(f"--blocks {args.blocks} is more than --K {args.K} (the ring's pieces split the K rows)")
    # the output folder, checked before the benchmark (not after it)
    rank0_verdict(comm, lambda: check_output_dir(args.out, "--out"), f"{prog}: checking --out")
    over = warn_oversubscribed(comm, prog)  # collective
    shared = warn_core_sharing(comm, prog) if over is None else None  # collective: other work on the cores
    compile_notice(rank)
    dt = np.dtype(args.dtype)
    rng = np.random.default_rng(args.seed + rank)
    B, L, H, K, V = args.B, args.tokens, args.H, args.K, args.V
    q = rng.standard_normal((B, L, H, K)).astype(dt)
    k = rng.standard_normal((B, L, H, K)).astype(dt)
    v = rng.standard_normal((B, L, H, V)).astype(dt)
    g = np.log(rng.uniform(0.9, 1.0, size=(B, L, H, K))).astype(dt)
    do = rng.standard_normal((B, L, H, V)).astype(dt)
    topologies = args.topologies
    variants = ["ideal", *topologies]
    layers = {t: ZeCOGLA(comm, topology=t, blocks=args.blocks, chunk_size=args.chunk_size) for t in topologies}

    samples: dict[str, list[tuple[float, float, dict]]] = {name: [] for name in variants}
    for rep in range(args.warmup + args.repeats):
        for name in variants:
            with guard(comm, f"{prog}: the barrier before a timed repeat"):  # blocking, as timed; bounded
                comm.Barrier()
            if name == "ideal":
                fwd, bwd, tm = _time_ideal(q, k, v, g, do, args.chunk_size)
            else:
                fwd, bwd, tm = _time_layer(layers[name], q, k, v, g, do)
            # one reduction: the slowest rank's forward, backward, forward+backward (the repeat's time: each rank
            # starts at the barrier) and scan wait
            mine = np.array([fwd, bwd, fwd + bwd, tm.get("fwd_wait", 0.0) + tm.get("bwd_wait", 0.0)])
            worst = mine.copy()
            timed.Allreduce(comm, worst, MPI.MAX, f"{prog}: the slowest rank's times of a repeat")
            if rep >= args.warmup:
                samples[name].append((float(worst[0]), float(worst[1]), {"total": float(worst[2]),
                                                                        "wait": float(worst[3]), **tm}))

    if rank != 0:
        return 0
    ideal_total = float(np.median([s[2]["total"] for s in samples["ideal"]]))
    ideal_sum = float(np.median([f + b for f, b, _ in samples["ideal"]]))
    rows = []
    for name in variants:
        fw = float(np.median([s[0] for s in samples[name]]))
        bw = float(np.median([s[1] for s in samples[name]]))
        tot = float(np.median([s[2]["total"] for s in samples[name]]))
        # the former figure: slowest forward + slowest backward. For the layer it counts the forward's rank skew
        # twice (an early rank waits for the late ones in the backward's agreement, inside its backward time)
        sum_max = float(np.median([s[0] + s[1] for s in samples[name]]))
        wait = float(np.median([s[2].get("wait", 0.0) for s in samples[name]]))
        rows.append({
            "variant": name, "P": P, "tokens_per_rank": L, "fwd_ms": fw * 1e3, "bwd_ms": bw * 1e3,
            "fwd_bwd_ms": tot * 1e3, "ratio_vs_ideal": tot / ideal_total,
            "fwd_plus_bwd_ms": sum_max * 1e3, "ratio_sum_vs_ideal": sum_max / ideal_sum,
            "tokens_per_rank_per_s": L / tot, "max_wait_ms": wait * 1e3, "oversubscribed": over is not None,
        })
    print(f"ZeCO GLA weak scaling: P={P}, {L} tokens/rank, B={B} H={H} K={K} V={V} {args.dtype}, "
          f"chunk {args.chunk_size}, median of {args.repeats} (warm-up {args.warmup})"
          + ("; OVERSUBSCRIBED (see the warning above): ratios measure core sharing" if over else ""))
    print("fwd ms, bwd ms: the slowest rank's phase; fwd+bwd ms (x ideal): the slowest rank's forward+backward, "
          "the repeat's time; sum-max ms (x): slowest fwd + slowest bwd, the former figure")
    print(f"{'variant':10s} {'fwd ms':>9s} {'bwd ms':>9s} {'fwd+bwd ms':>11s} {'x ideal':>8s} "
          f"{'sum-max ms':>11s} {'x':>6s} {'tok/rank/s':>11s} {'wait ms':>8s}")
    for r in rows:
        print(f"{r['variant']:10s} {r['fwd_ms']:9.2f} {r['bwd_ms']:9.2f} {r['fwd_bwd_ms']:11.2f} "
              f"{r['ratio_vs_ideal']:8.3f} {r['fwd_plus_bwd_ms']:11.2f} {r['ratio_sum_vs_ideal']:6.3f} "
              f"{r['tokens_per_rank_per_s']:11.0f} {r['max_wait_ms']:8.2f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from .benchkit import cpu_model

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
            "machine": cpu_model(), "cpus": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "args": vars(args),
            "oversubscription": None if over is None else over.describe(),
            "core_sharing": None if shared is None else shared.describe()}
    (out / f"zeco_P{P}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    with open(out / f"zeco_P{P}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    groups = _plot(out)
    if len(groups) > 1:
        print(f"zeco.png: the runs in {out} have {len(groups)} different tokens/rank "
              f"({', '.join(map(str, groups))}): one weak-scaling curve per tokens/rank")
    print(f"wrote {out}/zeco_P{P}.json, .csv and {out}/zeco.png")
    return 0


def plot_groups(rows: list[dict]) -> dict[int, dict[str, list[tuple[int, float, bool]]]]:
    """Rows of ``zeco_P*.json`` files as weak-scaling curves: ``{tokens_per_rank: {variant: [(P, ratio to
    ideal, oversubscribed), ...] sorted by P}}``. Only runs with the same tokens per rank share a curve."""
    out: dict[int, dict[str, list[tuple[int, float, bool]]]] = {}
    for r in rows:
        curve = out.setdefault(int(r["tokens_per_rank"]), {}).setdefault(r["variant"], [])
        curve.append((int(r["P"]), float(r["ratio_vs_ideal"]), bool(r.get("oversubscribed"))))
    for curves in out.values():
        for pts in curves.values():
            pts.sort()
    return dict(sorted(out.items()))


def _plot(out: Path) -> list[int]:
    """Write ``out/zeco.png`` from every ``zeco_P*.json`` in ``out``: one curve per (tokens/rank, variant),
    labelled with its tokens/rank; oversubscribed points hollow. Returns the tokens/rank values plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .files import read_bounded

    runs = []
    for f in sorted(out.glob("zeco_P*.json")):
        try:  # the other runs in the folder: bounded reads; one that is not a bench zeco result is named, not used
            rows = json.loads(read_bounded(str(f), 64 << 20, "bench zeco: the runs to plot"))["rows"]
            plot_groups(rows)
            runs.extend(rows)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{f}: not plotted, not a bench zeco result ({type(exc).__name__}: {exc})", flush=True)
    if not runs:
        return []
    groups = plot_groups(runs)
    styles = ["-", "--", ":", "-."]
    variants = sorted({r["variant"] for r in runs})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for gi, (tokens, curves) in enumerate(groups.items()):
        for name, pts in curves.items():
            color = f"C{variants.index(name) % 10}"
            label = f"{name}, {tokens} tok/rank" if len(groups) > 1 else name
            ax.plot([p for p, _, _ in pts], [x for _, x, _ in pts], styles[gi % len(styles)], marker="os^D"[gi % 4],
                    color=color, label=label)
            for p, x, over in pts:
                if over:
                    ax.plot([p], [x], "os^D"[gi % 4], color=color, mfc="white")
    ax.axhline(1.10, color="grey", ls=":", lw=1, label="1.10x ideal")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks P")
    ax.set_ylabel("fwd+bwd time / ideal")
    any_over = any(r.get("oversubscribed") for r in runs)
    note = "; hollow: oversubscribed" if any_over else ""
    if len(groups) == 1:
        ax.set_title(f"ZeCO GLA weak scaling ({next(iter(groups))} tokens/rank{note})")
    else:
        ax.set_title(f"ZeCO GLA weak scaling: one curve per tokens/rank ({', '.join(map(str, groups))}){note}",
                     fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "zeco.png", dpi=120)
    plt.close(fig)
    return list(groups)
