"""The send/recv seam: one small interface, and its host implementation.

Algorithms in this package (ring All-Scan, tree scan, baselines, halo exchange) are written once
against :class:`Transport`. ``HostTransport`` moves numpy buffers with mpi4py's uppercase
methods. Device transports for CuPy buffers (CUDA-aware MPI, host-staged MPI, NCCL) live in
:mod:`.device`; :mod:`.selection` picks and caches the transport for a communicator's buffers
(:func:`~.selection.get_transport`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

__all__ = ["Request", "Transport", "HostTransport"]


class Request(Protocol):
    """A pending transfer. ``test()`` makes progress and says whether it is complete."""

    def test(self) -> bool: ...

    def wait(self) -> None: ...


class _MPIRequest:
    __slots__ = ("req", "done")

    def __init__(self, req: MPI.Request):
        self.req = req
        self.done = False

    def test(self) -> bool:
        if not self.done:
            self.done = bool(self.req.Test())
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.req.Wait()
            self.done = True


class _DoneRequest:
    """A request that is already complete (blocking fallbacks of nonblocking calls)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Transport(ABC):
    """Point-to-point and allgather of contiguous buffers over one communicator.

    Buffers are arrays of the transport's memory kind (``xp``): numpy for the host transport,
    CuPy for device transports. A send buffer must stay untouched until its request completes.
    """

    name: str = "abstract"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    @property
    @abstractmethod
    def xp(self) -> Any:
        """The array module of this transport's buffers (numpy or cupy)."""

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.xp.empty(shape, dtype=dtype)

    @abstractmethod
    def isend(self, buf: Any, dest: int, tag: int) -> Request: ...

    @abstractmethod
    def irecv(self, buf: Any, source: int, tag: int) -> Request: ...

    @abstractmethod
    def allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Blocking allgather: ``recvbuf[r] = sendbuf of rank r``; ``recvbuf`` is ``[P, *sendbuf.shape]``."""

    def iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Nonblocking :meth:`allgather`. This default completes it at once (blocking) and returns a
        finished request; transports with a real nonblocking allgather override it."""
        self.allgather(sendbuf, recvbuf)
        return _DoneRequest()

    def send(self, buf: Any, dest: int, tag: int) -> None:
        self.isend(buf, dest, tag).wait()

    def recv(self, buf: Any, source: int, tag: int) -> None:
        self.irecv(buf, source, tag).wait()


class HostTransport(Transport):
    """numpy buffers through mpi4py's buffer (uppercase) methods."""

    name = "host"

    @property
    def xp(self):
        return np

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        return _MPIRequest(self.comm.Isend(buf, dest=dest, tag=tag))

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        return _MPIRequest(self.comm.Irecv(buf, source=source, tag=tag))

    def allgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        self.comm.Allgather(sendbuf, recvbuf)

    def iallgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request:
        return _MPIRequest(self.comm.Iallgather(sendbuf, recvbuf))
