"""The DAAF weight controller (:class:`hpczeco.daaf.WeightController`, the seed's rule) driven over rounds: a fixed
trace of (error, utilization) pairs, or the closed loop plan -> measure -> update that ``hpczeco bench daaf``
runs on its sample texts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hpczeco.daaf.controller import WeightController
from hpczeco.daaf.planner import Plan

__all__ = ["run_trace", "run_rounds"]


def run_trace(trace: Iterable[tuple[float, float]], **config: Any) -> list[float]:
    """Weights after each (error, utilization) pair of ``trace``, from a fresh controller."""
    c = WeightController(**config)
    return [c.update(e, u) for e, u in trace]


def run_rounds(controller: WeightController, tokens: Any, rounds: int,
               measure: Callable[[Plan], tuple[float, float]], **plan_kwargs: Any) -> list[dict]:
    """Closed loop: each round plan with the current weight, ``measure(plan) -> (error, utilization)``,
    update. Returns one record per round (weight used, plan policy, work fraction, error, utilization)."""
    out = []
    for i in range(rounds):
        p = controller.plan(tokens, **plan_kwargs)
        err, util = measure(p)
        w_used = controller.w
        controller.update(err, util)
        out.append({"round": i, "w": w_used, "policy": p.policy, "work_fraction": p.work_fraction,
                    "global_fraction": p.global_fraction, "error": err, "utilization": util,
                    "w_next": controller.w})
    return out

