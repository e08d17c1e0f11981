"""The collective timeout: its resolution, the wait that polls until a deadline, and the abort of a stalled job.

A collective wait has no timeout unless one is given (``timeout=`` seconds) or set in
``$HPCZECO_COLLECTIVE_TIMEOUT``. Past it, the waiting rank prints the operation and the rank(s) it
still waits for to stderr and calls ``MPI_Abort``: a stalled peer ends the job with a message
instead of hanging it. Knows nothing about attention.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

__all__ = ["TIMEOUT_ENV", "resolve_timeout", "abort_stalled", "poll_until", "POLL_SPIN_S", "POLL_MAX_PAUSE_S"]

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


def abort_stalled(comm: MPI.Comm, op: str, waiting_for: str, timeout: float) -> None:
    """Print why this rank gives up and abort the whole job (never returns)."""
    rank = comm.Get_rank()
    print(f"hpczeco: rank {rank}: {op} exceeded the collective timeout of {timeout:g} s; still waiting for "
          f"{waiting_for}; aborting the job (MPI_Abort)", file=sys.stderr, flush=True)
    comm.Abort(3)


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
