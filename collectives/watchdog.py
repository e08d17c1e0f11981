"""The collective timeout: its resolution, the wait that polls until a deadline, the abort of a stalled job,
and the abort of a job one of whose ranks fails.

A collective wait has no timeout unless one is given (``timeout=`` seconds) or set in
``$HPCZECO_COLLECTIVE_TIMEOUT``. Past it, the waiting rank prints the operation and the rank(s) it
still waits for to stderr and calls ``MPI_Abort`` on ``MPI_COMM_WORLD``: a stalled peer ends the job
with a message instead of hanging it. (Always ``COMM_WORLD``: the MPI standard promises only a best
effort for other communicators, and MPICH 4.0.2 does not end the job when a duplicate is aborted.)

:func:`abort_on_error` is the same guarantee for a rank that fails: an exception that leaves a rank
while the others wait in a collective would otherwise leave that rank blocked in ``MPI_Finalize`` and
the job hung. Every ``hpczeco`` command runs under it; library users wrap their ``main`` in it, or
launch with ``python -m mpi4py script.py``. Knows nothing about attention.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import numpy as np
from mpi4py import MPI

__all__ = ["TIMEOUT_ENV", "resolve_timeout", "abort_stalled", "abort_job", "poll_until", "POLL_SPIN_S",
           "POLL_MAX_PAUSE_S", "abort_on_error", "finish_rank", "fail_rank", "report_error",
           "exit_status", "EXIT_GRACE_S", "TRACEBACK_ENV"]

#: environment variable: seconds a collective wait may take before the job is aborted (unset = forever)
TIMEOUT_ENV = "HPCZECO_COLLECTIVE_TIMEOUT"


def resolve_timeout(timeout: float | None) -> float | None:
    """``timeout`` (checked: positive, finite) or, when None, ``$HPCZECO_COLLECTIVE_TIMEOUT`` (None if unset)."""
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip()
        if not env:
            return None
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"${TIMEOUT_ENV} must be a number of seconds, got {env!r}") from None
        what = f"${TIMEOUT_ENV}"
    else:
        what = "timeout"
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number of seconds or None, got {type(timeout).__name__}")
    if not (timeout > 0 and timeout < float("inf")):
        raise ValueError(f"{what} must be a positive finite number of seconds, got {timeout}")
    return float(timeout)


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
    print(f"hpczeco: rank {rank}: {op} exceeded the collective timeout of {timeout:g} s; still waiting for "
          f"{waiting_for}; aborting the job (MPI_Abort)", file=sys.stderr, flush=True)
    abort_job(3)


#: seconds a timed wait first polls without sleeping (yielding the core between polls, as MPI_Wait spins)
POLL_SPIN_S = 2e-3
#: the longest sleep between polls after that (the abort needs no finer clock; a longer pause is pure latency)
POLL_MAX_PAUSE_S = 1e-3


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Call ``done()`` until it returns True or ``deadline`` (``time.monotonic()`` seconds) passes; True when
    ``done()`` did.

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
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 1.5, POLL_MAX_PAUSE_S)


# --------------------------------------------------------------------------------------------- failing ranks

#: seconds a rank that ends with a non-zero status waits for the others to end too (they do when the error
#: was collective) before it aborts the job; the collective timeout replaces it where one is set
EXIT_GRACE_S = 10.0
#: environment variable: ``1`` prints the traceback of every error, not only of internal ones
TRACEBACK_ENV = "HPCZECO_TRACEBACK"


def _world() -> tuple[int, int] | None:
    """``(rank, size)`` of ``MPI_COMM_WORLD`` when MPI is running in this process, else None (never starts MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()


def _exit_timeout() -> float:
    try:
        tmo = resolve_timeout(None)
    except (TypeError, ValueError):
        tmo = None
    return EXIT_GRACE_S if tmo is None else tmo


def finish_rank(code: int, prog: str = "hpczeco") -> int:
    """End this rank's part of a job with exit status ``code``; returns ``code``.

    Status 0, one rank, or no MPI: nothing to do. A non-zero status on several ranks: this rank waits (a
    non-blocking barrier, polled) for every rank to end with an error too -- they all do when the error was
    collective, and the job then ends normally with that status. If they do not arrive within
    :data:`EXIT_GRACE_S` (or the collective timeout), the error was this rank's alone while the others go on
    (or wait for it): it says so and aborts the job."""
    world = _world()
    if code == 0 or world is None or world[1] == 1:
        return code
    grace = _exit_timeout()
    req = MPI.COMM_WORLD.Ibarrier()
    if poll_until(lambda: bool(req.Test()), time.monotonic() + grace):
        return code
    print(f"{prog}: rank {world[0]}: ended with status {code} while other ranks did not end within {grace:g} s; "
          "aborting the job (MPI_Abort on MPI_COMM_WORLD)", file=sys.stderr, flush=True)
    abort_job(code)
    return code  # pragma: no cover


#: which errors are reported in one line: a tuple of exception types, or a predicate
OneLine = tuple[type[BaseException], ...] | Callable[[BaseException], bool]


def _is_one_line(exc: BaseException, one_line: OneLine) -> bool:
    return bool(one_line(exc)) if callable(one_line) else isinstance(exc, one_line)


def report_error(exc: BaseException, prog: str, rank: int | None, one_line: OneLine = ()) -> None:
    """Print ``PROG: [rank R: ]error: Type: message`` to stderr, after the traceback unless ``exc`` is one of
    ``one_line`` (and ``$HPCZECO_TRACEBACK`` is not ``1``)."""
    who = f"{prog}: " + (f"rank {rank}: " if rank is not None else "")
    brief = _is_one_line(exc, one_line) and os.environ.get(TRACEBACK_ENV, "") != "1"
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


@contextlib.contextmanager
def abort_on_error(prog: str = "hpczeco", one_line: OneLine = ()) -> Iterator[None]:
    """Run the ``with`` body; if it raises on a rank of a job of several ranks, end the whole job.

    The failing rank prints ``PROG: rank R: error: Type: message`` to stderr (after the traceback, unless
    the exception is one of ``one_line`` (exception types, or a predicate) -- errors whose message says it
    all -- and ``$HPCZECO_TRACEBACK`` is not ``1``), then calls ``MPI_Abort`` on ``MPI_COMM_WORLD``
    (:func:`fail_rank`): the other ranks, which may be blocked in a collective waiting for it, end too.
    ``SystemExit`` with a non-zero status goes through :func:`finish_rank` (the job ends normally if every
    rank fails alike, else it is aborted). With one rank, or when MPI is not running, the exception
    propagates unchanged.

    For library users: ``with abort_on_error(): main()`` in the script (or run it as
    ``python -m mpi4py script.py``, which aborts on any uncaught exception)."""
    try:
        yield
    except SystemExit as exc:
        status = exit_status(exc)
        if status != 0:
            finish_rank(status, prog)
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        world = _world()
        if world is None or world[1] == 1:
            raise
        fail_rank(exc, prog, one_line)
