"""Ranks that leave the job, and waits the library cannot poll: the exit protocol and the guard thread.

**Leaving.** A rank leaves the job when its process ends (``sys.exit`` with any status, a return from ``main``,
an uncaught exception), or calls ``MPI.Finalize``. Another rank that still waits for it in a collective would
otherwise wait for ever -- and the leaving rank with it, in ``MPI_Finalize``. :func:`depart` (run by an ``atexit``
handler and by an ``MPI_COMM_SELF`` attribute whose deletion starts ``MPI_Finalize``, both installed when the
library first meets a communicator; also called by :func:`abort_on_error` and the ``hpczeco`` commands
with the exit status) therefore

1. sends every other member of every live communicator context (:mod:`.context`) a notice: its exit status and
   how many library operations it began on that communicator (``ops``);
2. waits for the same notice from every one of them -- they send it when they leave in turn, so a job that ends
   normally ends together -- for at most the collective timeout (10 s, :data:`.watchdog.EXIT_GRACE_S`, for a
   non-zero status: the others end alike when the error was collective), and past that aborts the job, naming
   the ranks that did not end.

A rank waiting in a library operation polls for those notices (:meth:`.context.CommContext.watch`): a member that
left before it began that operation will never take part in it, so the waiting rank ends the job at once, naming
it (``rank 1 (exit status 0) left the job before reaching scan``), instead of waiting for the timeout. A member
that left after it began the operation did its part: the wait goes on.

Not covered: a rank blocked in an MPI call of the user's own (``comm.Barrier()``) sees no notice; the leaving rank
then ends the job after the collective timeout. ``os._exit`` and signals skip ``atexit``: the launcher ends the
job when a process dies. With the timeout off (``HPCZECO_COLLECTIVE_TIMEOUT=0``) a rank that leaves with status 0
does not wait (the notices are still sent).

**Guards.** :func:`guard` bounds a blocking MPI call the library does not poll (a benchmark's barrier, whose
timing polling would change; an ``MPI_Comm_split``): a daemon thread ends the job when the call has not returned
within the collective timeout, or when a member left before it. It cannot name the rank that did not arrive. It
needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default); below that a guard only counts the operation. Knows nothing
about attention.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
from mpi4py import MPI

from .context import DEPART_TAG, ON_NEW_CONTEXT, CommContext, get_context, live_contexts
from .settings import collective_timeout
from .watchdog import (
    EXIT_GRACE_S,
    OneLine,
    _world,
    abort_departed,
    abort_job,
    abort_stalled,
    describe_timeout,
    exit_status,
    fail_rank,
    poll_until,
    report_error,
)

__all__ = ["depart", "install_exit_hooks", "guard", "has_departed", "finish_rank", "abort_on_error", "fail_rank",
           "report_error", "exit_status"]

_STATE = {"departed": False, "hooks": False}


def has_departed() -> bool:
    """True once this process ran :func:`depart` (it is leaving the job)."""
    return _STATE["departed"]


def _world_size() -> int:
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return 0
    return MPI.COMM_WORLD.Get_size()


def depart(status: int | None = None, prog: str = "hpczeco") -> None:
    """This rank leaves the job with exit ``status`` (None: not known, e.g. at interpreter exit): tell the members
    of every live context, wait for them to leave too, and abort the job if they do not within the bound (see the
    module docstring). Once per process; nothing with one rank or without MPI."""
    if _STATE["departed"] or _world_size() <= 1:
        return
    _STATE["departed"] = True
    code = -1 if status is None else int(status)
    contexts = [c for c in live_contexts() if c.size > 1 and c.pcomm != MPI.COMM_NULL]
    sends, keep = [], []
    for ctx in contexts:
        note = np.array([code, ctx.ops], np.int64)
        keep.append(note)
        sends += [ctx.pcomm.Isend(note, dest=r, tag=DEPART_TAG) for r in range(ctx.size) if r != ctx.rank]
    # the agreed timeouts of the communicators (the variable may have changed since they were made)
    timeouts = [c.timeout for c in contexts]
    timeout = None if not timeouts or None in timeouts else max(timeouts)
    bound = (min(EXIT_GRACE_S, timeout) if timeout else EXIT_GRACE_S) if code > 0 else timeout
    if contexts and bound is not None:
        def all_left() -> bool:
            for ctx in contexts:
                ctx.poll_departures()
            return all(len(ctx.departed) >= ctx.size - 1 for ctx in contexts)

        if not poll_until(all_left, time.monotonic() + bound):
            missing = sorted({r for ctx in contexts for r in range(ctx.size)
                              if r != ctx.rank and r not in ctx.departed})
            how = f"exit status {code}" if code >= 0 else "process exit"
            rank = MPI.COMM_WORLD.Get_rank()
            print(f"{prog}: rank {rank}: leaving the job ({how}) while rank(s) {missing} did not end within "
                  f"{describe_timeout(bound) if bound == timeout else f'{bound:g} s'}; aborting the job (MPI_Abort "
                  "on MPI_COMM_WORLD)", file=sys.stderr, flush=True)
            abort_job(code if code > 0 else 3)
        poll_until(lambda: bool(MPI.Request.Testall(sends)), time.monotonic() + 1.0)
    elif code > 0 and not contexts:
        _world_barrier(code, prog)


def _world_barrier(code: int, prog: str) -> None:
    """Without any library context (an error before the first collective): wait for every rank to end with an
    error too (a non-blocking barrier on ``MPI_COMM_WORLD``, polled), else abort the job after the grace."""
    try:
        timeout = collective_timeout()
    except ValueError:
        timeout = None
    grace = min(EXIT_GRACE_S, timeout) if timeout else EXIT_GRACE_S
    req = MPI.COMM_WORLD.Ibarrier()
    if poll_until(lambda: bool(req.Test()), time.monotonic() + grace):
        return
    print(f"{prog}: rank {MPI.COMM_WORLD.Get_rank()}: ended with status {code} while other ranks did not end within "
          f"{grace:g} s; aborting the job (MPI_Abort on MPI_COMM_WORLD)", file=sys.stderr, flush=True)
    abort_job(code)


def _at_exit() -> None:
    depart(None)


def _at_finalize(comm: MPI.Comm, keyval: int, value: object) -> int:
    depart(None)
    return MPI.SUCCESS


def install_exit_hooks() -> None:
    """Make this process run :func:`depart` when it exits (``atexit``, which runs before mpi4py's own
    ``MPI_Finalize``) and when ``MPI.Finalize`` is called (an attribute of ``MPI_COMM_SELF``, deleted first thing
    in ``MPI_Finalize``). Idempotent; called when the library first meets a communicator."""
    if _STATE["hooks"]:
        return
    _STATE["hooks"] = True
    atexit.register(_at_exit)
    keyval = MPI.Comm.Create_keyval(delete_fn=_at_finalize)
    MPI.COMM_SELF.Set_attr(keyval, True)


# --------------------------------------------------------------------------------------------- leaving guarded


def finish_rank(code: int, prog: str = "hpczeco") -> int:
    """This rank leaves the job with exit status ``code`` (any, 0 included); returns ``code``.

    One rank, or no MPI: nothing to do. Else :func:`.lifeline.depart`: the members of every communicator the
    library used are told (a rank waiting in a library operation this rank never began ends the job at once,
    naming it), and this rank waits for every rank to leave too -- they do when the job ends normally, or when the
    error was collective -- for at most the collective timeout (:data:`EXIT_GRACE_S` for a non-zero status);
    past it, it says so and aborts the job."""
    world = _world()
    if world is None or world[1] == 1:
        return code
    depart(code, prog)
    return code


@contextlib.contextmanager
def abort_on_error(prog: str = "hpczeco", one_line: OneLine = ()) -> Iterator[None]:
    """Run the ``with`` body; if it raises on a rank of a job of several ranks, end the whole job.

    The failing rank prints ``PROG: rank R: error: Type: message`` to stderr (after the traceback, unless
    the exception is one of ``one_line`` (exception types, or a predicate) -- errors whose message says it
    all -- and ``$HPCZECO_TRACEBACK`` is not ``1``), then calls ``MPI_Abort`` on ``MPI_COMM_WORLD``
    (:func:`fail_rank`): the other ranks, which may be blocked in a collective waiting for it, end too.
    ``SystemExit`` with any status (0 included) is this rank leaving the job: :func:`finish_rank` (a rank waiting
    for it in a library operation ends the job at once; the job ends normally if every rank leaves alike, else it
    is aborted after the grace or the collective timeout). With one rank, or when MPI is not running, the
    exception propagates unchanged. A rank that returns from the body and ends its process (or calls
    ``MPI.Finalize``) is handled the same way by the exit hooks of :mod:`.lifeline`.

    For library users: ``with abort_on_error(): main()`` in the script. ``python -m mpi4py script.py`` aborts
    the job on an uncaught exception (with the traceback), but not when a rank calls ``sys.exit``, returns or calls
    ``MPI.Finalize`` early: there the library's exit hooks (installed with its first communicator) end the job --
    at once for ranks waiting in the library's operations, after the collective timeout for ranks blocked in MPI
    calls of the script's own."""
    try:
        yield
    except SystemExit as exc:
        finish_rank(exit_status(exc), prog)
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        world = _world()
        if world is None or world[1] == 1:
            raise
        fail_rank(exc, prog, one_line)


# --------------------------------------------------------------------------------------------- guards


class _Watcher:
    """The daemon thread that checks the current guard every ``period`` seconds while one is set."""

    def __init__(self) -> None:
        self.current: tuple[float, str, CommContext, int, float] | None = None
        self.depth = 0
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpczeco-guard", daemon=True)
        self._thread.start()

    def set(self, item: tuple[float, str, CommContext, int, float]) -> None:
        self.current = item
        self._wake.set()

    def clear(self) -> None:
        self.current = None

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while (item := self.current) is not None:
                deadline, op, ctx, index, timeout = item
                time.sleep(min(0.05, timeout / 20))
                if self.current is not item:
                    continue
                gone = ctx.left_before(index)
                if gone:
                    abort_departed(ctx.pcomm, op, gone)
                if time.monotonic() > deadline and self.current is item:
                    abort_stalled(ctx.pcomm, op, "a rank that did not arrive or stopped inside it (a blocking MPI "
                                  "call: which one is not known)", timeout)


_WATCHER: _Watcher | None = None
_WATCHER_LOCK = threading.Lock()


def _watcher() -> _Watcher | None:
    global _WATCHER
    if _WATCHER is None:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return None
        with _WATCHER_LOCK:
            if _WATCHER is None:
                _WATCHER = _Watcher()
    return _WATCHER


@contextlib.contextmanager
def guard(comm: MPI.Comm | CommContext, op: str) -> Iterator[None]:
    """Bound the blocking MPI calls of the ``with`` body (collective: every rank of ``comm`` enters it, in the same
    order as the library's other operations): past the collective timeout, or when a member left the job before
    it, the job is aborted with ``op`` in the message (see the module docstring). Nested guards: the outermost one
    counts."""
    ctx = comm if isinstance(comm, CommContext) else get_context(comm)
    index = ctx.begin()
    w = _watcher() if ctx.timeout is not None and ctx.size > 1 else None
    if w is None or w.depth:
        if w is not None:
            w.depth += 1
        try:
            yield
        finally:
            if w is not None:
                w.depth -= 1
        return
    w.depth = 1
    w.set((time.monotonic() + ctx.timeout, op, ctx, index, ctx.timeout))
    try:
        yield
    finally:
        w.clear()
        w.depth = 0


ON_NEW_CONTEXT.append(install_exit_hooks)
