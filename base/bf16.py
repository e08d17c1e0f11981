"""bfloat16 on the host: round-to-nearest-even conversion to and from ``uint16`` bit patterns.

The one bf16 helper of the project (kernels, emulation, tests and drivers use it). NaN stays NaN
(a quiet NaN of the same sign), +-Inf stays +-Inf; finite values round to nearest even, so values
above the largest bfloat16 round to Inf, as the GPU's ``cvt.rn.bf16.f32`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def to_bits(x: Any) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``, same shape) of ``x`` (any real array)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((u >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(nan, quiet, r)


def from_bits(bits: Any) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (``uint16`` or ``int16``)."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x: Any) -> np.ndarray:
    """``x`` rounded to bfloat16 and back, as float32."""
    return from_bits(to_bits(x))
