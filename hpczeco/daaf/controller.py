"""The DAAF weight controller (the seed's dynamic weight rule) and the error/recall measurements it uses.

Rule (seed ``004``, docs/DESIGN.md): the weight ``w`` starts at 0.5; after each round,

    if error > error_threshold:  w += 0.1 * (1 - utilization)
    else:                        w -= 0.05 * utilization
    w = clamp(w, 0.3, 0.8)

**What w means.** ``w`` is the budget of global attention expressed as a share of the dense causal
attention work: the next plan is ``plan(tokens, work_budget=w)``, i.e. the highest-entropy windows
are made key regions while the exact query-key pair count stays ``<= w * T (T + 1) / 2``. So
``w = 0.5`` allows at most half of the dense work (at least 2x fewer pairs), ``w = 0.3`` at most 30%,
``w = 0.8`` at most 80%.

**Error.** The relative error of DAAF attention against exact causal attention on a deterministic
sample of query rows: ``||o_daaf[rows] - o_exact[rows]||_F / ||o_exact[rows]||_F`` (all batches and
heads; :func:`sampled_error`). Only the sampled rows are computed exactly (``O(n_rows * T)``).

**Utilization.** The fraction of the round's time budget the prefill kept the processor busy:
``u = min(1, busy_seconds / budget_seconds)`` (:func:`utilization`); with a device it is the device
busy time of the last round over the round's length. High utilization means little spare capacity:
the weight grows slowly when the error is high and shrinks fast when it is low.

Everything here is deterministic given the trace of (error, utilization) pairs. Closed loops that drive the
controller over rounds (a fixed trace, or plan-measure-update) are programs: :mod:`hpczeco.drivers.daaf_demo.control`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .attention import check_qkv, resolve_scale
from .kernels import causal_rows, finalize, local_rows
from .planner import Plan, plan

__all__ = [
    "WeightController",
    "utilization",
    "sample_rows",
    "exact_rows",
    "daaf_rows",
    "sampled_error",
    "mass_recall",
]


def utilization(busy_seconds: float, budget_seconds: float) -> float:
    """``min(1, busy / budget)``: the share of the round's time budget spent computing."""
    if not (budget_seconds > 0 and math.isfinite(budget_seconds)):
        raise ValueError(f"budget_seconds must be positive and finite, got {budget_seconds}")
    if not (busy_seconds >= 0 and math.isfinite(busy_seconds)):
        raise ValueError(f"busy_seconds must be >= 0 and finite, got {busy_seconds}")
    return min(1.0, busy_seconds / budget_seconds)


@dataclass
class WeightController:
    """The seed's weight rule; ``w`` is the work budget of the next plan (see the module docstring)."""

    w0: float = 0.5
    error_threshold: float = 0.05
    up: float = 0.1
    down: float = 0.05
    w_min: float = 0.3
    w_max: float = 0.8
    w: float = field(init=False)
    history: list[dict] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not (0 <= self.w_min <= self.w_max <= 1):
            raise ValueError(f"need 0 <= w_min <= w_max <= 1, got [{self.w_min}, {self.w_max}]")
        if not (self.w_min <= self.w0 <= self.w_max):
            raise ValueError(f"w0 ({self.w0}) must lie in [w_min, w_max] = [{self.w_min}, {self.w_max}]")
        if not self.error_threshold >= 0:
            raise ValueError(f"error_threshold must be >= 0, got {self.error_threshold}")
        self.w = float(self.w0)

    def update(self, error: float, utilization: float) -> float:
        """Apply one round's measurement and return the new weight."""
        if not (isinstance(error, (int, float, np.floating)) and math.isfinite(error) and error >= 0):
            raise ValueError(f"error must be a finite number >= 0, got {error!r}")
        if not (isinstance(utilization, (int, float, np.floating)) and 0 <= utilization <= 1):
            raise ValueError(f"utilization must lie in [0, 1], got {utilization!r}")
        before = self.w
        if error > self.error_threshold:
            w = before + self.up * (1.0 - utilization)
        else:
            w = before - self.down * utilization
        self.w = min(self.w_max, max(self.w_min, w))
        self.history.append({"w_before": before, "error": float(error), "utilization": float(utilization),
                             "w": self.w})
        return self.w

    def plan(self, tokens: Any, **plan_kwargs: Any) -> Plan:
        """The plan of the next round: ``plan(tokens, work_budget=self.w, **plan_kwargs)``."""
        return plan(tokens, work_budget=self.w, **plan_kwargs)


# --------------------------------------------------------------------------- sampled measurements


def sample_rows(T: int, n: int, seed: int = 0, min_row: int = 0) -> np.ndarray:
    """``min(n, T - min_row)`` distinct sorted query rows in ``[min_row, T)`` (deterministic in ``seed``)."""
    if T <= min_row:
        return np.zeros(0, dtype=np.int64)
    n = min(int(n), T - min_row)
    return np.sort(np.random.default_rng(seed).choice(np.arange(min_row, T), size=n, replace=False))


def _hm(x: np.ndarray) -> np.ndarray:
    dt = np.float64 if x.dtype == np.float64 else np.float32
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=dt)


def exact_rows(q, k, v, rows: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Exact causal attention at query ``rows`` only: ``[B, n, H, Dv]`` (``O(n T)``)."""
    check_qkv(q, k, v)
    scale = resolve_scale(scale, q.shape[-1])
    qh, kh, vh = _hm(q), _hm(k), _hm(v)
    rows = np.asarray(rows, dtype=np.int64)
    out = np.empty((qh.shape[0], qh.shape[1], len(rows), vh.shape[-1]), dtype=qh.dtype)
    for c in range(0, len(rows), 64):
        r = rows[c : c + 64]
        out[:, :, c : c + len(r)] = finalize(causal_rows(qh[:, :, r], r, kh, vh, 0, scale))
    return out.transpose(0, 2, 1, 3)


def daaf_rows(q, k, v, p: Plan, rows: np.ndarray, scale: float | None = None) -> np.ndarray:
    """DAAF attention at query ``rows`` only: ``[B, n, H, Dv]``."""
    check_qkv(q, k, v, p.T)
    scale = resolve_scale(scale, q.shape[-1])
    qh, kh, vh = _hm(q), _hm(k), _hm(v)
    g = p.global_mask
    gidx = np.flatnonzero(g)
    kg, vg = kh[:, :, gidx], vh[:, :, gidx]
    rows = np.asarray(rows, dtype=np.int64)
    out = np.empty((qh.shape[0], qh.shape[1], len(rows), vh.shape[-1]), dtype=qh.dtype)
    for i, t in enumerate(rows):
        r = np.array([t])
        if g[t]:
            st = causal_rows(qh[:, :, r], r, kh, vh, 0, scale)
        else:
            st = local_rows(qh[:, :, r], r, kh, vh, 0, g, kg, vg, gidx, p.local_window, scale)
        out[:, :, i : i + 1] = finalize(st)
    return out.transpose(0, 2, 1, 3)


def sampled_error(q, k, v, p: Plan, rows: np.ndarray, scale: float | None = None,
                  o_daaf: np.ndarray | None = None) -> float:
    """Relative Frobenius error of DAAF vs exact attention on ``rows`` (``o_daaf``: full DAAF output
    ``[B, T, H, Dv]`` if already computed, else the rows are computed here)."""
    ex = exact_rows(q, k, v, rows, scale).astype(np.float64)
    da = (o_daaf[:, rows] if o_daaf is not None else daaf_rows(q, k, v, p, rows, scale)).astype(np.float64)
    den = float(np.linalg.norm(ex))
    return float(np.linalg.norm(da - ex)) / den if den > 0 else float(np.linalg.norm(da - ex))


def mass_recall(q, k, v, p: Plan, rows: np.ndarray, scale: float | None = None) -> float:
    """Mean over ``rows`` (and batches, heads) of the exact softmax mass on the keys DAAF keeps."""
    check_qkv(q, k, v, p.T)
    scale = resolve_scale(scale, q.shape[-1])
    qh, kh = _hm(q).astype(np.float64), _hm(k).astype(np.float64)
    g, W = p.global_mask, p.local_window
    tot = []
    for t in np.asarray(rows, dtype=np.int64):
        s = np.einsum("bhd,bhjd->bhj", qh[:, :, t], kh[:, :, : t + 1]) * scale
        s -= s.max(-1, keepdims=True)
        w = np.exp(s)
        w /= w.sum(-1, keepdims=True)
        j = np.arange(t + 1)
        keep = np.ones(t + 1, bool) if g[t] else ((t - j <= W) | g[: t + 1])
        tot.append(w[..., keep].sum(-1).mean())
    return float(np.mean(tot)) if tot else 1.0
