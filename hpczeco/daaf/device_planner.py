"""DAAF planning on the device: the CPU planner's :func:`hpczeco.daaf.plan` with the CuPy RawKernels of
``gpu/daaf_plan.cu`` (launched by :mod:`hpczeco.gpu.daaf_plan`).

:func:`plan` runs two kernels on CuPy's current stream -- the entropy scan (one block per window, the window's
ids sorted in shared memory: no vocabulary-sized histogram, any int64 ids) and one single-block kernel for the
threshold, the dense fallback, the key-region mask, its compaction to a sorted ``global_idx``, the key regions
as spans and (optionally) ``n_global_before`` -- and reads one small array back at the end (the host metadata:
key-token and region counts, the policy the rule took, the id range for the input errors). It returns a
:class:`hpczeco.gpu.daaf.DevicePlan` that :func:`hpczeco.gpu.daaf.prepare` / ``attention`` /
``attention_torch`` take as ``plan=`` (no further host round trip per layer or call).

Rules: those of :mod:`hpczeco.daaf.planner` (windows, normalised plug-in or Miller-Madow entropy, threshold,
``policy="dense"`` fallback on the device). The percentile rules (``budget``, ``work_budget``, and the
``policy="budget"`` fallback when the threshold rule cannot decide) rank the windows on the host from the device
scores (:func:`hpczeco.daaf.planner.choose_windows`): one more round trip, then the mask and index on the device.
Scores are float64 and, on both sides, a function of the window's id-count multiset (so windows that differ by
a permutation of ids score exactly equal on each side, and every rule ranks such ties by position, as the CPU
planner does); the device's summation order and ``log2`` differ from numpy's (relative differences ~1e-16),
so a window whose score lies within that distance of the threshold (or of another window's score, for the
percentile rules) may be chosen differently than on the CPU. A score exactly equal to the threshold is chosen
(``>=``) on both (e.g. 1.0 for all-distinct windows, 0.0 for constant ones). Windows up to :data:`MAX_WINDOW`.
Nothing here talks MPI.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..base.checks import check_int
from ..gpu import daaf_plan as kernels
from ..gpu.daaf import DevicePlan
from . import planner as _planner

__all__ = ["MAX_WINDOW", "host_plan", "plan", "plan_torch", "window_entropy"]

MAX_WINDOW = kernels.MAX_WINDOW


def _device_tokens(tokens: Any):
    """``tokens`` ``[T]`` as a contiguous int32/int64 device array (numpy input is uploaded)."""
    rt = kernels.RUNTIME.get()
    xp = rt.xp
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"tokens must be a sequence of int token ids, got {type(tokens).__name__} "
                        "(tokenize the text first)")
    if rt.is_native(tokens):
        tok = tokens
    elif type(tokens).__module__.startswith("torch") and getattr(tokens, "is_cuda", False):
        tok = xp.from_dlpack(tokens.contiguous())
    else:
        arr = np.asarray(tokens)
        if arr.dtype == object:
            raise TypeError("tokens must hold int token ids")
        tok = arr
    if tok.dtype.kind not in "iu":
        raise TypeError(f"tokens must hold int token ids, got dtype {tok.dtype}")
    if tok.ndim != 1:
        raise ValueError(f"tokens must be 1-D [T], got shape {tuple(tok.shape)}")
    if tok.size == 0:
        raise ValueError("tokens is empty: nothing to plan")
    if tok.size >= 2**31 - kernels.MAX_THREADS * kernels.ITEMS:
        raise ValueError(f"tokens has {tok.size} entries: too many for the int32 indices of the plan")
    dt = np.int32 if tok.dtype == np.int32 else np.int64
    if isinstance(tok, np.ndarray) and not rt.is_native(tok):
        return xp.asarray(np.ascontiguousarray(tok, dtype=dt))
    return xp.ascontiguousarray(tok, dtype=dt)


class _Scan:
    """The scan windows of one token stream (the CPU planner's :func:`~hpczeco.daaf.planner.window_starts`)
    and the outputs of the device's entropy scan over them."""

    def __init__(self, tok, window: int, stride: int, vocab_size: int | None, bias: str, threads: int | None):
        T = int(tok.size)
        self.T, self.window, self.stride = T, window, stride
        self.nreg = (T - window) // stride + 1
        self.starts = _planner.window_starts(T, window, stride)
        self.nw = len(self.starts)
        cap = window if vocab_size is None else min(window, vocab_size)
        log2cap = math.log2(cap) if cap > 1 else 0.0
        self.ent, self.wmin, self.wmax = kernels.entropy_scan(tok, window, stride, self.nreg, self.nw, log2cap,
                                                              bias == "miller-madow", threads)


def _check_ids(lo: int, hi: int, vocab_size: int | None) -> None:
    if lo < 0:
        raise ValueError(f"tokens must be non-negative ids, got min {lo}")
    if vocab_size is not None and hi >= vocab_size:
        raise ValueError(f"tokens holds id {hi} >= vocab_size ({vocab_size})")


def _check_scan_args(window: Any, vocab_size: Any, bias_correction: str) -> tuple[int, int | None]:
    window = check_int("window", window, 1)
    if window > MAX_WINDOW:
        raise ValueError(f"the device planner supports window <= {MAX_WINDOW}, got {window} (use hpczeco.daaf.plan)")
    if bias_correction not in ("none", "miller-madow"):
        raise ValueError(f"bias_correction must be one of ('none', 'miller-madow'), got {bias_correction!r}")
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, 1)
    return window, vocab_size


def window_entropy(tokens: Any, window: int = 512, stride: int | None = None, vocab_size: int | None = None,
                   bias_correction: str = "none", *, validate: bool = True, threads: int | None = None):
    """Normalised window entropies ``[n_windows]`` (float64 device array) of ``tokens`` ``[T]``: the CPU
    planner's :func:`hpczeco.daaf.window_entropy` on the device. ``validate`` reads the id range back (one
    synchronisation) for the CPU planner's errors (negative ids, ids ``>= vocab_size``)."""
    window, vocab_size = _check_scan_args(window, vocab_size, bias_correction)
    tok = _device_tokens(tokens)
    T = int(tok.size)
    stride = window if stride is None else check_int("stride", stride, 1)
    if window > T:
        raise ValueError(f"window ({window}) is larger than the text ({T} tokens)")
    scan = _Scan(tok, window, stride, vocab_size, bias_correction, threads)
    if validate:
        xp = kernels.RUNTIME.get().xp
        lo_hi = kernels.to_host(xp.stack([scan.wmin.min(), scan.wmax.max()]))
        _check_ids(int(lo_hi[0]), int(lo_hi[1]), vocab_size)
    return scan.ent


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
    n_global_before: bool = False,
    threads: int | None = None,
    select_threads: int | None = None,
) -> DevicePlan:
    """Plan DAAF attention for ``tokens`` ``[T]`` (CuPy, torch CUDA or host ints) on the device.

    Arguments and rules as :func:`hpczeco.daaf.plan`. Returns a :class:`~hpczeco.gpu.daaf.DevicePlan`:
    ``global_idx`` int32 ``[G]``, ``gmask`` uint8 ``[T]``, host ``n_global``; ``info`` holds ``policy``,
    ``reason``, ``threshold``, ``window``, ``stride``, ``window_starts`` (host int64 ``[n]``), ``weights``
    (device float64 ``[n]``), ``selected`` (device uint8 ``[n]``), ``spans`` (device int32 ``[R, 2]``),
    ``n_regions``, ``n_selected`` and ``n_global_before`` (device int32 ``[T + 1]`` when asked, else None).
    One host synchronisation (two for the percentile rules). ``threads`` / ``select_threads``: block sizes
    of the two kernels (powers of two in [32, 1024]; the tests use small ones).
    """
    window, vocab_size = _check_scan_args(window, vocab_size, bias_correction)
    W = check_int("local_window", local_window, 0)
    threshold = _planner._check_fraction("threshold", threshold)
    if budget is not None:
        budget = _planner._check_fraction("budget", budget)
    if work_budget is not None:
        work_budget = _planner._check_fraction("work_budget", work_budget)
    fallback_budget = _planner._check_fraction("fallback_budget", fallback_budget)
    uniform_eps = _planner._check_fraction("uniform_eps", uniform_eps)
    if policy not in _planner.FALLBACK_POLICIES:
        raise ValueError(f"policy must be one of {_planner.FALLBACK_POLICIES}, got {policy!r}")
    if stride is not None:
        check_int("stride", stride, 1)
    nts = kernels.check_threads(select_threads, kernels.SELECT_THREADS, "select_threads")
    tok = _device_tokens(tokens)
    xp = kernels.RUNTIME.get().xp
    T = int(tok.size)
    short = T < window
    stride_eff = T if short else (window if stride is None else stride)
    scan = _Scan(tok, T if short else window, stride_eff, vocab_size, bias_correction, threads)
    host_rule = budget is not None or work_budget is not None
    if short:
        mode = "dense"
    elif host_rule:
        mode = None
    else:
        mode = "threshold+dense" if policy == "dense" else "threshold+host"
    out = kernels.SelectBuffers(scan.nw, T, n_global_before)

    def select(m: str) -> kernels.SelectInfo:
        return kernels.select(scan.ent, scan.wmin, scan.wmax, out, T, scan.window, stride_eff, scan.nreg, m,
                              threshold, uniform_eps, nts)

    # the threshold rule (or the report that it cannot decide) in one pass; percentile rules: host ranking
    inf = select("threshold+host" if mode is None else mode)
    _check_ids(inf.id_min, inf.id_max, vocab_size)
    emin, emax = inf.entropy_min, inf.entropy_max
    thr_used: float | None = None
    extra: dict = {}
    if short:
        pol, reason = "dense", _planner.short_text_reason(T, window)
    elif mode is None or inf.policy == "host":
        ch = _planner.choose_windows(kernels.to_host(scan.ent), scan.starts, T, window, W, threshold, budget, policy,
                                     work_budget=work_budget, fallback_budget=fallback_budget,
                                     uniform_eps=uniform_eps)
        out.chosen[...] = xp.asarray(ch.selected.astype(np.uint8))
        inf = select("given")
        pol, reason, thr_used, extra = ch.policy, ch.reason, ch.threshold, ch.extra
    elif inf.policy == "threshold":
        pol, reason, thr_used = "threshold", _planner.threshold_reason(inf.n_selected, scan.nw, threshold), threshold
    else:  # fallback-dense
        why = _planner.undecided_reason(emin, emax, threshold, uniform_eps)
        pol, reason = "fallback-dense", f"{why}; fallback: dense attention"
    G, R = inf.n_global, inf.n_regions
    return DevicePlan(out.gidx[:G], out.mask, T, W, n_global=G, info={
        "policy": pol, "reason": reason, "threshold": thr_used, "extra": extra, "window": window,
        "stride": window if stride is None else stride, "window_starts": np.zeros(1, np.int64) if short
        else scan.starts, "weights": scan.ent, "selected": out.chosen, "spans": out.spans[: 2 * R].reshape(R, 2),
        "n_regions": R, "n_selected": inf.n_selected, "n_global_before": out.before, "entropy_range": (emin, emax)})


def plan_torch(tokens: Any, *args: Any, **kwargs: Any) -> DevicePlan:
    """:func:`plan` for a CUDA tensor of token ids ``[T]``, on torch's current stream and device (the plan's
    arrays are then ready for :func:`hpczeco.gpu.daaf.attention_torch` ``(..., plan=...)`` on that stream)."""
    import torch  # noqa: PLC0415

    if not (isinstance(tokens, torch.Tensor) and tokens.is_cuda):
        raise TypeError(f"tokens must be a CUDA tensor, got {type(tokens).__name__}")
    xp = kernels.RUNTIME.get().xp
    dev = tokens.device.index if tokens.device.index is not None else torch.cuda.current_device()
    with xp.cuda.Device(dev), xp.cuda.ExternalStream(torch.cuda.current_stream(tokens.device).cuda_stream):
        return plan(xp.from_dlpack(tokens.contiguous()), *args, **kwargs)


def host_plan(dp: DevicePlan) -> _planner.Plan:
    """The :class:`hpczeco.daaf.Plan` of a device plan from :func:`plan` (copies to the host: tests, reports)."""
    info = dp.info
    if "weights" not in info:
        raise ValueError("host_plan needs a DevicePlan made by hpczeco.daaf.device_planner.plan")
    mask = kernels.to_host(dp.gmask).astype(bool)
    return _planner._make(T=dp.T, mask=mask, W=dp.local_window, window=info["window"], stride=info["stride"],
                          starts=info["window_starts"], weights=kernels.to_host(info["weights"]),
                          selected=kernels.to_host(info["selected"]).astype(bool), policy=info["policy"],
                          reason=info["reason"], threshold=info["threshold"], extra=info["extra"])
