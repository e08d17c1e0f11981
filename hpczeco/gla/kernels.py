"""Numba kernels of the CPU chunked GLA (:mod:`hpczeco.gla.chunk`, :mod:`hpczeco.gla.split`): fused element-wise
work, the matmuls stay in BLAS via numpy. Exponents, matmul operands, token-row copies and state recurrences; the
backward's ``dA`` mask, gradient combination and writes; the exact pairwise diagonal blocks.

Kernels work on one (batch b, head h) sequence, or on a block of sequences ``(ub[u], uh[u])``, and a group
of ``G`` consecutive chunks from chunk ``n0``: token ``t = n C + pos`` of chunk ``n`` sits at row ``pos``
(``pos < C``) of a chunk padded to ``Cp = ns c`` rows (``ns`` sub-chunks of ``c`` tokens); rows past ``C`` or
past ``T`` are no-op tokens, so the valid rows are a prefix. Kernels release the GIL (``nogil``) so several
sequences run in parallel Python threads. Scalars (scale) arrive in the compute dtype so float32 work stays
in float32.

Exponent buffer ``X [G, LX, K]`` (see :func:`layout`): rows ``[0, Cp)`` ``b - r_I`` (q side), rows
``[Cp, 2 Cp)`` ``e_J - b`` (k side), then ``F`` exponents (``ns (ns + 1) / 2`` rows, ``I``-major,
``r_I - e_J`` for ``J < I`` and the clamped span on the diagonal), ``r_I`` (ns rows), ``b_C - e_J``
(ns rows) and ``b_C`` (1 row). ``np.exp`` is applied to it in place before the operand kernel.

Backward: the fused backward (:func:`bwd_finish`) writes every term at once; the phase-split one writes the
dht-independent terms first (:func:`local_write`) and adds the ``dH`` terms once the incoming state gradient is
known (:func:`add_state_grads`).

Pairwise blocks: where the span of a sub-chunk (minus the gate summed after its first token) exceeds the span
limit (:data:`hpczeco.gla.chunk.SPAN_LIMIT`), its diagonal block of ``A`` is computed in the exact form
``scale sum_k q_ik k_jk exp(b_ik - b_jk)`` (every exponent <= 0) instead of the factored one, and the
backward adds that block's parts of dq and dk the same way (:func:`pairwise_A`, :func:`pairwise_dqdk`; ``exp``
of the packed exponents runs in numpy, the rest in numba).

Optional outputs are ``None``: numba compiles one specialisation per combination and prunes the branches
of the absent ones, so each caller gets a kernel that does only its own work.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

__all__ = [
    "layout",
    "qx_offset",
    "prep_exponents",
    "chunk_exponents",
    "prep_operands",
    "scaled_rows",
    "gather_rows",
    "write_rows",
    "add_rows",
    "mask_diag",
    "state_fwd",
    "state_chain",
    "state_bwd",
    "correct_states",
    "corrected_states",
    "mask_dA",
    "combine",
    "bwd_finish",
    "local_write",
    "add_state_grads",
    "pairwise_A",
    "pairwise_dqdk",
]


def layout(ns: int, c: int) -> tuple[int, int, int, int, int]:
    """Row offsets in the exponent buffer: ``(oF, oR, oB, oA, LX)``."""
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    oB = oR + ns
    oA = oB + ns
    return oF, oR, oB, oA, oA + 1


def qx_offset(j: int, ns: int, c: int) -> int:
    """Row offset of column block ``J`` in the q-side buffer ``QX`` (blocks ``I = J..ns-1`` stacked)."""
    return c * (j * ns - j * (j - 1) // 2)


# ------------------------------------------------------------------------------------------ exponents


@nb.njit(cache=True, nogil=True)
def prep_exponents(g, b, h, n0, G, T, C, ns, c, limit, X, bad):
    """Fill ``X[:G]`` with the exponents of chunks ``n0 .. n0+G-1`` and ``bad[:G, ns]`` (span > limit)."""
    K = g.shape[3]
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    oB = oR + ns
    oA = oB + ns
    dt = X.dtype
    acc = np.empty(K, dt)
    tot = np.empty((ns, K), dt)
    first = np.empty((ns, K), dt)
    for gi in range(G):
        n = n0 + gi
        for i in range(ns):
            for kk in range(K):
                acc[kk] = 0
            for p in range(c):
                pos = i * c + p
                t = n * C + pos
                if pos < C and t < T:
                    for kk in range(K):
                        acc[kk] += g[b, t, h, kk]
                for kk in range(K):
                    X[gi, pos, kk] = acc[kk]  # local cumulative gate, turned into exponents below
            for kk in range(K):
                first[i, kk] = X[gi, i * c, kk]
                tot[i, kk] = acc[kk]
            for p in range(c):
                pos = i * c + p
                for kk in range(K):
                    X[gi, cp + pos, kk] = tot[i, kk] - X[gi, pos, kk]
                for kk in range(K):
                    X[gi, pos, kk] -= first[i, kk]
        for kk in range(K):
            acc[kk] = 0
        for i in range(ns):
            for kk in range(K):
                X[gi, oR + i, kk] = acc[kk] + first[i, kk]
                acc[kk] += tot[i, kk]
        for kk in range(K):
            X[gi, oA, kk] = acc[kk]
            acc[kk] = 0
        for j in range(ns - 1, -1, -1):
            for kk in range(K):
                X[gi, oB + j, kk] = acc[kk]
                acc[kk] += tot[j, kk]
        for i in range(ns):
            row = oF + i * (i + 1) // 2
            mx = 0.0
            for kk in range(K):
                span = first[i, kk] - tot[i, kk]
                mx = max(mx, span)
                X[gi, row + i, kk] = min(span, limit)
            bad[gi, i] = mx > limit
            for kk in range(K):
                acc[kk] = first[i, kk]
            for j in range(i - 1, -1, -1):
                for kk in range(K):
                    X[gi, row + j, kk] = acc[kk]
                    acc[kk] += tot[j, kk]


@nb.njit(cache=True, nogil=True)
def chunk_exponents(g, ub, uh, n0, G, T, C, Cp, X, tot, suffix):
    """Light exponents (one per token and key) for the sequences ``(ub[u], uh[u])``: ``X[u, gi, pos]`` = gate
    summed over the chunk's tokens after ``pos`` (``suffix``) or up to ``pos`` inclusive (otherwise), <= 0
    and 0 for no-op rows; ``X[u, gi, Cp]`` = the chunk's total, summed in float64 into ``tot[b, h, n0 + gi]``.
    Chunk by chunk, the block's sequences inside (one chunk's rows stay in cache)."""
    K = g.shape[3]
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for u in range(ub.size):
            b = ub[u]
            h = uh[u]
            Xg = X[u, gi]
            if suffix:
                for pos in range(nv - 1, Cp):
                    xr = Xg[pos]
                    for kk in range(K):
                        xr[kk] = 0
                for pos in range(nv - 1, 0, -1):
                    gr = g[b, n * C + pos, h]
                    xr = Xg[pos]
                    xn = Xg[pos - 1]
                    for kk in range(K):
                        xn[kk] = xr[kk] + gr[kk]
            else:
                g0 = g[b, n * C, h]
                x0 = Xg[0]
                for kk in range(K):
                    x0[kk] = g0[kk]
                for pos in range(1, nv):
                    gr = g[b, n * C + pos, h]
                    xp = Xg[pos - 1]
                    xr = Xg[pos]
                    for kk in range(K):
                        xr[kk] = xp[kk] + gr[kk]
                for pos in range(nv, Cp):
                    xr = Xg[pos]
                    for kk in range(K):
                        xr[kk] = 0
            tr = tot[b, h, n]  # float64 totals in their own loop (a shared loop vectorises poorly)
            for kk in range(K):
                tr[kk] = 0.0
            for pos in range(nv):
                gr = g[b, n * C + pos, h]
                for kk in range(K):
                    tr[kk] += gr[kk]
            xr = Xg[Cp]
            for kk in range(K):
                xr[kk] = tr[kk]


# ------------------------------------------------------------------------------------------ operands


@nb.njit(cache=True, nogil=True)
def prep_operands(q, k, b, h, n0, G, T, C, ns, c, scale, X, bad, Qp, KX, Qe, qe_col, QX, Kd, E, v, Vb, do, dOb):
    """Matmul operands of chunks ``n0 .. n0+G-1`` of sequence ``(b, h)`` (``X`` exponentiated); zero rows for
    no-op tokens. Every output but ``Kd`` may be None (``Qe`` and ``QX`` need ``Qp``):

    - ``Qp [G, Cp, K]`` = scale q exp(b - r_I); ``Qe`` = scale q exp(b) (= ``Qp exp(r_I)``) in the columns
      ``[qe_col, qe_col + K)`` of ``Qe [G, >= Cp, >= qe_col + K]`` (the forward writes it beside ``A``);
    - ``KX [G, c ns(ns+1)/2, K]``: for row sub-chunk ``I`` at row ``c I(I+1)/2`` the k side
      ``k exp(r_I - b)`` of sub-chunks ``0..I`` (diagonal rows zero where ``bad``);
    - ``QX [G, c ns(ns+1)/2, K]``: for column block ``J`` at row :func:`qx_offset` the q side
      ``scale q exp(b - e_J)`` of sub-chunks ``J..ns-1`` (diagonal rows zero where ``bad``);
    - ``Kd [G, Cp, K]`` = k exp(b_C - b) and ``E [G, Cp, K]`` = exp(b_C - b);
    - ``Vb`` = the rows of ``v`` and ``dOb`` = the rows of ``do`` (rows ``[0, Cp)`` of ``[G, >= Cp, V]``).

    Direct indexing of C-contiguous arrays throughout (row views, or strided views as outputs, keep LLVM from
    vectorising the inner loops), and ``qe_col`` clamped to >= 0 so numba's negative-index check stays out of
    them.
    """
    K = k.shape[3]
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    oB = oR + ns
    qo = max(qe_col, 0)
    kp = np.empty(K, X.dtype)
    for gi in range(G):
        n = n0 + gi
        for i in range(ns):
            for p in range(c):
                pos = i * c + p
                t = n * C + pos
                if pos < C and t < T:
                    if Qp is not None:
                        for kk in range(K):
                            Qp[gi, pos, kk] = q[b, t, h, kk] * scale * X[gi, pos, kk]
                        if Qe is not None:
                            for kk in range(K):
                                Qe[gi, pos, qo + kk] = Qp[gi, pos, kk] * X[gi, oR + i, kk]
                    for kk in range(K):
                        kp[kk] = k[b, t, h, kk] * X[gi, cp + pos, kk]
                    if Kd is not None:
                        for kk in range(K):
                            Kd[gi, pos, kk] = kp[kk] * X[gi, oB + i, kk]
                    if E is not None:
                        for kk in range(K):
                            E[gi, pos, kk] = X[gi, cp + pos, kk] * X[gi, oB + i, kk]
                    if Vb is not None:
                        for vv in range(Vb.shape[2]):
                            Vb[gi, pos, vv] = v[b, t, h, vv]
                    if dOb is not None:
                        for vv in range(dOb.shape[2]):
                            dOb[gi, pos, vv] = do[b, t, h, vv]
                else:
                    for kk in range(K):
                        kp[kk] = 0
                    if Qp is not None:
                        for kk in range(K):
                            Qp[gi, pos, kk] = 0
                        if Qe is not None:
                            for kk in range(K):
                                Qe[gi, pos, qo + kk] = 0
                    if Kd is not None:
                        for kk in range(K):
                            Kd[gi, pos, kk] = 0
                    if E is not None:
                        for kk in range(K):
                            E[gi, pos, kk] = 0
                    if Vb is not None:
                        for vv in range(Vb.shape[2]):
                            Vb[gi, pos, vv] = 0
                    if dOb is not None:
                        for vv in range(dOb.shape[2]):
                            dOb[gi, pos, vv] = 0
                if KX is not None:
                    for i2 in range(i, ns):
                        row = c * i2 * (i2 + 1) // 2 + pos
                        if i2 == i and bad[gi, i]:
                            for kk in range(K):
                                KX[gi, row, kk] = 0
                        else:
                            fr = oF + i2 * (i2 + 1) // 2 + i
                            for kk in range(K):
                                KX[gi, row, kk] = kp[kk] * X[gi, fr, kk]
                if QX is not None:
                    for j in range(i + 1):
                        row = c * (j * ns - j * (j - 1) // 2) + (i - j) * c + p
                        if j == i and bad[gi, i]:
                            for kk in range(K):
                                QX[gi, row, kk] = 0
                        else:
                            fr = oF + i * (i + 1) // 2 + j
                            for kk in range(K):
                                QX[gi, row, kk] = Qp[gi, pos, kk] * X[gi, fr, kk]


@nb.njit(cache=True, nogil=True, inline="always")
def _scale_row(o, s, xr, er, D):
    for d in range(D):
        o[d] = s * xr[d] * er[d]


@nb.njit(cache=True, nogil=True)
def scaled_rows(x, ub, uh, n0, G, T, C, Cp, s, X, E, out):
    """``out[u, gi, pos] = s x[b, t, h] f`` for the sequences ``(ub[u], uh[u])``, zero rows for no-op tokens,
    with the factor ``f = X[u, gi, pos]`` (exponentiated light exponents) or, when ``X`` is None,
    ``f = E[b, h, n0 + gi, pos]`` (stored per chunk, ``[B, H, N, Cp, D]``)."""
    D = x.shape[3]
    nu = ub.size
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for pos in range(nv):
            t = n * C + pos
            for u in range(nu):
                xr = x[ub[u], t, uh[u]]
                o = out[u, gi, pos]
                if X is not None:  # one of X, E is None: its branch is pruned at compile time
                    _scale_row(o, s, xr, X[u, gi, pos], D)
                if E is not None:
                    _scale_row(o, s, xr, E[ub[u], uh[u], n, pos], D)
        for u in range(nu):
            for pos in range(nv, Cp):
                out[u, gi, pos] = 0


# ------------------------------------------------------------------------------------------ token rows


@nb.njit(cache=True, nogil=True)
def gather_rows(x, b, h, n0, G, T, C, Cp, out):
    """``out[gi, pos] = x[b, t, h]`` for the group's tokens, zero rows for no-op tokens."""
    D = x.shape[3]
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for pos in range(nv):
            xr = x[b, n * C + pos, h]
            o = out[gi, pos]
            for d in range(D):
                o[d] = xr[d]
        for pos in range(nv, Cp):
            out[gi, pos] = 0


@nb.njit(cache=True, nogil=True)
def write_rows(Ot, out, b, h, n0, G, T, C):
    """Copy the valid rows of ``Ot [G, Cp, D]`` to ``out[b, t, h, :]`` (casting to ``out``'s dtype)."""
    D = out.shape[3]
    for gi in range(G):
        n = n0 + gi
        for pos in range(min(C, T - n * C)):
            t = n * C + pos
            for d in range(D):
                out[b, t, h, d] = Ot[gi, pos, d]


@nb.njit(cache=True, nogil=True)
def add_rows(Ot, out, ub, uh, n0, G, T, C):
    """``out[b, t, h] += Ot[u, gi, pos]`` for the group's valid tokens (sequences ``(ub[u], uh[u])``)."""
    D = out.shape[3]
    nu = ub.size
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for pos in range(nv):
            t = n * C + pos
            for u in range(nu):
                src = Ot[u, gi, pos]
                o = out[ub[u], t, uh[u]]
                for d in range(D):
                    o[d] += src[d]


@nb.njit(cache=True, nogil=True)
def mask_diag(L, G, ns, c):
    """Zero the strict upper triangle of every diagonal ``c x c`` block of ``L[:G, :Cp, :Cp]``."""
    for gi in range(G):
        for i in range(ns):
            o = i * c
            for r in range(c):
                for s in range(r + 1, c):
                    L[gi, o + r, o + s] = 0


# ------------------------------------------------------------------------------------------ states


@nb.njit(cache=True, nogil=True)
def state_fwd(U, X, oA, G, S, R, cp):
    """``R[gi, Cp:] = S`` (state entering chunk gi), then ``S = exp(b_C) S + U[gi]``; ``S [K, V]`` in place."""
    K, V = S.shape
    for gi in range(G):
        for kk in range(K):
            a = X[gi, oA, kk]
            for vv in range(V):
                s = S[kk, vv]
                R[gi, cp + kk, vv] = s
                S[kk, vv] = a * s + U[gi, kk, vv]


@nb.njit(cache=True, nogil=True)
def state_chain(U, X, oA, G, Sst, n0):
    """``Sst[n0 + gi + 1] = exp(b_C) Sst[n0 + gi] + U[gi]`` for ``gi < G`` (``Sst [N + 1, K, V]``)."""
    K, V = Sst.shape[1], Sst.shape[2]
    for gi in range(G):
        s0 = Sst[n0 + gi]
        s1 = Sst[n0 + gi + 1]
        u = U[gi]
        for kk in range(K):
            a = X[gi, oA, kk]
            for vv in range(V):
                s1[kk, vv] = a * s0[kk, vv] + u[kk, vv]


@nb.njit(cache=True, nogil=True)
def state_bwd(W, X, oA, G, dH, dHe):
    """Reverse recurrence over the group: ``dHe[gi] = dH`` (gradient into the end state of chunk gi), then
    ``dH = exp(b_C) dH + W[gi]``, for ``gi = G-1 .. 0``; ``dH [K, V]`` in place."""
    K, V = dH.shape
    for gi in range(G - 1, -1, -1):
        for kk in range(K):
            a = X[gi, oA, kk]
            for vv in range(V):
                d = dH[kk, vv]
                dHe[gi, kk, vv] = d
                dH[kk, vv] = a * d + W[gi, kk, vv]


@nb.njit(cache=True, nogil=True)
def correct_states(Sst, e, S0, ub, uh, n0, G):
    """In place: ``Sst[b, h, n0 + gi] += diag(e[b, h, n0 + gi]) S0[b, h]`` for the sequences ``(ub, uh)``."""
    K, V = S0.shape[2], S0.shape[3]
    for u in range(ub.size):
        b = ub[u]
        h = uh[u]
        s0 = S0[b, h]
        for gi in range(G):
            s = Sst[b, h, n0 + gi]
            er = e[b, h, n0 + gi]
            for kk in range(K):
                f = er[kk]
                sr = s[kk]
                s0r = s0[kk]
                for vv in range(V):
                    sr[vv] += f * s0r[vv]


@nb.njit(cache=True, nogil=True)
def corrected_states(Sl, e, S0, ub, uh, n0, G, out):
    """``out[u, gi] = Sl[b, h, n0 + gi] + diag(e[b, h, n0 + gi]) S0[b, h]`` (the second term only when ``S0``
    is not None): ``Sl [B, H, N(+1), K, V]``, ``e [B, H, N, K]``, ``S0 [B, H, K, V]``."""
    K, V = out.shape[2], out.shape[3]
    for u in range(ub.size):
        b = ub[u]
        h = uh[u]
        for gi in range(G):
            s = Sl[b, h, n0 + gi]
            o = out[u, gi]
            if S0 is not None:
                er = e[b, h, n0 + gi]
                s0 = S0[b, h]
                for kk in range(K):
                    f = er[kk]
                    sr = s[kk]
                    s0r = s0[kk]
                    orow = o[kk]
                    for vv in range(V):
                        orow[vv] = sr[vv] + f * s0r[vv]
            else:
                for kk in range(K):
                    sr = s[kk]
                    orow = o[kk]
                    for vv in range(V):
                        orow[vv] = sr[vv]

# ---------------------------------------------------------------------------------------------------------- backward

@nb.njit(cache=True, nogil=True)
def mask_dA(dA, dd, G, ns, c):
    """Move the diagonal of ``dA [G, Cp, Cp]`` to ``dd [G, Cp]`` and keep only the strictly lower part of
    the diagonal blocks and the blocks below them."""
    cp = ns * c
    for gi in range(G):
        for pos in range(cp):
            dd[gi, pos] = dA[gi, pos, pos]
            r = dA[gi, pos]
            for j in range(pos, cp):
                r[j] = 0


@nb.njit(cache=True, nogil=True)
def combine(X, G, ns, c, scale, M1, DQ, DK, VdH):
    """In place: ``DQ = scale eq (er M1 + DQ)`` (dq without its diagonal term), ``DK = ek DK`` (intra part
    of dk without its diagonal term) and, unless ``VdH`` is None, ``VdH = ek eb VdH`` (the inter part of dk)."""
    K = DQ.shape[2]
    cp = ns * c
    oR = 2 * cp + ns * (ns + 1) // 2
    oB = oR + ns
    for gi in range(G):
        Xg = X[gi]
        for i in range(ns):
            er = Xg[oR + i]
            eb = Xg[oB + i]
            for p in range(c):
                pos = i * c + p
                eq = Xg[pos]
                ek = Xg[cp + pos]
                m1 = M1[gi, pos]
                dq = DQ[gi, pos]
                dk = DK[gi, pos]
                for kk in range(K):
                    dq[kk] = scale * eq[kk] * (er[kk] * m1[kk] + dq[kk])
                for kk in range(K):
                    dk[kk] = ek[kk] * dk[kk]
                if VdH is not None:
                    vd = VdH[gi, pos]
                    for kk in range(K):
                        vd[kk] *= ek[kk] * eb[kk]


@nb.njit(cache=True, nogil=True)
def bwd_finish(q, k, b, h, n0, G, T, C, scale, X, oA, DQ, DKI, DKE, dd, DV, DV2, Sst, dHe, dq, dk, dv, dg):
    """Write ``dq, dk, dv, dg`` of the group's tokens (one sequence, every term).

    ``dg_t = sum_{tau >= t} (q DQ - k DKI)_tau + sum_{j < t} (k DKE)_j + exp(b_C) sum_v(S_prev dH_end)``
    (sums inside the chunk); ``dq = DQ + scale dd k``, ``dk = DKI + DKE + scale dd q``, ``dv = DV + DV2``.
    """
    K = q.shape[3]
    V = dv.shape[3]
    dt = DQ.dtype
    acc = np.empty(K, dt)
    base = np.empty(K, dt)
    excl = np.empty((DQ.shape[1], K), dt)
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)  # valid rows are a prefix of the chunk
        for kk in range(K):
            s = 0.0
            for vv in range(V):
                s += Sst[n, kk, vv] * dHe[gi, kk, vv]
            base[kk] = X[gi, oA, kk] * s
            acc[kk] = 0
        for pos in range(nv):
            t = n * C + pos
            for kk in range(K):
                excl[pos, kk] = acc[kk]
            for kk in range(K):
                acc[kk] += k[b, t, h, kk] * DKE[gi, pos, kk]
        for kk in range(K):
            acc[kk] = 0
        for pos in range(nv - 1, -1, -1):
            t = n * C + pos
            sd = scale * dd[gi, pos]
            for kk in range(K):
                acc[kk] += q[b, t, h, kk] * DQ[gi, pos, kk] - k[b, t, h, kk] * DKI[gi, pos, kk]
            for kk in range(K):
                dg[b, t, h, kk] = acc[kk] + excl[pos, kk] + base[kk]
            for kk in range(K):
                dq[b, t, h, kk] = DQ[gi, pos, kk] + sd * k[b, t, h, kk]
            for kk in range(K):
                dk[b, t, h, kk] = DKI[gi, pos, kk] + DKE[gi, pos, kk] + sd * q[b, t, h, kk]
            for vv in range(V):
                dv[b, t, h, vv] = DV[gi, pos, vv] + DV2[gi, pos, vv]


@nb.njit(cache=True, nogil=True)
def local_write(q, k, ub, uh, n0, G, T, C, scale, DQ, DKI, dd, DV, dq, dk, dv, dg):
    """Write the dht-independent parts (scratch ``[u, gi, pos]``): ``dq = DQ + scale dd k`` (complete),
    ``dk = DKI + scale dd q``, ``dv = DV``, ``dg_t = sum_{tau >= t} (q DQ - k DKI)_tau`` (inside the chunk)."""
    K = q.shape[3]
    V = dv.shape[3]
    nu = ub.size
    acc = np.empty((nu, K), DQ.dtype)
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for u in range(nu):
            for kk in range(K):
                acc[u, kk] = 0
        for pos in range(nv - 1, -1, -1):
            t = n * C + pos
            for u in range(nu):
                b = ub[u]
                h = uh[u]
                qr = q[b, t, h]
                kr = k[b, t, h]
                dqr = DQ[u, gi, pos]
                dkr = DKI[u, gi, pos]
                sd = scale * dd[u, gi, pos]
                ac = acc[u]
                dgo = dg[b, t, h]
                dqo = dq[b, t, h]
                dko = dk[b, t, h]
                for kk in range(K):
                    ac[kk] += qr[kk] * dqr[kk] - kr[kk] * dkr[kk]
                for kk in range(K):
                    dgo[kk] = ac[kk]
                for kk in range(K):
                    dqo[kk] = dqr[kk] + sd * kr[kk]
                for kk in range(K):
                    dko[kk] = dkr[kk] + sd * qr[kk]
                dvo = dv[b, t, h]
                d1 = DV[u, gi, pos]
                for vv in range(V):
                    dvo[vv] = d1[vv]


@nb.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_dots(S, D, a, out):
    """``out[kk] = a[kk] sum_v S[kk, v] D[kk, v]`` (``S, D [K, V]``)."""
    K, V = S.shape
    for kk in range(K):
        sr = S[kk]
        dr = D[kk]
        acc = 0.0
        for vv in range(V):
            acc += sr[vv] * dr[vv]
        out[kk] = a[kk] * acc


@nb.njit(cache=True, nogil=True)
def add_state_grads(k, ub, uh, n0, G, T, C, E, VdH, DV2, ac, Sst, dHe, dk, dv, dg):
    """Add the dH terms in place (scratch ``[u, gi, ...]``, ``E [B, H, N, Cp, K]``): ``dk += E VdH``,
    ``dv += DV2``, ``dg += sum_{j < t} (k E VdH)_j + ac sum_v(S_prev dH)`` (sums inside the chunk)."""
    K = k.shape[3]
    V = dv.shape[3]
    nu = ub.size
    acc = np.empty((nu, K), E.dtype)
    x = np.empty(K, E.dtype)
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for u in range(nu):
            _row_dots(Sst[ub[u], uh[u], n], dHe[u, gi], ac[ub[u], uh[u], n], acc[u])
        for pos in range(nv):
            t = n * C + pos
            for u in range(nu):
                b = ub[u]
                h = uh[u]
                kr = k[b, t, h]
                er = E[b, h, n, pos]
                z = VdH[u, gi, pos]
                ar = acc[u]
                dgo = dg[b, t, h]
                dko = dk[b, t, h]
                for kk in range(K):
                    x[kk] = er[kk] * z[kk]
                for kk in range(K):
                    dko[kk] += x[kk]
                for kk in range(K):
                    dgo[kk] += ar[kk]
                for kk in range(K):
                    ar[kk] += kr[kk] * x[kk]
                dvo = dv[b, t, h]
                d2 = DV2[u, gi, pos]
                for vv in range(V):
                    dvo[vv] += d2[vv]

# ------------------------------------------------------------------------------------ exact pairwise diagonal blocks

def pairwise_A(q, k, g, b: int, h: int, n0: int, bad: np.ndarray, geo: Any, s: float, L: np.ndarray):
    """Exact pairwise diagonal blocks of ``A`` for the flagged sub-chunks ``bad [gc, ns]`` of the group at
    chunk ``n0`` (written into ``L [G, Cp, *]``). Returns what :func:`pairwise_dqdk` needs."""
    c, K = geo.c, geo.K
    gb, ib = (x.astype(np.int64) for x in np.nonzero(bad))
    dt = L.dtype
    Qb, Kb = np.empty((gb.size, c, K), dt), np.empty((gb.size, c, K), dt)
    E = np.empty((gb.size, c * (c + 1) // 2, K), dt)
    _pw_prepare(q, k, g, b, h, n0, gb, ib, geo.T, geo.C, c, Qb, Kb, E)
    np.exp(E, out=E)
    _pw_A(Qb, Kb, E, gb, ib, c, s, L)
    return gb, ib, Qb, Kb, E


def pairwise_dqdk(pw, c: int, s: float, dA: np.ndarray, DQ: np.ndarray, DK: np.ndarray) -> None:
    """Add the exact diagonal-block parts of dq, dk (strictly lower ``dA``, unscaled) for the flagged blocks
    (``pw`` from :func:`pairwise_A`)."""
    gb, ib, Qb, Kb, E = pw
    _pw_dqdk(Qb, Kb, E, dA, gb, ib, c, s, DQ, DK)


@nb.njit(cache=True, nogil=True)
def _pw_prepare(q, k, g, b, h, n0, gb, ib, T, C, c, Qb, Kb, D):
    """For the flagged diagonal blocks ``(gb[j], ib[j])`` (group chunk, sub-chunk): their tokens' q and k
    (``Qb, Kb [nb, c, K]``, zeros for no-op rows) and the packed exponents ``D [nb, c (c+1)/2, K]`` =
    ``b_i - b_j`` (<= 0) for the pairs ``j <= i`` in row-major order."""
    K = q.shape[3]
    dt = D.dtype
    lc = np.empty((c, K), dt)
    for j in range(gb.size):
        n = n0 + gb[j]
        for r in range(c):
            pos = ib[j] * c + r
            t = n * C + pos
            qr = Qb[j, r]
            kr = Kb[j, r]
            lr = lc[r]
            if pos < C and t < T:
                qi = q[b, t, h]
                ki = k[b, t, h]
                gi = g[b, t, h]
                for kk in range(K):
                    qr[kk] = qi[kk]
                for kk in range(K):
                    kr[kk] = ki[kk]
                for kk in range(K):
                    lr[kk] = gi[kk]
            else:
                for kk in range(K):
                    qr[kk] = 0
                    kr[kk] = 0
                    lr[kk] = 0
            if r > 0:
                prev = lc[r - 1]
                for kk in range(K):
                    lr[kk] += prev[kk]
        p = 0
        for r in range(c):
            lr = lc[r]
            for s in range(r + 1):
                ls = lc[s]
                dr = D[j, p]
                for kk in range(K):
                    dr[kk] = lr[kk] - ls[kk]
                p += 1


@nb.njit(cache=True, nogil=True, fastmath={"reassoc", "nsz", "contract"})
def _pw_A(Qb, Kb, E, gb, ib, c, scale, L):
    """``L`` diagonal block of every flagged sub-chunk = scale sum_k q_ik k_jk exp(b_ik - b_jk) (j <= i)."""
    K = Qb.shape[2]
    for j in range(gb.size):
        o = ib[j] * c
        p = 0
        for r in range(c):
            qr = Qb[j, r]
            lr = L[gb[j], o + r]
            for s in range(r + 1):
                ks = Kb[j, s]
                er = E[j, p]
                acc = 0.0
                for kk in range(K):
                    acc += qr[kk] * ks[kk] * er[kk]
                lr[o + s] = scale * acc
                p += 1
            for s in range(r + 1, c):
                lr[o + s] = 0


@nb.njit(cache=True, nogil=True)
def _pw_dqdk(Qb, Kb, E, dA, gb, ib, c, scale, DQ, DK):
    """Add the flagged diagonal blocks' parts to dq and dk: ``DQ_i += scale sum_j dA_ij e_ij k_j``,
    ``DK_j += scale sum_i dA_ij e_ij q_i`` (``dA`` strictly lower, unscaled; ``e_ij = exp(b_i - b_j)``)."""
    K = Qb.shape[2]
    for j in range(gb.size):
        o = ib[j] * c
        z = gb[j]
        p = 0
        for r in range(c):
            qr = Qb[j, r]
            dqr = DQ[z, o + r]
            for s in range(r + 1):
                w = scale * dA[z, o + r, o + s]
                if w != 0.0:
                    ks = Kb[j, s]
                    er = E[j, p]
                    dks = DK[z, o + s]
                    for kk in range(K):
                        t = w * er[kk]
                        dqr[kk] += t * ks[kk]
                        dks[kk] += t * qr[kk]
                p += 1
