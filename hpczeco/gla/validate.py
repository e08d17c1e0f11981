"""Per-rank input validation for the GLA functions.

Everything here raises only ``ValueError`` or ``TypeError`` (with the argument's name in the message),
so the ZeCO layer can run :func:`validate_gla_inputs` inside
:func:`hpczeco.collectives.agree.collective_check`.

Dtypes (one rule for :func:`hpczeco.gla.chunk_gla`, :func:`~hpczeco.gla.chunk_gla_bwd`, the split classes and
``ZeCOGLA``): ``q, k, v, g, do`` share one dtype, float16/bfloat16/float32/float64 -- or, on CuPy arrays only,
``uint16`` holding raw bfloat16 bit patterns (:data:`RAW_BF16`; the CPU path computes in float32/float64, so a
numpy ``uint16`` array is rejected). Outputs come in the form of the inputs. ``initial_state`` / ``dht`` have
the input dtype or float32 (16-bit inputs; raw bits: float32 only); states and ``dh0`` of 16-bit inputs are
float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..base.backend import get_array_module, is_device_array
from ..base.checks import (
    FLOAT_DTYPES,
    check_array,
    check_chunk_size,
    check_finite,
    check_log_gate,
    check_same_dtype,
    check_scale,
    check_shape,
    dtype_name,
)
from ..base.packing import check_cu_seqlens

__all__ = [
    "validate_gla_inputs",
    "check_gla_call",
    "check_varlen_call",
    "check_finite_values",
    "check_device_values",
    "raise_for_flags",
    "check_gate_values",
    "compute_dtype_name",
    "state_dtype_ok",
    "check_cu_seqlens",
    "check_document_states",
    "check_input_dtype",
    "RAW_BF16",
]

_HALF = ("float16", "bfloat16")
#: the dtype of raw bfloat16 bit patterns (CuPy arrays only)
RAW_BF16 = "uint16"


def compute_dtype_name(dtype_name_: str) -> str:
    """The dtype the maths runs in: float64 for float64 inputs, float32 for everything else (raw bf16 bits too)."""
    return "float64" if dtype_name_ == "float64" else "float32"


def state_dtype_ok(input_dtype: str, state_dtype: str) -> bool:
    """States (``initial_state``, ``dht``) may have the input dtype or, for half inputs, float32 (raw bf16 bits:
    float32 only)."""
    if input_dtype == RAW_BF16:
        return state_dtype == "float32"
    return state_dtype == input_dtype or (input_dtype in _HALF and state_dtype == "float32")


def check_input_dtype(name: str, x: Any) -> None:
    """``TypeError`` naming ``name`` unless ``x`` (an array) is floating, or a CuPy ``uint16`` array of raw
    bfloat16 bits."""
    dt = dtype_name(x)
    if dt in FLOAT_DTYPES:
        return
    if dt == RAW_BF16:
        if is_device_array(x):
            return
        raise TypeError(f"{name} has dtype uint16 (raw bfloat16 bits), which only CuPy arrays may hold here: the CPU "
                        f"path computes in float32/float64; pass float32 values (e.g. hpczeco.base.bf16.from_bits)")
    raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64) or, on CuPy, uint16 raw "
                    f"bfloat16 bits; got {dt}")


def _fast_finite(x: Any) -> bool:
    """Cheap test that ``x`` has no NaN/Inf (one reduction); a False answer is confirmed by the caller."""
    if x.size == 0:
        return True
    xp = get_array_module(x)
    if dtype_name(x) in _HALF:
        return False  # sums of half floats overflow easily: let the exact check decide
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(xp.isfinite(x.sum()))


def check_finite_values(name: str, x: Any) -> None:
    """``ValueError`` naming ``name`` if ``x`` holds NaN or Inf (fast reduction first, exact check if it fails)."""
    if not _fast_finite(x):
        check_finite(name, x)


def check_gate_values(name: str, g: Any) -> None:
    """``ValueError`` naming ``name`` unless ``g`` is finite and <= 0 (two reductions; exact check on failure)."""
    if g.size == 0:
        return
    if dtype_name(g) not in _HALF:
        mx, mn = float(g.max()), float(g.min())
        if mx <= 0.0 and math.isfinite(mn):
            return
    check_log_gate(name, g)


def validate_gla_inputs(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    initial_state: Any = None,
    do: Any = None,
    dht: Any = None,
    check_values: bool = True,
) -> tuple[int, int, int, int, int]:
    """Check GLA inputs on this rank and return ``(B, T, H, K, V)``.

    Shapes: ``q, k, g: [B, T, H, K]``, ``v, do: [B, T, H, V]``, ``initial_state, dht: [B, H, K, V]``.
    ``q, k, v, g, do`` share one floating dtype (or, on CuPy, ``uint16`` raw bfloat16 bits); ``initial_state``/
    ``dht`` have that dtype or, for 16-bit inputs, float32 (raw bits: float32). All are numpy arrays or all are
    CuPy arrays. With
    ``check_values``: no NaN/Inf anywhere, ``g <= 0``. ``K, V >= 1``. Raises ``TypeError`` (array type,
    dtype) or ``ValueError`` (shape, values), naming the argument. Local (no communication).
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        check_array(name, x, ndim=4, float_only=False)
        check_input_dtype(name, x)
    B, T, H, K = (int(s) for s in q.shape)
    check_shape("k", k, (B, T, H, K), "(the shape of q [B, T, H, K])")
    check_shape("g", g, (B, T, H, K), "(the shape of q [B, T, H, K])")
    check_shape("v", v, (B, T, H, None), "([B, T, H, V] with B, T, H of q)")
    V = int(v.shape[3])
    if K < 1:
        raise ValueError(f"q has key dimension K={K}; K must be >= 1")
    if V < 1:
        raise ValueError(f"v has value dimension V={V}; V must be >= 1")
    if do is not None:
        check_array("do", do, ndim=4, float_only=False)
        check_input_dtype("do", do)
        check_shape("do", do, (B, T, H, V), "(the shape of v [B, T, H, V])")
    for name, s in (("initial_state", initial_state), ("dht", dht)):
        if s is not None:
            check_array(name, s, ndim=4)
            check_shape(name, s, (B, H, K, V), "([B, H, K, V] from q and v)")
    check_same_dtype(q=q, k=k, v=v, g=g, do=do)
    dt = dtype_name(q)
    for name, s in (("initial_state", initial_state), ("dht", dht)):
        if s is not None and not state_dtype_ok(dt, dtype_name(s)):
            allowed = "float32 (raw bfloat16 bits in q)" if dt == RAW_BF16 else dt + (" or float32" if dt in _HALF
                                                                                     else "")
            raise TypeError(f"{name} has dtype {dtype_name(s)}, expected {allowed} (the dtype of q)")
    arrays = {"q": q, "k": k, "v": v, "g": g, "initial_state": initial_state, "do": do, "dht": dht}
    present = {n: a for n, a in arrays.items() if a is not None}
    on_device = {n: is_device_array(a) for n, a in present.items()}
    if len(set(on_device.values())) > 1:
        host = [n for n, d in on_device.items() if not d]
        dev = [n for n, d in on_device.items() if d]
        raise TypeError(f"arrays must all be numpy or all be cupy arrays: {host} on the host, {dev} on the device")
    if check_values:
        if any(on_device.values()):
            check_device_values(present, gate="g")
        else:
            check_gate_values("g", g)
            for name, x in present.items():
                if name != "g":
                    check_finite_values(name, x)
    return B, T, H, K, V


def check_gla_call(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: Any,
    initial_state: Any,
    chunk_size: Any,
    do: Any = None,
    dht: Any = None,
    check_values: bool = True,
) -> tuple[int, int, int, int, int, float, int, np.dtype]:
    """The checks of a chunked GLA call (:func:`hpczeco.gla.chunk_gla`, :func:`~hpczeco.gla.chunk_gla_bwd`,
    the split classes): the arrays (:func:`validate_gla_inputs`), ``chunk_size`` and ``scale`` by their one rule
    (:func:`hpczeco.base.checks.check_chunk_size`, with the GPU limit for device arrays, and
    :func:`~hpczeco.base.checks.check_scale`: None or > 0). Returns ``(B, T, H, K, V, scale, chunk_size,
    compute dtype)``."""
    chunk_size = check_chunk_size(chunk_size, device=is_device_array(q))
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, initial_state=initial_state, do=do, dht=dht,
                                        check_values=check_values)
    s = check_scale(scale, K)
    return B, T, H, K, V, s, chunk_size, np.dtype(compute_dtype_name(str(q.dtype)))


def check_varlen_call(q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, scale: Any, chunk_size: Any,
                      initial_state: Any = None, do: Any = None, dht: Any = None) -> np.ndarray:
    """The checks of a packed call (:func:`hpczeco.gla.chunk_gla` with ``cu_seqlens``), before any work: the token
    arrays (:func:`validate_gla_inputs`), ``cu_seqlens`` (:func:`check_cu_seqlens`), the per-document states
    ``[N, H, K, V]``, ``scale`` and ``chunk_size``. Values: of device arrays here; host values are scanned by the
    fused kernels of each bucket (every token and state row is in one bucket). Returns the host offsets. Local."""
    device = is_device_array(q)
    chunk_size = check_chunk_size(chunk_size, device=device)
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, do=do, check_values=device)
    check_scale(scale, K)
    cu = check_cu_seqlens(cu_seqlens, B, T)
    for name, x in (("initial_state", initial_state), ("dht", dht)):
        if x is not None:
            check_document_states(name, x, len(cu) - 1, H, K, V, q, check_values=False)
    if device:
        states = {n: x for n, x in (("initial_state", initial_state), ("dht", dht)) if x is not None}
        if states:
            check_device_values(states)
    return cu


def check_device_values(arrays: dict[str, Any], gate: str | None = None) -> None:
    """NaN/Inf (and ``arrays[gate] <= 0``) checks of CuPy arrays: one fused reduction per array over the raw
    bits and one device synchronisation for all of them (:mod:`hpczeco.gpu.checks`). Same errors as the
    host checks, naming the first offending argument."""
    from ..gpu.checks import value_flags  # noqa: PLC0415

    names = list(arrays)
    raise_for_flags(arrays, value_flags([(arrays[n], n == gate) for n in names]))


def raise_for_flags(arrays: dict[str, Any], flags: list[int]) -> None:
    """Raise the host checks' ``ValueError`` for the first array whose flags (:mod:`hpczeco.gpu.checks`) are set."""
    from ..gpu.checks import NONFINITE, POSITIVE  # noqa: PLC0415

    for (name, x), f in zip(arrays.items(), flags):
        if f & NONFINITE:
            raise ValueError(f"{name} contains NaN or Inf")
        if f & POSITIVE:
            raise ValueError(f"{name} is a log forget gate and must be <= 0 everywhere (max is "
                             f"{float(x.astype('float32').max())})")


def check_document_states(name: str, x: Any, N: int, H: int, K: int, V: int, q: Any,
                          check_values: bool = True) -> None:
    """A per-document state (``initial_state``, ``dht`` with ``cu_seqlens``): an array ``[N, H, K, V]`` on the side
    of ``q`` (numpy or CuPy), of ``q``'s dtype (float32 too for half inputs), finite when ``check_values`` (host
    arrays; device values are the caller's). ``TypeError``/``ValueError`` naming ``name``. Local."""
    check_array(name, x, ndim=4)
    check_shape(name, x, (N, H, K, V), "([N, H, K, V]: one state per document of cu_seqlens)")
    dt = dtype_name(q)
    if not state_dtype_ok(dt, dtype_name(x)):
        allowed = dt + (" or float32" if dt in _HALF else "")
        raise TypeError(f"{name} has dtype {dtype_name(x)}, expected {allowed} (the dtype of q)")
    if is_device_array(x) != is_device_array(q):
        where = "cupy" if is_device_array(q) else "numpy"
        raise TypeError(f"{name} must live where q does (a {where} array)")
    if check_values and not is_device_array(x):
        check_finite_values(name, x)
