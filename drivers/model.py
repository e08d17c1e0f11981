"""`hpczeco model`: predicted All-Scan (ring) vs tree vs allgather (and serial, exscan) time for any P.

Alpha-beta-gamma model of :mod:`hpczeco.collectives.costmodel` for the link you give (``--link`` preset or
``--alpha``/``--beta``), optionally two-level (``--gpus-per-node`` with ``--inter-link`` between
nodes). The state per rank is ``--state-bytes`` or ``B*H*K*V*itemsize``. The ZeCO paper's measured
communication times (H100 cluster, 8 GPUs per node, NVLink inside and InfiniBand across nodes) are
printed beside the rows for P = 8 and 256.

Assumption behind that comparison (the paper does not print the state size next to its figure):
one layer's GLA state per GPU with B=1, H=16, K=V=128 in float32 = 1 MiB (the defaults here).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: ZeCO paper (arXiv 2507.01004), communication time per All-Scan vs LASP-2's AllGather, ms
PAPER = {8: {"ring": 0.226, "allgather": 0.375}, 256: {"ring": 2.165, "allgather": 8.514}}


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="nvlink4",
                    help="link preset (nvlink4, ib-ndr, shm) or 'alpha,beta[,gamma[,delta]]'")
    ap.add_argument("--alpha", type=float, help="seconds per message (overrides the preset's)")
    ap.add_argument("--beta", type=float, help="seconds per byte (overrides the preset's)")
    ap.add_argument("--gamma", type=float, help="seconds per state byte combined (overrides the preset's)")
    ap.add_argument("--gpus-per-node", type=int, default=0,
                    help="two-level machine: ranks per node (0 = one flat link)")
    ap.add_argument("--inter-link", default="ib-ndr", help="link between nodes when --gpus-per-node is set")
    ap.add_argument("--state-bytes", type=float, help="state bytes per rank (else B*H*K*V*itemsize)")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    ap.add_argument("--P", default="2,4,8,16,32,64,128,256,512,1024", help="comma list of rank counts")
    ap.add_argument("--exscan", default="recursive_doubling", choices=["recursive_doubling", "linear"],
                    help="how the MPI implements MPI_Exscan (MPICH: recursive doubling; Open MPI: linear)")
    ap.add_argument("--out", help="also write model.json and model.png into this folder")
    return ap


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
        Ps = [int(p) for p in args.P.split(",") if p.strip()]
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    if not Ps or min(Ps) < 1:
        raise SystemExit(f"{prog}: --P needs positive rank counts")
    itemsize = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}[args.dtype]
    nbytes = args.state_bytes if args.state_bytes else args.B * args.H * args.K * args.V * itemsize
    K, V = args.K, args.V

    print(f"cost model: state {nbytes / 2**20:.3f} MiB per rank (B={args.B} H={args.H} K={K} V={V} {args.dtype}"
          f"{'' if not args.state_bytes else ', from --state-bytes'})")
    print(f"  link {link.describe()}")
    if inter is not None:
        print(f"  {args.gpus_per_node} ranks per node; between nodes {inter.describe()}")
    print(f"  exscan modelled as {args.exscan}; times in ms\n")
    head = f"{'P':>6s} {'ring':>9s} {'k':>4s} {'tree':>9s} {'allgather':>10s} {'serial':>9s} {'exscan':>9s} " \
           f"{'ag/ring':>8s}  paper (ring / allgather)"
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
        rows.append(row)
        paper = PAPER.get(P)
        ptxt = f"  {paper['ring']:.3f} / {paper['allgather']:.3f}" if paper else ""
        ratio = row["allgather"] / row["ring"] if row["ring"] > 0 else float("nan")
        print(f"{P:6d} {row['ring'] * 1e3:9.3f} {row['k']!s:>4s} {row['tree'] * 1e3:9.3f} "
              f"{row['allgather'] * 1e3:10.3f} {row['serial'] * 1e3:9.3f} {row['exscan'] * 1e3:9.3f} "
              f"{ratio:8.2f}{ptxt}")
    print("\npaper ratios allgather/All-Scan: P=8 1.66x, P=256 3.93x")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"state_bytes": nbytes, "link": link.as_dict(), "inter": inter.as_dict() if inter else None,
                "gpus_per_node": args.gpus_per_node, "rows": rows, "paper": PAPER}
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
