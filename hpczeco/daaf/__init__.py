"""DAAF: Dynamic Attention Allocation Framework (seed ``004_*.txt``; docs/DESIGN.md, section DAAF).

An entropy scan of the token stream marks key regions (:func:`plan`); key-region tokens get global
attention both ways, every other token local sliding-window attention (:func:`attention`).

Public API:

- planning: ``tokenize``, ``window_entropy``, ``window_starts``, ``plan``, ``plan_from_mask``,
  ``Plan``, ``plan_arrays`` (the index-array interface of the CPU/GPU kernels), ``attention_pairs``
- attention: ``attention`` (CPU blockwise / GPU dispatch), ``exact_attention`` (dense causal),
  ``attention_reference`` / ``exact_attention_reference`` (float64, O(T^2), tests)
"""

from .attention import attention, exact_attention
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
from .tokenizer import tokenize

__all__ = [
    "Plan",
    "allowed_mask",
    "attention",
    "attention_pairs",
    "attention_reference",
    "dense_pairs",
    "exact_attention",
    "exact_attention_reference",
    "plan",
    "plan_arrays",
    "plan_from_mask",
    "tokenize",
    "window_entropy",
    "window_starts",
]
