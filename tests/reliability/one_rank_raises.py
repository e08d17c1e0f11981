"""Helper for tests/test_job_faults.py: a library user's script in which one rank raises while the others
wait in a collective, guarded by ``hpczeco.collectives.abort_on_error``.

Usage: mpiexec -n 3 python one_rank_raises.py KIND
  KIND value  : rank 1 raises ValueError (a one-line error: no traceback)
  KIND bug    : rank 1 raises KeyError (reported with its traceback)
Rank 1 prints ``t_fault=<unix time>`` just before it raises.
"""

from __future__ import annotations

import sys
import time

from hpczeco.collectives import abort_on_error
from mpi4py import MPI

kind = sys.argv[1]
comm = MPI.COMM_WORLD
with abort_on_error("one_rank_raises", one_line=(ValueError,)):
    comm.Barrier()
    if comm.Get_rank() == 1:
        print(f"rank 1: raises t_fault={time.time():.3f}", flush=True)
        if kind == "value":
            raise ValueError("a bad input on rank 1 only")
        raise KeyError("an internal error on rank 1 only")
    comm.Barrier()  # the others wait here for rank 1, which never comes
    print("finished (unexpected)", flush=True)
