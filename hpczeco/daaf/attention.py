"""DAAF attention and exact causal attention: validation, CPU kernels, GPU dispatch.

``attention(q, k, v, plan)`` follows the rule of :func:`hpczeco.daaf.planner.plan_arrays`:
query ``t`` sees keys ``[t - W, t]``, plus every earlier key-region key; a key-region query sees
every key ``j <= t``; softmax over the union. The CPU path is blockwise (numpy + BLAS, online
softmax): key-region queries are full causal rows, cost ``O(t)`` each; every other query costs
``O(W + block + n_global_before)``; no ``[T, T]`` mask is ever built. CuPy inputs are dispatched to
``hpczeco.gpu.daaf.attention(q, k, v, None, local_window, scale, plan=...)`` with the plan's device arrays
cached on the plan (no upload, check or host synchronisation per call; see :func:`attention`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ..base.backend import is_device_array
from ..base.checks import check_array, check_finite, check_same_dtype
from .kernels import causal_rows, finalize, local_rows
from .planner import Plan

__all__ = ["attention", "exact_attention", "check_qkv", "resolve_scale", "QUERY_BLOCK"]

#: query rows per block of the CPU kernels
QUERY_BLOCK = 128


def resolve_scale(scale: Any, D: int) -> float:
    """``scale`` or ``D ** -0.5``; ``ValueError`` unless a positive finite number."""
    if scale is None:
        return D**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    if not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    return float(scale)


def check_qkv(q: Any, k: Any, v: Any, T: int | None = None, finite: bool = True) -> None:
    """Local checks: ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]``, one floating dtype, one array kind
    (numpy or CuPy), ``T`` tokens when given, no NaN/Inf. Raises ``TypeError``/``ValueError``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, ndim=4)
    check_same_dtype(q=q, k=k, v=v)
    kinds = {name: is_device_array(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{n}={'cupy' if d else 'numpy'}" for n, d in kinds.items())
        raise TypeError(f"q, k, v must all be numpy or all CuPy arrays, got {desc}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k has shape {list(k.shape)}, expected q's shape {list(q.shape)} [B, T, H, D]")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v has shape {list(v.shape)}, expected [B, T, H, Dv] = {list(q.shape[:3])} + [Dv]")
    if T is not None and q.shape[1] != T:
        raise ValueError(f"q has {q.shape[1]} tokens (axis 1) but the plan covers T={T}")
    if finite:
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_finite(name, x)


def _compute_dtype(x: np.ndarray):
    return np.float64 if x.dtype == np.float64 else np.float32


def _heads_major(x: np.ndarray, dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).transpose(0, 2, 1, 3), dtype=dtype)


#: side stream of the value checks per device (they reduce while the attention kernel runs)
_SIDE: dict[int, Any] = {}


def _side_stream(cupy: Any) -> Any:
    dev = int(cupy.cuda.runtime.getDevice())
    if dev not in _SIDE:  # the highest priority: its few blocks go first as the kernel's blocks retire
        try:
            prio = cupy.cuda.runtime.deviceGetStreamPriorityRange()[1]
            _SIDE[dev] = cupy.cuda.Stream(non_blocking=True, priority=prio)
        except (AttributeError, TypeError):  # an older CuPy
            _SIDE[dev] = cupy.cuda.Stream(non_blocking=True)
    return _SIDE[dev]


def _gpu_attention(q, k, v, plan: Plan, scale: float, check: bool):
    """CuPy path: the plan's device arrays are cached on the plan (built once); with ``check`` the NaN/Inf
    checks of q, k, v reduce on a side stream while the kernel runs, and their flags are read once the
    kernel is queued (one wait on the side stream; the kernel's stream is not drained). Without ``check``
    nothing synchronises."""
    try:
        from hpczeco.gpu import checks as gpu_checks  # noqa: PLC0415
        from hpczeco.gpu import daaf as gpu_daaf  # noqa: PLC0415 - imports CuPy
    except ImportError as exc:
        raise RuntimeError(
            "q, k, v are CuPy arrays but the DAAF GPU kernels (hpczeco.gpu.daaf) are not available "
            f"({exc}); pass numpy arrays for the CPU path"
        ) from exc
    import cupy  # noqa: PLC0415

    dp = gpu_daaf.plan_on_device(plan)
    if not check:
        return gpu_daaf.attention(q, k, v, None, plan.local_window, scale, plan=dp)
    side = _side_stream(cupy)
    arrays = {"q": q, "k": k, "v": v}
    flags = gpu_checks.start_value_flags([(x, False) for x in arrays.values()], stream=side)
    out = gpu_daaf.attention(q, k, v, None, plan.local_window, scale, plan=dp)
    with side:
        found = flags.result()
    for (name, _), f in zip(arrays.items(), found):
        if f & gpu_checks.NONFINITE:
            raise ValueError(f"{name} contains NaN or Inf")
    return out


def daaf_heads_major(qh: np.ndarray, kh: np.ndarray, vh: np.ndarray, global_mask: np.ndarray,
                     local_window: int, scale: float, block: int = QUERY_BLOCK) -> np.ndarray:
    """CPU DAAF attention in head-major layout ``[B, H, T, *]`` -> ``[B, H, T, Dv]`` (no checks)."""
    B, H, T, _ = qh.shape
    out = np.empty((B, H, T, vh.shape[-1]), dtype=qh.dtype)
    g = np.asarray(global_mask, dtype=bool)
    gidx = np.flatnonzero(g)
    kg = np.ascontiguousarray(kh[:, :, gidx])
    vg = np.ascontiguousarray(vh[:, :, gidx])
    for c in range(0, len(gidx), block):  # key-region queries: full causal rows
        r = gidx[c : c + block]
        st = causal_rows(qh[:, :, r], r, kh, vh, 0, scale)
        out[:, :, r] = finalize(st)
    ng = np.flatnonzero(~g)
    for s0 in range(0, T, block):  # every other query: local band + earlier key-region keys
        r = ng[np.searchsorted(ng, s0) : np.searchsorted(ng, s0 + block)]
        if len(r) == 0:
            continue
        st = local_rows(qh[:, :, r], r, kh, vh, 0, g, kg, vg, gidx, local_window, scale)
        out[:, :, r] = finalize(st)
    return out


def exact_heads_major(qh: np.ndarray, kh: np.ndarray, vh: np.ndarray, scale: float,
                      block: int = QUERY_BLOCK) -> np.ndarray:
    """CPU exact causal attention, head-major ``[B, H, T, *]`` -> ``[B, H, T, Dv]`` (no checks)."""
    B, H, T, _ = qh.shape
    out = np.empty((B, H, T, vh.shape[-1]), dtype=qh.dtype)
    for s0 in range(0, T, block):
        r = np.arange(s0, min(T, s0 + block))
        st = causal_rows(qh[:, :, s0 : s0 + len(r)], r, kh, vh, 0, scale)
        out[:, :, s0 : s0 + len(r)] = finalize(st)
    return out


def attention(q: Any, k: Any, v: Any, plan: Plan, scale: float | None = None, *, check: bool = True) -> Any:
    """DAAF causal attention. ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]`` -> ``o: [B, T, H, Dv]`` (q's dtype).

    ``plan`` is a :class:`~hpczeco.daaf.planner.Plan` over the same ``T`` tokens; ``scale`` defaults
    to ``D ** -0.5``. numpy arrays run the blockwise CPU kernel (float64 stays float64, other
    dtypes compute in float32); CuPy arrays run ``hpczeco.gpu.daaf.attention`` with the plan's device
    arrays built once per plan (:func:`hpczeco.gpu.daaf.plan_on_device`). ``check``: the NaN/Inf checks
    of q, k, v (on CuPy arrays: fused reductions on a side stream during the kernel, one wait for their
    flags); ``check=False`` skips them: shapes and dtypes are still checked, and nothing synchronises.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a hpczeco.daaf.Plan, got {type(plan).__name__}")
    device = is_device_array(q)
    check_qkv(q, k, v, plan.T, finite=check and not device)
    scale = resolve_scale(scale, q.shape[-1])
    if device:
        return _gpu_attention(q, k, v, plan, scale, check)
    dt = _compute_dtype(q)
    oh = daaf_heads_major(_heads_major(q, dt), _heads_major(k, dt), _heads_major(v, dt),
                          plan.global_mask, plan.local_window, scale)
    return oh.transpose(0, 2, 1, 3).astype(q.dtype, copy=False)


@functools.lru_cache(maxsize=8)
def _dense_plan(T: int) -> Plan:
    from .planner import plan_from_mask  # noqa: PLC0415

    return plan_from_mask(np.ones(T, bool), 0, "exact")


def exact_attention(q: Any, k: Any, v: Any, scale: float | None = None, *, check: bool = True) -> Any:
    """Dense causal attention (blockwise, online softmax). Shapes, dtypes and ``check`` as :func:`attention`.

    The dense prefill path and the quality reference. CuPy arrays go to the GPU DAAF kernel with
    every token global (which is exact causal attention).
    """
    device = is_device_array(q)
    check_qkv(q, k, v, finite=check and not device)
    scale = resolve_scale(scale, q.shape[-1])
    if device:
        return _gpu_attention(q, k, v, _dense_plan(int(q.shape[1])), scale, check)
    dt = _compute_dtype(q)
    oh = exact_heads_major(_heads_major(q, dt), _heads_major(k, dt), _heads_major(v, dt), scale)
    return oh.transpose(0, 2, 1, 3).astype(q.dtype, copy=False)
