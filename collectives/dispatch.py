"""A master/worker task dispatcher over MPI: rank 0 hands tasks to free ranks in the order a policy picks.

Every rank holds the same list of tasks. Each task has a release time (seconds after the common
start, when it may begin); rank 0 keeps the released, not yet started tasks and, whenever a worker
(ranks ``1..P-1``) is free, asks ``pick(ready, now)`` which one it runs next (non-preemptive).
Workers call ``run(task)`` and report back; a rank alone runs every task itself in the same order.
The result, the same on every rank, records for each task who ran it, when it started and finished
on rank 0's clock (dispatch to completion message) and the seconds ``run`` took.

The messages travel on the private duplicate of the communicator (:mod:`.context`, tags
:data:`~.context.DISPATCH_TAGS`), so they never meet the caller's own traffic. Waiting ranks sleep
between probes instead of spinning in a blocking receive (MPICH's spins a core, which on an
oversubscribed node steals it from the ranks doing the work). Every wait -- a worker for its next task, rank 0
for a free worker -- is bounded by the collective timeout (which must therefore exceed the longest task), and ends
at once when a rank left the job (:mod:`.lifeline`). The policy and what a task is belong to the caller: knows
nothing about attention.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from mpi4py import MPI

from . import timed
from .context import DISPATCH_TAGS, CommContext, get_context
from .watchdog import abort_stalled

__all__ = ["Completion", "dispatch"]

T = TypeVar("T")
_READY, _WORK, _STOP = DISPATCH_TAGS


@dataclass(frozen=True)
class Completion:
    """Task ``index`` (into the task list) ran on rank ``worker`` from ``start`` to ``finish`` (seconds after
    the common start, on rank 0's clock); ``run`` itself took ``busy`` seconds on the worker."""

    index: int
    worker: int
    start: float
    finish: float
    busy: float


def _recv_polling(ctx: CommContext, source: int, tag: int, status: MPI.Status, waiting_for: str) -> Any:
    """``recv`` on the context's communicator that sleeps between probes (100 us growing to 2 ms), bounded by the
    collective timeout (then the job is aborted, naming ``waiting_for``) and ended at once by a rank that left."""
    comm = ctx.pcomm
    nap = 1e-4
    deadline = None if ctx.timeout is None else time.monotonic() + ctx.timeout
    watch = ctx.watch(ctx.ops - 1, "dispatch")
    checked = time.monotonic()
    while not comm.Iprobe(source=source, tag=tag):
        time.sleep(nap)
        nap = min(2e-3, nap * 1.5)
        now = time.monotonic()
        if now - checked > 0.05:
            checked = now
            watch()
        if deadline is not None and now > deadline:
            abort_stalled(comm, "dispatch", waiting_for, ctx.timeout)
    return comm.recv(source=source, tag=tag, status=status)


def _serve_alone(tasks: Sequence[T], run: Callable[[T], Any], pick: Callable[[list[T], float], T],
                 release: Callable[[T], float]) -> list[Completion]:
    """One rank: run every task here, each when released, in the order ``pick`` gives."""
    t0 = time.perf_counter()
    waiting = sorted(range(len(tasks)), key=lambda i: (release(tasks[i]), i))
    done: list[Completion] = []
    while waiting:
        now = time.perf_counter() - t0
        ready = [i for i in waiting if release(tasks[i]) <= now]
        if not ready:
            time.sleep(max(0.0, min(release(tasks[i]) for i in waiting) - now))
            continue
        i = _index_of(pick([tasks[j] for j in ready], now), ready, tasks)
        waiting.remove(i)
        a = time.perf_counter()
        run(tasks[i])
        b = time.perf_counter()
        done.append(Completion(i, 0, a - t0, b - t0, b - a))
    return done


def _index_of(task: T, candidates: list[int], tasks: Sequence[T]) -> int:
    """The index (among ``candidates``) of the task ``pick`` returned (by identity)."""
    for i in candidates:
        if tasks[i] is task:
            return i
    raise ValueError("pick must return one of the ready tasks it was given")


def _master(ctx: CommContext, tasks: Sequence[T], pick: Callable[[list[T], float], T],
            release: Callable[[T], float]) -> list[Completion]:
    """Rank 0: hand released tasks to ready workers in ``pick``'s order, record the completions."""
    comm = ctx.pcomm
    workers = comm.Get_size() - 1
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    waiting = sorted(range(len(tasks)), key=lambda i: (release(tasks[i]), i))
    started: dict[int, tuple[int, float]] = {}
    done: list[Completion] = []
    idle: list[int] = []
    stopped = 0
    st = MPI.Status()
    while stopped < workers:
        now = clock()
        while idle and waiting:
            ready = [i for i in waiting if release(tasks[i]) <= now]
            if not ready:
                break
            i = _index_of(pick([tasks[j] for j in ready], now), ready, tasks)
            waiting.remove(i)
            w = idle.pop(0)
            started[i] = (w, now)
            comm.send(i, dest=w, tag=_WORK)
        if not waiting:
            for w in idle:
                comm.send(None, dest=w, tag=_STOP)
                stopped += 1
            idle = []
            if stopped == workers:
                break
        elif idle:  # tasks remain but none is released: wait for the next release or a message
            t_next = min(release(tasks[i]) for i in waiting)
            while clock() < t_next and not comm.Iprobe(source=MPI.ANY_SOURCE, tag=_READY):
                time.sleep(min(1e-3, max(0.0, t_next - clock())))
            if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=_READY):
                continue
        busy = sorted({w for w, _ in started.values()})
        msg = _recv_polling(ctx, MPI.ANY_SOURCE, _READY, st, f"rank(s) {busy or 'any worker'} (running a task, or "
                            "not ready yet)")
        now = clock()
        if msg is not None:  # (index, seconds run took)
            i, secs = msg
            w, start = started.pop(i)
            done.append(Completion(i, w, start, now, secs))
        idle.append(st.Get_source())
    return done


def _worker(ctx: CommContext, tasks: Sequence[T], run: Callable[[T], Any]) -> None:
    """Ranks 1..P-1: say ready, run what rank 0 sends, report its time, until told to stop."""
    comm = ctx.pcomm
    comm.send(None, dest=0, tag=_READY)
    st = MPI.Status()
    while True:
        i = _recv_polling(ctx, 0, MPI.ANY_TAG, st, "rank 0 (the dispatcher) to send the next task")
        if st.Get_tag() == _STOP:
            return
        a = time.perf_counter()
        run(tasks[i])
        comm.send((i, time.perf_counter() - a), dest=0, tag=_READY)


def dispatch(
    comm: MPI.Comm,
    tasks: Sequence[T],
    run: Callable[[T], Any],
    pick: Callable[[list[T], float], T],
    release: Callable[[T], float],
) -> list[Completion]:
    """Run every task once over ``comm`` (collective; every rank passes the same ``tasks``).

    ``release(task)``: seconds after the common start when the task may begin. ``pick(ready, now)``
    (called on rank 0 only): the task, among the released waiting ones, that the next free worker
    runs (``now`` in seconds after the start). ``run(task)`` runs on a worker (ranks ``1..P-1``; with
    one rank, on rank 0). The start is a barrier. Returns the :class:`Completion` of every task, in
    the order they completed, on every rank. The arguments are not checked collectively: agree on
    them first (e.g. :func:`~.agree.collective_check`).
    """
    ctx = get_context(comm)
    timed.Barrier(ctx, "dispatch (the common start)")
    if ctx.size == 1:
        return _serve_alone(tasks, run, pick, release)
    if ctx.rank == 0:
        done: list[Completion] | None = _master(ctx, tasks, pick, release)
    else:
        _worker(ctx, tasks, run)
        done = None
    timed.Barrier(ctx, "dispatch (the end: the last worker)")  # polled with sleeps: no core spun
    data = timed.bcast(ctx, None if done is None else [asdict(c) for c in done], 0, "dispatch (the completions)")
    return [Completion(**c) for c in data]
