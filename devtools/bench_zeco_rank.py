"""One rank's share of `hpczeco bench zeco`: the ZeCO layer's forward+backward on a one-rank communicator
against the bench's ideal (``chunk_gla(..., output_final_state=True)`` then ``chunk_gla_bwd``), in CPU time
of the calling thread (``time.thread_time``, so other processes on a shared machine barely matter), with
the split's phases (``ForwardSplit`` / ``BackwardSplit`` given the forward's states, as the layer runs them),
and the layer without its workspace (``zeco_fresh``: fresh split arrays every call). Minor page faults per
call are counted too (``getrusage``).

Inputs as the bench (``g = log U(0.9, 1)``, seed 0). Variants interleaved in random order per repeat, one
warm-up repeat; medians. Run: ``OMP_NUM_THREADS=1 python devtools/bench_zeco_rank.py [--repeats 9]
[--tokens 16384] [--json out.json]``. The layer at one rank does no communication (its scans are local), so
``layer / ideal`` is the compute the split adds; at P > 1 the scans' unhidden waits come on top.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from mpi4py import MPI

    from hpczeco import ZeCOGLA
    from hpczeco.gla import chunk_gla, chunk_gla_bwd
    from hpczeco.gla.split import BackwardSplit, ForwardSplit, SplitWorkspace

    rng = np.random.default_rng(args.seed)
    B, L, H, K, V = args.B, args.tokens, args.H, args.K, args.V
    f = np.float32
    q = rng.standard_normal((B, L, H, K)).astype(f)
    k = rng.standard_normal((B, L, H, K)).astype(f)
    v = rng.standard_normal((B, L, H, V)).astype(f)
    g = np.log(rng.uniform(0.9, 1.0, size=(B, L, H, K))).astype(f)
    do = rng.standard_normal((B, L, H, V)).astype(f)
    layer = ZeCOGLA(MPI.COMM_SELF, topology=args.topology)
    fresh = ZeCOGLA(MPI.COMM_SELF, topology=args.topology)
    fresh._workspace = None  # the layer before its workspace: fresh split arrays every call
    clk = time.thread_time

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def ideal() -> dict[str, float]:
        t = [clk()]
        chunk_gla(q, k, v, g, output_final_state=True)
        t.append(clk())
        chunk_gla_bwd(q, k, v, g, do)
        t.append(clk())
        return dict(zip(["fwd", "bwd"], np.diff(t)))

    def zeco(lay=layer) -> dict[str, float]:
        t = [clk()]
        lay.forward(q, k, v, g)
        t.append(clk())
        lay.backward(do)
        t.append(clk())
        return dict(zip(["fwd", "bwd"], np.diff(t)))

    ws = SplitWorkspace()

    def split() -> dict[str, float]:
        t = [clk()]
        fs = ForwardSplit(q, k, v, g, check_values=False, workspace=ws)
        t.append(clk())
        fs.intra()
        t.append(clk())
        fs.finish(None)
        t.append(clk())
        states = fs.states
        del fs
        bs = BackwardSplit(q, k, v, g, do, states=states, check_values=False, workspace=ws)
        t.append(clk())
        bs.local()
        t.append(clk())
        bs.finish(None)
        t.append(clk())
        return dict(zip(["f_ctor", "f_intra", "f_finish", "b_ctor", "b_local", "b_finish"], np.diff(t)))

    variants = {"ideal": ideal, "zeco": zeco, "zeco_fresh": lambda: zeco(fresh), "split": split}
    res: dict[str, list[dict[str, float]]] = {n: [] for n in variants}
    flt: dict[str, list[int]] = {n: [] for n in variants}
    order = np.random.default_rng(12345)
    for r in range(args.repeats + 1):
        names = list(variants)
        order.shuffle(names)
        for n in names:
            f0 = faults()
            x = variants[n]()
            if r:
                res[n].append(x)
                flt[n].append(faults() - f0)
    tot_i = np.median([sum(x.values()) for x in res["ideal"]])
    out = {}
    for n, rows in res.items():
        d = {key: 1e3 * float(np.median([x[key] for x in rows])) for key in rows[0]}
        d["total"] = 1e3 * float(np.median([sum(x.values()) for x in rows]))
        d["x_ideal"] = d["total"] / (1e3 * tot_i)
        d["minor_faults"] = float(np.median(flt[n]))
        out[n] = d
        cells = []
        for key, val in d.items():
            fmt = ".3f" if key == "x_ideal" else ".0f" if key == "minor_faults" else ".1f"
            cells.append(f"{key}={val:{fmt}}")
        print(f"{n:10s} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
