"""Exact pairwise diagonal blocks of the CPU GLA, for sub-chunks whose decay span is too large to factor.

Where the span of a sub-chunk (minus the gate summed after its first token) exceeds the span limit
(:data:`hpczeco.gla._geometry.SPAN_LIMIT`), its diagonal block of ``A`` is computed in the exact form
``scale sum_k q_ik k_jk exp(b_ik - b_jk)`` (every exponent <= 0) instead of the factored one, and the
backward adds that block's parts of dq and dk the same way. ``exp`` of the packed exponents runs in numpy,
the rest in numba (conventions as :mod:`hpczeco.gla._kernels`).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ._geometry import Geom

__all__ = ["pairwise_A", "pairwise_dqdk"]


def pairwise_A(q, k, g, b: int, h: int, n0: int, bad: np.ndarray, geo: Geom, s: float, L: np.ndarray):
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
