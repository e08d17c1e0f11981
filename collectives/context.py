"""Per-communicator state of the collectives, cached on the communicator as an MPI attribute.

The first collective call on a user communicator ``comm`` (collective: every rank calls it)
creates a :class:`CommContext` holding

* ``pcomm``: a private duplicate of ``comm`` (``MPI_Comm_idup``), so that the library's messages never
  match the caller's own point-to-point traffic (the MPI library convention). Its tags: :data:`RELAY_TAGS`,
  :data:`AGREE_TAG`, :data:`ARRIVAL_TAG`, :data:`DISPATCH_TAGS` below :data:`SCAN_TAG_BASE`, then one tag
  per collective;
* ``timeout``: the collective timeout (seconds, or None: none), from ``$HPCZECO_COLLECTIVE_TIMEOUT`` (unset: the
  default, :data:`.settings.DEFAULT_TIMEOUT_S`; ``0``/``off``: none). Every library ``HPCZECO_*`` variable
  (:mod:`.settings`) is read on every rank here and agreed: a value that is not valid on some rank, or one that
  must be the same everywhere and is not, raises the same :class:`~.errors.CollectiveInputError`
  ("configuration" / "configuration mismatch") on every rank. The duplication and this agreement are
  non-blocking requests polled until the timeout, so even the first call on a communicator cannot hang past it
  (it cannot name the absent rank: nothing was exchanged yet);
* ``device_kind``: the device transport ``$HPCZECO_TRANSPORT`` names ("auto" when unset), read and agreed here --
  the one read of the variable; everything else receives this value;
* an operation counter: every rank calls collectives on ``comm`` in the same order, so the n-th
  operation gets the same tag on every rank without any communication. Two operations in flight
  at once (forward and backward scans, two layers) therefore use distinct tags;
* ``ops``: the library operations begun on ``comm`` (:meth:`CommContext.begin`: every rank begins the same ones
  in the same order), and ``departed``: the members that left the job (:mod:`.lifeline`) with their exit status
  and their ``ops`` then -- a wait for operation ``i`` ends the job at once when a member left before it
  (its ``ops <= i``: it will never arrive) instead of waiting for the timeout;
* a lazily built rank-reversed communicator (for ``MPI_Exscan`` in reverse order), the pool of
  scratch buffers and ``transports``: the one cache of the transports that carry the library's
  traffic on ``pcomm`` (filled by :mod:`.selection` and :mod:`.device`; device transports can be
  expensive to build: NCCL communicators).

The context lives as long as ``comm``: freeing ``comm`` frees the private communicators and drops
the cached transports. Knows nothing about attention, nor about what a transport is.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from . import settings
from .errors import CollectiveInputError
from .settings import TIMEOUT_ENV
from .watchdog import abort_departed, abort_stalled, poll_until

__all__ = [
    "BufferPool",
    "CommContext",
    "get_context",
    "RELAY_TAGS",
    "AGREE_TAG",
    "ARRIVAL_TAG",
    "DEPART_TAG",
    "DISPATCH_TAGS",
    "SCAN_TAG_BASE",
    "POOL_ENV",
    "live_contexts",
]

#: environment variable: most MiB of scratch buffers kept for reuse per communicator (default 512)
POOL_ENV = "HPCZECO_POOL_MB"

#: tags of the whole-state relay (LASP-1) in scan order and in reverse order
RELAY_TAGS = (1, 2)
#: tag of the timeout-mode arrival/agreement messages (:func:`.agree.agree_fast`)
AGREE_TAG = 7
#: tag of the arrival tokens of the timed collectives (:mod:`.timed`)
ARRIVAL_TAG = 8
#: tag of the notice a rank sends every member when it leaves the job (:mod:`.lifeline`)
DEPART_TAG = 9
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
        local = settings.read_all()
        wait_s = local[TIMEOUT_ENV][1] if local[TIMEOUT_ENV][2] is None else settings.DEFAULT_TIMEOUT_S
        self.pcomm: MPI.Comm = _wait(comm, "first hpczeco call on this communicator (MPI_Comm_idup)", wait_s,
                                     *comm.Idup())
        self.rank = self.pcomm.Get_rank()
        self.size = self.pcomm.Get_size()
        try:
            agreed = _agree_settings(self.pcomm, local, wait_s)
        except Exception:
            self.pcomm.Free()
            raise
        #: seconds a collective wait of the library may take (None: forever); the same on every rank
        self.timeout: float | None = agreed[TIMEOUT_ENV]
        self._device_kind: str = agreed["HPCZECO_TRANSPORT"]
        tag_ub = self.pcomm.Get_attr(MPI.TAG_UB) or 32767
        self.tag_slots = max(1, min(1 << 20, int(tag_ub) - SCAN_TAG_BASE))
        self.seq = 0
        #: library operations begun on this communicator (:meth:`begin`)
        self.ops = 0
        #: members that left the job: rank -> (exit status, -1 when unknown; their ``ops`` when they left)
        self.departed: dict[int, tuple[int, int]] = {}
        self._departed_lock = threading.Lock()
        self._reversed: MPI.Comm | None = None
        #: transports on ``pcomm`` by name ("host", and device kinds requested or resolved)
        self.transports: dict[str, Any] = {}
        self.pool = BufferPool(settings.pool_bytes())
        _LIVE[id(self)] = self
        for hook in ON_NEW_CONTEXT:  # the exit hooks of .lifeline (installed once)
            hook()

    @property
    def device_kind(self) -> str:
        """The device transport kind ``$HPCZECO_TRANSPORT`` names on every rank ("auto" when unset): what a
        transport given as None (or "auto") stands for on device buffers (agreed when the context was made)."""
        return self._device_kind

    def next_tag(self) -> int:
        """The tag of the next collective operation (advances the counter; call on every rank)."""
        tag = SCAN_TAG_BASE + self.seq % self.tag_slots
        self.seq += 1
        return tag

    def begin(self) -> int:
        """Count a library operation begun on this communicator; returns its index (call on every rank, in the
        same order: every collective of the library does)."""
        index = self.ops
        self.ops += 1
        return index

    def poll_departures(self) -> None:
        """Receive the notices of members that left the job (:mod:`.lifeline`), without blocking. Thread-safe
        (matched probes)."""
        if self.size == 1:
            return
        status = MPI.Status()
        while True:
            msg = self.pcomm.Improbe(source=MPI.ANY_SOURCE, tag=DEPART_TAG, status=status)
            if msg is None:
                return
            buf = np.empty(2, np.int64)
            msg.Recv(buf)
            with self._departed_lock:
                self.departed[status.Get_source()] = (int(buf[0]), int(buf[1]))

    def left_before(self, index: int) -> list[tuple[int, int]]:
        """``(rank, exit status)`` of the members that left the job before they began operation ``index`` (they
        will never take part in it), after polling for new notices."""
        self.poll_departures()
        with self._departed_lock:
            return [(r, st) for r, (st, ops) in sorted(self.departed.items()) if ops <= index]

    def watch(self, index: int, op: str) -> Callable[[], None]:
        """A check for a wait of operation ``index``: ends the job (``MPI_Abort``) when a member left before it."""

        def check() -> None:
            gone = self.left_before(index)
            if gone:
                abort_departed(self.pcomm, op, gone)

        return check

    def reversed_comm(self) -> MPI.Comm:
        """``pcomm`` with ranks in reverse order (collective on first use: the ranks meet first, within the
        timeout, so that the blocking ``MPI_Comm_split`` only runs once every rank is there)."""
        if self._reversed is None:
            self.begin()
            _wait(self.pcomm, "reverse-order communicator (the ranks meet before MPI_Comm_split)", self.timeout, None,
                  self.pcomm.Ibarrier())
            self._reversed = self.pcomm.Split(0, self.size - 1 - self.rank)
        return self._reversed

    def free(self) -> None:
        _LIVE.pop(id(self), None)
        for c in (self._reversed, self.pcomm):
            if c is not None and c != MPI.COMM_NULL:
                try:
                    c.Free()
                except Exception:  # noqa: S110 - finalizing: nothing useful to do
                    pass
        self._reversed = None
        self.transports.clear()
        self.pool.clear()


#: the contexts whose communicator is alive, by ``id``: the exit protocol (:mod:`.lifeline`) tells their members
_LIVE: dict[int, CommContext] = {}
#: called when a context is made (:mod:`.lifeline` puts its exit hooks' installer here when it is imported: the
#: package imports it first, so every context has them)
ON_NEW_CONTEXT: list[Callable[[], None]] = []


def live_contexts() -> list[CommContext]:
    """The library contexts of this process whose communicators are not freed (oldest first)."""
    return list(_LIVE.values())


def _wait(comm: MPI.Comm, what: str, timeout: float | None, result: Any, req: MPI.Request) -> Any:
    """``req.Wait()`` (no timeout) or poll ``req`` until ``timeout`` and abort the job past it; returns ``result``."""
    if timeout is None:
        req.Wait()
    elif not poll_until(lambda: bool(req.Test()), time.monotonic() + timeout):
        abort_stalled(comm, what, "a rank that did not arrive (not known: nothing was exchanged before)", timeout)
    return result


def _describe(name: str, raw: str, value: Any) -> str:
    if name == TIMEOUT_ENV:
        if not raw:
            return f"unset (the default, {settings.DEFAULT_TIMEOUT_S:g} s)"
        return "off" if value is None else f"{value:g} s"
    return "unset" if not raw else repr(raw)


def _agree_settings(pcomm: MPI.Comm, local: dict[str, tuple[str, Any, str | None]],
                    wait_s: float | None) -> dict[str, Any]:
    """Every rank's library variables (:mod:`.settings`; one non-blocking exchange, polled until ``wait_s``):
    their values, the same on every rank. The same ``CollectiveInputError`` on every rank when some rank's value is
    invalid, or a variable of :data:`.settings.AGREED` means different things on different ranks."""
    P = pcomm.Get_size()
    mine = {k: (raw, value, err) for k, (raw, value, err) in local.items()}
    everyone = [mine] if P == 1 else _allgather_polled(pcomm, mine, wait_s)
    bad: dict[str, dict[str, list[int]]] = {}
    for r, theirs in enumerate(everyone):
        for name, (_, _, err) in theirs.items():
            if err is not None:
                bad.setdefault(name, {}).setdefault(err, []).append(r)
    if bad:
        msgs = [f"{err} on rank(s) {ranks}" for groups in bad.values() for err, ranks in groups.items()]
        raise CollectiveInputError("configuration: " + "; ".join(msgs))
    for name in settings.AGREED:
        groups: dict[str, list[int]] = {}
        values = {repr(theirs[name][1]) for theirs in everyone}
        if len(values) > 1:
            for r, theirs in enumerate(everyone):
                groups.setdefault(_describe(name, theirs[name][0], theirs[name][1]), []).append(r)
            desc = "; ".join(f"{k} on rank(s) {rs}" for k, rs in groups.items())
            raise CollectiveInputError(f"configuration mismatch: ${name} differs between the ranks ({desc}); set it "
                                       "to the same value on every rank, or on none")
    return {name: everyone[0][name][1] for name in settings.SETTINGS}


def _allgather_polled(pcomm: MPI.Comm, obj: Any, wait_s: float | None) -> list[Any]:
    """Every rank's ``obj`` (pickled), by ``MPI_Iallgather`` + ``MPI_Iallgatherv`` polled until ``wait_s``."""
    P = pcomm.Get_size()
    what = "agreement of the HPCZECO_* settings (first hpczeco call on this communicator)"
    data = np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), np.uint8)
    sizes = np.empty(P, np.int64)
    deadline = None if wait_s is None else time.monotonic() + wait_s
    _wait(pcomm, what, wait_s, None, pcomm.Iallgather(np.array([data.size], np.int64), sizes))
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    everyone = np.empty(int(sizes.sum()), np.uint8)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    _wait(pcomm, what, left, None, pcomm.Iallgatherv(data, [everyone, sizes, displs, MPI.BYTE]))
    return [pickle.loads(everyone[d:d + n].tobytes()) for d, n in zip(displs, sizes)]  # noqa: S301 - own ranks


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
