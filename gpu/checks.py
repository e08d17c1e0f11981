"""Fused value checks for device arrays: one reduction per array over the raw bits, one synchronisation for all.

The host-style checks (``isfinite(x.astype(float32)).all()``, ``(g > 0).any()``) cost a float32 copy, a bool
temporary and a device synchronisation per array (what that cost at the ZeCO bench shape: docs/RELIABILITY.md).
Here each array is reduced once, on its bit pattern, to a small integer of flags:

* bit 0 (:data:`NONFINITE`): some element is NaN or +-Inf (exponent bits all set);
* bit 1 (:data:`POSITIVE`, only with ``gate=True``): some element has a clear sign bit and is not +0 (> 0,
  +Inf, or a NaN with a clear sign bit).

A contiguous, 8-byte aligned array is read as 64-bit words holding 4 (16-bit types) or 2 (float32)
elements, tested lane by lane without carries between lanes; anything else is read element by element
with the same formulas. :func:`start_value_flags` queues the reductions (optionally on another stream,
to overlap them with other work) and :meth:`ValueFlags.result` copies every flag to the host at once.
:func:`value_flags_host` is the numpy mirror (same words, same formulas) that the CPU tests check against
``np.isfinite`` and ``> 0``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np

__all__ = ["NONFINITE", "POSITIVE", "BITS", "ValueFlags", "start_value_flags", "value_flags", "value_flags_host"]

NONFINITE = 1
POSITIVE = 2

#: dtype name -> (bits per element, exponent mask)
BITS: dict[str, tuple[int, int]] = {
    "float16": (16, 0x7C00),
    "bfloat16": (16, 0x7F80),
    "float32": (32, 0x7F800000),
    "float64": (64, 0x7FF0000000000000),
    "uint16": (16, 0x7F80),  # raw bfloat16 bit patterns (the uint16 form hpczeco.gpu.gla and hpczeco.gla take)
}
_UINT = {16: "uint16", 32: "uint32", 64: "uint64"}


def _bits(name: str) -> tuple[int, int]:
    try:
        return BITS[name]
    except KeyError:
        raise TypeError(f"value checks need a float16/bfloat16/float32/float64 array (or uint16 raw bfloat16 bits), "
                        f"got {name}") from None


def _rep(value: int, width: int, lanes: int) -> int:
    return sum(value << (width * i) for i in range(lanes))


def _constants(width: int, exp_mask: int, lanes: int) -> tuple[int, int, int]:
    """(exponent masks, sign bits, magnitude masks), replicated over ``lanes`` lanes of ``width`` bits."""
    sign = 1 << (width - 1)
    return _rep(exp_mask, width, lanes), _rep(sign, width, lanes), _rep(sign - 1, width, lanes)


def _word_flags(w: np.ndarray, E: int, SIGN: int, LOW: int, gate: bool) -> int:
    """The formulas of the device kernel on uint64 words ``w`` (each lane < 2**width, no carries across)."""
    E, SIGN, LOW = np.uint64(E), np.uint64(SIGN), np.uint64(LOW)
    u = ((w & E) ^ E) + LOW  # a lane's top bit is set unless its exponent bits are all set
    flags = NONFINITE if bool(((~u) & SIGN).any()) else 0
    if gate:
        nz = ((w & LOW) + LOW) & SIGN  # top bit set where the magnitude is not zero
        if bool((nz & ~w).any()):  # ... and the sign bit is clear
            flags |= POSITIVE
    return flags


@functools.cache
def _kernel(utype: str, E: int, SIGN: int, LOW: int, gate: bool):
    import cupy  # noqa: PLC0415

    u = f"(((x & {E}ULL) ^ {E}ULL) + {LOW}ULL)"
    expr = f"(((~{u}) & {SIGN}ULL) != 0ULL ? {NONFINITE} : 0)"
    if gate:
        expr += f" | (((((x & {LOW}ULL) + {LOW}ULL) & ~(unsigned long long)x & {SIGN}ULL) != 0ULL) ? {POSITIVE} : 0)"
    return cupy.ReductionKernel(f"{utype} x", "int32 y", expr, "a | b", "y = a", "0",
                                f"hpczeco_value_flags_{utype}_{E:x}_{int(gate)}")


#: words per row of the first reduction level: a reduction to one value runs on few blocks in CuPy, a
#: reduction of rows to one value per row fills the device
_ROW = 8192


@functools.cache
def _or_kernel():
    import cupy  # noqa: PLC0415

    return cupy.ReductionKernel("int32 x", "int32 y", "x", "a | b", "y = a", "0", "hpczeco_or_reduce")


def _reduce(kernel: Any, words: Any) -> Any:
    """``kernel`` over every word of ``words`` as a 0-d int32: rows of :data:`_ROW` words first (one value
    each), then those values and the leftover words."""
    import cupy  # noqa: PLC0415

    if not words.flags.c_contiguous:
        return kernel(words)  # element by element over any strides
    flat = words.reshape(-1)
    rows = flat.size // _ROW
    if rows < 2:
        return kernel(flat)
    parts = kernel(flat[: rows * _ROW].reshape(rows, _ROW), axis=1)
    if flat.size > rows * _ROW:
        parts = cupy.concatenate([parts, kernel(flat[rows * _ROW :]).reshape(1)])
    return _or_kernel()(parts)


def _packed(x: Any, width: int) -> tuple[Any, int]:
    """``(view, lanes)``: 64-bit words when ``x`` is contiguous, 8-byte aligned and fills whole words."""
    lanes = 64 // width
    flat_ok = x.flags.c_contiguous and x.size % lanes == 0
    ptr = x.data.ptr if type(x).__module__.startswith("cupy") else x.__array_interface__["data"][0]
    if lanes > 1 and flat_ok and ptr % 8 == 0:
        return x.reshape(-1).view(_UINT[width]).view("uint64"), lanes
    return x.view(_UINT[width]), 1


class ValueFlags:
    """Reductions in flight (from :func:`start_value_flags`); :meth:`result` returns the flags."""

    def __init__(self, outs: list, event: Any):
        self._outs, self._event = outs, event

    def result(self) -> list[int]:
        """Flags per array, in order (one device-to-host copy; waits for the reductions only)."""
        import cupy  # noqa: PLC0415

        if not self._outs:
            return []
        if self._event is not None:
            self._event.synchronize()
        return [int(f) for f in cupy.stack(self._outs).get()]


def start_value_flags(arrays: list[tuple[Any, bool]], stream: Any = None) -> ValueFlags:
    """Queue the flag reductions of each ``(cupy array, gate)``; on ``stream`` (after the work queued so far on
    the current stream, which produced the arrays) when given, else on the current stream."""
    import cupy  # noqa: PLC0415

    specs = []
    for x, gate in arrays:
        width, exp_mask = _bits(str(x.dtype))
        specs.append((x, width, exp_mask, bool(gate)))
    event = None
    if stream is not None:
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        stream.wait_event(ready)
    outs = []
    with stream if stream is not None else contextlib.nullcontext():
        for x, width, exp_mask, gate in specs:
            if x.size == 0:
                outs.append(cupy.zeros((), dtype=np.int32))
                continue
            words, lanes = _packed(x, width)
            E, SIGN, LOW = _constants(width, exp_mask, lanes)
            outs.append(_reduce(_kernel(str(words.dtype), E, SIGN, LOW, gate), words))
        if stream is not None:
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
    return ValueFlags(outs, event)


def value_flags(arrays: list[tuple[Any, bool]]) -> list[int]:
    """Flags of each ``(cupy array, gate)`` pair, on the current stream, with one synchronisation."""
    return start_value_flags(arrays).result()


def value_flags_host(x: np.ndarray, gate: bool = False) -> int:
    """The same flags for a numpy array (mirror of the device kernel: same packing, same formulas)."""
    width, exp_mask = _bits(str(x.dtype))
    if x.size == 0:
        return 0
    words, lanes = _packed(x, width)
    E, SIGN, LOW = _constants(width, exp_mask, lanes)
    return _word_flags(np.asarray(words).astype(np.uint64), E, SIGN, LOW, gate)

