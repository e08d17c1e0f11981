"""Numba kernels of the streaming CPU GLA (fused element-wise work; matmuls stay in BLAS via numpy).

All kernels work on one (batch b, head h) sequence and a group of ``G`` consecutive chunks starting
at chunk ``n0``; token ``t = n C + pos`` of chunk ``n`` sits at row ``pos`` (``pos < C``) of a chunk padded
to ``Cp = ns c`` rows (``ns`` sub-chunks of ``c`` tokens). Rows past ``C`` or past ``T`` are no-op tokens.
Kernels release the GIL (``nogil``) so several heads run in parallel Python threads.

Exponent buffer ``X [G, LX, K]`` (see :func:`layout`): rows ``[0, Cp)`` ``b - r_I`` (q side), rows
``[Cp, 2 Cp)`` ``e_J - b`` (k side), then ``F`` exponents (``ns (ns + 1) / 2`` rows, ``I``-major,
``r_I - e_J`` for ``J < I`` and the clamped span on the diagonal), ``r_I`` (ns rows), ``b_C - e_J``
(ns rows) and ``b_C`` (1 row). ``np.exp`` is applied to it in place between the two prep kernels.

Used by :mod:`hpczeco.gla.chunk` and :mod:`hpczeco.gla.split` (layout, prep_exponents, mask_diag,
write_rows, state_chain, state_bwd, mask_dA, qx_offset): keep signatures stable.
"""

from __future__ import annotations

import numba as nb
import numpy as np


def layout(ns: int, c: int) -> tuple[int, int, int, int, int]:
    """Row offsets in the exponent buffer: ``(oF, oR, oB, oA, LX)``."""
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    oB = oR + ns
    oA = oB + ns
    return oF, oR, oB, oA, oA + 1


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
def prep_fwd_operands(q, k, v, b, h, n0, G, T, C, ns, c, scale, X, bad, Qp, KX, L, Kd, R):
    """Matmul operands of the forward for chunks ``n0 .. n0+G-1`` (``X`` already exponentiated).

    ``Qp [G, Cp, K]`` = scale q exp(b - r_I); ``KX [G, c ns(ns+1)/2, K]``: for row sub-chunk ``I`` at row
    ``c I(I+1)/2`` the k-side ``k exp(r_I - b)`` of sub-chunks ``0..I`` (diagonal rows zero where ``bad``);
    ``L [G, Cp, Cp + K]``: columns ``[Cp, Cp+K)`` = scale q exp(b) (the blocks of ``[0, Cp)`` above the
    diagonal are never written: ``L`` starts zeroed); ``Kd [G, Cp, K]`` = k exp(b_C - b);
    ``R [G, Cp + K, V]``: rows ``[0, Cp)`` = v.
    """
    K = q.shape[3]
    V = v.shape[3]
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    oB = oR + ns
    kp = np.empty(K, X.dtype)
    # direct indexing and one array per loop: measurably faster than row views here
    for gi in range(G):
        n = n0 + gi
        for i in range(ns):
            for p in range(c):
                pos = i * c + p
                t = n * C + pos
                if pos < C and t < T:
                    for kk in range(K):
                        Qp[gi, pos, kk] = q[b, t, h, kk] * scale * X[gi, pos, kk]
                    for kk in range(K):
                        L[gi, pos, cp + kk] = Qp[gi, pos, kk] * X[gi, oR + i, kk]
                    for kk in range(K):
                        kp[kk] = k[b, t, h, kk] * X[gi, cp + pos, kk]
                    for kk in range(K):
                        Kd[gi, pos, kk] = kp[kk] * X[gi, oB + i, kk]
                    for vv in range(V):
                        R[gi, pos, vv] = v[b, t, h, vv]
                else:
                    for kk in range(K):
                        kp[kk] = 0
                        Qp[gi, pos, kk] = 0
                        L[gi, pos, cp + kk] = 0
                        Kd[gi, pos, kk] = 0
                    for vv in range(V):
                        R[gi, pos, vv] = 0
                for i2 in range(i, ns):
                    row = c * i2 * (i2 + 1) // 2 + pos
                    if i2 == i and bad[gi, i]:
                        for kk in range(K):
                            KX[gi, row, kk] = 0
                    else:
                        fr = oF + i2 * (i2 + 1) // 2 + i
                        for kk in range(K):
                            KX[gi, row, kk] = kp[kk] * X[gi, fr, kk]


@nb.njit(cache=True, nogil=True)
def mask_diag(L, G, ns, c):
    """Zero the strict upper triangle of every diagonal ``c x c`` block of ``L[:G, :Cp, :Cp]``."""
    for gi in range(G):
        for i in range(ns):
            o = i * c
            for r in range(c):
                for s in range(r + 1, c):
                    L[gi, o + r, o + s] = 0


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
def write_rows(Ot, out, b, h, n0, G, T, C):
    """Copy the valid rows of ``Ot [G, Cp, D]`` to ``out[b, t, h, :]`` (casting to ``out``'s dtype)."""
    D = out.shape[3]
    for gi in range(G):
        n = n0 + gi
        for pos in range(C):
            t = n * C + pos
            if t >= T:
                break
            for d in range(D):
                out[b, t, h, d] = Ot[gi, pos, d]


# ------------------------------------------------------------------------------------------ backward


def qx_offset(j: int, ns: int, c: int) -> int:
    """Row offset of column block ``J`` in the q-side buffer ``QX`` (blocks ``I = J..ns-1`` stacked)."""
    return c * (j * ns - j * (j - 1) // 2)


@nb.njit(cache=True, nogil=True)
def prep_state_operands(k, v, b, h, n0, G, T, C, ns, c, X, Kd, R):
    """``Kd [G, Cp, K]`` = k exp(b_C - b) and ``R[:, :Cp]`` = v (zero rows for no-op tokens)."""
    K = k.shape[3]
    V = v.shape[3]
    cp = ns * c
    oB = 2 * cp + ns * (ns + 1) // 2 + ns
    for gi in range(G):
        n = n0 + gi
        for i in range(ns):
            for p in range(c):
                pos = i * c + p
                t = n * C + pos
                if pos < C and t < T:
                    for kk in range(K):
                        Kd[gi, pos, kk] = k[b, t, h, kk] * X[gi, cp + pos, kk] * X[gi, oB + i, kk]
                    for vv in range(V):
                        R[gi, pos, vv] = v[b, t, h, vv]
                else:
                    for kk in range(K):
                        Kd[gi, pos, kk] = 0
                    for vv in range(V):
                        R[gi, pos, vv] = 0


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
def prep_bwd_operands(q, k, v, do, b, h, n0, G, T, C, ns, c, scale, X, bad, Qp, Qe, KX, QX, Kd, Vb, dOb):
    """Matmul operands of the backward: as :func:`prep_fwd_operands` (``Qp``, ``KX``, ``Kd``) plus
    ``Qe`` = scale q exp(b); ``QX``: for column block ``J`` at row :func:`qx_offset` the q-side
    ``scale q exp(b - e_J)`` of sub-chunks ``J..ns-1`` (diagonal rows zero where ``bad``); ``Vb`` = v and
    ``dOb`` = do (``[G, Cp, V]``)."""
    K = q.shape[3]
    V = v.shape[3]
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    oB = oR + ns
    kp = np.empty(K, X.dtype)
    for gi in range(G):
        n = n0 + gi
        for i in range(ns):
            for p in range(c):
                pos = i * c + p
                t = n * C + pos
                if pos < C and t < T:
                    for kk in range(K):
                        Qp[gi, pos, kk] = q[b, t, h, kk] * scale * X[gi, pos, kk]
                    for kk in range(K):
                        Qe[gi, pos, kk] = Qp[gi, pos, kk] * X[gi, oR + i, kk]
                    for kk in range(K):
                        kp[kk] = k[b, t, h, kk] * X[gi, cp + pos, kk]
                    for kk in range(K):
                        Kd[gi, pos, kk] = kp[kk] * X[gi, oB + i, kk]
                    for vv in range(V):
                        Vb[gi, pos, vv] = v[b, t, h, vv]
                    for vv in range(V):
                        dOb[gi, pos, vv] = do[b, t, h, vv]
                else:
                    for kk in range(K):
                        kp[kk] = 0
                        Qp[gi, pos, kk] = 0
                        Qe[gi, pos, kk] = 0
                        Kd[gi, pos, kk] = 0
                    for vv in range(V):
                        Vb[gi, pos, vv] = 0
                        dOb[gi, pos, vv] = 0
                for i2 in range(i, ns):
                    row = c * i2 * (i2 + 1) // 2 + pos
                    if i2 == i and bad[gi, i]:
                        for kk in range(K):
                            KX[gi, row, kk] = 0
                    else:
                        fr = oF + i2 * (i2 + 1) // 2 + i
                        for kk in range(K):
                            KX[gi, row, kk] = kp[kk] * X[gi, fr, kk]
                for j in range(i + 1):
                    row = c * (j * ns - j * (j - 1) // 2) + (i - j) * c + p
                    if j == i and bad[gi, i]:
                        for kk in range(K):
                            QX[gi, row, kk] = 0
                    else:
                        fr = oF + i * (i + 1) // 2 + j
                        for kk in range(K):
                            QX[gi, row, kk] = Qp[gi, pos, kk] * X[gi, fr, kk]


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
def bwd_combine(X, G, ns, c, scale, M1, DQ, DK, VdH):
    """In place: ``DQ = scale eq (er M1 + DQ)`` (dq without its diagonal term), ``DK = ek DK`` (intra part
    without the diagonal term), ``VdH = ek eb VdH`` (the inter part of dk)."""
    K = DQ.shape[2]
    cp = ns * c
    oR = 2 * cp + ns * (ns + 1) // 2
    oB = oR + ns
    for gi in range(G):
        for i in range(ns):
            for p in range(c):
                pos = i * c + p
                for kk in range(K):
                    DQ[gi, pos, kk] = scale * X[gi, pos, kk] * (X[gi, oR + i, kk] * M1[gi, pos, kk] + DQ[gi, pos, kk])
                for kk in range(K):
                    DK[gi, pos, kk] *= X[gi, cp + pos, kk]
                for kk in range(K):
                    VdH[gi, pos, kk] *= X[gi, cp + pos, kk] * X[gi, oB + i, kk]


@nb.njit(cache=True, nogil=True)
def bwd_finish(q, k, b, h, n0, G, T, C, scale, X, oA, DQ, DKI, DKE, dd, DV, DV2, Sst, dHe, dq, dk, dv, dg):
    """Write ``dq, dk, dv, dg`` of the group's tokens.

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


# ------------------------------------------------------------------------------- exact pairwise blocks


@nb.njit(cache=True, nogil=True)
def pw_prepare(q, k, g, b, h, n0, gb, ib, T, C, c, Qb, Kb, D):
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
def pw_A(Qb, Kb, E, gb, ib, c, scale, L):
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
def pw_dqdk(Qb, Kb, E, dA, gb, ib, c, scale, DQ, DK):
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
