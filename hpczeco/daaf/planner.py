"""DAAF planning: entropy scan -> key regions -> a :class:`Plan` that the attention kernels follow.

Entropy scan
------------
Windows of ``window`` tokens start at ``0, stride, 2 stride, ...`` (``stride`` defaults to
``window``) while they fit; if the last one stops short of the end, one more window aligned to
the end (``[T - window, T)``) is added, so every token lies in at least one window. The score of a
window is the Shannon entropy (bits) of its token-id histogram divided by
``log2(min(window, vocab_size))`` (the largest entropy a window can have; ``vocab_size=None``
means an unbounded vocabulary, i.e. ``log2(window)``). With ``bias_correction="miller-madow"`` the
plug-in estimate gets the Miller–Madow term ``(m - 1) / (2 N ln 2)`` bits (``m`` distinct ids,
``N = window``), which removes most of the downward bias of the plug-in estimate on short windows;
the normalised score is then clipped to ``[0, 1]``. The default is no correction (the seed's rule).
A score depends only on the multiset of id counts of its window (summed in ascending count order), so
windows that differ by a permutation of ids score exactly equal and rank by position.

Selection policies (recorded in ``Plan.policy`` with a human-readable ``Plan.reason``)
-----------------------------------------------------------------------------------------
``"threshold"``     windows with score ``>= threshold`` (default 0.8) are key windows.
``"budget"``        ``budget`` is the fraction of tokens allowed global: windows are taken in
                    descending score (ties: earlier first) while the key tokens stay within
                    ``max(budget * T, window)`` (so ``budget > 0`` always keeps at least one window;
                    ``budget = 0`` is an explicit all-local plan). This is a percentile rule: the
                    effective threshold is the score of the last window taken.
``"work-budget"``   ``work_budget`` is the fraction of the dense causal work (query-key pairs) the
                    plan may spend; the longest prefix of the ranked windows whose exact pair count
                    fits is taken (used by the controller, whose weight is this fraction).
``"dense"``         every token is global (= exact causal attention): used for texts shorter
                    than one window, where the scan has nothing to rank.
``"fallback-dense"`` / ``"fallback-budget"``
                    the threshold rule could not decide: the window scores are too uniform
                    (``max - min < uniform_eps``: logs, repeated records, or random ids) or no
                    window reached the threshold. ``policy="dense"`` (default) then plans dense
                    attention; ``policy="budget"`` keeps the top ``fallback_budget`` by percentile.
A threshold plan never silently ends up all-local.

Key regions are the union of the key windows, as sorted disjoint half-open spans. The work count is
exact: a global query ``t`` costs ``t + 1`` pairs; a local query ``t`` costs ``min(t, W) + 1`` pairs
plus one per key-region token ``j < t - W`` (``W = local_window``); dense causal costs
``T (T + 1) / 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..base.checks import check_int
from ..base.windows import window_starts

__all__ = [
    "Plan",
    "window_starts",
    "window_entropy",
    "plan",
    "plan_from_mask",
    "plan_arrays",
    "attention_pairs",
    "dense_pairs",
    "check_tokens",
    "choose_windows",
    "WindowChoice",
    "FALLBACK_POLICIES",
]

FALLBACK_POLICIES = ("dense", "budget")
_BIAS = ("none", "miller-madow")


# --------------------------------------------------------------------------- validation


def _check_fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    value = float(value)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return value


def check_tokens(tokens: Any, name: str = "tokens") -> np.ndarray:
    """``tokens`` as a 1-D int64 array; ``TypeError`` for non-integer ids, ``ValueError`` for empty,
    multi-dimensional or negative input."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(tokens).__name__} "
                        "(tokenize the text first)")
    arr = np.asarray(tokens)
    if arr.size == 0:
        raise ValueError(f"{name} is empty: nothing to plan")
    if arr.dtype == object:
        raise TypeError(f"{name} must hold int token ids, got objects such as {type(arr.flat[0]).__name__}"
                        if arr.size else f"{name} must hold int token ids")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold int token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [T], got shape {tuple(arr.shape)}")
    if arr.dtype.kind == "i" and arr.min() < 0:
        raise ValueError(f"{name} must be non-negative ids, got min {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


# --------------------------------------------------------------------------- entropy scan


def _entropy_rows(tok: np.ndarray, starts: np.ndarray, window: int, bias: str) -> np.ndarray:
    """Plug-in (or Miller–Madow) entropy in bits of each window ``tok[s : s + window]``."""
    out = np.empty(len(starts), dtype=np.float64)
    chunk = max(1, (1 << 22) // window)  # bound the [n, window] index matrix at ~4M entries
    ar = np.arange(window, dtype=np.int64)
    for c in range(0, len(starts), chunk):
        st = starts[c : c + chunk]
        rows = np.sort(tok[st[:, None] + ar[None, :]], axis=1)
        n = len(st)
        # runs of equal ids in each sorted row
        new = np.ones((n, window), dtype=bool)
        new[:, 1:] = rows[:, 1:] != rows[:, :-1]
        row_id, col = np.nonzero(new)
        ends = np.empty_like(col)
        ends[:-1] = col[1:]
        same_row = np.empty(len(col), dtype=bool)
        same_row[:-1] = row_id[1:] == row_id[:-1]
        same_row[-1] = False
        ends = np.where(same_row, ends, window)
        counts = ends - col
        # summed per row in ascending count order: the score is a function of the row's count multiset
        # (windows equal up to a permutation of ids score exactly equal, so ties rank by position)
        by = np.lexsort((counts, row_id))
        p = counts[by].astype(np.float64) / window
        h = np.bincount(row_id[by], weights=-p * np.log2(p), minlength=n)
        if bias == "miller-madow":
            m = np.bincount(row_id, minlength=n).astype(np.float64)
            h = h + (m - 1.0) / (2.0 * window * math.log(2.0))
        out[c : c + n] = h
    return out


def window_entropy(
    tokens: Any,
    window: int = 512,
    stride: int | None = None,
    vocab_size: int | None = None,
    bias_correction: str = "none",
) -> np.ndarray:
    """Normalised Shannon entropy ``[n_windows]`` in ``[0, 1]`` of each scan window of ``tokens`` ``[T]``.

    Windows as in :func:`window_starts`. Normaliser ``log2(min(window, vocab_size))``
    (``vocab_size=None``: unbounded, ``log2(window)``); a one-token window scores 0.
    ``bias_correction``: ``"none"`` (plug-in) or ``"miller-madow"`` (clipped to 1).
    ``ValueError`` if ``window`` exceeds the text or a token id is ``>= vocab_size``.
    """
    tok = check_tokens(tokens)
    window = check_int("window", window, 1)
    if bias_correction not in _BIAS:
        raise ValueError(f"bias_correction must be one of {_BIAS}, got {bias_correction!r}")
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, 1)
        if int(tok.max()) >= vocab_size:
            raise ValueError(f"tokens holds id {int(tok.max())} >= vocab_size ({vocab_size})")
    starts = window_starts(len(tok), window, stride)
    h = _entropy_rows(tok, starts, window, bias_correction)
    cap = window if vocab_size is None else min(window, vocab_size)
    if cap <= 1:
        return np.zeros_like(h)
    return np.clip(h / math.log2(cap), 0.0, 1.0)


# --------------------------------------------------------------------------- work count


def dense_pairs(T: int) -> int:
    """Query-key pairs of dense causal attention over ``T`` tokens: ``T (T + 1) / 2``."""
    return T * (T + 1) // 2


def attention_pairs(global_mask: np.ndarray, local_window: int) -> int:
    """Exact number of (query, key) pairs DAAF attention computes for ``global_mask`` ``[T]``."""
    g = np.asarray(global_mask, dtype=bool)
    T = len(g)
    W = int(local_window)
    cg = np.zeros(T + 1, dtype=np.int64)
    np.cumsum(g, out=cg[1:])
    t = np.arange(T, dtype=np.int64)
    local = np.minimum(t, W) + 1 + cg[np.clip(t - W, 0, None)]
    return int(np.where(g, t + 1, local).sum())


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class Plan:
    """A DAAF attention plan for one token stream of length ``T``.

    ``global_mask`` ``[T]`` bool marks key-region tokens (global both ways); ``regions`` are the
    same tokens as sorted disjoint half-open spans ``[(start, end)]``. The weight map is
    ``window_starts`` ``[n]`` / ``weights`` ``[n]`` (normalised window entropies) / ``selected`` ``[n]``.
    ``pairs`` is the exact attention work, ``dense`` the dense causal work.
    """

    T: int
    global_mask: np.ndarray
    regions: list[tuple[int, int]]
    local_window: int
    window: int
    stride: int
    window_starts: np.ndarray
    weights: np.ndarray
    selected: np.ndarray
    policy: str
    reason: str
    threshold: float | None
    pairs: int
    dense: int
    extra: dict = field(default_factory=dict)

    @property
    def n_global(self) -> int:
        return int(self.global_mask.sum())

    @property
    def global_fraction(self) -> float:
        return self.n_global / self.T

    @property
    def work_fraction(self) -> float:
        """DAAF pairs / dense causal pairs."""
        return self.pairs / self.dense

    @property
    def work_saved(self) -> float:
        """Fraction of the dense causal attention work (pairs) saved: ``1 - pairs / dense``."""
        return 1.0 - self.pairs / self.dense

    @property
    def density(self) -> float:
        """Information density of the text: mean normalised window entropy."""
        return float(np.mean(self.weights))

    @property
    def entropy_spread(self) -> float:
        return float(np.max(self.weights) - np.min(self.weights))

    def summary(self) -> str:
        regions = ", ".join(f"[{a},{b})" for a, b in self.regions[:8])
        if len(self.regions) > 8:
            regions += f", ... ({len(self.regions)} regions)"
        return (
            f"T={self.T} window={self.window} stride={self.stride} local_window={self.local_window}\n"
            f"policy={self.policy}: {self.reason}\n"
            f"windows={len(self.weights)} entropy min/mean/max={np.min(self.weights):.3f}/"
            f"{self.density:.3f}/{np.max(self.weights):.3f}\n"
            f"key regions ({len(self.regions)}): {regions or 'none'}\n"
            f"global tokens {self.n_global} ({100 * self.global_fraction:.1f}%), attention pairs "
            f"{self.pairs} of {self.dense} dense: work saved {100 * self.work_saved:.1f}%"
        )

    def to_dict(self) -> dict:
        """JSON-friendly summary (no per-token arrays)."""
        return {
            "T": self.T,
            "window": self.window,
            "stride": self.stride,
            "local_window": self.local_window,
            "policy": self.policy,
            "reason": self.reason,
            "threshold": self.threshold,
            "regions": [list(r) for r in self.regions],
            "n_global": self.n_global,
            "global_fraction": self.global_fraction,
            "pairs": self.pairs,
            "dense_pairs": self.dense,
            "work_saved": self.work_saved,
            "density": self.density,
            "weights": [float(x) for x in self.weights],
        }


def _spans(mask: np.ndarray) -> list[tuple[int, int]]:
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts = np.flatnonzero(d == 1)
    ends = np.flatnonzero(d == -1)
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def _mask_of(T: int, starts: np.ndarray, window: int, chosen: np.ndarray) -> np.ndarray:
    diff = np.zeros(T + 1, dtype=np.int64)
    np.add.at(diff, starts[chosen], 1)
    np.add.at(diff, starts[chosen] + window, -1)
    return np.cumsum(diff[:T]) > 0


def _make(T, mask, W, window, stride, starts, weights, selected, policy, reason, threshold, extra=None) -> Plan:
    mask = np.ascontiguousarray(mask, dtype=bool)
    return Plan(
        T=T,
        global_mask=mask,
        regions=_spans(mask),
        local_window=W,
        window=window,
        stride=stride,
        window_starts=np.asarray(starts, dtype=np.int64),
        weights=np.asarray(weights, dtype=np.float64),
        selected=np.asarray(selected, dtype=bool),
        policy=policy,
        reason=reason,
        threshold=None if threshold is None else float(threshold),
        pairs=attention_pairs(mask, W),
        dense=dense_pairs(T),
        extra=dict(extra or {}),
    )


def plan(
    tokens: Any,
    window: int = 512,
    threshold: float = 0.8,
    local_window: int = 128,
    budget: float | None = None,
    policy: str = "dense",
    *,
    stride: int | None = None,
    vocab_size: int | None = None,
    work_budget: float | None = None,
    fallback_budget: float = 0.25,
    uniform_eps: float = 0.02,
    bias_correction: str = "none",
) -> Plan:
    """Plan DAAF attention for ``tokens`` ``[T]`` (see the module docstring for every rule).

    ``budget`` (fraction of tokens allowed global) or ``work_budget`` (fraction of the dense causal
    pairs allowed) replace the ``threshold`` rule by a percentile rule. ``policy`` is the fallback
    when the threshold rule cannot decide: ``"dense"`` or ``"budget"`` (``fallback_budget``).
    Texts shorter than ``window`` are planned dense. The result records the policy used and why.
    """
    tok = check_tokens(tokens)
    T = len(tok)
    window = check_int("window", window, 1)
    W = check_int("local_window", local_window, 0)
    threshold = _check_fraction("threshold", threshold)
    if budget is not None:
        budget = _check_fraction("budget", budget)
    if work_budget is not None:
        work_budget = _check_fraction("work_budget", work_budget)
    fallback_budget = _check_fraction("fallback_budget", fallback_budget)
    uniform_eps = _check_fraction("uniform_eps", uniform_eps)
    if policy not in FALLBACK_POLICIES:
        raise ValueError(f"policy must be one of {FALLBACK_POLICIES}, got {policy!r}")
    if stride is not None:
        check_int("stride", stride, 1)

    if T < window:  # nothing to rank: one score for the whole text (the density), dense attention
        weights = window_entropy(tok, T, None, vocab_size, bias_correction)
        return _make(T, np.ones(T, bool), W, window, stride or window, np.zeros(1, np.int64), weights,
                     np.ones(1, bool), "dense", short_text_reason(T, window), None)

    stride = window if stride is None else stride
    starts = window_starts(T, window, stride)
    ent = window_entropy(tok, window, stride, vocab_size, bias_correction)
    ch = choose_windows(ent, starts, T, window, W, threshold, budget, policy, work_budget=work_budget,
                        fallback_budget=fallback_budget, uniform_eps=uniform_eps)
    mask = np.ones(T, bool) if ch.dense else _mask_of(T, starts, window, ch.selected)
    return _make(T=T, mask=mask, W=W, window=window, stride=stride, starts=starts, weights=ent,
                 selected=ch.selected, policy=ch.policy, reason=ch.reason, threshold=ch.threshold, extra=ch.extra)


@dataclass(frozen=True, eq=False)
class WindowChoice:
    """The key windows a selection policy picks: ``selected`` bool ``[n_windows]``, the ``policy`` used and why
    (``reason``), the effective ``threshold`` (None when no threshold applies), ``dense`` (every token global,
    whatever the windows: the dense fallback) and the policy's parameters (``extra``)."""

    selected: np.ndarray
    policy: str
    reason: str
    threshold: float | None
    dense: bool = False
    extra: dict = field(default_factory=dict)


def short_text_reason(T: int, window: int) -> str:
    """``Plan.reason`` of a text shorter than one window."""
    return f"text of {T} tokens is shorter than one window ({window}): dense attention"


def threshold_reason(n_selected: int, n_windows: int, threshold: float) -> str:
    """``Plan.reason`` of a threshold plan."""
    return f"{n_selected} of {n_windows} windows with entropy >= {threshold}"


def undecided_reason(emin: float, emax: float, threshold: float, uniform_eps: float) -> str | None:
    """Why the threshold rule cannot decide on scores in ``[emin, emax]`` (None: it can)."""
    spread = float(emax - emin)
    if spread < uniform_eps:
        return f"window entropies too uniform to separate (spread {spread:.4f} < {uniform_eps})"
    if not emax >= threshold:
        return f"no window reached threshold {threshold} (max entropy {emax:.3f})"
    return None


def choose_windows(
    ent: np.ndarray,
    starts: np.ndarray,
    T: int,
    window: int,
    local_window: int,
    threshold: float = 0.8,
    budget: float | None = None,
    policy: str = "dense",
    *,
    work_budget: float | None = None,
    fallback_budget: float = 0.25,
    uniform_eps: float = 0.02,
) -> WindowChoice:
    """The key windows of :func:`plan` (every rule in the module docstring) from the window scores ``ent``
    ``[n]`` (float64) at ``starts`` ``[n]`` over ``T >= window`` tokens; arguments already checked."""
    ent = np.asarray(ent, dtype=np.float64)
    starts = np.asarray(starts, dtype=np.int64)
    W = int(local_window)
    order = np.argsort(-ent, kind="stable")  # descending score, ties: earlier window first

    def by_prefix(k: int, pol: str, reason: str, extra=None) -> WindowChoice:
        chosen = np.zeros(len(ent), dtype=bool)
        chosen[order[:k]] = True
        thr = float(ent[order[k - 1]]) if k > 0 else None
        return WindowChoice(chosen, pol, reason, thr, False, dict(extra or {}))

    def coverage_prefix(frac: float) -> int:
        cap = max(frac * T, window) if frac > 0 else 0.0
        covered = np.zeros(T, dtype=bool)
        k = n_cov = 0
        for i in order:
            s = starts[i]
            add = int((~covered[s : s + window]).sum())
            if n_cov + add > cap:
                break
            covered[s : s + window] = True
            n_cov += add
            k += 1
        return k

    if work_budget is not None:
        dense = dense_pairs(T)
        lo, hi = 0, len(ent)  # largest k with pairs(k) <= work_budget * dense (pairs grow with k)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            chosen = np.zeros(len(ent), dtype=bool)
            chosen[order[:mid]] = True
            if attention_pairs(_mask_of(T, starts, window, chosen), W) <= work_budget * dense:
                lo = mid
            else:
                hi = mid - 1
        reason = f"top {lo} of {len(ent)} windows by entropy within work budget {work_budget:.3f} of dense"
        if lo == 0:
            reason = f"no window fits the work budget {work_budget:.3f} of dense: local attention only"
        return by_prefix(lo, "work-budget", reason, {"work_budget": work_budget})
    if budget is not None:
        k = coverage_prefix(budget)
        reason = f"top {k} of {len(ent)} windows by entropy within token budget {budget:.3f}"
        if k == 0:
            reason = "budget = 0: explicit local-only plan"
        return by_prefix(k, "budget", reason, {"budget": budget})

    why = undecided_reason(float(ent.min()), float(ent.max()), threshold, uniform_eps)
    if why is None:
        chosen = ent >= threshold
        return WindowChoice(chosen, "threshold", threshold_reason(int(chosen.sum()), len(ent), threshold), threshold)
    if policy == "dense":
        return WindowChoice(np.ones(len(ent), bool), "fallback-dense", why + "; fallback: dense attention", None,
                            True)
    k = coverage_prefix(fallback_budget)
    return by_prefix(k, "fallback-budget", why + f"; fallback: top {k} windows by percentile "
                     f"(budget {fallback_budget:.3f})", {"budget": fallback_budget})


def plan_from_mask(global_mask: Any, local_window: int = 128, reason: str = "explicit global mask") -> Plan:
    """A :class:`Plan` with an explicit key-region mask ``[T]`` (tests, experiments; policy ``"explicit"``)."""
    g = np.asarray(global_mask)
    if g.dtype != bool:
        raise TypeError(f"global_mask must be a bool array, got dtype {g.dtype}")
    if g.ndim != 1 or g.size == 0:
        raise ValueError(f"global_mask must be a non-empty 1-D [T] array, got shape {tuple(g.shape)}")
    W = check_int("local_window", local_window, 0)
    T = len(g)
    return _make(T=T, mask=g, W=W, window=T, stride=T, starts=np.zeros(1, np.int64), weights=np.zeros(1),
                 selected=np.zeros(1, bool), policy="explicit", reason=reason, threshold=None)


def plan_arrays(plan: Plan) -> dict:
    """The index-array form of ``plan`` that the kernels (CPU and GPU) receive. Host numpy arrays:

    ``T`` (int), ``local_window`` (int, ``W``),
    ``global_idx``           int32 ``[G]``   sorted ascending positions of the key-region tokens;
    ``is_global_query_mask`` bool  ``[T]``   True at key-region tokens (the same set as ``global_idx``);
    ``n_global_before``      int32 ``[T+1]`` ``n_global_before[i]`` = number of key-region tokens at
                                             positions ``< i``;
    ``spans``                int32 ``[R, 2]`` the key regions as half-open ``[start, end)``.

    Semantics (causal; each key counted once; softmax over the union): query ``t`` attends to

    * every key ``j <= t`` if ``is_global_query_mask[t]``;
    * otherwise the local keys ``j in [max(0, t - W), t]`` and the key-region keys
      ``global_idx[: n_global_before[max(0, t - W)]]`` (those strictly before the local window).

    Output ``o[b, t, h] = sum_j softmax_j(scale * q[b, t, h] . k[b, j, h]) v[b, j, h]``.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a hpczeco.daaf.Plan, got {type(plan).__name__}")
    g = plan.global_mask
    nb = np.zeros(plan.T + 1, dtype=np.int32)
    np.cumsum(g, out=nb[1:])
    spans = np.asarray(plan.regions, dtype=np.int32).reshape(-1, 2)
    return {
        "T": plan.T,
        "local_window": plan.local_window,
        "global_idx": np.flatnonzero(g).astype(np.int32),
        "is_global_query_mask": g.copy(),
        "n_global_before": nb,
        "spans": spans,
    }
