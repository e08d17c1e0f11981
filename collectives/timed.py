"""Collectives of whole buffers and small Python objects whose waits honour the collective timeout.

Drivers and layers call these instead of ``comm.allgather``/``bcast``/``Allgather``/``Allreduce``/``Bcast``
so that a rank that stops (stalled, stopped by a signal, stuck elsewhere) ends the job within the
timeout, with a message that names it, instead of leaving the others blocked forever.

All traffic goes over the private duplicate of ``comm`` (:mod:`.context`, created on first use). The
timeout is the context's (``$HPCZECO_COLLECTIVE_TIMEOUT``, agreed over the ranks when the context is
made):

* unset: the plain blocking MPI call (on the private duplicate), nothing added;
* set: every rank first posts an empty *arrival* message to every other rank (tag
  :data:`~.context.ARRIVAL_TAG`: ``P - 1`` each way), then the non-blocking form of the collective
  (``MPI_Iallgather`` ...), and polls both (:func:`.watchdog.poll_until`). Past the timeout it names
  the ranks whose arrival never came -- ``rank(s) [2], which did not reach OP`` -- or, when every
  rank arrived, says that one stopped making progress inside the collective; then ``MPI_Abort``.

Object collectives pickle (between the job's own ranks only); with a timeout they run as two
non-blocking steps (the sizes, then the bytes). Knows nothing about attention.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .context import ARRIVAL_TAG, get_context
from .watchdog import abort_stalled, poll_until

__all__ = ["allgather", "bcast", "Allgather", "Allreduce", "Bcast"]


class _Arrivals:
    """Empty messages to and from every other rank, posted when a rank reaches a timed collective."""

    def __init__(self, pcomm: MPI.Comm):
        P, rank = pcomm.Get_size(), pcomm.Get_rank()
        self.others = [r for r in range(P) if r != rank]
        self._empty = np.empty(0, np.uint8)
        self.recvs = [pcomm.Irecv(np.empty(0, np.uint8), source=r, tag=ARRIVAL_TAG) for r in self.others]
        self.sends = [pcomm.Isend(self._empty, dest=r, tag=ARRIVAL_TAG) for r in self.others]
        self.arrived = [False] * len(self.others)
        self.sent = [False] * len(self.others)

    def test(self) -> bool:
        for i, req in enumerate(self.recvs):
            if not self.arrived[i]:
                self.arrived[i] = bool(req.Test())
        for i, req in enumerate(self.sends):
            if not self.sent[i]:
                self.sent[i] = bool(req.Test())
        return all(self.arrived) and all(self.sent)

    def missing(self) -> list[int]:
        return [r for r, ok in zip(self.others, self.arrived) if not ok]


def _wait(pcomm: MPI.Comm, op: str, timeout: float, arrivals: _Arrivals, req: MPI.Request) -> None:
    """Poll ``req`` and the arrivals until both are done, or abort the job past ``timeout``."""

    def done() -> bool:
        finished = bool(req.Test())
        return arrivals.test() and finished

    if not poll_until(done, time.monotonic() + timeout):
        missing = arrivals.missing()
        if missing:
            who = f"rank(s) {missing}, which did not reach {op}"
        else:
            who = f"a rank that stopped making progress inside {op} (every rank reached it)"
        abort_stalled(pcomm, op, who, timeout)


def _setup(comm: MPI.Comm) -> tuple[MPI.Comm, float | None]:
    ctx = get_context(comm)
    return ctx.pcomm, ctx.timeout


def allgather(comm: MPI.Comm, obj: Any, op: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order (collective over ``comm``; ``op`` names it in messages)."""
    pcomm, timeout = _setup(comm)
    if timeout is None:
        return pcomm.allgather(obj)
    P = pcomm.Get_size()
    arrivals = _Arrivals(pcomm)
    data = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), np.uint8)
    sizes = np.empty(P, np.int64)
    _wait(pcomm, op, timeout, arrivals, pcomm.Iallgather(np.array([data.size], np.int64), sizes))
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    everyone = np.empty(int(sizes.sum()), np.uint8)
    _wait(pcomm, op, timeout, arrivals, pcomm.Iallgatherv(data, [everyone, sizes, displs, MPI.BYTE]))
    return [pickle.loads(everyone[d:d + n].tobytes()) for d, n in zip(displs, sizes)]  # noqa: S301 - own ranks


def bcast(comm: MPI.Comm, obj: Any, root: int, op: str) -> Any:
    """``obj`` of rank ``root`` on every rank (picklable; collective over ``comm``)."""
    pcomm, timeout = _setup(comm)
    if timeout is None:
        return pcomm.bcast(obj, root=root)
    arrivals = _Arrivals(pcomm)
    mine = pcomm.Get_rank() == root
    data = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), np.uint8) if mine else None
    size = np.array([data.size if mine else 0], np.int64)
    _wait(pcomm, op, timeout, arrivals, pcomm.Ibcast(size, root=root))
    if not mine:
        data = np.empty(int(size[0]), np.uint8)
    _wait(pcomm, op, timeout, arrivals, pcomm.Ibcast(data, root=root))
    return obj if mine else pickle.loads(data.tobytes())  # noqa: S301 - from our own root rank


def Allgather(comm: MPI.Comm, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:  # noqa: N802 - MPI name
    """``recvbuf[r] = sendbuf`` of rank ``r`` (``recvbuf`` ``[P, *sendbuf.shape]``; collective over ``comm``)."""
    pcomm, timeout = _setup(comm)
    if timeout is None:
        pcomm.Allgather(sendbuf, recvbuf)
        return
    arrivals = _Arrivals(pcomm)
    _wait(pcomm, op, timeout, arrivals, pcomm.Iallgather(sendbuf, recvbuf))


def Allreduce(comm: MPI.Comm, buf: np.ndarray, mpi_op: MPI.Op, op: str) -> None:  # noqa: N802 - MPI name
    """``buf <- mpi_op`` of every rank's ``buf``, in place (collective over ``comm``)."""
    pcomm, timeout = _setup(comm)
    if timeout is None:
        pcomm.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
        return
    arrivals = _Arrivals(pcomm)
    _wait(pcomm, op, timeout, arrivals, pcomm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op))


def Bcast(comm: MPI.Comm, buf: np.ndarray, root: int, op: str) -> None:  # noqa: N802 - MPI name
    """``buf`` of rank ``root`` into ``buf`` on every rank (collective over ``comm``)."""
    pcomm, timeout = _setup(comm)
    if timeout is None:
        pcomm.Bcast(buf, root=root)
        return
    arrivals = _Arrivals(pcomm)
    _wait(pcomm, op, timeout, arrivals, pcomm.Ibcast(buf, root=root))
