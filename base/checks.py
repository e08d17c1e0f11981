"""Per-rank input checks that raise a clear ``ValueError``/``TypeError`` naming the argument.

These checks are local. Anything that runs before communication wraps them with
:func:`hpczeco.collectives.agree.collective_check` so every rank raises the same error.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from .backend import get_array_module, is_device_array

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_int(name: str, value: Any, lo: int | None = None) -> int:
    """``value`` as an int; ``TypeError`` unless an int (bool excluded), ``ValueError`` if below ``lo``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def env_positive_int(name: str, text: str) -> int | None:
    """The value ``text`` of the environment variable ``name`` as an int >= 1; None when empty; ``ValueError`` naming
    the variable otherwise (e.g. ``$HPCZECO_GLA_THREADS``)."""
    t = text.strip()
    if not t:
        return None
    if not t.isdigit() or int(t) < 1:
        raise ValueError(f"${name} must be an int >= 1, got {text!r}")
    return int(t)


def dtype_name(x: Any) -> str:
    return str(getattr(x, "dtype", type(x).__name__))


def check_array(name: str, x: Any, ndim: int | None = None, float_only: bool = True) -> None:
    """Raise ``TypeError`` unless ``x`` is a numpy/cupy array (floating when ``float_only``),
    ``ValueError`` unless it has ``ndim`` dimensions."""
    if not (isinstance(x, np.ndarray) or is_device_array(x)):
        raise TypeError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")
    if float_only and dtype_name(x) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64), got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def check_shape(name: str, x: Any, expected: Sequence[int | None], what: str = "") -> None:
    """``expected`` may hold ``None`` for free dimensions."""
    shape = tuple(x.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape))
    if not ok:
        exp = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} has shape {list(shape)}, expected {exp}{' ' + what if what else ''}")


def check_finite(name: str, x: Any) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf."""
    xp = get_array_module(x)
    if x.size and not bool(xp.isfinite(x.astype(xp.float32) if dtype_name(x) == "bfloat16" else x).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def check_log_gate(name: str, g: Any) -> None:
    """A log forget gate must be finite and <= 0."""
    check_finite(name, g)
    xp = get_array_module(g)
    if g.size and bool((g > 0).any()):
        raise ValueError(f"{name} is a log forget gate and must be <= 0 everywhere (max is {float(xp.max(g))})")


def check_same_dtype(**arrays: Any) -> None:
    present = {k: v for k, v in arrays.items() if v is not None}
    dts = {k: dtype_name(v) for k, v in present.items()}
    if len(set(dts.values())) > 1:
        desc = ", ".join(f"{k}={d}" for k, d in dts.items())
        raise TypeError(f"arrays must share one dtype, got {desc}")


#: the largest chunk size of the GPU GLA kernels (``hpczeco.gpu.gla``)
GPU_MAX_CHUNK = 64


def check_chunk_size(chunk_size: Any, device: bool = False) -> int:
    """The one rule for ``chunk_size``: an int >= 1, and <= :data:`GPU_MAX_CHUNK` when the arrays are on a GPU.

    ``TypeError`` for a non-int (bools too), ``ValueError`` out of range. Returns it as an int.
    """
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if device and int(chunk_size) > GPU_MAX_CHUNK:
        raise ValueError(f"chunk_size must be in [1, {GPU_MAX_CHUNK}] on the GPU, got {chunk_size}")
    return int(chunk_size)


def check_scale(scale: Any, K: int | None = None) -> float | None:
    """The one rule for ``scale``: None (meaning ``K ** -0.5``) or a positive finite real number.

    Returns the value to use: ``K ** -0.5`` for None when ``K`` is given, else ``scale`` as a float
    (None stays None while ``K`` is not known yet). ``TypeError`` for bools, strings and other
    non-numbers; ``ValueError`` for zero, negative, NaN or infinite values.
    """
    if scale is None:
        return None if K is None else float(K) ** -0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive number or None, got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return float(scale)
