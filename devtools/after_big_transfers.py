"""Small ring scans right after large transfers: does a big ring or cyclic shift leave the next small scans slow?

Run under MPI, e.g. inside ``tests/netns/netns.sh -n 4 -- sh -c '$NETNS_MPIEXEC -n 4 $PYTHON
devtools/after_big_transfers.py'``. Rank 0 prints, per case, the median and the first twelve times (ms, slowest
rank) of 30 barrier-started 4 KiB ring scans.
"""

from __future__ import annotations

import time

import numpy as np
from hpczeco.collectives import scan_start
from mpi4py import MPI

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def _state(nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = nbytes // 512  # [1, rows, 128] float32
    S = np.ones((1, rows, 128), np.float32)
    return np.full((1, rows), 0.5, np.float32), S, np.empty_like(S)


def small_scans(n: int = 30, nbytes: int = 4096) -> list[float]:
    a, S, out = _state(nbytes)
    times = []
    for _ in range(n):
        COMM.Barrier()
        t = time.perf_counter()
        scan_start(a, S, COMM, topology="ring", out=out).wait()
        times.append(COMM.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return times


def big_ring(nbytes: int, k: int = 16, reps: int = 3) -> None:
    a, S, out = _state(nbytes)
    for _ in range(reps):
        COMM.Barrier()
        scan_start(a, S, COMM, topology="ring", blocks=k, out=out).wait()


def big_shift(nbytes: int, reps: int = 3) -> None:
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    for _ in range(reps):
        COMM.Sendrecv(x, dest=(RANK + 1) % P, recvbuf=y, source=(RANK - 1) % P)


def show(tag: str, times: list[float]) -> None:
    if RANK == 0:
        first = [round(t * 1e3, 1) for t in times[:12]]
        print(f"{tag:28s} median {np.median(times) * 1e3:6.2f} ms  first {first}", flush=True)


def main() -> None:
    show("baseline", small_scans())
    for nbytes in (4 << 20, 16 << 20):
        big_ring(nbytes)
        show(f"after ring {nbytes >> 20} MiB", small_scans())
        big_shift(nbytes)
        show(f"after shift {nbytes >> 20} MiB", small_scans())
    big_ring(16 << 20)
    COMM.Barrier()
    time.sleep(0.5)
    show("after ring 16 MiB + 0.5 s", small_scans())


if __name__ == "__main__":
    main()
