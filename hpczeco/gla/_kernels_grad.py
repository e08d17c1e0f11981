"""Numba kernels of the CPU GLA backward: the ``dA`` mask, the element-wise combination of the gradient
products and the writes of ``dq, dk, dv, dg``.

Conventions as :mod:`hpczeco.gla._kernels` (groups of ``G`` chunks from ``n0``, rows padded to ``Cp``, the
exponent buffer ``X``, optional outputs as None). The fused backward (:func:`bwd_finish`) writes every term
at once; the phase-split one writes the dht-independent terms first (:func:`local_write`) and adds the
``dH`` terms once the incoming state gradient is known (:func:`add_state_grads`).
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["mask_dA", "combine", "bwd_finish", "local_write", "add_state_grads"]


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
