"""The fused chunked GLA of one batch of sequences on the CPU: forward ``fused_gla`` and backward ``fused_gla_bwd``,
the bodies of :func:`hpczeco.gla.chunk_gla` / :func:`hpczeco.gla.chunk_gla_bwd` without ``cu_seqlens`` (packed
documents run through these per bucket: :mod:`hpczeco.gla.varlen`).

Semantics and layout as :mod:`hpczeco.gla.naive` (``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``,
states ``[B, H, K, V]``). CuPy inputs are handed to :mod:`hpczeco.gpu.gla` (same signatures).

Chunked form. The sequence is cut into chunks of ``C`` tokens, each chunk into ``ns`` sub-chunks of
``c <= 16`` tokens. With ``b`` the cumulative gate inside a chunk (inclusive), ``r_I = b`` at the
first token of sub-chunk ``I`` and ``e_J = b`` at its last token::

    Q' = q * exp(b - r_I)        K' = k * exp(e_J - b)             (both factors <= 1)
    F_IJ = exp(r_I - e_J)        (<= 1 for J < I; the diagonal F_II = exp(span_I) >= 1)
    A[I, J] = scale * Q'_I (K'_J * F_IJ)^T   for J <= I, lower triangle on the diagonal blocks
    O = A V + scale * (Q' * exp(r_I)) S_prev = [A | scale q exp(b)] @ [V ; S_prev]
    S_next = diag(exp(b_C)) S_prev + (K' * exp(b_C - e_J))^T V

Every exponent is <= 0 except the diagonal-block factor ``exp(span_I)`` (``span_I`` = minus the gate
summed over a sub-chunk after its first token). Where ``span_I`` exceeds the span limit
(:mod:`hpczeco.gla._geometry`: 40 in float32, 300 in float64; strong decays such as g = -8 per token),
that diagonal block is computed in the exact pairwise form ``sum_k q_ik k_jk exp(b_ik - b_jk)`` (masked
exponents <= 0; :mod:`hpczeco.gla._pairwise`) instead, so no factor ever overflows. Partial chunks and
sub-chunks are padded with no-op tokens (q = k = v = g = 0). Gate sums are taken inside sub-chunks (short
sums) and across sub-chunks from their totals.

Execution (streaming). Time runs in the outer loop, in groups of chunks (about 512 padded tokens, so
the scratch stays in cache), the (batch, head) sequences in the inner loop; sequences are split over
threads by :mod:`hpczeco.gla._runner` (``HPCZECO_GLA_THREADS`` / ``OMP_NUM_THREADS`` / cores). Per group,
numba kernels (:mod:`hpczeco.gla._kernels`, GIL released) build the exponents and the matmul operands,
``np.exp`` exponentiates, BLAS does every product (``A`` row blocks, ``K^T V``, the fused
``[A | Qe] [V; S]``), and the ``[K, V]`` state is carried from group to group. The group steps shared with
the phase-split form (:mod:`hpczeco.gla.split`) are in :mod:`hpczeco.gla._steps`.

Backward. Pass 1 (time forward) stores the state entering every chunk (``[N + 1, K, V]`` per
sequence, never per token); pass 2 (time backward) carries ``dH``, the gradient into the current
chunk's end state (``dH <- exp(b_C) dH + scale (q exp(b))^T dO``, starting from ``dht``; its final
value is ``dh0``), recomputes ``A`` and, with ``dA = dO V^T``::

    dv = A^T dO + K exp(b_C - b) dH                dq = scale exp(b) (dO S_prev^T) + [dA-weighted k-side]
    dk = exp(b_C - b) (V dH^T) + [dA^T-weighted q-side]
    dg_t = sum_v (diag(exp(g_t)) S_{t-1}) * dS_t
         = sum_{tau >= t} (q dq' - k dk_intra')_tau + sum_{j < t} (k dk_inter)_j + exp(b_C) sum_v(S_prev dH)

(sums inside the chunk; ``'`` = without the ``j == t`` terms, which cancel exactly). Unlike the plain
identity ``dg = revcumsum(q dq - k dk) + sum_v(S_T dht)``, this form subtracts no large terms, so dg
keeps its relative accuracy in float32 when the decays are strong and dg is tiny.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.backend import is_device_array
from . import _kernels as _kn
from . import _kernels_grad as _kg
from ._geometry import Geom
from ._runner import run_units
from ._steps import OperandBuffers, a_matrix, exponents, intra_grads, matmul_rows
from .validate import check_gla_call

__all__ = ["fused_gla", "fused_gla_bwd"]


def _gpu_module():
    try:
        from ..gpu import gla as gpu_gla  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            "chunk_gla got CuPy arrays but the device implementation hpczeco.gpu.gla could not be imported "
            f"({exc}); install the 'gpu' extra or pass numpy arrays"
        ) from exc
    return gpu_gla


def _any_device(*arrays: Any) -> bool:
    return any(a is not None and is_device_array(a) for a in arrays)


# --------------------------------------------------------------------------------------------- forward


def fused_gla(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Any, Any]:
    """:func:`hpczeco.gla.chunk_gla` without ``cu_seqlens``: ``(o [B, T, H, V], final_state [B, H, K, V] or None)``
    (arguments, dtypes and the device dispatch as there)."""
    B, T, H, K, V, s, chunk_size, cdt = check_gla_call(q, k, v, g, scale, initial_state, chunk_size)
    if _any_device(q, k, v, g, initial_state):
        return _gpu_module().chunk_gla(
            q,
            k,
            v,
            g,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=chunk_size,
        )
    h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
    in_dtype = q.dtype
    if T == 0 or B * H == 0:
        o = np.zeros((B, T, H, V), dtype=q.dtype)
        final = np.zeros((B, H, K, V), dtype=cdt) if h0 is None else h0.copy()
        return o, (final if output_final_state else None)
    geo = Geom(B, T, H, K, V, chunk_size)
    q, k, v, g = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g))
    out = np.empty((B, T, H, V), dtype=cdt)
    final = np.empty((B, H, K, V), dtype=cdt)
    run_units(B, H, lambda units, tick: _fwd_units(units, q, k, v, g, s, h0, geo, out, final))
    if out.dtype != in_dtype:
        out = out.astype(in_dtype)
    return out, (final if output_final_state else None)


def _fwd_units(units, q, k, v, g, s, h0, geo: Geom, out, final) -> None:
    """Streaming forward of the sequences ``units``: groups of chunks in time order, state carried along."""
    K, V, C, T, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.ns, geo.c, geo.Cp
    G = geo.group()
    dt = q.dtype
    oA = _kn.layout(ns, c)[3]
    ob = OperandBuffers(geo, G, dt)
    L = np.zeros((G, Cp, Cp + K), dt)  # [A | scale q exp(b)]; blocks above the diagonal stay zero
    Kd = np.empty((G, Cp, K), dt)
    R = np.empty((G, Cp + K, V), dt)  # [V ; S_prev]
    U = np.empty((G, K, V), dt)
    Ot = np.empty((G, Cp, V), dt)
    S = np.empty((len(units), K, V), dt)
    for u, (b, h) in enumerate(units):
        S[u] = 0 if h0 is None else h0[b, h]
    for n0 in range(0, geo.N, G):
        gc = min(G, geo.N - n0)
        for u, (b, h) in enumerate(units):
            exponents(g, b, h, n0, gc, geo, ob.X, ob.bad)
            _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, ob.X, ob.bad, ob.Qp, ob.KX, L, Cp, None, Kd, None,
                              v, R, None, None)  # fmt: skip
            a_matrix(q, k, g, b, h, n0, gc, geo, s, ob.bad, ob.Qp, ob.KX, L)
            np.matmul(Kd[:gc].transpose(0, 2, 1), R[:gc, :Cp], out=U[:gc])
            _kn.state_fwd(U, ob.X, oA, gc, S[u], R, Cp)
            matmul_rows(L[:gc], R[:gc], out, b, h, n0, gc, geo, Ot)
    for u, (b, h) in enumerate(units):
        final[b, h] = S[u]


# --------------------------------------------------------------------------------------------- backward


def fused_gla_bwd(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    do: Any,
    scale: float | None = None,
    initial_state: Any = None,
    dht: Any = None,
    chunk_size: int = 64,
) -> tuple[Any, Any, Any, Any, Any]:
    """:func:`hpczeco.gla.chunk_gla_bwd` without ``cu_seqlens``: ``(dq, dk, dv, dg, dh0)`` (arguments, dtypes
    and the device dispatch as there)."""
    B, T, H, K, V, s, chunk_size, cdt = check_gla_call(q, k, v, g, scale, initial_state, chunk_size, do=do, dht=dht)
    if _any_device(q, k, v, g, do, initial_state, dht):
        return _gpu_module().chunk_gla_bwd(
            q, k, v, g, do, scale=scale, initial_state=initial_state, dht=dht, chunk_size=chunk_size
        )
    h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
    dh0_dtype = cdt if initial_state is None else initial_state.dtype
    in_dtype = q.dtype
    dH_last = np.zeros((B, H, K, V), dtype=cdt) if dht is None else np.asarray(dht, dtype=cdt)
    if T == 0 or B * H == 0:
        dq = np.zeros((B, T, H, K), dtype=q.dtype)
        return dq, dq.copy(), np.zeros((B, T, H, V), dtype=q.dtype), dq.copy(), dH_last.astype(dh0_dtype)
    geo = Geom(B, T, H, K, V, chunk_size)
    q, k, v, g, do = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g, do))
    dq, dk, dg = (np.empty((B, T, H, K), dtype=cdt) for _ in range(3))
    dv = np.empty((B, T, H, V), dtype=cdt)
    dh0 = np.empty((B, H, K, V), dtype=cdt)
    grads = (dq, dk, dv, dg)
    run_units(B, H, lambda units, tick: _bwd_units(units, q, k, v, g, do, s, h0, dH_last, geo, grads, dh0))
    return (
        dq.astype(in_dtype, copy=False),
        dk.astype(in_dtype, copy=False),
        dv.astype(in_dtype, copy=False),
        dg.astype(in_dtype, copy=False),
        dh0.astype(dh0_dtype, copy=False),
    )


def _bwd_units(units, q, k, v, g, do, s, h0, dH_last, geo: Geom, grads, dh0) -> None:
    """Streaming backward of the sequences ``units``: chunk-start states forward in time (stored per chunk,
    ``[N + 1, K, V]``), then the gradients group by group in reverse time order with ``dH`` carried along."""
    K, V, C, T, N, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.ns, geo.c, geo.Cp
    G = geo.group()
    dt = q.dtype
    oA = _kn.layout(ns, c)[3]
    ob = OperandBuffers(geo, G, dt, qx=True)
    X, bad = ob.X, ob.bad
    Qe, Kd, M1, DQ, DK, VdH = (np.empty((G, Cp, K), dt) for _ in range(6))
    R = np.empty((G, Cp + K, V), dt)
    Vb, dOb, DV, DV2 = (np.empty((G, Cp, V), dt) for _ in range(4))
    LA, dA = np.zeros((G, Cp, Cp), dt), np.empty((G, Cp, Cp), dt)  # LA: blocks above the diagonal stay zero
    dd = np.empty((G, Cp), dt)
    U, W, dHe = (np.empty((G, K, V), dt) for _ in range(3))
    nu = len(units)
    Sst = np.empty((nu, N + 1, K, V), dt)  # state entering every chunk (and the final state), per sequence
    dH = np.empty((nu, K, V), dt)
    # pass 1: the state entering every chunk (time outer, sequences inner: input rows read once)
    for u, (b, h) in enumerate(units):
        Sst[u, 0] = 0 if h0 is None else h0[b, h]
    for n0 in range(0, N, G):
        gc = min(G, N - n0)
        for u, (b, h) in enumerate(units):
            exponents(g, b, h, n0, gc, geo, X, bad)
            _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, X, bad, None, None, None, 0, None, Kd, None,
                              v, R, None, None)  # fmt: skip
            np.matmul(Kd[:gc].transpose(0, 2, 1), R[:gc, :Cp], out=U[:gc])
            _kn.state_chain(U, X, oA, gc, Sst[u], n0)
    # pass 2: reverse time, group by group
    for u, (b, h) in enumerate(units):
        dH[u] = dH_last[b, h]
    for n0 in range(((N - 1) // G) * G, -1, -G):
        gc = min(G, N - n0)
        for u, (b, h) in enumerate(units):
            exponents(g, b, h, n0, gc, geo, X, bad)
            _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, X, bad, ob.Qp, ob.KX, Qe, 0, ob.QX, Kd, None,
                              v, Vb, do, dOb)  # fmt: skip
            np.matmul(Qe[:gc].transpose(0, 2, 1), dOb[:gc], out=W[:gc])
            _kn.state_bwd(W, X, oA, gc, dH[u], dHe)
            np.matmul(Kd[:gc], dHe[:gc], out=DV2[:gc])
            np.matmul(Vb[:gc], dHe[:gc].transpose(0, 2, 1), out=VdH[:gc])
            intra_grads(q, k, g, b, h, n0, gc, geo, s, ob, Vb[:gc], dOb[:gc], Sst[u, n0 : n0 + gc], LA, dA, dd, DV,
                        M1, DQ, DK, VdH)  # fmt: skip
            _kg.bwd_finish(q, k, b, h, n0, gc, T, C, s, X, oA, DQ, DK, VdH, dd, DV, DV2, Sst[u], dHe, *grads)
    for u, (b, h) in enumerate(units):
        dh0[b, h] = dH[u]
