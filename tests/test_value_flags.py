"""The bit-pattern value checks of hpczeco.gpu.checks (host mirror of the device kernel: same words, same
formulas) against np.isfinite and > 0, for every dtype, packed (64-bit words) and element by element."""

from __future__ import annotations

import numpy as np
import pytest
from hpczeco.gpu.checks import NONFINITE, POSITIVE, value_flags_host

SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 1e-45, 0.5, -0.5, 65504.0, 7e4, 3e38, -3e38]


def _expected(x: np.ndarray, gate: bool) -> int:
    f = 0 if np.isfinite(x).all() else NONFINITE
    # POSITIVE: sign bit clear and not +0 (> 0, +Inf, and NaNs with a clear sign bit)
    if gate and bool((~np.signbit(x) & ((x != 0) | np.isnan(x))).any()):
        f |= POSITIVE
    return f


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 8, 33, 1000])
def test_flags_match_numpy(rng, dtype, n):
    for trial in range(40):
        x = (-np.abs(rng.standard_normal(n)) * 3).astype(dtype)  # a valid log gate: <= 0, finite
        picks = rng.integers(0, 3)
        for _ in range(picks):
            if n:
                with np.errstate(over="ignore"):
                    x[rng.integers(0, n)] = np.array(SPECIALS[rng.integers(0, len(SPECIALS))]).astype(dtype)
        for gate in (False, True):
            assert value_flags_host(x, gate) == _expected(x, gate), (dtype, n, trial, x[:16])
            if n > 2:  # strided view: element by element
                v = x[::2]
                assert value_flags_host(v, gate) == _expected(v, gate)
            if n > 5:  # misaligned start: element by element
                v = x[1:]
                assert value_flags_host(v, gate) == _expected(v, gate)


def test_every_float16_bit_pattern():
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for i in range(0, 1 << 16, 4):
        blk = x[i : i + 4]
        for gate in (False, True):
            assert value_flags_host(blk, gate) == _expected(blk, gate), blk.view(np.uint16)


def test_bfloat16_bit_patterns_when_available():
    ml = pytest.importorskip("ml_dtypes")
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(ml.bfloat16)
    f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    for i in range(0, 1 << 16, 4):
        for gate in (False, True):
            assert value_flags_host(x[i : i + 4], gate) == _expected(f32[i : i + 4], gate)


def test_rejects_other_dtypes():
    with pytest.raises(TypeError, match="value checks"):
        value_flags_host(np.zeros(4, np.int32))
