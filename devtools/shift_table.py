"""The cyclic shift of :func:`collectives.calibrate.calibrate` at many sizes, and the ring's pieces timed alone.

Under ``mpiexec -n P``: for each size, the median (over repeats, then over ranks) seconds of one step of the
shift every rank runs at once (send to rank+1, receive from rank-1), and the same per byte beyond the smallest
size's step; then the ring on measure_ring's 2 MiB state at k = 4 .. 64. Prints a table on rank 0 and writes JSON
(``--out``). A diagnostic of the cost model's ``beta`` against the message size (docs/benchmarks/network.md).
"""

from __future__ import annotations

import argparse
import json

from mpi4py import MPI

from collectives import calibrate as cal
from collectives.costmodel import LinkParams, ring_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,4096,16384,32768,65536,131072,262144,1048576,4194304")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    sizes = [int(s) for s in args.sizes.split(",")]
    table = {}
    for s in sizes:
        cal._sleep_barrier(comm)
        mine = cal._median(cal._shift(comm, s, args.repeats, "float32"))
        table[s] = cal._median(comm.allgather(mine))
    link = cal.calibrate(comm, piece=False)
    ks = (4, 8, 16, 32, 48, 64)
    nbytes, times = cal.ring_times(comm, cal.RING_STATE_BYTES, ks)  # measure_ring's state (2 MiB)
    rings = dict(zip(ks, times))
    if comm.rank == 0:
        a0 = table[sizes[0]]
        print(f"P={comm.size}  shift step (median of {args.repeats}, median over ranks)")
        print(f"{'bytes':>10} {'step us':>10} {'ns/B beyond alpha':>18} {'GB/s':>8}")
        for s in sizes:
            per = (table[s] - a0) / (s - sizes[0]) if s > sizes[0] else float("nan")
            print(f"{s:>10} {table[s] * 1e6:10.2f} {per * 1e9:18.3f} {1e-9 / per if per > 0 else float('nan'):8.2f}")
        print(link.describe() if hasattr(link, "describe") else link)
        base = LinkParams(link.alpha, link.beta, link.gamma, link.delta, link.overhead, name="no piece")
        print(f"ring on {nbytes} B (measure_ring's state): k, measured ms, model ms (piece 0)")
        for k, t in rings.items():
            print(f"{k:>4} {t * 1e3:9.3f} {ring_time(comm.size, nbytes, k, base) * 1e3:9.3f}")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"P": comm.size, "shift_s": table, "link": link.__dict__ if hasattr(link, "__dict__")
                           else str(link), "ring_2MiB_s": rings}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
