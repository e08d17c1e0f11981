"""bfloat16 as ``uint16`` bit patterns: round-to-nearest-even conversion to and from float32.

The one bf16 helper of the project (kernels, emulation, tests and drivers use it). NaN stays NaN
(a quiet NaN of the same sign), +-Inf stays +-Inf; finite values round to nearest even, so values
above the largest bfloat16 round to Inf, as the GPU's ``cvt.rn.bf16.f32`` does. Host arrays by default;
``xp`` (an array module: CuPy) converts device arrays where they are, with the same arithmetic.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def to_bits(x: Any, xp: Any = np) -> Any:
    """bfloat16 bit patterns (``uint16``, same shape) of ``x`` (any real array of ``xp``)."""
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = ((u.astype(xp.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)
    quiet = ((u >> 16) | np.uint32(0x0040)).astype(xp.uint16)
    return xp.where(nan, quiet, r)


def from_bits(bits: Any, xp: Any = np) -> Any:
    """float32 values of bfloat16 bit patterns (``uint16`` or ``int16`` arrays of ``xp``)."""
    return (xp.asarray(bits).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def round_to_bf16(x: Any) -> np.ndarray:
    """``x`` rounded to bfloat16 and back, as float32."""
    return from_bits(to_bits(x))
