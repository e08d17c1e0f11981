"""DAAF: Dynamic Attention Allocation Framework (seed ``004_*.txt``; docs/DESIGN.md, section DAAF).

An entropy scan of the token stream marks key regions (:func:`plan`); key-region tokens get global
attention both ways, every other token local sliding-window attention (:func:`attention`).

Public API:

- planning: ``tokenize``, ``window_entropy``, ``window_starts``, ``plan``, ``plan_from_mask``,
  ``Plan``, ``plan_arrays`` (the index-array interface of the CPU/GPU kernels), ``attention_pairs``;
  ``device_planner`` (``plan`` / ``plan_torch`` / ``window_entropy`` / ``host_plan`` on the GPU; imported on
  first use)
- attention: ``attention`` (CPU blockwise / GPU dispatch), ``exact_attention`` (dense causal),
  ``attention_reference`` / ``exact_attention_reference`` (float64, O(T^2), tests)
- MPI: ``distributed_attention`` (sequence split with halo exchange, or heads split)
- control: ``WeightController`` (the seed's weight rule), ``sampled_error``, ``mass_recall``
- serving: ``Request``, ``simulate`` / ``serve_mpi`` (priority = density / time to deadline, or FCFS)
- model: ``PrefillModel``, ``ModelConfig`` (random-weight decoder, dense or DAAF prefill)
"""

import importlib

from .attention import attention, exact_attention
from .controller import WeightController, mass_recall, run_rounds, run_trace, sampled_error, utilization
from .distributed import distributed_attention, head_range, sequence_range
from .model import ModelConfig, PrefillModel, PrefillResult
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
from .reference import allowed_mask, attention_reference, exact_attention_reference
from .scheduler import Request, ScheduleResult, metrics, serve_mpi, simulate
from .tokenizer import tokenize

__all__ = [
    "device_planner",
    "ModelConfig",
    "Plan",
    "PrefillModel",
    "PrefillResult",
    "Request",
    "ScheduleResult",
    "WeightController",
    "allowed_mask",
    "attention",
    "attention_pairs",
    "attention_reference",
    "dense_pairs",
    "distributed_attention",
    "exact_attention",
    "exact_attention_reference",
    "head_range",
    "mass_recall",
    "metrics",
    "plan",
    "plan_arrays",
    "plan_from_mask",
    "run_rounds",
    "run_trace",
    "sampled_error",
    "sequence_range",
    "serve_mpi",
    "simulate",
    "tokenize",
    "utilization",
    "window_entropy",
    "window_starts",
]


def __getattr__(name: str):
    """``device_planner`` on first use (it imports the GPU layer)."""
    if name == "device_planner":
        return importlib.import_module(f"{__name__}.device_planner")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
