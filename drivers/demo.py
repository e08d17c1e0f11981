"""`hpczeco demo`: a short multi-rank demonstration of what exists (grown by later work)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None, prog: str = "hpczeco demo") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank())
    if comm.Get_rank() == 0:
        lib = MPI.Get_library_version().splitlines()[0]
        print(f"hpczeco demo: {comm.Get_size()} ranks, {lib}, sum of ranks {total}")
    return 0
