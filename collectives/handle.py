"""A scan in flight: the handle every algorithm fills in, its progress thread, and the plan they share.

:class:`ScanHandle` is what :func:`~hpczeco.collectives.scan.scan_start` returns. Each algorithm
(:mod:`.ring`, :mod:`.tree`, :mod:`.baselines`) subclasses it with three steps: ``_progress()``
(non-blocking: do whatever has become possible, True once all communication is done),
``_complete()`` (block until it is) and ``_finish()`` (the result ``S_in``).

Progress. The ring's per-piece combine-and-forward, and the tree's rounds, happen inside
``handle.test()`` and ``handle.wait()``. A rank that never polls between start and wait forwards
nothing until it calls ``wait()``: the ranks after it in scan order then wait for it (the result
is still correct, the overlap is lost). ``progress="thread"`` instead drives the handle from a
helper thread that blocks in ``MPI_Wait`` (mpi4py initialises MPI with ``MPI_THREAD_MULTIPLE``);
``wait()`` joins it. With a rank on every core the helper thread competes with the compute for the
core, so it pays only where ranks leave cores free (docs/benchmarks/scan.md). With a timeout,
``wait()`` polls (:func:`.watchdog.poll_until`: 2 ms back to back, then sleeping at most 1 ms between
polls) and aborts the job past it, naming the peer it waits for.

:class:`ScanPlan` holds what every algorithm needs: the flattened ``[R]`` decays and ``[R, V]``
states, this rank's position in scan order, the transport, the tag, and scratch buffers from the
communicator's pool (reused across calls; a fresh large allocation costs a page fault per page on
first touch). :func:`scan_stats` counts handles and pooled buffers for leak checks.
Knows nothing about attention.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from .context import get_context
from .kernels import axpy_rows
from .watchdog import abort_stalled, poll_until

__all__ = ["ScanHandle", "DoneHandle", "ScanPlan", "pair_views", "scan_stats"]

_STATS = {"inflight": 0, "started": 0}


def scan_stats(comm: MPI.Comm | None = None) -> dict[str, int]:
    """Counters for leak checks: ``inflight`` (scan handles started and not yet complete, this process),
    ``started`` (scans started), and with ``comm`` its context's pool: ``pooled`` (buffers kept for reuse)
    and ``pooled_bytes``. Local (no communication); ``comm``'s context must already exist to report a pool."""
    out = dict(_STATS)
    if comm is not None:
        pool = get_context(comm).pool
        with pool._lock:
            out["pooled"] = sum(len(v) for v in pool._free.values())
            out["pooled_bytes"] = int(pool.held)
    return out


class ScanHandle:
    """A scan in flight (from :func:`scan_start`).

    ``test()`` makes whatever progress is possible without blocking and returns True once the
    result is ready; ``wait()`` blocks until it is and returns ``S_in`` (``S``'s shape and dtype,
    same array module). ``topology`` and ``blocks`` say what actually runs.
    """

    topology: str
    blocks: int | None

    def __init__(self, topology: str, blocks: int | None):
        self.topology = topology
        self.blocks = blocks
        self._result: Any = None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._out: Any = None  # the caller's ``out``, returned as is
        self._timeout: float | None = None  # seconds; set by scan_start
        self._comm: MPI.Comm | None = None  # aborted on a timeout
        self._watch: Callable[[], None] | None = None  # ends the job when a rank left before this scan
        self._counted = False

    def _count(self) -> None:
        self._counted = True
        _STATS["inflight"] += 1
        _STATS["started"] += 1

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            _STATS["inflight"] -= 1

    def _waiting_for(self) -> str:
        """Who this rank is still waiting for (for the timeout message)."""
        return "a collective: some rank did not arrive"

    # subclasses: _progress() -> bool (all communication done), _complete() (block), _finish() -> S_in
    def _progress(self) -> bool:  # pragma: no cover - overridden
        return True

    def _complete(self) -> None:  # pragma: no cover - overridden
        return None

    def _finish(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def done(self) -> bool:
        """True once ``wait()`` would return without blocking on communication."""
        return self._result is not None

    def test(self) -> bool:
        """Make progress (combine/forward whatever has arrived); True when the result is ready."""
        if self._result is not None:
            return True
        if self._thread is not None:
            if self._thread.is_alive():
                return False
            self._join()
            self._uncount()
            return True
        if self._progress():
            self._result = self._deliver(self._finish())
            self._uncount()
            return True
        return False

    def wait(self) -> Any:
        """Block until done; return ``S_in`` (this rank's exclusive scan).

        With a timeout (``scan_start(timeout=...)`` or ``$HPCZECO_COLLECTIVE_TIMEOUT``) the handle is
        polled instead (:func:`.watchdog.poll_until`); past the timeout the rank prints which rank(s) it still
        waits for and calls ``MPI_Abort`` on the communicator (ending the job)."""
        if self._result is None:
            if self._timeout is not None:
                self._wait_timeout()
            elif self._thread is not None:
                self._join()
            else:
                self._complete()
                self._result = self._deliver(self._finish())
        self._uncount()
        return self._result

    def _wait_timeout(self) -> None:
        assert self._timeout is not None
        deadline = time.monotonic() + self._timeout
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                abort_stalled(self._comm, f"scan({self.topology}) wait", self._waiting_for(), self._timeout)
            self._join()
            return
        if not poll_until(self.test, deadline, self._watch):
            abort_stalled(self._comm, f"scan({self.topology}) wait", self._waiting_for(), self._timeout)

    def _deliver(self, result: Any) -> Any:
        return result if self._out is None else self._out

    # progress thread --------------------------------------------------------
    def _start_thread(self) -> None:
        def run() -> None:
            try:
                self._complete()
                self._result_pending = self._finish()
            except BaseException as exc:  # noqa: BLE001 - re-raised in wait()
                self._thread_error = exc

        self._thread = threading.Thread(target=run, name=f"hpczeco-scan-{self.topology}", daemon=True)
        self._thread.start()

    def _join(self) -> Any:
        assert self._thread is not None
        self._thread.join()
        if self._thread_error is not None:
            raise self._thread_error
        self._result = self._deliver(self._result_pending)
        return self._result


class DoneHandle(ScanHandle):
    """A scan that needed no communication (one rank): done at creation."""

    def __init__(self, topology: str, blocks: int | None, result: Any):
        super().__init__(topology, blocks)
        self._result = result


class ScanPlan:
    """What every algorithm needs: flattened views, positions, transport, tag, buffers."""

    __slots__ = ("tr", "xp", "a2", "S2", "init2", "shape", "R", "V", "dtype", "pos", "P", "reverse", "tag",
                 "pool", "out", "_held")

    def __init__(self, tr, xp, a2, S2, init2, shape, pos, P, reverse, tag, pool, out):
        self.tr, self.xp, self.a2, self.S2, self.init2 = tr, xp, a2, S2, init2
        self.shape, self.pos, self.P, self.reverse, self.tag = shape, pos, P, reverse, tag
        self.R, self.V = S2.shape
        self.dtype = S2.dtype
        self.pool = pool
        self.out = out  # caller's result buffer viewed as [R, V], or None
        self._held: list = []

    def rank_of(self, pos: int) -> int:
        return self.P - 1 - pos if self.reverse else pos

    # buffers ---------------------------------------------------------------
    def acquire(self, shape: tuple[int, ...]) -> Any:
        """A scratch buffer from the context's pool (returned by :meth:`release_all`)."""
        buf = self.pool.acquire(self.xp, shape, self.dtype, self.tr)
        self._held.append(buf)
        return buf

    def release_all(self) -> None:
        """Give every scratch buffer back (call only when no request uses them any more)."""
        for buf in self._held:
            self.pool.release(self.xp, buf)
        self._held.clear()

    def result(self) -> Any:
        """The ``[R, V]`` buffer for S_in: the caller's ``out`` or a new array."""
        if self.out is None:
            empty = self.tr.empty if self.tr is not None else (lambda sh, dt: self.xp.empty(sh, dtype=dt))
            self.out = empty((self.R, self.V), self.dtype)
        return self.out

    def first_result(self) -> Any:
        """S_in of the first rank in scan order: initial (copied) or zeros."""
        out = self.result()
        if self.init2 is not None:
            out[...] = self.init2
        else:
            out.fill(0)
        return out.reshape(self.shape)

    def packed(self) -> Any:
        """A pooled buffer ``[a | S]`` (``R + R*V`` elements) holding this rank's pair (initial folded in)."""
        buf = self.acquire((self.R * (self.V + 1),))
        pa, pS = pair_views(buf, self.R, self.V)
        pa[...] = self.a2
        if self.pos == 0 and self.init2 is not None:
            axpy_rows(self.init2, self.a2, self.S2, pS)
        else:
            pS[...] = self.S2
        return buf


def pair_views(buf: Any, R: int, V: int) -> tuple[Any, Any]:
    """The decays ``[R]`` and the state ``[R, V]`` of a packed pair buffer ``[a | S]`` (views)."""
    return buf[:R], buf[R:].reshape(R, V)
