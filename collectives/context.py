"""Per-communicator state of the collectives, cached on the communicator as an MPI attribute.

The first collective call on a user communicator ``comm`` (collective: every rank calls it)
creates a :class:`CommContext` holding

* ``pcomm``: a private duplicate of ``comm`` (``MPI_Comm_idup``), so that the library's messages never
  match the caller's own point-to-point traffic (the MPI library convention). Its tags: :data:`RELAY_TAGS`,
  :data:`AGREE_TAG`, :data:`ARRIVAL_TAG`, :data:`DISPATCH_TAGS` below :data:`SCAN_TAG_BASE`, then one tag
  per collective;
* ``timeout``: ``$HPCZECO_COLLECTIVE_TIMEOUT`` (seconds, or None), read on every rank and agreed: a value
  set on some ranks only, or set differently, or not a number on some rank, raises the same
  :class:`~.agree.CollectiveInputError` ("configuration mismatch") on every rank. The duplication and
  this agreement are non-blocking requests polled until that timeout, so even the first call on a
  communicator cannot hang past it (it cannot name the absent rank: nothing was exchanged yet);
* ``device_kind``: the device transport ``$HPCZECO_TRANSPORT`` names ("auto" when unset), read here -- the one
  read of the variable -- and agreed in the same exchange; everything else receives this value. A value that is
  not a device transport kind, or differs between the ranks, is reported (the same
  :class:`~.agree.CollectiveInputError` on every rank) when a device transport is chosen by it, so host-only
  work is not stopped by a variable it does not use;
* an operation counter: every rank calls collectives on ``comm`` in the same order, so the n-th
  operation gets the same tag on every rank without any communication. Two operations in flight
  at once (forward and backward scans, two layers) therefore use distinct tags;
* a lazily built rank-reversed communicator (for ``MPI_Exscan`` in reverse order), the pool of
  scratch buffers and ``transports``: the one cache of the transports that carry the library's
  traffic on ``pcomm`` (filled by :mod:`.selection` and :mod:`.device`; device transports can be
  expensive to build: NCCL communicators).

The context lives as long as ``comm``: freeing ``comm`` frees the private communicators and drops
the cached transports. Knows nothing about attention, nor about what a transport is.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .errors import CollectiveInputError
from .names import DEVICE_TRANSPORT_KINDS, TRANSPORT_ENV
from .watchdog import TIMEOUT_ENV, abort_stalled, poll_until, resolve_timeout

__all__ = [
    "BufferPool",
    "CommContext",
    "get_context",
    "RELAY_TAGS",
    "AGREE_TAG",
    "ARRIVAL_TAG",
    "DISPATCH_TAGS",
    "SCAN_TAG_BASE",
    "POOL_ENV",
]

#: environment variable: most MiB of scratch buffers kept for reuse per communicator (default 512)
POOL_ENV = "HPCZECO_POOL_MB"

#: tags of the whole-state relay (LASP-1) in scan order and in reverse order
RELAY_TAGS = (1, 2)
#: tag of the timeout-mode arrival/agreement messages (:func:`.agree.agree_fast`)
AGREE_TAG = 7
#: tag of the arrival tokens of the timed collectives (:mod:`.timed`)
ARRIVAL_TAG = 8
#: tags of the task dispatcher (:mod:`.dispatch`): worker ready, work, stop
DISPATCH_TAGS = (11, 12, 13)
#: collective operations use tags SCAN_TAG_BASE + (sequence number mod slots)
SCAN_TAG_BASE = 16

_KEYVAL: int | None = None


class BufferPool:
    """Scratch buffers kept for reuse, keyed by array module, shape and dtype.

    Fresh large allocations cost a page fault per page on first touch, which on virtual machines is
    of the order of the transfer itself; the scans therefore take their scratch
    buffers from here and give them back when their requests are complete. At most ``max_bytes``
    are kept; beyond that, released buffers are dropped. Thread-safe.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.held = 0
        self._free: dict[tuple, list] = {}
        self._lock = threading.Lock()

    def acquire(self, xp: Any, shape: tuple[int, ...], dtype: Any, tr: Any = None) -> Any:
        key = (xp.__name__, tuple(shape), np.dtype(dtype).str)
        with self._lock:
            lst = self._free.get(key)
            if lst:
                buf = lst.pop()
                self.held -= buf.nbytes
                return buf
        return tr.empty(tuple(shape), dtype) if tr is not None else xp.empty(shape, dtype=dtype)

    def release(self, xp: Any, buf: Any) -> None:
        with self._lock:
            if self.held + buf.nbytes > self.max_bytes:
                return
            key = (xp.__name__, tuple(buf.shape), buf.dtype.str)
            self._free.setdefault(key, []).append(buf)
            self.held += buf.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.held = 0


class CommContext:
    """The library's private state for one user communicator (see the module docstring)."""

    def __init__(self, comm: MPI.Comm):
        try:
            local, bad = resolve_timeout(None), None
        except (TypeError, ValueError) as exc:
            local, bad = None, str(exc)
        self.pcomm: MPI.Comm = _wait(comm, "first hpczeco call on this communicator (MPI_Comm_idup)", local,
                                     *comm.Idup())
        self.rank = self.pcomm.Get_rank()
        self.size = self.pcomm.Get_size()
        try:
            #: seconds a collective wait of the library may take (None: forever); the same on every rank
            self.timeout: float | None
            self.timeout, kind, kind_error = _agree_config(self.pcomm, local, bad, _transport_code())
        except Exception:
            self.pcomm.Free()
            raise
        self._device_kind, self._device_kind_error = kind, kind_error
        tag_ub = self.pcomm.Get_attr(MPI.TAG_UB) or 32767
        self.tag_slots = max(1, min(1 << 20, int(tag_ub) - SCAN_TAG_BASE))
        self.seq = 0
        self._reversed: MPI.Comm | None = None
        #: transports on ``pcomm`` by name ("host", and device kinds requested or resolved)
        self.transports: dict[str, Any] = {}
        self.pool = BufferPool(int(float(os.environ.get(POOL_ENV, "512")) * (1 << 20)))

    @property
    def device_kind(self) -> str:
        """The device transport kind ``$HPCZECO_TRANSPORT`` names on every rank ("auto" when unset): what a
        transport given as None (or "auto") stands for on device buffers. ``CollectiveInputError`` (the same on
        every rank) when the variable is not a device transport kind or differs between the ranks."""
        if self._device_kind_error is not None:
            raise CollectiveInputError(self._device_kind_error)
        return self._device_kind

    def next_tag(self) -> int:
        """The tag of the next collective operation (advances the counter; call on every rank)."""
        tag = SCAN_TAG_BASE + self.seq % self.tag_slots
        self.seq += 1
        return tag

    def reversed_comm(self) -> MPI.Comm:
        """``pcomm`` with ranks in reverse order (collective on first use)."""
        if self._reversed is None:
            self._reversed = self.pcomm.Split(0, self.size - 1 - self.rank)
        return self._reversed

    def free(self) -> None:
        for c in (self._reversed, self.pcomm):
            if c is not None and c != MPI.COMM_NULL:
                try:
                    c.Free()
                except Exception:  # noqa: S110 - finalizing: nothing useful to do
                    pass
        self._reversed = None
        self.transports.clear()
        self.pool.clear()


def _wait(comm: MPI.Comm, what: str, timeout: float | None, result: Any, req: MPI.Request) -> Any:
    """``req.Wait()`` (no timeout) or poll ``req`` until ``timeout`` and abort the job past it; returns ``result``."""
    if timeout is None:
        req.Wait()
    elif not poll_until(lambda: bool(req.Test()), time.monotonic() + timeout):
        abort_stalled(comm, what, "a rank that did not arrive (not known: nothing was exchanged before)", timeout)
    return result


def _transport_code() -> int:
    """This rank's ``$HPCZECO_TRANSPORT`` as an index into :data:`.names.DEVICE_TRANSPORT_KINDS` ("auto" when
    unset or empty), -1 for a value that is not a kind. The only place the variable is read."""
    value = os.environ.get(TRANSPORT_ENV, "").strip() or "auto"
    return DEVICE_TRANSPORT_KINDS.index(value) if value in DEVICE_TRANSPORT_KINDS else -1


def _transport_agreement(codes: list[int]) -> tuple[str, str | None]:
    """``(kind, None)`` when every rank's ``$HPCZECO_TRANSPORT`` names the same kind, else ``("auto", message)``."""
    invalid = [r for r, c in enumerate(codes) if c < 0]
    if invalid:
        return "auto", (f"configuration: ${TRANSPORT_ENV} is not one of {DEVICE_TRANSPORT_KINDS} (or unset) on "
                        f"rank(s) {invalid}")
    if len(set(codes)) > 1:
        groups: dict[str, list[int]] = {}
        for r, c in enumerate(codes):
            groups.setdefault(DEVICE_TRANSPORT_KINDS[c], []).append(r)
        desc = "; ".join(f"{k!r} on rank(s) {rs}" for k, rs in groups.items())
        return "auto", (f"configuration mismatch: ${TRANSPORT_ENV} differs between the ranks ({desc}); set it to "
                        "the same value on every rank, or on none")
    return DEVICE_TRANSPORT_KINDS[codes[0]], None


def _agree_config(pcomm: MPI.Comm, local: float | None, bad: str | None,
                  transport: int) -> tuple[float | None, str, str | None]:
    """Every rank's ``$HPCZECO_COLLECTIVE_TIMEOUT`` and ``$HPCZECO_TRANSPORT`` code (one ``Iallgather``):
    ``(timeout, device kind, device kind error)``. The same ``CollectiveInputError`` on every rank when some
    rank's timeout is invalid or they differ; the transport's disagreement is returned as a message (raised
    where a device transport is chosen by it: :attr:`CommContext.device_kind`)."""
    P = pcomm.Get_size()
    mine = np.array([2.0 if bad else (0.0 if local is None else 1.0), local or 0.0, float(transport)])
    everyone = mine[None, :].copy()
    if P > 1:
        everyone = np.empty((P, 3))
        _wait(pcomm, f"agreement of ${TIMEOUT_ENV} (first hpczeco call on this communicator)", local, None,
              pcomm.Iallgather(mine, everyone))
    invalid = [r for r in range(P) if everyone[r, 0] == 2.0]
    if invalid:
        raise CollectiveInputError(f"configuration: ${TIMEOUT_ENV} is not a positive finite number of seconds on "
                                   f"rank(s) {invalid}")
    values = [None if everyone[r, 0] == 0.0 else float(everyone[r, 1]) for r in range(P)]
    if len(set(values)) > 1:
        groups: dict[float | None, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        desc = "; ".join(f"{'unset' if v is None else f'{v:g} s'} on rank(s) {rs}" for v, rs in groups.items())
        raise CollectiveInputError(f"configuration mismatch: ${TIMEOUT_ENV} differs between the ranks ({desc}); "
                                   "set it to the same value on every rank, or on none")
    return (values[0], *_transport_agreement([int(everyone[r, 2]) for r in range(P)]))


def _delete(comm: MPI.Comm, keyval: int, ctx: CommContext) -> None:
    if not MPI.Is_finalized():
        ctx.free()


def get_context(comm: MPI.Comm) -> CommContext:
    """The library context of intra-communicator ``comm``; created on first use (collective then)."""
    global _KEYVAL
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intra-communicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete)
    ctx = comm.Get_attr(_KEYVAL)
    if ctx is None:
        ctx = CommContext(comm)
        comm.Set_attr(_KEYVAL, ctx)
    return ctx
