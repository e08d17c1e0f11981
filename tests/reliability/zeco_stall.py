"""Helper for tests/test_job_faults.py: one rank stalls around ``ZeCOGLA``; the others must end the job
within ``$HPCZECO_COLLECTIVE_TIMEOUT`` with a message naming it.

Usage: mpiexec -n 3 python zeco_stall.py MODE
  first-forward  : the last rank sleeps before its very first library call (the others wait in the context's
                   communicator duplication, which cannot name it yet)
  before-forward : after one good step, the last rank sleeps instead of calling forward (agreement: named)
  in-forward     : after one good step, rank 1 stalls inside its forward, after the agreement (its local pass
                   sleeps): rank 2 times out in the scan's wait naming rank 1
  before-backward: the last rank sleeps instead of calling backward (backward agreement: named)
  mismatch       : only rank 0 sets the timeout (before the first call): every rank must raise the same
                   configuration-mismatch error, and the job end normally
Every rank prints ``t_fault=<unix time>`` when the fault starts (the test measures the time to exit from it).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

mode = sys.argv[1]
comm = MPI.COMM_WORLD
rank, P = comm.Get_rank(), comm.Get_size()
if mode == "mismatch":
    os.environ.pop("HPCZECO_COLLECTIVE_TIMEOUT", None)
    if rank == 0:
        os.environ["HPCZECO_COLLECTIVE_TIMEOUT"] = "2"

from hpczeco import ZeCOGLA  # noqa: E402
from hpczeco import zeco as zeco_module  # noqa: E402

rng = np.random.default_rng(rank)
B, L, H, K, V = 1, 16, 2, 8, 8
q, k = rng.standard_normal((2, B, L, H, K)).astype(np.float32)
v, do = rng.standard_normal((2, B, L, H, V)).astype(np.float32)
g = -rng.uniform(0.0, 0.4, (B, L, H, K)).astype(np.float32)


def fault(msg: str) -> None:
    print(f"rank {rank}: {msg} t_fault={time.time():.3f}", flush=True)


if mode == "mismatch":
    try:
        ZeCOGLA(comm).forward(q, k, v, g)
        print(f"rank {rank}: no error (unexpected)", flush=True)
    except ValueError as exc:
        # one write(2) of the whole line: the ranks share mpiexec's stdout, and print's several writes interleave
        os.write(1, f"rank {rank}: raised {type(exc).__name__}: {exc}\n".encode())
    sys.exit(0)

comm.Barrier()
if mode == "first-forward" and rank == P - 1:
    fault("sleeps before its first call")
    time.sleep(120)
layer = ZeCOGLA(comm)
layer.forward(q, k, v, g)
layer.backward(do)
comm.Barrier()
print(f"rank {rank}: one good step", flush=True)
if mode == "before-forward" and rank == P - 1:
    fault("sleeps instead of calling forward")
    time.sleep(120)
if mode == "in-forward" and rank == 1:
    real = zeco_module.split_forward

    def stalled(*args, **kwargs):
        fault("stalls inside forward")
        time.sleep(120)
        return real(*args, **kwargs)

    zeco_module.split_forward = stalled
layer.forward(q, k, v, g)
if mode == "before-backward" and rank == P - 1:
    fault("sleeps instead of calling backward")
    time.sleep(120)
layer.backward(do)
print(f"rank {rank}: finished (unexpected)", flush=True)
time.sleep(120)
