"""DAAF: Dynamic Attention Allocation Framework (seed ``004_*.txt``; docs/DESIGN.md, section DAAF).

An entropy scan of the token stream marks key regions (:func:`plan`); key-region tokens get global
attention both ways, every other token local sliding-window attention (:func:`attention`).

Public API:

- planning (token ids ``[T]`` in, any tokenizer's): ``window_entropy``, ``window_starts``, ``plan``,
  ``plan_from_mask``, ``Plan``, ``plan_arrays`` (the index-array interface of the CPU/GPU kernels),
  ``attention_pairs``, ``dense_pairs``; ``device_planner`` (``plan`` / ``plan_torch`` / ``window_entropy`` /
  ``host_plan`` on the GPU; imported on first use)
- attention: ``attention`` (CPU blockwise / GPU dispatch), ``exact_attention`` (dense causal); the float64
  references it is tested against live in :mod:`hpczeco.daaf.reference`
- MPI: ``distributed_attention`` (sequence split with halo exchange, or heads split) and the slices it uses,
  ``sequence_range`` / ``head_range``
- control: ``WeightController`` (the seed's weight rule), ``utilization``, ``sampled_error``, ``mass_recall``
- serving: ``Request``, ``serve_mpi`` (priority = density / time to deadline, or FCFS, over MPI),
  ``ScheduleResult``, ``metrics``

The demonstration programs around them (a tokenizer, sample texts, a random-weight decoder, the controller's
closed loop, a serving simulation) live in :mod:`hpczeco.drivers.daaf_demo`.
"""

import importlib

from .attention import attention, exact_attention
from .controller import WeightController, mass_recall, sampled_error, utilization
from .distributed import distributed_attention, head_range, sequence_range
from .planner import (
    Plan,
    attention_pairs,
    dense_pairs,
    plan,
    plan_arrays,
    plan_from_mask,
    window_entropy,
    window_starts,
)
from .scheduler import Request, ScheduleResult, metrics, serve_mpi

__all__ = [
    "device_planner",
    "Plan",
    "Request",
    "ScheduleResult",
    "WeightController",
    "attention",
    "attention_pairs",
    "dense_pairs",
    "distributed_attention",
    "exact_attention",
    "head_range",
    "mass_recall",
    "metrics",
    "plan",
    "plan_arrays",
    "plan_from_mask",
    "sampled_error",
    "sequence_range",
    "serve_mpi",
    "utilization",
    "window_entropy",
    "window_starts",
]


def __getattr__(name: str):
    """``device_planner`` on first use (it imports the GPU layer)."""
    if name == "device_planner":
        return importlib.import_module(f"{__name__}.device_planner")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
