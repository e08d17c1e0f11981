"""Device-buffer transports (CuPy arrays): CUDA-aware MPI, host-staged MPI, NCCL.

All three implement :class:`~hpczeco.collectives.transport.Transport`, so the scans and
baselines run unchanged on device arrays. Choose one with :func:`get_device_transport`
(``kind`` in ``"auto"``, ``"cuda-aware"``, ``"staged"``, ``"nccl"``; built on the communicator's private
duplicate and cached in its context, :attr:`.context.CommContext.transports`, per kind).

Stream semantics (all transports): a send buffer is read *after* all work already queued on the
CuPy stream current at ``isend`` time; a receive buffer is safe to use from the stream current at
``wait()``/successful ``test()`` time (the data are there, or the copy into it is ordered on that
stream). Never hand a device pointer to an MPI not known to be CUDA-aware: it segfaults.

CUDA-awareness is known when ``$HPCZECO_CUDA_AWARE=1`` (explicit opt-in, e.g. Open MPI made
CUDA-aware by a CUDA-enabled UCX while ``MPIX_Query_cuda_support()`` still says 0) or when the MPI
library exports ``MPIX_Query_cuda_support`` and it returns 1. ``$HPCZECO_CUDA_AWARE=0`` forbids it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from mpi4py import MPI

from .context import CommContext, get_context
from .lifeline import guard
from .names import DEVICE_TRANSPORT_KINDS, check_device_kind
from .settings import cuda_aware
from .transport import Request, Transport, _DoneRequest, _MPIRequest

__all__ = [
    "CUDA_AWARE_ENV",
    "CudaAwareTransport",
    "StagedTransport",
    "NcclTransport",
    "get_device_transport",
    "device_transport",
    "resolve_kind",
    "shared_gpus",
    "mpi_cuda_support",
    "cuda_aware_known",
    "nccl_available",
    "TRANSPORT_KINDS",
]

#: set to 1 to declare the MPI CUDA-aware (0 to forbid device pointers in MPI calls)
CUDA_AWARE_ENV = "HPCZECO_CUDA_AWARE"
#: the device transport kinds (:data:`.names.DEVICE_TRANSPORT_KINDS`)
TRANSPORT_KINDS = DEVICE_TRANSPORT_KINDS

_cp = None


def _cupy():
    global _cp
    if _cp is None:
        import cupy  # noqa: PLC0415

        _cp = cupy
    return _cp


def mpi_cuda_support() -> int | None:
    """``MPIX_Query_cuda_support()`` of the loaded MPI library: 1, 0, or None where it has no such call."""
    fn = getattr(MPI, "Query_cuda_support", None)  # newer mpi4py builds may expose it
    if fn is not None:
        try:
            return int(bool(fn()))
        except Exception:  # pragma: no cover - depends on the MPI
            pass
    # dlsym on the mpi4py extension searches it and its load-time dependencies (libmpi)
    try:
        lib = ctypes.CDLL(MPI.__file__)
        sym = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    sym.restype = ctypes.c_int
    sym.argtypes = []
    try:
        return int(sym())
    except Exception:  # pragma: no cover
        return None


def cuda_aware_known() -> bool:
    """True when device pointers may be handed to this MPI (env opt-in or MPIX query says 1). ``ValueError`` for a
    value of ``$HPCZECO_CUDA_AWARE`` that is not a yes/no word (:func:`.settings.cuda_aware`)."""
    declared = cuda_aware()
    if declared is not None:
        return declared
    return mpi_cuda_support() == 1


def nccl_available() -> bool:
    """True when ``cupy.cuda.nccl`` imports and reports a usable NCCL."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415

        return bool(getattr(nccl, "available", True)) and hasattr(nccl, "NcclCommunicator")
    except Exception:
        return False


def gpu_id() -> str:
    """This rank's GPU as ``"host/PCI bus id"`` (the current CuPy device)."""
    dev = _cupy().cuda.Device()
    try:
        bus = str(dev.pci_bus_id)
    except Exception:  # noqa: BLE001 - an older CuPy: the ordinal is as good within one process tree
        bus = f"device {dev.id}"
    return f"{MPI.Get_processor_name()}/{bus}"


def shared_gpus(comm: MPI.Comm) -> dict[str, list[int]]:
    """The GPUs that several ranks of ``comm`` use, with those ranks (collective; the same on every
    rank; empty when each rank has its own). NCCL refuses two ranks of one communicator on one GPU."""
    ids = comm.allgather(gpu_id())
    ranks: dict[str, list[int]] = {}
    for r, i in enumerate(ids):
        ranks.setdefault(i, []).append(r)
    return {i: rs for i, rs in ranks.items() if len(rs) > 1}


def _check_buf(name: str, buf: Any) -> None:
    cp = _cupy()
    if not isinstance(buf, cp.ndarray):
        raise TypeError(f"{name} must be a cupy array for a device transport, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {buf.shape}, strides {buf.strides})")


_Done = _DoneRequest  # a request that completed at creation (e.g. a zero-byte message)
_MPIReq = _MPIRequest


# ----------------------------------------------------------------------------------------------
# (a) CUDA-aware MPI
# ----------------------------------------------------------------------------------------------


class CudaAwareTransport(Transport):
    """CuPy arrays straight into mpi4py ``Isend``/``Irecv`` (``__cuda_array_interface__``).

    The producing stream is synchronised before each call, so MPI reads finished data and does not
    write a buffer that queued kernels still read. Only for MPIs known to be CUDA-aware.
    """

    name = "cuda-aware"

    def __init__(self, comm: MPI.Comm, *, force: bool = False):
        if not force and not cuda_aware_known():
            raise RuntimeError(
                "this MPI is not known to be CUDA-aware (MPIX_Query_cuda_support() != 1); "
                f"set {CUDA_AWARE_ENV}=1 if it is (e.g. Open MPI over a CUDA-enabled UCX)"
            )
        super().__init__(comm)

    @property
    def xp(self):
        return _cupy()

    def isend(self, buf: Any, dest: int, tag: int) -> Request:
        _check_buf("buf", buf)
        _cupy().cuda.get_current_stream().synchronize()
        return _MPIReq(self.comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag))

    def irecv(self, buf: Any, source: int, tag: int) -> Request:
        _check_buf("buf", buf)
        _cupy().cuda.get_current_stream().synchronize()
        return _MPIReq(self.comm.Irecv([buf, MPI.BYTE], source=source, tag=tag))

    def allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Ring allgather from point-to-point messages only.

        An MPI whose point-to-point layer is CUDA-aware through UCX (pml ucx) may still run its
        collectives through host code paths (an Open MPI built without CUDA segfaulted in ``Allgather``
        on device buffers: docs/benchmarks/gpu.md). So only Isend/Irecv touch device memory here; the
        local block is copied by CuPy.
        """
        _check_buf("sendbuf", sendbuf)
        _check_buf("recvbuf", recvbuf)
        cp = _cupy()
        P, r = self.size, self.rank
        blocks = recvbuf.reshape(P, -1)
        blocks[r] = sendbuf.reshape(-1)
        cp.cuda.get_current_stream().synchronize()
        tag = 0x7A11
        for step in range(P - 1):  # block of rank (r - step) goes to r + 1; (r - step - 1) arrives from r - 1
            send_idx, recv_idx = (r - step) % P, (r - step - 1) % P
            rreq = self.comm.Irecv([blocks[recv_idx], MPI.BYTE], source=(r - 1) % P, tag=tag)
            sreq = self.comm.Isend([blocks[send_idx], MPI.BYTE], dest=(r + 1) % P, tag=tag)
            MPI.Request.Waitall([rreq, sreq])


# ----------------------------------------------------------------------------------------------
# (b) host-staged MPI through pinned buffers
# ----------------------------------------------------------------------------------------------

_D2H = 2  # cudaMemcpyDeviceToHost
_H2D = 1  # cudaMemcpyHostToDevice


class _PinnedPool:
    """Pinned host buffers reused by size; a buffer returns to the pool only when its copy is done."""

    def __init__(self):
        self.free: dict[int, list[np.ndarray]] = {}
        self.inflight: list[tuple[Any, np.ndarray]] = []  # (event, host buffer) of async copies

    def take(self, nbytes: int) -> np.ndarray:
        self.reap()
        bucket = self.free.get(nbytes)
        if bucket:
            return bucket.pop()
        mem = _cupy().cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def give(self, host: np.ndarray, event: Any = None) -> None:
        if event is None:
            self.free.setdefault(host.nbytes, []).append(host)
        else:
            self.inflight.append((event, host))

    def reap(self) -> None:
        keep = []
        for ev, host in self.inflight:
            if ev.done:
                self.free.setdefault(host.nbytes, []).append(host)
            else:
                keep.append((ev, host))
        self.inflight = keep


class _StagedSend:
    __slots__ = ("req", "host", "pool")

    def __init__(self, req: MPI.Request, host: np.ndarray, pool: _PinnedPool):
        self.req, self.host, self.pool = req, host, pool

    def test(self) -> bool:
        if self.host is None:
            return True
        if self.req.Test():
            self.pool.give(self.host)
            self.host = None
            return True
        return False

    def wait(self) -> None:
        if self.host is not None:
            self.req.Wait()
            self.pool.give(self.host)
            self.host = None


class _StagedRecv:
    """Completes with a host->device copy on the stream current at ``test()``/``wait()`` time."""

    __slots__ = ("req", "host", "buf", "pool", "done")

    def __init__(self, req: MPI.Request, host: np.ndarray, buf: Any, pool: _PinnedPool):
        self.req, self.host, self.buf, self.pool, self.done = req, host, buf, pool, False

    def _post_copy(self) -> None:
        cp = _cupy()
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(self.buf.data.ptr, self.host.ctypes.data, self.host.nbytes, _H2D, stream.ptr)
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        self.pool.give(self.host, ev)
        self.host = None
        self.done = True

    def test(self) -> bool:
        if not self.done and self.req.Test():
            self._post_copy()
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.req.Wait()
            self._post_copy()


class StagedTransport(Transport):
    """Device buffers through pinned host memory and ordinary (host) MPI.

    ``isend``: the device->host copy runs on a side stream after the producing stream's queued
    work, then ``Isend`` on the pinned buffer (so the copy of the next block overlaps the send of
    this one). ``irecv``: ``Irecv`` into a pinned buffer; the request's ``test()``/``wait()``
    enqueues the host->device copy once the message is in. Works with any MPI.
    """

    name = "staged"

    def __init__(self, comm: MPI.Comm):
        super().__init__(comm)
        cp = _cupy()
        self._side = cp.cuda.Stream(non_blocking=True)
        self._pool = _PinnedPool()

    @property
    def xp(self):
        return _cupy()

    def _to_host(self, buf: Any) -> np.ndarray:
        cp = _cupy()
        host = self._pool.take(buf.nbytes)
        if buf.nbytes:
            ready = cp.cuda.Event(block=False, disable_timing=True)
            ready.record(cp.cuda.get_current_stream())
            self._side.wait_event(ready)
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, buf.data.ptr, buf.nbytes, _D2H, self._side.ptr)
            copied = cp.cuda.Event(block=False, disable_timing=True)
            copied.record(self._side)
            copied.synchronize()
        return host

    def isend(self, buf: Any, dest: int, tag: int) -> Request:
        _check_buf("buf", buf)
        host = self._to_host(buf)
        return _StagedSend(self.comm.Isend([host, MPI.BYTE], dest=dest, tag=tag), host, self._pool)

    def irecv(self, buf: Any, source: int, tag: int) -> Request:
        _check_buf("buf", buf)
        host = self._pool.take(buf.nbytes)
        return _StagedRecv(self.comm.Irecv([host, MPI.BYTE], source=source, tag=tag), host, buf, self._pool)

    def allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        _check_buf("sendbuf", sendbuf)
        _check_buf("recvbuf", recvbuf)
        cp = _cupy()
        hsend = self._to_host(sendbuf)
        hrecv = self._pool.take(recvbuf.nbytes)
        self.comm.Allgather([hsend, MPI.BYTE], [hrecv, MPI.BYTE])
        self._pool.give(hsend)
        stream = cp.cuda.get_current_stream()
        if recvbuf.nbytes:
            cp.cuda.runtime.memcpyAsync(recvbuf.data.ptr, hrecv.ctypes.data, hrecv.nbytes, _H2D, stream.ptr)
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        self._pool.give(hrecv, ev)


# ----------------------------------------------------------------------------------------------
# (c) NCCL
# ----------------------------------------------------------------------------------------------


class _NcclReq:
    """Completed by a CUDA event recorded on the NCCL stream after the group holding the operation."""

    __slots__ = ("owner", "event", "done")

    def __init__(self, owner: NcclTransport):
        self.owner, self.event, self.done = owner, None, False

    def test(self) -> bool:
        if self.done:
            return True
        if self.event is None:
            self.owner.flush()
        self.done = bool(self.event.done)
        return self.done

    def wait(self) -> None:
        if self.done:
            return
        if self.event is None:
            self.owner.flush()
        self.event.synchronize()
        self.done = True


class NcclTransport(Transport):
    """Point-to-point and allgather through ``cupy.cuda.nccl`` on a dedicated stream.

    ``isend``/``irecv`` are queued and issued together inside one ``groupStart``/``groupEnd`` at the
    next ``test()``/``wait()`` (or :meth:`flush`), so sends and receives posted before a wait
    progress concurrently (an exchange never deadlocks on NCCL's blocking send). The NCCL stream
    first waits for the stream current at flush time, so queued producers finish before a send
    reads its buffer. The unique id is made on rank 0 and broadcast over ``comm`` (collective).
    """

    name = "nccl"

    def __init__(self, comm: MPI.Comm):
        super().__init__(comm)
        shared = shared_gpus(comm) if self.size > 1 else {}
        if shared:  # the same list on every rank: the same error everywhere, before NCCL is asked
            gpu, ranks = next(iter(shared.items()))
            raise ValueError(f"transport 'nccl' needs one GPU per rank: ranks {ranks} share the GPU {gpu} "
                             "(give each rank its own device, or use 'staged' or 'cuda-aware')")
        cp = _cupy()
        from cupy.cuda import nccl  # noqa: PLC0415

        self._nccl = nccl
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._u8 = int(getattr(nccl, "NCCL_UINT8", 1))
        self._pending: list[tuple[str, Any, int, _NcclReq]] = []

    @property
    def xp(self):
        return _cupy()

    @property
    def stream(self):
        """The stream NCCL operations run on."""
        return self._stream

    def isend(self, buf: Any, dest: int, tag: int) -> Request:
        _check_buf("buf", buf)
        if not 0 <= dest < self.size:
            raise ValueError(f"dest {dest} out of range for {self.size} ranks")
        req = _NcclReq(self)
        self._pending.append(("send", buf, dest, req))
        return req

    def irecv(self, buf: Any, source: int, tag: int) -> Request:
        _check_buf("buf", buf)
        if not 0 <= source < self.size:
            raise ValueError(f"source {source} out of range for {self.size} ranks")
        req = _NcclReq(self)
        self._pending.append(("recv", buf, source, req))
        return req

    def _order_after_current(self) -> None:
        cp = _cupy()
        ready = cp.cuda.Event(block=False, disable_timing=True)
        ready.record(cp.cuda.get_current_stream())
        self._stream.wait_event(ready)

    def flush(self) -> None:
        """Issue every queued send/recv in one NCCL group on the NCCL stream."""
        if not self._pending:
            return
        cp = _cupy()
        ops, self._pending = self._pending, []
        self._order_after_current()
        s = self._stream.ptr
        self._nccl.groupStart()
        try:
            for kind, buf, peer, _ in ops:
                if buf.nbytes == 0:
                    continue
                if kind == "send":
                    self.nccl_comm.send(buf.data.ptr, buf.nbytes, self._u8, peer, s)
                else:
                    self.nccl_comm.recv(buf.data.ptr, buf.nbytes, self._u8, peer, s)
        finally:
            self._nccl.groupEnd()
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self._stream)
        for *_, req in ops:
            req.event = ev

    def allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        _check_buf("sendbuf", sendbuf)
        _check_buf("recvbuf", recvbuf)
        if recvbuf.nbytes != sendbuf.nbytes * self.size:
            raise ValueError(f"recvbuf has {recvbuf.nbytes} bytes, expected {self.size} x {sendbuf.nbytes}")
        self.flush()
        self._order_after_current()
        self.nccl_comm.allGather(sendbuf.data.ptr, recvbuf.data.ptr, sendbuf.nbytes, self._u8, self._stream.ptr)
        self._stream.synchronize()


# ----------------------------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------------------------


def _cache_for(comm: MPI.Comm) -> dict:
    """The transports cached for ``comm``: its library context's :attr:`~.context.CommContext.transports`
    (an MPI attribute of ``comm``), so they go when ``comm`` is freed -- a handle-keyed cache handed a
    freed communicator's transport to the next ``Dup`` that reused its handle ("invalid communicator")."""
    return get_context(comm).transports


def resolve_kind(comm: MPI.Comm, kind: str) -> str:
    """The concrete kind "auto" stands for on ``comm`` (the same on every rank)."""
    check_device_kind(kind)
    if kind != "auto":
        return kind
    aware = cuda_aware_known()
    has_nccl = nccl_available()
    if comm.Get_size() > 1:  # agree, so every rank picks the same transport
        aware = all(comm.allgather(aware))
        has_nccl = all(comm.allgather(has_nccl)) and not shared_gpus(comm)
    if aware:
        return "cuda-aware"
    if has_nccl:
        return "nccl"
    return "staged"


def device_transport(ctx: CommContext, kind: str = "auto") -> Transport:
    """The device transport ``kind`` on ``ctx.pcomm``, from (or into) ``ctx.transports``.

    ``"auto"``: CUDA-aware MPI if known CUDA-aware, else NCCL if available and every rank has its own
    GPU, else host-staged. Collective over the communicator the first time for "auto" and "nccl"
    (agreement / unique-id bcast).
    """
    check_device_kind(kind)
    cache = ctx.transports
    if kind in cache:
        return cache[kind]
    # the set-up's blocking collectives (the agreement, NCCL's unique id and communicator) bounded by the timeout
    with guard(ctx, f"device transport {kind!r} (set-up)"):
        concrete = resolve_kind(ctx.pcomm, kind)
        if concrete in cache:
            t = cache[concrete]
        elif concrete == "cuda-aware":
            t = CudaAwareTransport(ctx.pcomm)
        elif concrete == "nccl":
            t = NcclTransport(ctx.pcomm)
        else:
            t = StagedTransport(ctx.pcomm)
    cache[concrete] = t
    cache[kind] = t
    return t


def get_device_transport(comm: MPI.Comm, kind: str = "auto") -> Transport:
    """The device transport ``kind`` for ``comm``: it carries its messages on ``comm``'s private duplicate
    and is cached in ``comm``'s library context per kind (the same object the scans on ``comm`` use).

    ``"auto"``: CUDA-aware MPI if known CUDA-aware, else NCCL if available and every rank has its own
    GPU, else host-staged. Collective over ``comm`` the first time (the context's ``Dup``; agreement / unique-id bcast).
    """
    check_device_kind(kind)
    return device_transport(get_context(comm), kind)
