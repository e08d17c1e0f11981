"""Serving prefill requests by priority = information density / time to deadline, beside FCFS.

A :class:`Request` carries its arrival time, absolute deadline, information density (the mean
normalised window entropy of its plan, :attr:`Plan.density`) and its prefill cost in seconds (measured,
or modelled from the plan's pair count). Workers are the ranks/GPUs of the job.

Policies (non-preemptive; a free worker takes the best waiting request that has arrived):

* ``"priority"`` (the seed's rule): highest ``density / max(deadline - now, eps)``; a request whose
  deadline has passed has time-to-deadline ``eps`` and so goes first (it still needs its first
  token). Ties: earlier arrival, then lower id.
* ``"fcfs"``: earliest arrival, then lower id.

:func:`simulate` is a discrete-event simulation (deterministic); :func:`serve_mpi` runs the same
policies for real over MPI (rank 0 dispatches, ranks ``1..P-1`` prefill; one rank serves alone).
Metrics (:func:`metrics`): TTFT = finish - arrival (queueing + prefill), p50/p99, share of deadlines
met (finish <= deadline), busy fraction = total service time / (workers x (last finish - first arrival)).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["Request", "Served", "ScheduleResult", "POLICIES", "priority", "simulate", "metrics", "serve_mpi"]

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


def _pick(waiting: list[Request], now: float, policy: str) -> Request:
    if policy == "fcfs":
        return min(waiting, key=lambda r: (r.arrival, r.rid))
    return min(waiting, key=lambda r: (-priority(r, now), r.arrival, r.rid))


def _check(requests: Sequence[Request], workers: int, policy: str) -> None:
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


def simulate(requests: Sequence[Request], workers: int, policy: str = "priority") -> ScheduleResult:
    """Discrete-event simulation of ``workers`` identical workers serving ``requests`` (deterministic)."""
    _check(requests, workers, policy)
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
        r = _pick(waiting, now, policy)
        waiting.remove(r)
        served.append(Served(r.rid, w, now, now + r.cost, r.arrival, r.deadline))
        free_at[w] = now + r.cost
    return ScheduleResult(policy, workers, sorted(served, key=lambda s: s.rid), float(sum(r.cost for r in requests)))


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


_READY, _WORK, _STOP = 11, 12, 13


def _recv_polling(comm, source: int, tag: int, status):
    """``comm.recv`` that sleeps between probes (MPICH's blocking receive spins a core, which on an
    oversubscribed node steals it from the ranks doing the prefill)."""
    nap = 1e-4
    while not comm.Iprobe(source=source, tag=tag):
        time.sleep(nap)
        nap = min(2e-3, nap * 1.5)
    return comm.recv(source=source, tag=tag, status=status)


def _dispatch(comm, scaled: dict[int, Request], policy: str, workers: int) -> ScheduleResult:
    """Rank 0 of :func:`serve_mpi`: hand requests to ready workers by policy, record completions."""
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0
    waiting = sorted(scaled.values(), key=lambda r: (r.arrival, r.rid))
    started: dict[int, tuple[int, float]] = {}
    served: list[Served] = []
    idle: list[int] = []
    busy, stopped = 0.0, 0
    st = MPI.Status()
    while stopped < workers:
        now = clock()
        while idle and waiting:
            ready = [r for r in waiting if r.arrival <= now]
            if not ready:
                break
            r = _pick(ready, now, policy)
            waiting.remove(r)
            w = idle.pop(0)
            started[r.rid] = (w, now)
            comm.send(r.rid, dest=w, tag=_WORK)
        if not waiting:
            for w in idle:
                comm.send(None, dest=w, tag=_STOP)
                stopped += 1
            idle = []
            if stopped == workers:
                break
        elif idle:  # requests remain but none has arrived: wait for the next arrival or a message
            t_next = min(r.arrival for r in waiting)
            while clock() < t_next and not comm.Iprobe(source=MPI.ANY_SOURCE, tag=_READY):
                time.sleep(min(1e-3, max(0.0, t_next - clock())))
            if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=_READY):
                continue
        msg = _recv_polling(comm, MPI.ANY_SOURCE, _READY, st)
        now = clock()
        if msg is not None:  # (rid, seconds of service)
            rid, secs = msg
            w, start = started.pop(rid)
            r = scaled[rid]
            served.append(Served(rid, w, start, now, r.arrival, r.deadline))
            busy += secs
        idle.append(st.Get_source())
    return ScheduleResult(policy, workers, sorted(served, key=lambda s: s.rid), busy)


def serve_mpi(requests: Sequence[Request], comm, run: Callable[[Request], Any], policy: str = "priority",
              time_scale: float = 1.0) -> ScheduleResult:
    """Serve ``requests`` for real over ``comm`` (collective; every rank passes the same list).

    Rank 0 dispatches by ``policy`` on its own clock (arrival/deadline are seconds after the start,
    multiplied by ``time_scale``); ranks ``1..P-1`` call ``run(request)`` and report back. With one
    rank, rank 0 serves alone. TTFT is measured on rank 0 from arrival to the completion message.
    Returns the same :class:`ScheduleResult` on every rank (``busy`` = measured service seconds).
    """
    from ..collectives.agree import collective_check, local_error  # noqa: PLC0415

    size = comm.Get_size()
    workers = max(1, size - 1)
    err = local_error(lambda: _check(requests, workers, policy))
    collective_check(comm, "serve_mpi", err, {"policy": policy, "rids": [r.rid for r in requests] if err is None
                                              else None})
    scaled = {r.rid: Request(r.rid, r.arrival * time_scale, r.deadline * time_scale, r.density, r.cost, r.payload)
              for r in requests}
    by_id = {r.rid: r for r in requests}
    comm.Barrier()
    if size == 1:
        t0 = time.perf_counter()
        waiting = sorted(scaled.values(), key=lambda r: (r.arrival, r.rid))
        served, busy = [], 0.0
        while waiting:
            now = time.perf_counter() - t0
            ready = [r for r in waiting if r.arrival <= now]
            if not ready:
                time.sleep(max(0.0, min(r.arrival for r in waiting) - now))
                continue
            r = _pick(ready, now, policy)
            waiting.remove(r)
            a = time.perf_counter()
            run(by_id[r.rid])
            b = time.perf_counter()
            busy += b - a
            served.append(Served(r.rid, 0, a - t0, b - t0, r.arrival, r.deadline))
        return ScheduleResult(policy, 1, sorted(served, key=lambda s: s.rid), busy)

    if comm.Get_rank() == 0:
        res = _dispatch(comm, scaled, policy, workers)
    else:
        comm.send(None, dest=0, tag=_READY)
        st = MPI.Status()
        while True:
            rid = _recv_polling(comm, 0, MPI.ANY_TAG, st)
            if st.Get_tag() == _STOP:
                break
            a = time.perf_counter()
            run(by_id[rid])
            comm.send((rid, time.perf_counter() - a), dest=0, tag=_READY)
        res = None
    req = comm.Ibarrier()  # wait for the last worker without spinning a core
    while not req.Test():
        time.sleep(1e-3)
    data = comm.bcast(None if res is None else (res.policy, res.workers, [asdict(s) for s in res.served], res.busy))
    return ScheduleResult(data[0], data[1], [Served(**s) for s in data[2]], data[3])
