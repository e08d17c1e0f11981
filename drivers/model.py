"""`hpczeco model`: predicted All-Scan (ring) vs tree vs allgather (and serial, exscan) time for any P.

Alpha-beta-gamma model of :mod:`hpczeco.collectives.costmodel` for the link you give (``--link`` preset or
``--alpha``/``--beta``), optionally two-level (``--gpus-per-node`` with ``--inter-link`` between
nodes). The state per rank is ``--state-bytes`` or ``B*H*K*V*itemsize``. The ZeCO paper's measured
communication times (Table 2: H100 cluster, 8 GPUs per node, NVLink inside and InfiniBand across
nodes, P = 8 .. 256) are printed beside the rows of the same P with the ratio model/paper, and
``--fit-paper`` refits the ``nvlink4``/``ib-ndr`` presets to that table and prints the residuals.

Assumptions behind the comparison and every extrapolation (printed with the table):
the state is one layer's GLA state, 1 MiB per GPU (the paper's H=32, K=V=128 in bf16; the defaults
here, H=16 float32, are the same bytes); ranks fill nodes in order; each GPU has its own link out of
its node, so a tree or allgather round whose pairs cross nodes shares no bandwidth; the per-hop cost
``alpha`` does not grow with P (no congestion, no topology effects past one switch); the ring uses the
model's best piece count. The tree is not in the paper's table: its prediction is the model's only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .costfit import PAPER_TABLE2 as PAPER  # ms, All-Scan vs LASP-2's AllGather
from .options import float_range, int_list, int_range, link_text

ASSUMPTIONS = [
    "state: one layer's GLA state per GPU; the paper's row is H=32, K=V=128 in bf16 = 1 MiB (it prints no size)",
    "ranks fill nodes in order; one link out of the node per GPU: rounds that cross nodes share no bandwidth",
    "alpha is constant in P (no congestion, no switch hierarchy); beyond the paper's P=256 it is extrapolation",
    "the ring pipelines with the model's best piece count k; combines run at HBM speed (gamma), 2 us a launch",
    "tree: NOT measured by the paper (nor at P > 4 here); its log2(P) rounds assume every round costs one hop",
    "ptree (pipelined in-order binary tree): not in the paper either; `hpczeco simulate` runs its schedule",
]


def build_parser(prog: str) -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter, split_doc

    description, epilog = split_doc(__doc__)
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)
    ap.add_argument("--link", default="nvlink4", type=link_text,
                    help="link preset (nvlink4, ib-ndr, shm, tcp) or "
                         "'alpha,beta[,gamma[,delta[,overhead]]][,piece=S][,eager=BYTES]'")
    ap.add_argument("--alpha", type=float_range(0), help="seconds per message (overrides the preset's)")
    ap.add_argument("--beta", type=float_range(0), help="seconds per byte (overrides the preset's)")
    ap.add_argument("--gamma", type=float_range(0), help="seconds per state byte combined (overrides the preset's)")
    ap.add_argument("--gpus-per-node", type=int_range(0), default=0,
                    help="two-level machine: ranks per node (0 = one flat link)")
    ap.add_argument("--inter-link", default="ib-ndr", type=link_text,
                    help="link between nodes when --gpus-per-node is set")
    ap.add_argument("--state-bytes", type=float_range(0, lo_open=True),
                    help="state bytes per rank (else B*H*K*V*itemsize)")
    ap.add_argument("--B", type=int_range(1), default=1, help="batch of the state [B, H, K, V]")
    ap.add_argument("--H", type=int_range(1), default=16, help="heads of the state")
    ap.add_argument("--K", type=int_range(1), default=128, help="key dim of the state")
    ap.add_argument("--V", type=int_range(1), default=128, help="value dim of the state")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                    help="state element type")
    ap.add_argument("--P", default="2,4,8,16,32,64,128,256,512,1024", type=int_list(1, 1 << 24),
                    help="comma list of rank counts")
    ap.add_argument("--exscan", default="recursive_doubling", choices=["recursive_doubling", "linear"],
                    help="how the MPI implements MPI_Exscan (MPICH: recursive doubling; Open MPI: linear)")
    ap.add_argument("--fit-paper", action="store_true",
                    help="refit nvlink4 (inside a node) and ib-ndr (between nodes) to the paper's Table 2 and "
                         "print the fit's residuals")
    ap.add_argument("--out", help="also write model.json and model.png into this folder")
    return ap


def print_paper_fit(link, inter, per_node: int, nbytes: float) -> list[dict]:
    """Table 2 beside the two-level model (``link`` inside a node, ``inter`` between): rows with residuals."""
    from . import costfit

    rows = costfit.paper_rows(link, inter, nbytes, per_node)
    print(f"\nZeCO paper Table 2 vs the model ({link.name} inside nodes of {per_node}, {inter.name} between), ms:")
    print(f"{'P':>5s} {'ring':>8s} {'paper':>7s} {'ratio':>6s} {'k':>4s} {'allgather':>10s} {'paper':>7s} {'ratio':>6s}"
          f" {'ag/ring':>8s} {'paper':>6s} {'tree*':>7s}")
    for r in rows:
        print(f"{r['P']:5d} {r['ring'] * 1e3:8.3f} {r['ring_paper'] * 1e3:7.3f} {r['ring'] / r['ring_paper']:6.2f} "
              f"{r['k']!s:>4s} {r['allgather'] * 1e3:10.3f} {r['allgather_paper'] * 1e3:7.3f} "
              f"{r['allgather'] / r['allgather_paper']:6.2f} {r['allgather'] / r['ring']:8.2f} "
              f"{r['allgather_paper'] / r['ring_paper']:6.2f} {r['tree'] * 1e3:7.3f}")
    import math

    logs = [math.log(r[t] / r[f"{t}_paper"]) for r in rows for t in ("ring", "allgather")]
    print(f"residual: RMS of log(model/paper) {math.sqrt(sum(x * x for x in logs) / len(logs)):.3f}, "
          f"worst {max(abs(x) for x in logs):.3f} ({math.exp(max(abs(x) for x in logs)):.2f}x); "
          "* tree: the model's only (not in the paper)")
    return rows


def main(argv: list[str] | None = None, prog: str = "hpczeco model") -> int:
    from dataclasses import replace

    from hpczeco.collectives import costmodel as cm
    from hpczeco.collectives.names import ALGORITHMS as TOPOS

    args = build_parser(prog).parse_args(argv)
    try:
        link = cm.parse_link(args.link)
        over = {k: getattr(args, k) for k in ("alpha", "beta", "gamma") if getattr(args, k) is not None}
        if over:
            link = replace(link, name=f"{link.name}*", **over)
        inter = cm.parse_link(args.inter_link) if args.gpus_per_node else None
    except ValueError as exc:
        build_parser(prog).error(str(exc))
    Ps = list(args.P)
    if args.out:  # checked before the work
        from .files import check_output_dir

        check_output_dir(args.out, "--out")
    itemsize = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}[args.dtype]
    nbytes = args.state_bytes if args.state_bytes else args.B * args.H * args.K * args.V * itemsize
    K, V = args.K, args.V

    print(f"cost model: state {nbytes / 2**20:.3f} MiB per rank (B={args.B} H={args.H} K={K} V={V} {args.dtype}"
          f"{'' if not args.state_bytes else ', from --state-bytes'})")
    print(f"  link {link.describe()}")
    if inter is not None:
        print(f"  {args.gpus_per_node} ranks per node; between nodes {inter.describe()}")
    print(f"  exscan modelled as {args.exscan}; times in ms; the paper's Table 2 where P matches\n")
    head = f"{'P':>6s} {'ring':>9s} {'k':>4s} {'tree':>9s} {'allgather':>10s} {'serial':>9s} {'exscan':>9s} " \
           f"{'ptree':>9s} {'k':>4s} {'ag/ring':>8s}  paper (ring / allgather)"
    print(head)
    rows = []
    for P in Ps:
        row = {"P": P}
        for t in TOPOS:
            if inter is not None:
                sec, k = cm.predict_hier(t, P, nbytes, link, inter, args.gpus_per_node, K=K, V=V)
                if t == "exscan" and P > args.gpus_per_node:
                    merged = replace(inter, gamma=link.gamma, delta=link.delta)
                    sec = cm.exscan_time(P, nbytes, merged, V, args.exscan)
                elif t == "exscan":
                    sec = cm.exscan_time(P, nbytes, link, V, args.exscan)
            else:
                k = cm.best_blocks(P, nbytes, K, link) if t == "ring" else None
                sec = cm.predict(t, P, nbytes, link, blocks=k, K=K, V=V, exscan_algorithm=args.exscan)
            row[t] = sec
            if t == "ring":
                row["k"] = k
            if t == "ptree":
                row["ptree_k"] = k if inter is not None else cm.best_blocks_ptree(P, nbytes, K, link)
        rows.append(row)
        paper = PAPER.get(P)
        ptxt = (f"  {paper['ring']:.3f} / {paper['allgather']:.3f} (model/paper {row['ring'] * 1e3 / paper['ring']:.2f}"
                f" / {row['allgather'] * 1e3 / paper['allgather']:.2f})") if paper else ""
        ratio = row["allgather"] / row["ring"] if row["ring"] > 0 else float("nan")
        print(f"{P:6d} {row['ring'] * 1e3:9.3f} {row['k']!s:>4s} {row['tree'] * 1e3:9.3f} "
              f"{row['allgather'] * 1e3:10.3f} {row['serial'] * 1e3:9.3f} {row['exscan'] * 1e3:9.3f} "
              f"{row['ptree'] * 1e3:9.3f} {row['ptree_k']!s:>4s} {ratio:8.2f}{ptxt}")
    print("\npaper ratios allgather/All-Scan: " + ", ".join(
        f"P={P} {v['allgather'] / v['ring']:.2f}x" for P, v in PAPER.items()))
    paper_rows = None
    if args.fit_paper:
        from . import costfit

        nv, ib, rms = costfit.fit_paper(nbytes, args.gpus_per_node or costfit.PAPER_PER_NODE)
        print(f"\nfit to Table 2 (RMS log residual {rms:.3f}):\n  {nv.describe()}\n  {ib.describe()}")
        paper_rows = print_paper_fit(nv, ib, args.gpus_per_node or costfit.PAPER_PER_NODE, nbytes)
    elif inter is not None:
        paper_rows = print_paper_fit(link, inter, args.gpus_per_node, nbytes)
    print("\nassumptions behind these predictions:")
    for a in ASSUMPTIONS:
        print(f"  - {a}")
    if max(Ps) > max(PAPER):
        print(f"  - rows past P={max(PAPER)} extrapolate the model beyond every measurement")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"state_bytes": nbytes, "link": link.as_dict(), "inter": inter.as_dict() if inter else None,
                "gpus_per_node": args.gpus_per_node, "rows": rows, "paper": PAPER, "paper_fit": paper_rows,
                "assumptions": ASSUMPTIONS}
        (out / "model.json").write_text(json.dumps(data, indent=1))
        _plot(rows, out / "model.png", f"cost model, {nbytes / 2**20:.2f} MiB state, {link.name}"
              + (f" / {inter.name} x{args.gpus_per_node}" if inter else ""))
        print(f"wrote {out / 'model.json'}, {out / 'model.png'}")
    return 0


def _plot(rows: list[dict], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hpczeco.collectives.names import ALGORITHMS as TOPOS

    fig, ax = plt.subplots(figsize=(7, 4.5))
    Ps = [r["P"] for r in rows]
    for i, t in enumerate(TOPOS):
        ax.plot(Ps, [r[t] * 1e3 for r in rows], "-", color=f"C{i}", label=t)
    for P, v in PAPER.items():
        ax.plot([P], [v["ring"]], "o", color="C0")
        ax.plot([P], [v["allgather"]], "s", color="C2")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("ms per scan")
    ax.set_title(title + "\nmarkers: ZeCO paper (ring o, allgather s)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
