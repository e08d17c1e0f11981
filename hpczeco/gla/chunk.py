"""Chunked gated linear attention on the CPU: forward ``chunk_gla`` and backward ``chunk_gla_bwd``.

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
summed over a sub-chunk after its first token). Where ``span_I`` exceeds ``_SPAN_LIMIT`` (40 in
float32, 300 in float64: strong decays such as g = -8 per token), that diagonal block is computed in
the exact pairwise form ``sum_k q_ik k_jk exp(b_ik - b_jk)`` (masked exponents <= 0) instead, so no
factor ever overflows. Partial chunks and sub-chunks are padded with no-op tokens (q = k = v = g = 0).
Gate sums are taken inside sub-chunks (short sums) and across sub-chunks from their totals.

Execution (streaming). Time runs in the outer loop, in groups of chunks (about ``_GROUP_TOKENS``
tokens, so the scratch stays in cache), the (batch, head) sequences in the inner loop; sequences are
split over threads (``HPCZECO_GLA_THREADS`` / ``OMP_NUM_THREADS`` / cores). Per group, numba kernels
(:mod:`hpczeco.gla._kernels`, GIL released) build the exponents and the matmul operands, ``np.exp``
exponentiates, BLAS does every product (``A`` row blocks, ``K^T V``, the fused ``[A | Qe] [V; S]``),
and the ``[K, V]`` state is carried from group to group.

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

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..base.backend import is_device_array
from . import _kernels as _kn
from ._blas import single_threaded_blas
from .validate import check_chunk_size, check_scale, compute_dtype_name, validate_gla_inputs

__all__ = ["chunk_gla", "chunk_gla_bwd"]

# NOTE: hpczeco.gla.split (the ZeCO phase split) imports _SPAN_LIMIT, _check_common, _Geom, _group_size,
# _num_threads, _pairwise_A, _pairwise_dqdk and _run_units from here, and several kernels of _kernels:
# keep their signatures and meaning, or change split.py with them.

_SUB = 16  # sub-chunk size (tokens)
_SPAN_LIMIT = {np.dtype(np.float32): 40.0, np.dtype(np.float64): 300.0}
_GROUP_TOKENS = 512  # padded tokens per streaming group of chunks (keeps the scratch in cache)
_GROUP_TOKENS_BWD = 512


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


# --------------------------------------------------------------------------------------------- layout


class _Geom:
    """Chunk geometry: ``N`` chunks of ``C`` tokens, each padded to ``Cp = ns * c`` (``ns`` sub-chunks)."""

    def __init__(self, B: int, T: int, H: int, K: int, V: int, chunk_size: int):
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.C = C = max(1, min(chunk_size, T))
        self.N = -(-T // C)
        self.ns = -(-C // _SUB)
        self.c = -(-C // self.ns)
        self.Cp = self.ns * self.c
        self.Z = B * H * self.N


# --------------------------------------------------------------------------------------------- checks


def _check_common(q, k, v, g, scale, initial_state, chunk_size, do=None, dht=None):
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, initial_state=initial_state, do=do, dht=dht)
    s = check_scale(scale, K)
    cdt = np.dtype(compute_dtype_name(str(q.dtype)))
    return B, T, H, K, V, s, chunk_size, cdt


# --------------------------------------------------------------------------------------------- forward


def chunk_gla(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Any, Any]:
    """Chunked GLA forward: ``(o [B, T, H, V], final_state [B, H, K, V] or None)``.

    ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g`` the log forget gate (<= 0),
    ``initial_state: [B, H, K, V]`` or None (zeros), ``scale`` defaults to ``K**-0.5``. float32/float64
    inputs are computed in their own precision; float16/bfloat16 in float32. ``o`` has the input dtype,
    the final state the compute dtype (float32 for half inputs). CuPy inputs run on the device
    (:func:`hpczeco.gpu.gla.chunk_gla`). Local: no communication.
    """
    if _any_device(q, k, v, g, initial_state):
        _check_common(q, k, v, g, scale, initial_state, chunk_size)
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
    B, T, H, K, V, s, chunk_size, cdt = _check_common(q, k, v, g, scale, initial_state, chunk_size)
    h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
    in_dtype = q.dtype
    if T == 0 or B * H == 0:
        o = np.zeros((B, T, H, V), dtype=q.dtype)
        final = np.zeros((B, H, K, V), dtype=cdt) if h0 is None else h0.copy()
        return o, (final if output_final_state else None)
    geo = _Geom(B, T, H, K, V, chunk_size)
    q, k, v, g = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g))
    out = np.empty((B, T, H, V), dtype=cdt)
    final = np.empty((B, H, K, V), dtype=cdt)
    _run_units(B, H, lambda units: _fwd_units(units, q, k, v, g, s, h0, geo, out, final))
    if out.dtype != in_dtype:
        out = out.astype(in_dtype)
    return out, (final if output_final_state else None)


def _num_threads(units: int) -> int:
    """Worker threads: ``HPCZECO_GLA_THREADS``, else ``OMP_NUM_THREADS``, else the usable cores; at most
    one per (batch, head) sequence. Under MPI with several ranks per node set one of them (e.g. 1)."""
    for var in ("HPCZECO_GLA_THREADS", "OMP_NUM_THREADS"):
        env = os.environ.get(var, "").strip()
        if env.isdigit() and int(env) > 0:
            return max(1, min(int(env), units))
    return max(1, min(len(os.sched_getaffinity(0)), units))


def _run_units(B: int, H: int, fn) -> None:
    """Run ``fn(list of (b, h))`` over all sequences, split into contiguous blocks over threads (the kernels
    release the GIL). Each ``fn`` walks time in its outer loop and its sequences inside, so the rows of
    ``[B, T, H, D]`` inputs are read from memory once, not once per head."""
    units = [(b, h) for b in range(B) for h in range(H)]
    nt = _num_threads(len(units))

    def work(part):
        with single_threaded_blas():  # we parallelise; BLAS thread pools would fight the workers
            fn(part)

    if nt == 1:
        work(units)
        return
    bounds = [len(units) * i // nt for i in range(nt + 1)]
    with ThreadPoolExecutor(nt) as ex:
        for f in [ex.submit(work, units[bounds[i] : bounds[i + 1]]) for i in range(nt)]:
            f.result()


def _group_size(geo: _Geom) -> int:
    """Chunks per streaming group: about _GROUP_TOKENS padded tokens, so the scratch stays in cache."""
    return max(1, min(geo.N, _GROUP_TOKENS // geo.Cp))


def _fwd_units(units, q, k, v, g, s, h0, geo: _Geom, out, final) -> None:
    """Streaming forward of the sequences ``units``: groups of chunks in time order, state carried along."""
    K, V, C, T, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.ns, geo.c, geo.Cp
    G = _group_size(geo)
    dt = q.dtype
    limit = _SPAN_LIMIT[dt]
    oF, oR, oB, oA, LX = _kn.layout(ns, c)
    X = np.empty((G, LX, K), dt)
    bad = np.empty((G, ns), np.bool_)
    Qp = np.empty((G, Cp, K), dt)
    KX = np.empty((G, c * ns * (ns + 1) // 2, K), dt)
    L = np.zeros((G, Cp, Cp + K), dt)  # blocks above the diagonal stay zero
    Kd = np.empty((G, Cp, K), dt)
    R = np.empty((G, Cp + K, V), dt)
    U = np.empty((G, K, V), dt)
    Ot = np.empty((G, Cp, V), dt)
    S = np.empty((len(units), K, V), dt)
    for u, (b, h) in enumerate(units):
        S[u] = 0 if h0 is None else h0[b, h]
    for n0 in range(0, geo.N, G):
        gc = min(G, geo.N - n0)
        for u, (b, h) in enumerate(units):
            _kn.prep_exponents(g, b, h, n0, gc, T, C, ns, c, limit, X, bad)
            np.exp(X[:gc], out=X[:gc])
            _kn.prep_fwd_operands(q, k, v, b, h, n0, gc, T, C, ns, c, s, X, bad, Qp, KX, L, Kd, R)
            for i in range(ns):
                off = c * i * (i + 1) // 2
                np.matmul(
                    Qp[:gc, i * c : (i + 1) * c],
                    KX[:gc, off : off + (i + 1) * c].transpose(0, 2, 1),
                    out=L[:gc, i * c : (i + 1) * c, : (i + 1) * c],
                )
            _kn.mask_diag(L, gc, ns, c)
            if bad[:gc].any():
                _pairwise_A(q, k, g, b, h, n0, bad[:gc], geo, s, L)
            np.matmul(Kd[:gc].transpose(0, 2, 1), R[:gc, :Cp], out=U[:gc])
            _kn.state_fwd(U, X, oA, gc, S[u], R, Cp)
            t0, t1 = n0 * C, (n0 + gc) * C
            if Cp == C and t1 <= T:  # whole chunks: BLAS writes the strided rows of out[b, :, h] directly
                np.matmul(L[:gc], R[:gc], out=np.reshape(out[b, t0:t1, h], (gc, C, V), copy=False))
            else:
                np.matmul(L[:gc], R[:gc], out=Ot[:gc])
                _kn.write_rows(Ot, out, b, h, n0, gc, T, C)
    for u, (b, h) in enumerate(units):
        final[b, h] = S[u]


# --------------------------------------------------------------------------------------------- backward


def chunk_gla_bwd(
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
    """Analytic backward of :func:`chunk_gla`: ``(dq, dk, dv, dg, dh0)``.

    Gradients of ``L = sum(o * do) + sum(S_T * dht)`` (``dht: [B, H, K, V]`` or None for zeros) with
    respect to ``q, k, v, g`` (``[B, T, H, K]``, ``[B, T, H, V]`` for dv, in the input dtype) and the
    initial state ``dh0 [B, H, K, V]`` — returned as an array even when ``initial_state`` is None (it is
    then the gradient with respect to a zero initial state), in the dtype of ``initial_state`` if given,
    else the compute dtype. The chunk states are recomputed (``[N, K, V]`` per head, never per token).
    CuPy inputs run on the device (:func:`hpczeco.gpu.gla.chunk_gla_bwd`). Local: no communication.
    """
    if _any_device(q, k, v, g, do, initial_state, dht):
        _check_common(q, k, v, g, scale, initial_state, chunk_size, do=do, dht=dht)
        return _gpu_module().chunk_gla_bwd(
            q, k, v, g, do, scale=scale, initial_state=initial_state, dht=dht, chunk_size=chunk_size
        )
    B, T, H, K, V, s, chunk_size, cdt = _check_common(q, k, v, g, scale, initial_state, chunk_size, do=do, dht=dht)
    h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
    dh0_dtype = cdt if initial_state is None else initial_state.dtype
    in_dtype = q.dtype
    dH_last = np.zeros((B, H, K, V), dtype=cdt) if dht is None else np.asarray(dht, dtype=cdt)
    if T == 0 or B * H == 0:
        dq = np.zeros((B, T, H, K), dtype=q.dtype)
        return dq, dq.copy(), np.zeros((B, T, H, V), dtype=q.dtype), dq.copy(), dH_last.astype(dh0_dtype)
    geo = _Geom(B, T, H, K, V, chunk_size)
    q, k, v, g, do = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g, do))
    dq, dk, dg = (np.empty((B, T, H, K), dtype=cdt) for _ in range(3))
    dv = np.empty((B, T, H, V), dtype=cdt)
    dh0 = np.empty((B, H, K, V), dtype=cdt)
    _run_units(B, H, lambda units: _bwd_units(units, q, k, v, g, do, s, h0, dH_last, geo, dq, dk, dv, dg, dh0))
    return (
        dq.astype(in_dtype, copy=False),
        dk.astype(in_dtype, copy=False),
        dv.astype(in_dtype, copy=False),
        dg.astype(in_dtype, copy=False),
        dh0.astype(dh0_dtype, copy=False),
    )


def _bwd_units(units, q, k, v, g, do, s, h0, dH_last, geo: _Geom, dq, dk, dv, dg, dh0) -> None:
    """Streaming backward of the sequences ``units``: chunk-start states forward in time (stored per chunk,
    ``[N + 1, K, V]``), then the gradients group by group in reverse time order with ``dH`` carried along."""
    K, V, C, T, N, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.ns, geo.c, geo.Cp
    G = max(1, min(N, _GROUP_TOKENS_BWD // Cp))
    dt = q.dtype
    limit = _SPAN_LIMIT[dt]
    oF, oR, oB, oA, LX = _kn.layout(ns, c)
    nx = c * ns * (ns + 1) // 2
    X = np.empty((G, LX, K), dt)
    bad = np.empty((G, ns), np.bool_)
    Qp, Qe, Kd, M1, DQ, DK, VdH = (np.empty((G, Cp, K), dt) for _ in range(7))
    KX, QX = np.empty((G, nx, K), dt), np.empty((G, nx, K), dt)
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
            _kn.prep_exponents(g, b, h, n0, gc, T, C, ns, c, limit, X, bad)
            np.exp(X[:gc], out=X[:gc])
            _kn.prep_state_operands(k, v, b, h, n0, gc, T, C, ns, c, X, Kd, R)
            np.matmul(Kd[:gc].transpose(0, 2, 1), R[:gc, :Cp], out=U[:gc])
            _kn.state_chain(U, X, oA, gc, Sst[u], n0)
    # pass 2: reverse time, group by group
    for u, (b, h) in enumerate(units):
        dH[u] = dH_last[b, h]
    for n0 in range(((N - 1) // G) * G, -1, -G):
        gc = min(G, N - n0)
        for u, (b, h) in enumerate(units):
            _kn.prep_exponents(g, b, h, n0, gc, T, C, ns, c, limit, X, bad)
            np.exp(X[:gc], out=X[:gc])
            _kn.prep_bwd_operands(q, k, v, do, b, h, n0, gc, T, C, ns, c, s, X, bad, Qp, Qe, KX, QX, Kd, Vb, dOb)
            np.matmul(Qe[:gc].transpose(0, 2, 1), dOb[:gc], out=W[:gc])
            _kn.state_bwd(W, X, oA, gc, dH[u], dHe)
            for i in range(ns):  # A (scaled, lower triangular) as in the forward
                off = c * i * (i + 1) // 2
                np.matmul(
                    Qp[:gc, i * c : (i + 1) * c],
                    KX[:gc, off : off + (i + 1) * c].transpose(0, 2, 1),
                    out=LA[:gc, i * c : (i + 1) * c, : (i + 1) * c],
                )
            _kn.mask_diag(LA, gc, ns, c)
            pw = _pairwise_A(q, k, g, b, h, n0, bad[:gc], geo, s, LA) if bad[:gc].any() else None
            np.matmul(dOb[:gc], Vb[:gc].transpose(0, 2, 1), out=dA[:gc])  # dO V^T (unscaled)
            _kn.mask_dA(dA, dd, gc, ns, c)
            np.matmul(LA[:gc].transpose(0, 2, 1), dOb[:gc], out=DV[:gc])
            np.matmul(Kd[:gc], dHe[:gc], out=DV2[:gc])
            np.matmul(dOb[:gc], Sst[u, n0 : n0 + gc].transpose(0, 2, 1), out=M1[:gc])
            for i in range(ns):
                off = c * i * (i + 1) // 2
                np.matmul(
                    dA[:gc, i * c : (i + 1) * c, : (i + 1) * c],
                    KX[:gc, off : off + (i + 1) * c],
                    out=DQ[:gc, i * c : (i + 1) * c],
                )
                oq = _kn.qx_offset(i, ns, c)
                np.matmul(
                    dA[:gc, i * c :, i * c : (i + 1) * c].transpose(0, 2, 1),
                    QX[:gc, oq : oq + (ns - i) * c],
                    out=DK[:gc, i * c : (i + 1) * c],
                )
            np.matmul(Vb[:gc], dHe[:gc].transpose(0, 2, 1), out=VdH[:gc])
            _kn.bwd_combine(X, gc, ns, c, s, M1, DQ, DK, VdH)
            if pw is not None:
                _pairwise_dqdk(pw, c, s, dA, DQ, DK)
            _kn.bwd_finish(q, k, b, h, n0, gc, T, C, s, X, oA, DQ, DK, VdH, dd, DV, DV2, Sst[u], dHe, dq, dk, dv, dg)
    for u, (b, h) in enumerate(units):
        dh0[b, h] = dH[u]


def _pairwise_A(q, k, g, b, h, n0, bad, geo: _Geom, s, L):
    """Exact pairwise diagonal blocks of ``A`` where the span is too large to factor (written into ``L``;
    ``exp`` of the packed exponents by numpy, the rest in numba). Returns what :func:`_pairwise_dqdk` needs."""
    c, K = geo.c, geo.K
    gb, ib = (x.astype(np.int64) for x in np.nonzero(bad))
    dt = L.dtype
    Qb, Kb = np.empty((gb.size, c, K), dt), np.empty((gb.size, c, K), dt)
    E = np.empty((gb.size, c * (c + 1) // 2, K), dt)
    _kn.pw_prepare(q, k, g, b, h, n0, gb, ib, geo.T, geo.C, c, Qb, Kb, E)
    np.exp(E, out=E)
    _kn.pw_A(Qb, Kb, E, gb, ib, c, s, L)
    return gb, ib, Qb, Kb, E


def _pairwise_dqdk(pw, c: int, s: float, dA, DQ, DK) -> None:
    """Add the exact diagonal-block parts of dq, dk (strictly lower ``dA``, unscaled) for the flagged blocks."""
    gb, ib, Qb, Kb, E = pw
    _kn.pw_dqdk(Qb, Kb, E, dA, gb, ib, c, s, DQ, DK)
