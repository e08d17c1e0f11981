"""The collective timeout: its resolution, the wait that polls until a deadline, the abort of a stalled job,
and the abort of a job one of whose ranks fails.

Every collective wait of the library is bounded: by ``timeout=`` (seconds) where a call takes one, else by
``$HPCZECO_COLLECTIVE_TIMEOUT`` -- by default :data:`.settings.DEFAULT_TIMEOUT_S` (600 s), ``0``/``off`` for no
bound. Past it, the waiting rank prints the operation and the rank(s) it still waits for to stderr and calls
``MPI_Abort`` on ``MPI_COMM_WORLD``: a stalled peer ends the job with a message instead of hanging it. (Always
``COMM_WORLD``: the MPI standard promises only a best effort for other communicators, and MPICH 4.0.2 does not
end the job when a duplicate is aborted.) A rank that left the job ends a wait for it at once
(:func:`abort_departed`, :mod:`.lifeline`).

:func:`fail_rank` reports a rank's error and, with several ranks, ends the job (``MPI_Abort``): an exception that
leaves a rank while the others wait in a collective would otherwise leave that rank blocked in ``MPI_Finalize`` and
the job hung. :func:`.lifeline.abort_on_error` (every ``hpczeco`` command runs under the same guard) uses it.
Knows nothing about attention.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from .settings import DEFAULT_TIMEOUT_S, SETTINGS, TIMEOUT_ENV, collective_timeout

__all__ = ["TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "resolve_timeout", "abort_stalled", "abort_departed", "abort_job",
           "poll_until", "POLL_SPIN_S", "POLL_MAX_PAUSE_S", "fail_rank", "report_error", "exit_status", "EXIT_GRACE_S",
           "TRACEBACK_ENV", "describe_timeout"]


def resolve_timeout(timeout: float | None) -> float | None:
    """``timeout`` (checked: positive, finite) or, when None, ``$HPCZECO_COLLECTIVE_TIMEOUT``
    (:func:`.settings.collective_timeout`: the default :data:`DEFAULT_TIMEOUT_S` when unset, None when off)."""
    if timeout is None:
        return collective_timeout()
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not (timeout > 0 and timeout < float("inf")):
        raise ValueError(f"timeout must be a positive finite number of seconds, got {timeout}")
    return float(timeout)


def describe_timeout(timeout: float) -> str:
    """``600 s (the default; $HPCZECO_COLLECTIVE_TIMEOUT=S sets it, 0 turns it off)`` or ``2 s``."""
    if timeout == DEFAULT_TIMEOUT_S and not os.environ.get(TIMEOUT_ENV, "").strip():
        return f"{timeout:g} s (the default; ${TIMEOUT_ENV}=S sets another, 0 turns it off)"
    return f"{timeout:g} s"


#: seconds between this rank's last message and ``MPI_Abort``: the launcher forwards output asynchronously, and
#: an abort that kills the job first can lose the one line that says why (seen under MPICH's hydra on 2 cores)
ABORT_GRACE_S = 0.2


def abort_job(code: int) -> None:
    """``MPI_Abort(MPI_COMM_WORLD, code)``: end every process of the job (never returns), after flushing this
    rank's output and giving the launcher :data:`ABORT_GRACE_S` to forward it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # pragma: no cover - MPI_Abort does not return


def abort_stalled(comm: MPI.Comm, op: str, waiting_for: str, timeout: float) -> None:
    """Print why this rank gives up and abort the whole job (never returns).

    ``comm`` is the communicator the wait was on (its rank is printed); the abort is on ``MPI_COMM_WORLD``."""
    rank = comm.Get_rank()
    print(f"hpczeco: rank {rank}: {op} exceeded the collective timeout of {describe_timeout(timeout)}; still waiting "
          f"for {waiting_for}; aborting the job (MPI_Abort)", file=sys.stderr, flush=True)
    abort_job(3)


def abort_departed(comm: MPI.Comm, op: str, gone: list[tuple[int, int]]) -> None:
    """Print that the rank(s) ``gone`` (``(rank, exit status or -1)``) left the job before ``op``, which this rank
    waits in on ``comm`` and which cannot complete without them, and abort the job (never returns): status 3, or
    the first non-zero status of those ranks."""
    rank = comm.Get_rank()
    how = ", ".join(f"rank {r} ({'exit status ' + str(st) if st >= 0 else 'process exit'})" for r, st in gone)
    print(f"hpczeco: rank {rank}: {op}: {how} left the job before reaching it, so it can never complete; aborting "
          "the job (MPI_Abort)", file=sys.stderr, flush=True)
    abort_job(next((st for _, st in gone if st > 0), 3))


#: seconds a timed wait first polls without sleeping (yielding the core between polls, as MPI_Wait spins)
POLL_SPIN_S = 2e-3
#: the longest sleep between polls after that (the abort needs no finer clock; a longer pause is pure latency)
POLL_MAX_PAUSE_S = 1e-3


#: seconds between two calls of a wait's ``watch`` (the check for ranks that left the job)
WATCH_EVERY_S = 5e-3


def poll_until(done: Callable[[], bool], deadline: float, watch: Callable[[], None] | None = None) -> bool:
    """Call ``done()`` until it returns True or ``deadline`` (``time.monotonic()`` seconds) passes; True when
    ``done()`` did. ``watch()`` (optional: e.g. the check for ranks that left the job, which aborts) is called
    every :data:`WATCH_EVERY_S` while it waits.

    For :data:`POLL_SPIN_S` it polls back to back, yielding the core between polls (``sched_yield``: free on
    a core of its own, and on an oversubscribed one the rank it waits for may be the one that runs); then it
    sleeps between polls, 50 us growing by 1.5x to at most :data:`POLL_MAX_PAUSE_S`. A message that lands
    while the rank sleeps is therefore seen at most ~1 ms late (the former pause doubling to 10 ms made a
    pipeline of ``P - 1`` such waits cost up to 10 ms per hop).
    """
    start = time.monotonic()
    spin_until = min(deadline, start + POLL_SPIN_S)
    yield_core = getattr(os, "sched_yield", None)
    while True:
        if done():
            return True
        now = time.monotonic()
        if now >= spin_until:
            break
        if yield_core is not None:
            yield_core()
    pause = 5e-5
    watched = time.monotonic()
    while True:
        if done():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if watch is not None and now - watched >= WATCH_EVERY_S:
            watched = now
            watch()
        time.sleep(pause)
        pause = min(pause * 1.5, POLL_MAX_PAUSE_S)


# --------------------------------------------------------------------------------------------- failing ranks

#: seconds a rank that ends with a non-zero status waits for the others to end too (they do when the error
#: was collective) before it aborts the job (at most the collective timeout); status 0 waits the collective timeout
EXIT_GRACE_S = 10.0
#: environment variable: ``1`` prints the traceback of every error, not only of internal ones
TRACEBACK_ENV = "HPCZECO_TRACEBACK"


def _world() -> tuple[int, int] | None:
    """``(rank, size)`` of ``MPI_COMM_WORLD`` when MPI is running in this process, else None (never starts MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()


#: which errors are reported in one line: a tuple of exception types, or a predicate
OneLine = tuple[type[BaseException], ...] | Callable[[BaseException], bool]


def _is_one_line(exc: BaseException, one_line: OneLine) -> bool:
    return bool(one_line(exc)) if callable(one_line) else isinstance(exc, one_line)


def _traceback_always() -> bool:
    try:
        return bool(SETTINGS[TRACEBACK_ENV](os.environ.get(TRACEBACK_ENV, "")))
    except ValueError:  # reported where the settings are agreed (the first collective)
        return False


def report_error(exc: BaseException, prog: str, rank: int | None, one_line: OneLine = ()) -> None:
    """Print ``PROG: [rank R: ]error: Type: message`` to stderr, after the traceback unless ``exc`` is one of
    ``one_line`` (and ``$HPCZECO_TRACEBACK`` is not ``1``)."""
    who = f"{prog}: " + (f"rank {rank}: " if rank is not None else "")
    brief = _is_one_line(exc, one_line) and not _traceback_always()
    if not brief:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    text = str(exc).strip().splitlines()
    msg = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    if isinstance(exc, KeyboardInterrupt):
        msg = "interrupted"
    print(f"{who}error: {msg}" + ("" if brief else " (internal error: traceback above)"), file=sys.stderr, flush=True)


def fail_rank(exc: BaseException, prog: str = "hpczeco", one_line: OneLine = ()) -> int:
    """Report ``exc`` (:func:`report_error`); with several ranks, abort the job (``MPI_Abort`` on
    ``MPI_COMM_WORLD``: status 2 for ``one_line`` errors, else 1; never returns). With one rank, or no MPI
    running, return that status (130 for ``KeyboardInterrupt``) instead."""
    brief = _is_one_line(exc, one_line)
    world = _world()
    if world is None or world[1] == 1:
        report_error(exc, prog, None, one_line)
        return 130 if isinstance(exc, KeyboardInterrupt) else (2 if brief else 1)
    report_error(exc, prog, world[0], one_line)
    print(f"{prog}: rank {world[0]}: aborting the job (MPI_Abort on MPI_COMM_WORLD)", file=sys.stderr, flush=True)
    abort_job(2 if brief else 1)
    return 1  # pragma: no cover


def exit_status(exc: SystemExit) -> int:
    """The process exit status ``sys.exit(code)`` gives."""
    code = exc.code
    return 0 if code is None else (code if isinstance(code, int) else 1)
