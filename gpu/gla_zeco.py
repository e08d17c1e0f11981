"""The GPU pieces ZeCO's per-rank glue needs around the GLA kernels (host side of ``gla_zeco.cu``).

``g, q: [B, T, H, K]``, ``o, do: [B, T, H, V]``, states ``[B, H, K, V]`` float32, ``a [B, H, K]``:
:func:`decay_cumsum` (the log decay from the slice start), :func:`state_correction` (``o += scale (q
exp(G)) S_in`` once the scan has delivered ``S_in``), :func:`final_state` / :func:`scan_combine` (the scan
operator's state part), :func:`initial_state_grad` (what the backward scans in reverse). 16-bit inputs with
K, V multiples of 16 up to 128 run on tensor cores, float32 and other 16-bit ones on the simt kernels, float64
ones (states float64 too) on the Numba CUDA kernels of :mod:`hpczeco.gpu.gla_numba`. Exported by
:mod:`hpczeco.gpu.gla`; nothing here talks MPI.
"""

from __future__ import annotations

from typing import Any

from ..base.checks import check_chunk_size, check_int, check_scale
from .gla_common import (
    NT_SIMT,
    RUNTIME,
    check_inputs,
    contig,
    cumsum_T,
    f32,
    i32,
    local_states,
    state32,
    state64,
    state_scan,
    type_of,
)
from .gla_tc_states import num_sms

__all__ = ["ZC_SMEM_CORRECTION", "decay_cumsum", "state_correction", "final_state", "scan_combine",
           "initial_state_grad"]

#: dynamic shared memory of zeco_tc_correction (mirror of ZC_SMEM_CORRECTION in gla_zeco.cu)
ZC_SMEM_CORRECTION = 64 * 136 * 2 + 128 * 136 * 2


def _numba() -> Any:
    """:mod:`hpczeco.gpu.gla_numba` (imported on first use: it imports ``numba.cuda``)."""
    from . import gla_numba  # noqa: PLC0415

    return gla_numba


def chunks_per_segment(rt: Any, BH: int, NT: int, nc: int | None = None) -> int:
    """Chunks of 64 tokens per segment of ``zeco_tc_qT_do``: ``nc`` when given, else enough segments for about
    eight waves of blocks on the device."""
    if nc is not None:
        return check_int("nc", nc, 1)
    ns = max(1, -(-8 * num_sms(rt) // max(BH, 1)))
    return max(1, -(-NT // ns))


def _zeco_tc(rt: Any, t: str, K: int, V: int, *arrays: Any) -> bool:
    """Tensor-core ZeCO kernels apply: 16-bit data, K, V multiples of 16 up to 128, 16-byte aligned, module builds."""
    if t not in ("bf16", "f16") or K % 16 or V % 16 or K > 128 or V > 128:
        return False
    if any(rt.ptr(x) % 16 for x in arrays):
        return False
    return rt.available("gla_zeco.cu", t)


def decay_cumsum(g: Any, chunk_size: int = 64) -> Any:
    """``G = cumsum(g, axis=1)`` (inclusive, ``[B, T, H, K]``; float32, float64 for float64 ``g``): the log decay
    from the slice start."""
    rt = RUNTIME.get()
    if not rt.is_native(g) or g.ndim != 4:
        raise TypeError("g must be a 4-dimensional device array [B, T, H, K]")
    t = type_of("g", g)
    C = check_chunk_size(chunk_size, device=True)
    B, T, H, K = (int(x) for x in g.shape)
    if T == 0 or B * H * K == 0:
        return rt.xp.zeros(g.shape, dtype=rt.xp.float64 if t == "f64" else rt.xp.float32)
    if t == "f64":
        return _numba().decay_cumsum(rt.xp, contig(g, rt), C)
    return cumsum_T(rt, contig(g, rt), t, "float", rt.xp.float32, B, T, H, K, C, reverse=False)


def state_correction(o: Any, q: Any, G: Any, S_in: Any, scale: float | None = None) -> Any:
    """In place ``o += scale * (q * exp(G)) @ S_in`` (per b, h); returns ``o``.

    ``o [B, T, H, V]`` and ``q [B, T, H, K]`` share a dtype, ``G [B, T, H, K]`` float32 (from
    :func:`decay_cumsum`), ``S_in [B, H, K, V]`` (both cast to float64 for float64 ``o``, ``q``). The ZeCO
    correction once the scan has delivered S_in.
    """
    rt = RUNTIME.get()
    for name, x in (("o", o), ("q", q), ("G", G), ("S_in", S_in)):
        if not rt.is_native(x) or x.ndim != 4:
            raise TypeError(f"{name} must be a 4-dimensional device array")
    B, T, H, K = (int(x) for x in q.shape)
    V = int(o.shape[3])
    if tuple(o.shape) != (B, T, H, V) or tuple(G.shape) != (B, T, H, K) or tuple(S_in.shape) != (B, H, K, V):
        raise ValueError(f"shapes disagree: o {o.shape}, q {q.shape}, G {G.shape}, S_in {S_in.shape}")
    if str(o.dtype) != str(q.dtype):
        raise TypeError(f"o has dtype {o.dtype}, expected {q.dtype} (the dtype of q)")
    if not o.flags.c_contiguous:
        raise ValueError("o must be C-contiguous (it is updated in place)")
    t = type_of("q", q)
    s = check_scale(scale, K)
    if T == 0 or B * H == 0:
        return o
    q = contig(q, rt)
    if t == "f64":
        return _numba().state_correction(o, q, state64(G, rt), state64(S_in, rt), s)
    if _zeco_tc(rt, t, K, V, q, o):
        rt.launch(
            f"zeco_tc_correction<{t}>", (-(-T // 128), B * H), (NT_SIMT,),
            (o, q, state32(G, rt), state32(S_in, rt), f32(s), i32(B), i32(T), i32(H), i32(K), i32(V)),
            shared_mem=ZC_SMEM_CORRECTION,
        )  # fmt: skip
        return o
    rt.launch(
        f"gla_state_correction<{t}>", (-(-T // 64), B * H, -(-V // 64)), (NT_SIMT,),
        (o, q, state32(G, rt), state32(S_in, rt), f32(s), i32(B), i32(T), i32(H), i32(K), i32(V)),
    )  # fmt: skip
    return o


def _float64(*arrays: Any) -> bool:
    return any(str(x.dtype) == "float64" for x in arrays)


def final_state(a: Any, S_in: Any, S_local: Any) -> Any:
    """``diag(a) S_in + S_local`` with ``a = exp(G_T) [B, H, K]`` (decay over the slice); float32 (float64, on the
    Numba kernels, when ``S_in`` or ``S_local`` is float64)."""
    rt = RUNTIME.get()
    xp = rt.xp
    if _float64(S_in, S_local):
        return _numba().combine(xp, state64(a, rt), state64(S_in, rt), state64(S_local, rt))
    return xp.asarray(S_local, dtype=xp.float32) + xp.asarray(a, dtype=xp.float32)[..., None] * S_in


def scan_combine(a: Any, S_in: Any, S_local: Any, out: Any = None) -> Any:
    """The scan operator's state part ``a * S_in + S_local`` (``a`` broadcast over the last axis), into ``out``
    (float64 ``[B, H, K, V]`` states: on the Numba kernels)."""
    if _float64(S_in, S_local) and S_local.ndim == 4 and (out is None or out.flags.c_contiguous):
        rt = RUNTIME.get()
        return _numba().combine(rt.xp, state64(a, rt), state64(S_in, rt), state64(S_local, rt), out=out)
    res = a[..., None] * S_in + S_local
    if out is None:
        return res
    out[...] = res
    return out


def initial_state_grad(q: Any, g: Any, do: Any, scale: float | None = None, chunk_size: int = 64, *,
                       nc: int | None = None) -> Any:
    """``U = scale * sum_t (q_t * exp(G_t))^T do_t``: ``[B, H, K, V]`` float32 (float64 for float64 inputs; the
    gradient into the slice's initial state from its own outputs; ZeCO's backward scans these in reverse).
    ``nc``: chunks of 64 tokens per segment of the tensor-core kernel (None: :func:`chunks_per_segment`'s)."""
    rt = RUNTIME.get()
    B, T, H, K, V, t = check_inputs(q, q, do, g, rt=rt)
    C = check_chunk_size(chunk_size, device=True)
    s = check_scale(scale, K)
    if T == 0 or B * H == 0:
        return rt.xp.zeros((B, H, K, V), dtype=rt.xp.float64 if t == "f64" else rt.xp.float32)
    q, g, do = (contig(x, rt) for x in (q, g, do))
    if t == "f64":
        return _numba().initial_state_grad(rt.xp, q, g, do, s, C)
    if _zeco_tc(rt, t, K, V, q, do):
        G = decay_cumsum(g, chunk_size=C)
        NTc = -(-T // 64)
        NC = chunks_per_segment(rt, B * H, NTc, nc)
        NS = -(-NTc // NC)
        part = rt.xp.empty((B * H, NS, K, V), dtype=rt.xp.float32)
        rt.launch(
            f"zeco_tc_qT_do<{t}>", (NS, B * H), (NT_SIMT,),
            (q, G, do, part, f32(s), i32(B), i32(T), i32(H), i32(K), i32(V), i32(NC), i32(NS)),
        )  # fmt: skip
        return part.sum(axis=1).reshape(B, H, K, V)
    NT = -(-T // C)
    dS, gtot = local_states(rt, q, do, g, t, B, T, H, K, V, C, NT, 1, s)
    return state_scan(rt, dS, gtot, None, NT, K, V, B * H, reverse=True).reshape(B, H, K, V)
