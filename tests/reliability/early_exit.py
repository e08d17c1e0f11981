"""Helper for tests/test_reliability_exits.py: one rank leaves the job early; the others must end promptly.

Usage: mpiexec -n 3 python early_exit.py MODE [WHERE]
  MODE exit0 | exit3 : rank 1 calls sys.exit(0) / sys.exit(3)
  MODE finalize      : rank 1 calls MPI.Finalize() and then returns
  MODE return        : rank 1 returns from main (its process ends)
  MODE raise         : rank 1 raises an uncaught exception outside any guard
  MODE stall         : rank 1 sleeps (120 s) instead
  MODE late          : (control) every rank ends normally, rank 0 two seconds after the others
  WHERE guarded (default): main runs under ``with abort_on_error(...)``; bare: without it
The other ranks then wait in a library collective (a timed barrier after one good scan); with ``raw`` as a third
argument in a plain ``comm.Barrier()`` of the script's own, with ``guard`` in such a barrier under
``hpczeco.collectives.lifeline.guard``. Rank 1 prints ``t_fault=<unix time>`` first.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from hpczeco.collectives import abort_on_error, scan, timed
from hpczeco.collectives.lifeline import guard
from mpi4py import MPI

mode = sys.argv[1]
where = sys.argv[2] if len(sys.argv) > 2 else "guarded"
wait = sys.argv[3] if len(sys.argv) > 3 else "library"
comm = MPI.COMM_WORLD
rank = comm.Get_rank()


def main() -> None:
    S = scan(np.full((2, 3), 0.5), np.ones((2, 3, 4)), comm)  # one good collective: the context exists everywhere
    assert S.shape == (2, 3, 4)
    if mode == "late":
        timed.Barrier(comm, "the last barrier")
        if rank == 0:
            time.sleep(2)
        print(f"rank {rank}: done", flush=True)
        return
    if rank == 1:
        print(f"rank 1: leaves ({mode}) t_fault={time.time():.3f}", flush=True)
        if mode == "exit0":
            sys.exit(0)
        if mode == "exit3":
            sys.exit(3)
        if mode == "finalize":
            MPI.Finalize()
            return
        if mode == "return":
            return
        if mode == "raise":
            raise RuntimeError("rank 1 fails outside any guard")
        if mode == "stall":
            time.sleep(120)
        raise ValueError(mode)
    if wait == "raw":
        comm.Barrier()
    elif wait == "guard":
        with guard(comm, "the script's guarded barrier"):
            comm.Barrier()
    else:
        timed.Barrier(comm, "the script's barrier")
    print(f"rank {rank}: finished (unexpected)", flush=True)


if where == "guarded" and mode != "raise":
    with abort_on_error("early_exit"):
        main()
else:
    main()
