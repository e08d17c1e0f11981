"""float64 references for DAAF attention and exact causal attention.

These build the full ``[T, T]`` allowed-pair mask and are O(T^2) in time and memory: tests and
small ``T`` only. The fast paths (``attention``, ``exact_attention``) must equal them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .planner import Plan

__all__ = ["allowed_mask", "attention_reference", "exact_attention_reference"]


def allowed_mask(global_mask: Any, local_window: int) -> np.ndarray:
    """``[T, T]`` bool: ``allowed[t, j]`` iff query ``t`` attends to key ``j`` under DAAF.

    ``j <= t`` and (``t - j <= local_window`` or ``global_mask[t]`` or ``global_mask[j]``).
    """
    g = np.asarray(global_mask, dtype=bool)
    T = len(g)
    t = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    return (j <= t) & ((t - j <= local_window) | g[:, None] | g[None, :])


def _masked_softmax_attention(q, k, v, allowed, scale):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    s = np.einsum("bthd,bjhd->bhtj", q, k) * scale
    s = np.where(allowed[None, None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhtj,bjhe->bthe", p, v)


def attention_reference(q: Any, k: Any, v: Any, plan: Plan | Any, scale: float | None = None,
                        local_window: int | None = None) -> np.ndarray:
    """DAAF attention in float64, ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]`` -> ``o: [B, T, H, Dv]``.

    ``plan`` is a :class:`Plan` or a bool key-region mask ``[T]`` (then ``local_window`` is required).
    ``scale`` defaults to ``D ** -0.5``. O(T^2): for tests.
    """
    if isinstance(plan, Plan):
        g, W = plan.global_mask, plan.local_window
    else:
        if local_window is None:
            raise ValueError("local_window is required when plan is a mask")
        g, W = np.asarray(plan, dtype=bool), int(local_window)
    return _masked_softmax_attention(q, k, v, allowed_mask(g, W), scale)


def exact_attention_reference(q: Any, k: Any, v: Any, scale: float | None = None) -> np.ndarray:
    """Dense causal attention in float64, shapes as :func:`attention_reference`. O(T^2): for tests."""
    T = np.shape(q)[1]
    return _masked_softmax_attention(q, k, v, np.tril(np.ones((T, T), dtype=bool)), scale)
