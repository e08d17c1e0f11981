"""Chunked gated linear attention on the CPU (numpy): forward ``chunk_gla`` and backward ``chunk_gla_bwd``.

Semantics and layout as :mod:`hpczeco.gla.naive` (``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``,
states ``[B, H, K, V]``). CuPy inputs are handed to :mod:`hpczeco.gpu.gla` (same signatures).

Algorithm (per batch and head; all chunks at once with batched matmuls, only the ``[B, H, K, V]``
state recurrence loops over chunks). The sequence is cut into chunks of ``C`` tokens, each chunk into
``ns`` sub-chunks of ``c <= 16`` tokens. With ``b`` the cumulative gate inside a chunk (inclusive),
``r_I = b`` at the first token of sub-chunk ``I`` and ``e_J = b`` at the last token of sub-chunk ``J``::

    Q' = q * exp(b - r_I)        K' = k * exp(e_J - b)             (both factors <= 1)
    F_IJ = exp(r_I - e_J)        (<= 1 for J < I; the diagonal F_II = exp(span_I) >= 1)
    A[I, J] = scale * Q'_I (K'_J * F_IJ)^T   for J <= I, lower triangle on the diagonal blocks
    O = A V + scale * (Q' * exp(r_I)) S_prev
    S_next = diag(exp(b_C)) S_prev + (K' * exp(b_C - e_J))^T V

Every exponent is <= 0 except the diagonal-block factor ``exp(span_I)`` (``span_I`` = minus the gate
summed over a sub-chunk after its first token). Where ``span_I`` exceeds ``_SPAN_LIMIT`` (40 in
float32, 300 in float64: strong decays such as g = -8 per token), that diagonal block is computed in
the exact pairwise form ``sum_k q_ik k_jk exp(b_ik - b_jk)`` (masked exponents <= 0) instead, so no
factor ever overflows. Partial chunks and sub-chunks are padded with no-op tokens (q = k = v = g = 0).

The backward recomputes the chunk-start states, runs the reverse state recurrence for the gradient
``dH`` flowing into each chunk's final state, and uses per chunk ``dg_t = sum_{tau >= t in chunk}
(q dq - k dk)_tau + sum_v (S_end * dH)`` (exact: the chunk's end state and its gradient close the sum).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..backend import is_device_array
from . import _kernels as _kn
from .validate import check_chunk_size, check_scale, compute_dtype_name, validate_gla_inputs

__all__ = ["chunk_gla", "chunk_gla_bwd"]

_SUB = 16  # sub-chunk size (tokens)
_SPAN_LIMIT = {np.dtype(np.float32): 40.0, np.dtype(np.float64): 300.0}
_PAIRWISE_BATCH = 256  # diagonal blocks per pairwise einsum (bounds memory to ~batch * c * c * K)
_GROUP_TOKENS = 2048  # padded tokens per streaming group of chunks (keeps the scratch in cache)


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


def _to_chunks(x: np.ndarray, geo: _Geom, dtype: np.dtype) -> np.ndarray:
    """``[B, T, H, D]`` -> contiguous ``[B, H, N, Cp, D]`` in ``dtype``; token ``n C + m`` at ``(n, m)``,
    padding zeros."""
    B, T, H, D = x.shape
    N, C, Cp = geo.N, geo.C, geo.Cp
    pad = N * C != T or Cp != C
    buf = (np.zeros if pad else np.empty)((B, H, N, Cp, D), dtype=dtype)
    xt = x.transpose(0, 2, 1, 3)
    n0 = T // C
    if n0:
        buf[:, :, :n0, :C] = np.reshape(xt[:, :, : n0 * C], (B, H, n0, C, D), copy=False)
    rem = T - n0 * C
    if rem:
        buf[:, :, n0, :rem] = xt[:, :, n0 * C :]
    return buf


def _from_chunks(xc: np.ndarray, geo: _Geom, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`_to_chunks`: ``[B, H, N, Cp, D]`` -> contiguous ``[B, T, H, D]`` in ``dtype``."""
    B, H, N, Cp, D = xc.shape
    T, C = geo.T, geo.C
    out = np.empty((B, T, H, D), dtype=dtype)
    ot = out.transpose(0, 2, 1, 3)
    n0 = T // C
    if n0:
        np.copyto(np.reshape(ot[:, :, : n0 * C], (B, H, n0, C, D), copy=False), xc[:, :, :n0, :C], casting="unsafe")
    rem = T - n0 * C
    if rem:
        np.copyto(ot[:, :, n0 * C :], xc[:, :, n0, :rem], casting="unsafe")
    return out


# --------------------------------------------------------------------------------------------- decays


class _Decays:
    """Decay factors of every chunk (``Z = B H N`` chunks, ``ns`` sub-chunks of ``c`` tokens).

    ``lc [Z, ns, c, K]``: gate cumsum inside each sub-chunk; ``eq = exp(b - r_I)``, ``ek = exp(e_J - b)``
    (``[Z, ns, c, K]``); ``er = exp(r_I)``, ``eb = exp(b_C - e_J)`` (``[Z, ns, K]``); ``a = exp(b_C)``
    (``[Z, K]``); ``F [Z, ns, ns, K]`` with ``F[:, I, J] = exp(r_I - e_J)`` for ``J < I`` and the clamped
    ``exp(min(span_I, limit))`` on the diagonal; ``bad [Z, ns]``: sub-chunks whose span exceeds the limit.
    """

    def __init__(self, gz: np.ndarray, limit: float):
        Z, ns, c, K = gz.shape
        lc = np.cumsum(gz, axis=2)
        tot = lc[:, :, -1, :]
        first = gz[:, :, 0, :]
        self.lc = lc
        self.eq = np.exp(lc - first[:, :, None, :])
        self.ek = np.exp(tot[:, :, None, :] - lc)
        pre = np.zeros_like(tot)  # exclusive prefix sums of the sub-chunk totals
        suf = np.zeros_like(tot)  # exclusive suffix sums
        for i in range(1, ns):
            pre[:, i] = pre[:, i - 1] + tot[:, i - 1]
            suf[:, ns - 1 - i] = suf[:, ns - i] + tot[:, ns - i]
        self.er = np.exp(pre + first)
        self.eb = np.exp(suf)
        self.a = np.exp(pre[:, -1] + tot[:, -1])
        span = first - tot  # >= 0: r_I - e_I
        self.bad = span.max(axis=-1) > limit if K else np.zeros((Z, ns), bool)
        F = np.zeros((Z, ns, ns, K), dtype=gz.dtype)
        for i in range(ns):
            F[:, i, i] = np.exp(np.minimum(span[:, i], limit))
            acc = first[:, i].copy()  # r_I - e_J for J = I - 1, I - 2, ...
            for j in range(i - 1, -1, -1):
                F[:, i, j] = np.exp(acc)
                acc += tot[:, j]
        self.F = F


def _pairwise_decay(lcb: np.ndarray) -> np.ndarray:
    """``E[n, i, j, k] = exp(b_ik - b_jk)`` for ``j <= i`` and 0 above (``lcb: [n, c, K]``): exact, <= 1."""
    c = lcb.shape[1]
    d = lcb[:, :, None, :] - lcb[:, None, :, :]
    d[:, ~np.tri(c, dtype=bool)] = -np.inf
    return np.exp(d)


def _bad_blocks(bad: np.ndarray):
    """Yield ``(z_idx, i_idx)`` index arrays of the flagged diagonal blocks in batches."""
    zs, is_ = np.nonzero(bad)
    for s in range(0, zs.size, _PAIRWISE_BATCH):
        yield zs[s : s + _PAIRWISE_BATCH], is_[s : s + _PAIRWISE_BATCH]


def _k_side(Kp: np.ndarray, dec: _Decays, i: int) -> np.ndarray:
    """``[Z, (i+1) c, K]``: ``k_j exp(r_i - b_j)`` for the tokens of sub-chunks ``0..i`` (diagonal rows of
    flagged sub-chunks zeroed)."""
    Z, ns, c, K = Kp.shape
    kx = Kp[:, : i + 1] * dec.F[:, i, : i + 1, None, :]
    zb = np.nonzero(dec.bad[:, i])[0]
    if zb.size:
        kx[zb, i] = 0
    return kx.reshape(Z, (i + 1) * c, K)


def _q_side(Qp: np.ndarray, dec: _Decays, j: int) -> np.ndarray:
    """``[Z, (ns-j) c, K]``: ``q_t exp(b_t - e_j)`` for the tokens of sub-chunks ``j..ns-1`` (diagonal rows
    of flagged sub-chunks zeroed)."""
    Z, ns, c, K = Qp.shape
    qx = Qp[:, j:] * dec.F[:, j:, j, None, :]
    zb = np.nonzero(dec.bad[:, j])[0]
    if zb.size:
        qx[zb, 0] = 0
    return qx.reshape(Z, (ns - j) * c, K)


def _intra_A(qz: np.ndarray, kz: np.ndarray, Qp: np.ndarray, Kp: np.ndarray, dec: _Decays, scale: float):
    """Intra-chunk attention ``A [Z, Cp, Cp]`` (lower triangular, scaled) and the per-row k-sides."""
    Z, ns, c, K = Qp.shape
    Cp = ns * c
    A = np.zeros((Z, Cp, Cp), dtype=Qp.dtype)
    tri = np.tri(c, dtype=Qp.dtype)
    kxs = []
    for i in range(ns):
        kx = _k_side(Kp, dec, i)
        kxs.append(kx)
        blk = A[:, i * c : (i + 1) * c, : (i + 1) * c]
        np.matmul(Qp[:, i], kx.transpose(0, 2, 1), out=blk)
        blk *= scale
        blk[:, :, i * c :] *= tri
    for zb, ib in _bad_blocks(dec.bad):
        E = _pairwise_decay(dec.lc[zb, ib])
        A.reshape(Z, ns, c, ns, c)[zb, ib, :, ib, :] = np.einsum("nik,nijk,njk->nij", qz[zb, ib], E, kz[zb, ib]) * scale
    return A, kxs


def _state_pass(U: np.ndarray, a: np.ndarray, h0: np.ndarray | None, geo: _Geom, dtype) -> np.ndarray:
    """Chunk-start states ``[N + 1, B, H, K, V]`` (the last one is the final state) from the per-chunk
    updates ``U [B, H, N, K, V]`` and decays ``a [B, H, N, K]``: ``S_{n+1} = a_n S_n + U_n``."""
    B, H, N, K, V = geo.B, geo.H, geo.N, geo.K, geo.V
    S = np.empty((N + 1, B, H, K, V), dtype=dtype)
    if h0 is None:
        S[0] = 0
    else:
        S[0] = h0
    for n in range(N):
        np.multiply(S[n], a[:, :, n, :, None], out=S[n + 1])
        S[n + 1] += U[:, :, n]
    return S


def _prepare(q, k, v, g, geo: _Geom, cdt):
    """Chunked inputs ``[Z, ns, c, D]`` and decays."""
    Z, ns, c = geo.Z, geo.ns, geo.c
    qz = _to_chunks(q, geo, cdt).reshape(Z, ns, c, geo.K)
    kz = _to_chunks(k, geo, cdt).reshape(Z, ns, c, geo.K)
    gz = _to_chunks(g, geo, cdt).reshape(Z, ns, c, geo.K)
    vz = _to_chunks(v, geo, cdt).reshape(Z, geo.Cp, geo.V)
    dec = _Decays(gz, _SPAN_LIMIT[np.dtype(cdt)])
    return qz, kz, vz, dec


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
        validate_gla_inputs(q, k, v, g, initial_state=initial_state)
        return _gpu_module().chunk_gla(
            q, k, v, g, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, chunk_size=chunk_size,
        )  # fmt: skip
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
    env = os.environ.get("HPCZECO_GLA_THREADS", "")
    n = int(env) if env.strip().isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
    return max(1, min(n, units))


def _run_units(B: int, H: int, fn) -> None:
    """Run ``fn(list of (b, h))`` over all sequences, split round-robin over threads (kernels release the GIL)."""
    units = [(b, h) for b in range(B) for h in range(H)]
    nt = _num_threads(len(units))
    if nt == 1:
        fn(units)
        return
    with ThreadPoolExecutor(nt) as ex:
        for f in [ex.submit(fn, units[i::nt]) for i in range(nt)]:
            f.result()


def _group_size(geo: _Geom) -> int:
    """Chunks per streaming group: about _GROUP_TOKENS padded tokens, so the scratch stays in cache."""
    return max(1, min(geo.N, _GROUP_TOKENS // geo.Cp))


def _gather_sub(x: np.ndarray, b: int, h: int, n: np.ndarray, i: np.ndarray, geo: _Geom) -> np.ndarray:
    """Tokens of sub-chunks ``(n, i)`` of sequence ``(b, h)``: ``[nb, c, D]`` with zeros for no-op rows."""
    pos = i[:, None] * geo.c + np.arange(geo.c)[None, :]
    t = n[:, None] * geo.C + pos
    valid = (pos < geo.C) & (t < geo.T)
    return x[b, np.where(valid, t, 0), h] * valid[..., None]


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
    L = np.empty((G, Cp, Cp + K), dt)
    Kd = np.empty((G, Cp, K), dt)
    R = np.empty((G, Cp + K, V), dt)
    U = np.empty((G, K, V), dt)
    Ot = np.empty((G, Cp, V), dt)
    S = np.empty((K, V), dt)
    for b, h in units:
        S[...] = 0 if h0 is None else h0[b, h]
        for n0 in range(0, geo.N, G):
            gc = min(G, geo.N - n0)
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
                gb, ib = np.nonzero(bad[:gc])
                nb_ = n0 + gb
                E = _pairwise_decay(np.cumsum(_gather_sub(g, b, h, nb_, ib, geo), axis=1))
                Ad = np.einsum("nik,nijk,njk->nij", _gather_sub(q, b, h, nb_, ib, geo), E,
                               _gather_sub(k, b, h, nb_, ib, geo))  # fmt: skip
                Ad *= s
                for j in range(gb.size):
                    o = ib[j] * c
                    L[gb[j], o : o + c, o : o + c] = Ad[j]
            np.matmul(Kd[:gc].transpose(0, 2, 1), R[:gc, :Cp], out=U[:gc])
            _kn.state_fwd(U, X, oA, gc, S, R, Cp)
            np.matmul(L[:gc], R[:gc], out=Ot[:gc])
            _kn.write_rows(Ot, out, b, h, n0, gc, T, C)
        final[b, h] = S


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
        validate_gla_inputs(q, k, v, g, initial_state=initial_state, do=do, dht=dht)
        return _gpu_module().chunk_gla_bwd(
            q, k, v, g, do, scale=scale, initial_state=initial_state, dht=dht, chunk_size=chunk_size
        )
    B, T, H, K, V, s, chunk_size, cdt = _check_common(q, k, v, g, scale, initial_state, chunk_size, do=do, dht=dht)
    h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
    dh0_dtype = cdt if initial_state is None else initial_state.dtype
    dH_last = np.zeros((B, H, K, V), dtype=cdt) if dht is None else np.asarray(dht, dtype=cdt)
    if T == 0 or B * H == 0:
        dq = np.zeros((B, T, H, K), dtype=q.dtype)
        return dq, dq.copy(), np.zeros((B, T, H, V), dtype=q.dtype), dq.copy(), dH_last.astype(dh0_dtype)
    geo = _Geom(B, T, H, K, V, chunk_size)
    Z, N, ns, c, Cp = geo.Z, geo.N, geo.ns, geo.c, geo.Cp
    qz, kz, vz, dec = _prepare(q, k, v, g, geo, cdt)
    doz = _to_chunks(do, geo, cdt).reshape(Z, Cp, V)
    Qp = qz * dec.eq
    Kp = kz * dec.ek
    a = dec.a.reshape(B, H, N, K)

    # chunk-start states (forward recurrence) and the gradient into every chunk's end state (reverse)
    Kd = (Kp * dec.eb[:, :, None, :]).reshape(Z, Cp, K)
    U = np.matmul(Kd.transpose(0, 2, 1), vz).reshape(B, H, N, K, V)
    S = _state_pass(U, a, h0, geo, cdt)  # S[n] = state entering chunk n, S[N] final
    Qe = (Qp * (dec.er * s)[:, :, None, :]).reshape(Z, Cp, K)  # scale q_t exp(b_t)
    W = np.matmul(Qe.transpose(0, 2, 1), doz).reshape(B, H, N, K, V)
    dH = np.empty((N + 1, B, H, K, V), dtype=cdt)  # dH[n + 1] = gradient into the end state of chunk n
    dH[N] = dH_last
    for n in range(N - 1, -1, -1):
        np.multiply(dH[n + 1], a[:, :, n, :, None], out=dH[n])
        dH[n] += W[:, :, n]
    Sprev = S[:-1].transpose(1, 2, 0, 3, 4).reshape(Z, K, V)
    dHend = dH[1:].transpose(1, 2, 0, 3, 4).reshape(Z, K, V)

    A, kxs = _intra_A(qz, kz, Qp, Kp, dec, s)
    dA = np.matmul(doz, vz.transpose(0, 2, 1))  # [Z, Cp, Cp]: scale * dO V^T, strictly lower part kept
    dA *= s
    dd = np.diagonal(dA, axis1=1, axis2=2).reshape(Z, ns, c, 1).copy()  # the j == t terms, handled apart
    tri = np.tri(c, k=-1, dtype=cdt)
    for i in range(ns):
        dA[:, i * c : (i + 1) * c, (i + 1) * c :] = 0
        dA[:, i * c : (i + 1) * c, i * c : (i + 1) * c] *= tri

    # dv = A^T dO + Kd dH_end  (A holds its diagonal; dA is strict from here on)
    dv = np.matmul(A.transpose(0, 2, 1), doz)
    dv += np.matmul(Kd, dHend)

    # dq' = eq * (dA K-side + scale er dO S_prev^T): dq without its diagonal term dd * k
    dq = np.matmul(doz, Sprev.transpose(0, 2, 1)).reshape(Z, ns, c, K)
    dq *= (dec.er * s)[:, :, None, :]
    for i in range(ns):
        dq[:, i] += np.matmul(dA[:, i * c : (i + 1) * c, : (i + 1) * c], kxs[i])
    dq *= dec.eq
    # dk_intra' = ek * (dA^T Q-side) (no diagonal term); dk_inter = ek * eb * (V dH_end^T)
    dk = np.empty_like(dq)
    for j in range(ns):
        np.matmul(dA[:, j * c :, j * c : (j + 1) * c].transpose(0, 2, 1), _q_side(Qp, dec, j), out=dk[:, j])
    dk *= dec.ek
    for zb, ib in _bad_blocks(dec.bad):
        E = _pairwise_decay(dec.lc[zb, ib])
        dAb = dA.reshape(Z, ns, c, ns, c)[zb, ib, :, ib, :]
        dq[zb, ib] += np.einsum("nij,nijk,njk->nik", dAb, E, kz[zb, ib])
        dk[zb, ib] += np.einsum("nij,nijk,nik->njk", dAb, E, qz[zb, ib])
    dk_inter = np.matmul(vz, dHend.transpose(0, 2, 1)).reshape(Z, ns, c, K)
    dk_inter *= dec.eb[:, :, None, :]
    dk_inter *= dec.ek

    # dg_t = sum_v (diag(exp(g_t)) S_{t-1}) * dS_t, summed without cancelling terms:
    #   sum_{tau >= t} (q dq' - k dk_intra')_tau   (pairs j < t <= tau of the intra-chunk part, plus q dq_inter)
    # + sum_{j < t} (k dk_inter)_j + exp(b_C) sum_v(S_prev * dH_end)   (the end-state part)
    y = (qz * dq - kz * dk).reshape(Z, Cp, K)
    dg = np.flip(np.cumsum(np.flip(y, axis=1), axis=1), axis=1)
    zz = (kz * dk_inter).reshape(Z, Cp, K)
    dg[:, 1:] += np.cumsum(zz[:, :-1], axis=1)  # exclusive: sum over j < t
    dg += (dec.a * np.einsum("zkv,zkv->zk", Sprev, dHend))[:, None, :]
    dq += dd * kz
    dk += dk_inter
    dk += dd * qz

    shp_k = (B, H, N, Cp, K)
    return (
        _from_chunks(dq.reshape(shp_k), geo, q.dtype),
        _from_chunks(dk.reshape(shp_k), geo, q.dtype),
        _from_chunks(dv.reshape(B, H, N, Cp, V), geo, q.dtype),
        _from_chunks(dg.reshape(shp_k), geo, q.dtype),
        dH[0].astype(dh0_dtype, copy=True),
    )
