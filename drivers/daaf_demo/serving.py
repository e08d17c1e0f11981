"""A discrete-event simulation of serving prefill requests (deterministic): the scheduler's policies of
:mod:`hpczeco.daaf.scheduler` (priority = information density / time to deadline, or FCFS) on ``workers``
identical workers, without running anything. ``hpczeco bench daaf`` compares it with :func:`hpczeco.daaf.serve_mpi`
(the same policies for real over MPI). Non-preemptive: a free worker takes the best waiting request that has
arrived."""

from __future__ import annotations

from collections.abc import Sequence

from hpczeco.daaf.scheduler import Request, ScheduleResult, Served, check_requests, pick

__all__ = ["simulate"]


def simulate(requests: Sequence[Request], workers: int, policy: str = "priority") -> ScheduleResult:
    """Discrete-event simulation of ``workers`` identical workers serving ``requests`` (deterministic)."""
    check_requests(requests, workers, policy)
    pending = sorted(requests, key=lambda r: (r.arrival, r.rid))
    free_at = [0.0] * workers
    waiting: list[Request] = []
    served: list[Served] = []
    i = 0
    now = pending[0].arrival if pending else 0.0
    while i < len(pending) or waiting:
        w = min(range(workers), key=lambda j: (free_at[j], j))
        now = max(now, free_at[w])
        while i < len(pending) and pending[i].arrival <= now:
            waiting.append(pending[i])
            i += 1
        if not waiting:  # idle until the next arrival
            now = pending[i].arrival
            continue
        r = pick(waiting, now, policy)
        waiting.remove(r)
        served.append(Served(r.rid, w, now, now + r.cost, r.arrival, r.deadline))
        free_at[w] = now + r.cost
    return ScheduleResult(policy, workers, sorted(served, key=lambda s: s.rid), float(sum(r.cost for r in requests)))
