"""Helper for tests/test_reliability.py: one rank stalls, the others must abort with a clear message.

Usage: mpiexec -n 3 python stall.py MODE TIMEOUT
  MODE absent : the last rank never calls the scan (sleeps); the others time out at the arrival check.
  MODE poll   : rank 1 starts the ring scan but never polls/waits (sleeps); rank 2 times out in wait().
  MODE relay  : rank 1 never sends; rank 2 times out in relay_recv.
  MODE tree   : tree scan of a 4 MiB state (rendezvous-size messages); rank 1 never polls/waits;
                rank 2 times out in wait() naming its round-0 partner, rank 1.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from hpczeco.collectives.ring import relay_recv, relay_send
from hpczeco.collectives.scan import scan, scan_start
from mpi4py import MPI

mode, timeout = sys.argv[1], float(sys.argv[2])
comm = MPI.COMM_WORLD
rank, P = comm.Get_rank(), comm.Get_size()
a = np.full((2, 4), 0.5)
S = np.ones((2, 4, 3))
# warm-up without a timeout (creates the context, a collective Dup; compiles the kernels: slow under load)
scan(a, S, comm, topology="ring", blocks=2)
comm.Barrier()
print(f"rank {rank}: ready", flush=True)
if mode == "absent":
    if rank == P - 1:
        time.sleep(120)
    else:
        scan(a, S, comm, topology="ring", blocks=2, timeout=timeout)
elif mode == "poll":
    h = scan_start(a, S, comm, topology="ring", blocks=2, timeout=timeout)
    if rank == 1:
        time.sleep(120)
    h.wait()
elif mode == "tree":
    big_a, big_S = np.full((64, 64), 0.5), np.ones((64, 64, 128))
    h = scan_start(big_a, big_S, comm, topology="tree", timeout=timeout)
    if rank == 1:
        time.sleep(120)
    h.wait()
elif mode == "relay":
    buf = np.zeros(6)
    if rank != 1:
        relay_recv(buf, comm, timeout=timeout)
        relay_send(buf, comm)
    else:
        time.sleep(120)
print(f"rank {rank}: finished (unexpected)", flush=True)
time.sleep(120)
