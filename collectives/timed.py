"""Collectives of whole buffers and small Python objects whose waits honour the collective timeout.

Drivers and layers call these instead of ``comm.allgather``/``bcast``/``gather``/``Barrier``/``Allgather``/
``Allgatherv``/``Allreduce``/``Reduce_scatter``/``Bcast`` so that a rank that stops (stalled, stopped by a signal,
stuck elsewhere, gone) ends the job within the timeout, with a message that names it, instead of leaving the others
blocked forever.

All traffic goes over the private duplicate of ``comm`` (:mod:`.context`, created on first use). The
timeout is the context's (``$HPCZECO_COLLECTIVE_TIMEOUT``, by default 600 s, agreed over the ranks when the
context is made):

* off (``0``): the plain blocking MPI call (on the private duplicate), nothing added;
* on: every rank first posts an empty *arrival* message to every other rank (tag
  :data:`~.context.ARRIVAL_TAG`: ``P - 1`` each way), then the non-blocking form of the collective
  (``MPI_Iallgather`` ...), and polls both (:func:`.watchdog.poll_until`). Past the timeout it names
  the ranks whose arrival never came -- ``rank(s) [2], which did not reach OP`` -- or, when every
  rank arrived, says that one stopped making progress inside the collective; then ``MPI_Abort``. A member that
  left the job before the operation (:mod:`.lifeline`) ends the wait at once.

Every operation is counted (:meth:`.context.CommContext.begin`). Object collectives pickle (between the job's own
ranks only); with a timeout they run as two non-blocking steps (the sizes, then the bytes). ``comm`` may also be
a :class:`~.context.CommContext`. Knows nothing about attention.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .context import ARRIVAL_TAG, CommContext, get_context
from .watchdog import abort_stalled, poll_until

__all__ = ["allgather", "bcast", "gather", "Barrier", "Allgather", "Allgatherv", "Allreduce", "Reduce_scatter", "Bcast",
           "wait_requests"]


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


class _Op:
    """One timed collective in progress: its context, index (:meth:`.context.CommContext.begin`), arrivals."""

    def __init__(self, comm: MPI.Comm | CommContext, op: str):
        self.ctx = comm if isinstance(comm, CommContext) else get_context(comm)
        self.pcomm, self.timeout, self.op = self.ctx.pcomm, self.ctx.timeout, op
        self.index = self.ctx.begin()
        self.arrivals = _Arrivals(self.pcomm) if self.timeout is not None else None

    def wait(self, req: MPI.Request) -> None:
        """Poll ``req`` and the arrivals until both are done, or abort the job past the timeout."""
        arrivals = self.arrivals
        assert arrivals is not None and self.timeout is not None

        def done() -> bool:
            finished = bool(req.Test())
            return arrivals.test() and finished

        if not poll_until(done, time.monotonic() + self.timeout, self.ctx.watch(self.index, self.op)):
            missing = arrivals.missing()
            if missing:
                who = f"rank(s) {missing}, which did not reach {self.op}"
            else:
                who = f"a rank that stopped making progress inside {self.op} (every rank reached it)"
            abort_stalled(self.pcomm, self.op, who, self.timeout)


def _pickled(obj: Any) -> np.ndarray:
    return np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), np.uint8)


def allgather(comm: MPI.Comm | CommContext, obj: Any, op: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order (collective over ``comm``; ``op`` names it in messages)."""
    t = _Op(comm, op)
    if t.timeout is None:
        return t.pcomm.allgather(obj)
    P = t.pcomm.Get_size()
    data = _pickled(obj)
    sizes = np.empty(P, np.int64)
    t.wait(t.pcomm.Iallgather(np.array([data.size], np.int64), sizes))
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    everyone = np.empty(int(sizes.sum()), np.uint8)
    t.wait(t.pcomm.Iallgatherv(data, [everyone, sizes, displs, MPI.BYTE]))
    return [pickle.loads(everyone[d:d + n].tobytes()) for d, n in zip(displs, sizes)]  # noqa: S301 - own ranks


def gather(comm: MPI.Comm | CommContext, obj: Any, root: int, op: str) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank ``root``, None elsewhere (collective over ``comm``). With the
    timeout it is an :func:`allgather` (small objects: every rank learns who arrived)."""
    everyone = allgather(comm, obj, op)
    rank = comm.rank if isinstance(comm, CommContext) else comm.Get_rank()
    return everyone if rank == root else None


def Barrier(comm: MPI.Comm | CommContext, op: str) -> None:  # noqa: N802 - MPI name
    """Every rank of ``comm`` reached this point (collective): the arrivals alone, with a timeout."""
    t = _Op(comm, op)
    if t.timeout is None:
        t.pcomm.Barrier()
        return
    t.wait(t.pcomm.Ibarrier())


def bcast(comm: MPI.Comm | CommContext, obj: Any, root: int, op: str) -> Any:
    """``obj`` of rank ``root`` on every rank (picklable; collective over ``comm``)."""
    t = _Op(comm, op)
    if t.timeout is None:
        return t.pcomm.bcast(obj, root=root)
    mine = t.pcomm.Get_rank() == root
    data = _pickled(obj) if mine else None
    size = np.array([data.size if mine else 0], np.int64)
    t.wait(t.pcomm.Ibcast(size, root=root))
    if not mine:
        data = np.empty(int(size[0]), np.uint8)
    t.wait(t.pcomm.Ibcast(data, root=root))
    return obj if mine else pickle.loads(data.tobytes())  # noqa: S301 - from our own root rank


def Allgather(comm: MPI.Comm | CommContext, sendbuf: np.ndarray, recvbuf: np.ndarray,  # noqa: N802 - MPI name
              op: str) -> None:
    """``recvbuf[r] = sendbuf`` of rank ``r`` (``recvbuf`` ``[P, *sendbuf.shape]``; collective over ``comm``)."""
    t = _Op(comm, op)
    if t.timeout is None:
        t.pcomm.Allgather(sendbuf, recvbuf)
        return
    t.wait(t.pcomm.Iallgather(sendbuf, recvbuf))


def Allgatherv(comm: MPI.Comm | CommContext, sendbuf: np.ndarray, recvbuf: np.ndarray,  # noqa: N802 - MPI name
               counts: list[int], displs: list[int], op: str) -> None:
    """``recvbuf[displs[r]:displs[r] + counts[r]] = sendbuf`` of rank ``r`` (elements of ``recvbuf``'s dtype,
    flat; collective over ``comm``)."""
    t = _Op(comm, op)
    spec = [recvbuf, (list(counts), list(displs))]
    if t.timeout is None:
        t.pcomm.Allgatherv(sendbuf, spec)
        return
    t.wait(t.pcomm.Iallgatherv(sendbuf, spec))


def Allreduce(comm: MPI.Comm | CommContext, buf: np.ndarray, mpi_op: MPI.Op, op: str) -> None:  # noqa: N802
    """``buf <- mpi_op`` of every rank's ``buf``, in place (collective over ``comm``)."""
    t = _Op(comm, op)
    if t.timeout is None:
        t.pcomm.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
        return
    t.wait(t.pcomm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op))


def Reduce_scatter(comm: MPI.Comm | CommContext, sendbuf: np.ndarray, recvbuf: np.ndarray,  # noqa: N802
                   recvcounts: list[int], mpi_op: MPI.Op, op: str) -> None:
    """``MPI_Reduce_scatter``: the ``mpi_op`` of every rank's ``sendbuf``, block ``r`` (``recvcounts[r]`` elements)
    into ``recvbuf`` of rank ``r`` (collective over ``comm``)."""
    t = _Op(comm, op)
    if t.timeout is None:
        t.pcomm.Reduce_scatter(sendbuf, recvbuf, recvcounts=list(recvcounts), op=mpi_op)
        return
    t.wait(t.pcomm.Ireduce_scatter(sendbuf, recvbuf, recvcounts=list(recvcounts), op=mpi_op))


def Bcast(comm: MPI.Comm | CommContext, buf: np.ndarray, root: int, op: str) -> None:  # noqa: N802 - MPI name
    """``buf`` of rank ``root`` into ``buf`` on every rank (collective over ``comm``)."""
    t = _Op(comm, op)
    if t.timeout is None:
        t.pcomm.Bcast(buf, root=root)
        return
    t.wait(t.pcomm.Ibcast(buf, root=root))


def wait_requests(comm: MPI.Comm | CommContext, requests: list[Any], op: str, peers: list[int]) -> None:
    """Complete ``requests`` (objects with ``test()``/``wait()``: :class:`~.transport.Request`) of a point-to-point
    exchange with the ranks ``peers`` of ``comm``: polled until the collective timeout, past which the job is
    aborted naming ``op`` and the peers (blocking ``wait()`` with the timeout off). Counts as one operation (every
    rank of ``comm`` calls it, each with its own requests)."""
    ctx = comm if isinstance(comm, CommContext) else get_context(comm)
    index = ctx.begin()
    if ctx.timeout is None:
        for r in requests:
            r.wait()
        return
    if not poll_until(lambda: all([r.test() for r in requests]), time.monotonic() + ctx.timeout,
                      ctx.watch(index, op)):
        abort_stalled(ctx.pcomm, op, f"rank(s) {sorted(set(peers))} (the peers of this exchange)", ctx.timeout)
