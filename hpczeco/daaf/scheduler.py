"""Serving prefill requests by priority = information density / time to deadline, beside FCFS.

A :class:`Request` carries its arrival time, absolute deadline, information density (the mean
normalised window entropy of its plan, :attr:`Plan.density`) and its prefill cost in seconds (measured,
or modelled from the plan's pair count). Workers are the ranks/GPUs of the job.

Policies (non-preemptive; a free worker takes the best waiting request that has arrived):

* ``"priority"`` (the seed's rule): highest ``density / max(deadline - now, eps)``; a request whose
  deadline has passed has time-to-deadline ``eps`` and so goes first (it still needs its first
  token). Ties: earlier arrival, then lower id.
* ``"fcfs"``: earliest arrival, then lower id.

:func:`serve_mpi` runs the policies for real over MPI (rank 0 dispatches, ranks ``1..P-1`` prefill; one rank
serves alone) through the collectives' task dispatcher (:mod:`hpczeco.collectives.dispatch`), which owns the
messages. A discrete-event simulation of the same policies is a program: :mod:`hpczeco.drivers.daaf_demo.serving`.
Metrics (:func:`metrics`): TTFT = finish - arrival (queueing + prefill), p50/p99, share of deadlines
met (finish <= deadline), busy fraction = total service time / (workers x (last finish - first arrival)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Request", "Served", "ScheduleResult", "POLICIES", "priority", "pick", "check_requests", "metrics",
           "serve_mpi"]

POLICIES = ("priority", "fcfs")
EPS = 1e-6


@dataclass(frozen=True)
class Request:
    """A prefill request. Times in seconds; ``deadline`` is absolute (same clock as ``arrival``)."""

    rid: int
    arrival: float
    deadline: float
    density: float
    cost: float
    payload: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("arrival", "deadline", "density", "cost"):
            x = getattr(self, name)
            if not (isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(x)):
                raise ValueError(f"request {self.rid}: {name} must be a finite number, got {x!r}")
        if self.cost < 0 or self.density < 0:
            raise ValueError(f"request {self.rid}: cost and density must be >= 0")
        if self.deadline < self.arrival:
            raise ValueError(f"request {self.rid}: deadline {self.deadline} is before arrival {self.arrival}")


@dataclass(frozen=True)
class Served:
    rid: int
    worker: int
    start: float
    finish: float
    arrival: float
    deadline: float

    @property
    def ttft(self) -> float:
        return self.finish - self.arrival

    @property
    def met(self) -> bool:
        return self.finish <= self.deadline


@dataclass
class ScheduleResult:
    policy: str
    workers: int
    served: list[Served]
    busy: float  # total service seconds

    def metrics(self) -> dict:
        return metrics(self)


def priority(req: Request, now: float) -> float:
    """The seed's priority: ``density / max(deadline - now, eps)``."""
    return req.density / max(req.deadline - now, EPS)


def pick(waiting: list[Request], now: float, policy: str) -> Request:
    """The request a free worker takes at time ``now`` from ``waiting`` (non-empty) under ``policy``."""
    if policy == "fcfs":
        return min(waiting, key=lambda r: (r.arrival, r.rid))
    return min(waiting, key=lambda r: (-priority(r, now), r.arrival, r.rid))


def check_requests(requests: Sequence[Request], workers: int, policy: str) -> None:
    """Raise ``ValueError``/``TypeError`` for an unknown policy, a worker count below 1, repeated ids or
    something other than :class:`Request` objects."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    ids = [r.rid for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"requests must be Request objects, got {type(r).__name__}")


def metrics(res: ScheduleResult) -> dict:
    """TTFT p50/p99 (seconds), share of deadlines met, busy fraction, makespan."""
    if not res.served:
        return {"policy": res.policy, "workers": res.workers, "n": 0}
    ttft = np.array([s.ttft for s in res.served])
    t0 = min(s.arrival for s in res.served)
    span = max(s.finish for s in res.served) - t0
    return {
        "policy": res.policy,
        "workers": res.workers,
        "n": len(res.served),
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "ttft_mean": float(ttft.mean()),
        "deadlines_met": float(np.mean([s.met for s in res.served])),
        "busy_fraction": float(res.busy / (res.workers * span)) if span > 0 else 1.0,
        "makespan": float(span),
    }


def serve_mpi(requests: Sequence[Request], comm, run: Callable[[Request], Any], policy: str = "priority",
              time_scale: float = 1.0) -> ScheduleResult:
    """Serve ``requests`` for real over ``comm`` (collective; every rank passes the same list).

    Rank 0 dispatches by ``policy`` on its own clock (arrival/deadline are seconds after the start,
    multiplied by ``time_scale``); ranks ``1..P-1`` call ``run(request)`` and report back. With one
    rank, rank 0 serves alone. TTFT is measured on rank 0 from arrival to the completion message.
    Returns the same :class:`ScheduleResult` on every rank (``busy`` = measured service seconds).
    The messages go through :func:`hpczeco.collectives.dispatch.dispatch` (on a private duplicate of ``comm``).
    """
    from ..collectives.agree import collective_check, local_error  # noqa: PLC0415
    from ..collectives.dispatch import dispatch  # noqa: PLC0415

    workers = max(1, comm.Get_size() - 1)
    err = local_error(lambda: check_requests(requests, workers, policy))
    collective_check(comm, "serve_mpi", err, {"policy": policy, "rids": [r.rid for r in requests] if err is None
                                              else None})
    scaled = [Request(r.rid, r.arrival * time_scale, r.deadline * time_scale, r.density, r.cost, r.payload)
              for r in requests]
    by_id = {r.rid: r for r in requests}
    done = dispatch(comm, scaled, lambda r: run(by_id[r.rid]), lambda ready, now: pick(ready, now, policy),
                    lambda r: r.arrival)
    served = [Served(scaled[c.index].rid, c.worker, c.start, c.finish, scaled[c.index].arrival,
                     scaled[c.index].deadline) for c in done]
    return ScheduleResult(policy, workers, sorted(served, key=lambda s: s.rid), float(sum(c.busy for c in done)))
