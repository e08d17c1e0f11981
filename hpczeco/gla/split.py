"""Phase-split chunked GLA on the CPU: the forward and backward of :mod:`hpczeco.gla.chunk`, cut where the
incoming state (forward) or the incoming state gradient (backward) enters, so that a sequence-parallel
layer (ZeCO, :mod:`hpczeco.zeco`) overlaps its scan with the work that does not need it.

Layout and semantics as :func:`hpczeco.gla.chunk_gla` / :func:`hpczeco.gla.chunk_gla_bwd` (``q, k, g:
[B, T, H, K]``, ``v, do: [B, T, H, V]``, states ``[B, H, K, V]``); numpy inputs only. Everything is local:
no communication. With ``G_n`` the gate summed over the chunks before chunk ``n`` (float64, <= 0) and
``a = exp(sum of g over the slice)``:

Forward (:class:`ForwardSplit`)::

    constructor   chunk states from a zero state S_n^loc, S_local, a       (before the scan: its input)
    intra()       A V of every chunk (intra-chunk attention), q-side operand scale q exp(b)   (overlaps)
    finish(S_in)  S_n = S_n^loc + diag(exp(G_n)) S_in;  o = A V + scale (q exp(b)) S_n;
                  final = diag(a) S_in + S_local                                            (after)

Backward (:class:`BackwardSplit`), ``dH_n`` the gradient into chunk ``n``'s end state, linear in dht::

    constructor   W_n = scale (q exp(b))^T dO per chunk, dH_n^loc by the reverse recurrence
                  from dht = 0, U = its value at the start (dh0 when dht = 0)             (before the scan)
    local()       chunk states from initial_state, A, dA, dq (complete), the intra parts of dk, dv, dg
                                                                                           (overlaps)
    finish(dht)   dH_n = dH_n^loc + diag(exp(G_T - G_{n+1})) dht; dv += K exp(b_C - b) dH_n,
                  dk += exp(b_C - b) (V dH_n^T), dg += the S dH terms; dh0 = U + diag(a) dht   (after)

Every product of chunk_gla / chunk_gla_bwd is done once (the forward's fused ``[A | Qe] [V; S]`` becomes
``A V`` in ``intra`` and ``Qe S`` in ``finish``); the constructors use light exponent kernels (one ``exp``
per token and key instead of the full sub-chunk exponent buffer). Numerical form as chunk.py: every
exponent is <= 0 (strong decays go through chunk.py's exact pairwise diagonal blocks), and dg uses the
same cancellation-free form. Kept between the phases: the chunk states ``[N + 1, K, V]`` and state
gradients ``[N, K, V]`` per sequence, and ``[T, K]`` per sequence of operands (``scale q exp(b)`` in the
forward, ``exp(b_C - b)`` in the backward). ``finish`` adds into the intra results in place, so it runs
once per object. After the forward's finish, :attr:`ForwardSplit.states` holds the true chunk states; a
:class:`BackwardSplit` given them (``states=``) skips their recomputation. ``check_values=False`` skips the
value scans (NaN/Inf, g <= 0) for inputs the caller has validated (the ZeCO layer checks collectively),
and of the state handed to ``finish`` (a scan result: a NaN found there on one rank only would end that
rank alone; it propagates instead).

``intra``/``local`` call ``poll()`` (if given) about every millisecond of work, from the calling thread:
between chunk groups when one thread computes, or while waiting for the worker threads otherwise, so
``poll`` may make MPI progress (``handle.test()``) without MPI_THREAD_MULTIPLE. Threads as chunk.py
(``HPCZECO_GLA_THREADS`` / ``OMP_NUM_THREADS`` / cores, over the (batch, head) sequences). The kernels that
only stream token rows walk tokens in the outer loop and up to ``_UNIT_BLOCK`` sequences inside, so the
rows of ``[B, T, H, D]`` arrays are touched in memory order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import numba as nb
import numpy as np

from ..base.backend import is_device_array
from ..base.checks import check_array, check_shape, dtype_name
from . import _kernels as _kn
from ._blas import single_threaded_blas
from .chunk import (
    _SPAN_LIMIT,
    _Geom,
    _group_size,
    _num_threads,
    _pairwise_A,
    _pairwise_dqdk,
    _run_units,
)
from .validate import (
    check_chunk_size,
    check_finite_values,
    check_scale,
    compute_dtype_name,
    state_dtype_ok,
    validate_gla_inputs,
)

__all__ = ["ForwardSplit", "BackwardSplit"]

_POLL_S = 1e-3  # poll about every millisecond of work
_GROUP_TOKENS_BWD = 512  # padded tokens per chunk group in BackwardSplit.local (as chunk.py)
_GROUP_TOKENS_LIGHT = 1024  # ... in the light phases (constructors, finish): little scratch per chunk
_UNIT_BLOCK = 8  # sequences whose token rows one kernel call walks together

Poll = Callable[[], Any] | None


# --------------------------------------------------------------------------------------------- kernels
# One (batch b, head h) sequence and a group of G chunks from chunk n0, as chunk.py's kernels: token
# t = n C + pos of chunk n sits at row pos of a chunk padded to Cp rows; the valid rows are a prefix.
# Scalars (scale) arrive in the compute dtype so float32 work stays in float32.


@nb.njit(cache=True, nogil=True)
def _suffix_exponents(g, ub, uh, n0, G, T, C, Cp, X, tot):
    """For the sequences ``(ub[u], uh[u])``: ``X[u, gi, pos]`` = gate summed over the chunk's tokens after
    ``pos`` (<= 0; 0 for no-op rows), ``X[u, gi, Cp]`` = the chunk's total, summed in float64 into
    ``tot[b, h, n0 + gi]``. Chunk by chunk, the block's sequences inside (one chunk's rows stay in cache)."""
    K = g.shape[3]
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for u in range(ub.size):
            b = ub[u]
            h = uh[u]
            Xg = X[u, gi]
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
            tr = tot[b, h, n]
            for kk in range(K):
                tr[kk] = 0.0
            for pos in range(nv):
                gr = g[b, n * C + pos, h]
                for kk in range(K):
                    tr[kk] += gr[kk]
            xr = Xg[Cp]
            for kk in range(K):
                xr[kk] = tr[kk]


@nb.njit(cache=True, nogil=True)
def _prefix_exponents(g, ub, uh, n0, G, T, C, Cp, X, tot):
    """For the sequences ``(ub[u], uh[u])``: ``X[u, gi, pos]`` = gate summed over the chunk's tokens up to
    ``pos`` inclusive (<= 0; 0 for no-op rows), ``X[u, gi, Cp]`` = the chunk's total, summed in float64 into
    ``tot[b, h, n0 + gi]``."""
    K = g.shape[3]
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for u in range(ub.size):
            b = ub[u]
            h = uh[u]
            Xg = X[u, gi]
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
            tr = tot[b, h, n]
            for kk in range(K):
                tr[kk] = 0.0
            for pos in range(nv):
                gr = g[b, n * C + pos, h]
                for kk in range(K):
                    tr[kk] += gr[kk]
            xr = Xg[Cp]
            for kk in range(K):
                xr[kk] = tr[kk]


@nb.njit(cache=True, nogil=True)
def _scaled_rows(x, ub, uh, n0, G, T, C, Cp, s, X, out):
    """``out[u, gi, pos] = s x[b, t, h] X[u, gi, pos]`` (``X`` exponentiated), zero rows for no-op tokens."""
    D = x.shape[3]
    nu = ub.size
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for pos in range(nv):
            t = n * C + pos
            for u in range(nu):
                xr = x[ub[u], t, uh[u]]
                er = X[u, gi, pos]
                o = out[u, gi, pos]
                for d in range(D):
                    o[d] = s * xr[d] * er[d]
        for u in range(nu):
            for pos in range(nv, Cp):
                o = out[u, gi, pos]
                for d in range(D):
                    o[d] = 0


@nb.njit(cache=True, nogil=True)
def _kd_rows(k, ub, uh, n0, G, T, C, Cp, E, out):
    """``out[u, gi, pos] = k[b, t, h] E[b, h, n0 + gi, pos]``, zero rows for no-op tokens."""
    K = k.shape[3]
    nu = ub.size
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for pos in range(nv):
            t = n * C + pos
            for u in range(nu):
                kr = k[ub[u], t, uh[u]]
                er = E[ub[u], uh[u], n, pos]
                o = out[u, gi, pos]
                for d in range(K):
                    o[d] = kr[d] * er[d]
        for u in range(nu):
            for pos in range(nv, Cp):
                o = out[u, gi, pos]
                for d in range(K):
                    o[d] = 0


@nb.njit(cache=True, nogil=True)
def _gather_rows(x, b, h, n0, G, T, C, Cp, out):
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
            o = out[gi, pos]
            for d in range(D):
                o[d] = 0


@nb.njit(cache=True, nogil=True)
def _prep_intra(q, k, b, h, n0, G, T, C, ns, c, scale, X, bad, Qp, KX, Qs):
    """Forward operands without the state ones (chunk.py's ``prep_fwd_operands`` less ``Kd`` and ``v``):
    ``Qp`` = scale q exp(b - r_I), ``KX`` (k side of the ``A`` row blocks, diagonal rows zero where ``bad``),
    ``Qs`` = scale q exp(b) (the inter-chunk operand, kept for ``finish``)."""
    K = q.shape[3]
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    kp = np.empty(K, X.dtype)
    for gi in range(G):
        n = n0 + gi
        Xg = X[gi]
        for i in range(ns):
            er = Xg[oR + i]
            for p in range(c):
                pos = i * c + p
                t = n * C + pos
                qpr = Qp[gi, pos]
                qsr = Qs[gi, pos]
                if pos < C and t < T:
                    qr = q[b, t, h]
                    kr = k[b, t, h]
                    eq = Xg[pos]
                    ek = Xg[cp + pos]
                    for kk in range(K):
                        qpr[kk] = qr[kk] * scale * eq[kk]
                    for kk in range(K):
                        qsr[kk] = qpr[kk] * er[kk]
                    for kk in range(K):
                        kp[kk] = kr[kk] * ek[kk]
                else:
                    for kk in range(K):
                        kp[kk] = 0
                        qpr[kk] = 0
                        qsr[kk] = 0
                for i2 in range(i, ns):
                    kxr = KX[gi, c * i2 * (i2 + 1) // 2 + pos]
                    if i2 == i and bad[gi, i]:
                        for kk in range(K):
                            kxr[kk] = 0
                    else:
                        fr = Xg[oF + i2 * (i2 + 1) // 2 + i]
                        for kk in range(K):
                            kxr[kk] = kp[kk] * fr[kk]


@nb.njit(cache=True, nogil=True)
def _prep_local(q, k, b, h, n0, G, T, C, ns, c, scale, X, bad, Qp, KX, QX, Kd, want_kd, E):
    """Backward operands (chunk.py's ``prep_bwd_operands`` less ``Qe``, ``v``, ``do``): ``Qp``, ``KX``,
    ``QX``, ``Kd`` = k exp(b_C - b) (if ``want_kd``), and ``E`` = exp(b_C - b) (kept for ``finish``; zero for
    no-op rows)."""
    K = q.shape[3]
    cp = ns * c
    oF = 2 * cp
    oR = oF + ns * (ns + 1) // 2
    oB = oR + ns
    kp = np.empty(K, X.dtype)
    for gi in range(G):
        n = n0 + gi
        Xg = X[gi]
        for i in range(ns):
            eb = Xg[oB + i]
            for p in range(c):
                pos = i * c + p
                t = n * C + pos
                qpr = Qp[gi, pos]
                kdr = Kd[gi, pos]
                erow = E[gi, pos]
                if pos < C and t < T:
                    qr = q[b, t, h]
                    kr = k[b, t, h]
                    eq = Xg[pos]
                    ek = Xg[cp + pos]
                    for kk in range(K):
                        qpr[kk] = qr[kk] * scale * eq[kk]
                    for kk in range(K):
                        kp[kk] = kr[kk] * ek[kk]
                    if want_kd:
                        for kk in range(K):
                            kdr[kk] = kp[kk] * eb[kk]
                    for kk in range(K):
                        erow[kk] = ek[kk] * eb[kk]
                else:
                    for kk in range(K):
                        kp[kk] = 0
                        qpr[kk] = 0
                        kdr[kk] = 0
                        erow[kk] = 0
                for i2 in range(i, ns):
                    kxr = KX[gi, c * i2 * (i2 + 1) // 2 + pos]
                    if i2 == i and bad[gi, i]:
                        for kk in range(K):
                            kxr[kk] = 0
                    else:
                        fr = Xg[oF + i2 * (i2 + 1) // 2 + i]
                        for kk in range(K):
                            kxr[kk] = kp[kk] * fr[kk]
                for j in range(i + 1):
                    qxr = QX[gi, c * (j * ns - j * (j - 1) // 2) + (i - j) * c + p]
                    if j == i and bad[gi, i]:
                        for kk in range(K):
                            qxr[kk] = 0
                    else:
                        fr = Xg[oF + i * (i + 1) // 2 + j]
                        for kk in range(K):
                            qxr[kk] = qpr[kk] * fr[kk]


@nb.njit(cache=True, nogil=True)
def _local_combine(X, G, ns, c, scale, M1, DQ, DK):
    """In place: ``DQ = scale eq (er M1 + DQ)`` (dq without its diagonal term), ``DK = ek DK`` (intra part of
    dk without its diagonal term)."""
    K = DQ.shape[2]
    cp = ns * c
    oR = 2 * cp + ns * (ns + 1) // 2
    for gi in range(G):
        Xg = X[gi]
        for i in range(ns):
            er = Xg[oR + i]
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


@nb.njit(cache=True, nogil=True)
def _local_write(q, k, ub, uh, n0, G, T, C, scale, DQ, DKI, dd, DV, dq, dk, dv, dg):
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


@nb.njit(cache=True, nogil=True)
def _corrected(Sl, e, S0, use_s0, ub, uh, n0, G, out):
    """``out[u, gi] = Sl[b, h, n0 + gi] + diag(e[b, h, n0 + gi]) S0[b, h]`` (the second term only when
    ``use_s0``): ``Sl [B, H, N(+1), K, V]``, ``e [B, H, N, K]``, ``S0 [B, H, K, V]``."""
    K, V = out.shape[2], out.shape[3]
    for u in range(ub.size):
        b = ub[u]
        h = uh[u]
        for gi in range(G):
            s = Sl[b, h, n0 + gi]
            o = out[u, gi]
            if use_s0:
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


@nb.njit(cache=True, nogil=True)
def _correct_states(Sst, e, S0, ub, uh, n0, G):
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
def _add_rows(Ot, out, ub, uh, n0, G, T, C):
    """``out[b, t, h] += Ot[u, gi, pos]`` for the group's valid tokens."""
    D = out.shape[3]
    nu = ub.size
    for gi in range(G):
        n = n0 + gi
        nv = min(C, T - n * C)
        for pos in range(nv):
            t = n * C + pos
            for u in range(nu):
                c = Ot[u, gi, pos]
                o = out[ub[u], t, uh[u]]
                for d in range(D):
                    o[d] += c[d]


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
def _bwd_finish(k, ub, uh, n0, G, T, C, E, VdH, DV2, ac, Sst, dHe, dk, dv, dg):
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


# --------------------------------------------------------------------------------------------- helpers


def _check_numpy(**arrays: Any) -> None:
    for name, x in arrays.items():
        if x is not None and is_device_array(x):
            raise TypeError(f"{name} is a CuPy array: the phase-split GLA runs on numpy arrays (use hpczeco.gpu.gla)")


def _validate(q, k, v, g, scale, initial_state, chunk_size, do=None, check_values=True):
    """As chunk.py's checks: ``(B, T, H, K, V, scale, chunk_size, compute dtype)``; ``check_values=False``
    skips the value scans (NaN/Inf, g <= 0) for inputs a caller has validated already."""
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, initial_state=initial_state, do=do, check_values=check_values)
    s = check_scale(scale, K)
    return B, T, H, K, V, s, chunk_size, np.dtype(compute_dtype_name(str(q.dtype)))


def _check_state(name: str, x: Any, B: int, H: int, K: int, V: int, in_dtype: np.dtype,
                 check_values: bool = True) -> None:
    """``x`` is a numpy ``[B, H, K, V]`` state with the input dtype (float32 too for half inputs), finite
    (unless ``check_values`` is False)."""
    check_array(name, x, ndim=4)
    _check_numpy(**{name: x})
    check_shape(name, x, (B, H, K, V), "([B, H, K, V] from q and v)")
    want = dtype_name(np.empty(0, in_dtype))
    if not state_dtype_ok(want, dtype_name(x)):
        raise TypeError(f"{name} has dtype {dtype_name(x)}, expected {want} (the dtype of q)")
    if check_values:
        check_finite_values(name, x)


def _rows(x: np.ndarray, b: int, h: int, n0: int, gc: int, geo: _Geom, buf: np.ndarray) -> np.ndarray:
    """The group's token rows of ``x[b, :, h]`` as ``[gc, Cp, D]``: a strided view for whole chunks, else
    gathered into ``buf`` with zero rows for no-op tokens."""
    C, Cp = geo.C, geo.Cp
    t0, t1 = n0 * C, (n0 + gc) * C
    if Cp == C and t1 <= geo.T:
        return x[b, t0:t1, h].reshape(gc, C, x.shape[3])
    _gather_rows(x, b, h, n0, gc, geo.T, C, Cp, buf)
    return buf[:gc]


def _group_size_bwd(geo: _Geom) -> int:
    return max(1, min(geo.N, _GROUP_TOKENS_BWD // geo.Cp))


def _group_size_light(geo: _Geom) -> int:
    return max(1, min(geo.N, _GROUP_TOKENS_LIGHT // geo.Cp))


def _blocks(units: list) -> list[tuple[list, np.ndarray, np.ndarray]]:
    """``units`` in blocks of at most ``_UNIT_BLOCK`` sequences: ``(units, b indices, h indices)``. The
    token-row kernels walk tokens in the outer loop and a block's sequences inside, so the rows of
    ``[B, T, H, D]`` arrays are touched in memory order (a per-sequence walk strides over the heads)."""
    out = []
    for i in range(0, len(units), _UNIT_BLOCK):
        part = units[i : i + _UNIT_BLOCK]
        out.append((part, np.array([b for b, _ in part], np.int64), np.array([h for _, h in part], np.int64)))
    return out


class _Ticker:
    """Calls ``poll`` when at least ``_POLL_S`` has passed since the last call (single-thread phases)."""

    def __init__(self, poll: Poll):
        self.poll = poll
        self.last = time.perf_counter()

    def __call__(self) -> None:
        if self.poll is not None:
            now = time.perf_counter()
            if now - self.last >= _POLL_S:
                self.poll()
                self.last = time.perf_counter()


def _run_polled(B: int, H: int, fn: Callable[[list, Callable[[], None]], None], poll: Poll) -> None:
    """As chunk.py's ``_run_units`` (``fn(units, tick)`` over blocks of sequences in worker threads), with
    ``poll()`` called from this thread: once at the start, then about every ``_POLL_S`` — between chunk
    groups (``tick``) when one thread computes, while waiting for the workers otherwise."""
    units = [(b, h) for b in range(B) for h in range(H)]
    nt = _num_threads(len(units))
    if poll is not None:
        poll()
    if nt == 1:
        with single_threaded_blas():
            fn(units, _Ticker(poll))
        return

    def work(part):
        with single_threaded_blas():
            fn(part, _Ticker(None))

    bounds = [len(units) * i // nt for i in range(nt + 1)]
    with ThreadPoolExecutor(nt) as ex:
        futs = [ex.submit(work, units[bounds[i] : bounds[i + 1]]) for i in range(nt)]
        pending = set(futs)
        while pending:
            _, pending = wait(pending, timeout=_POLL_S if poll is not None else None, return_when=FIRST_COMPLETED)
            if poll is not None:
                poll()
        for f in futs:
            f.result()


# --------------------------------------------------------------------------------------------- forward


class ForwardSplit:
    """Chunked GLA forward in three phases (numpy): :meth:`finish` returns what ``chunk_gla(q, k, v, g,
    scale, initial_state=S_in, output_final_state=True, chunk_size)`` returns.

    The constructor computes the chunk states from a zero state and exposes ``S_local [B, H, K, V]`` (the
    slice's final state from a zero state, compute dtype) and ``a [B, H, K]`` (``exp`` of the gate summed
    over the slice, summed in float64, compute dtype): the slice's scan element. After :meth:`finish`,
    ``states [B, H, N + 1, K, V]`` holds the state entering every chunk and the final state (what
    :class:`BackwardSplit` can take instead of recomputing them). ``q, k, g: [B, T, H, K]``, ``v: [B, T, H,
    V]``; validation and dtypes as :func:`hpczeco.gla.chunk_gla` (``check_values=False`` skips the NaN/Inf
    and ``g <= 0`` scans for inputs validated by the caller). Local: no communication.
    """

    S_local: np.ndarray
    a: np.ndarray

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        scale: float | None = None,
        chunk_size: int = 64,
        *,
        check_values: bool = True,
    ):
        _check_numpy(q=q, k=k, v=v, g=g)
        B, T, H, K, V, s, chunk_size, cdt = _validate(q, k, v, g, scale, None, chunk_size, check_values=check_values)
        self.shape = (B, T, H, K, V)
        self.chunk_size, self.dtype, self.in_dtype = chunk_size, cdt, q.dtype
        self.scale = cdt.type(s)
        self._check_values = bool(check_values)  # also for the state handed to finish()
        self._intra_done = self._finished = False
        self._states_out: np.ndarray | None = None
        if T == 0 or B * H == 0:
            self._geo = None
            self.S_local = np.zeros((B, H, K, V), cdt)
            self.a = np.ones((B, H, K), cdt)
            return
        geo = self._geo = _Geom(B, T, H, K, V, chunk_size)
        self._q, self._k, self._v, self._g = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g))
        N = geo.N
        self._Sst = np.empty((B, H, N + 1, K, V), cdt)  # state entering every chunk (and the end), zero start
        tot = np.empty((B, H, N, K), np.float64)
        _run_units(B, H, lambda units: self._states(units, tot))
        cum = np.cumsum(tot, axis=2)  # gate summed up to the end of each chunk, float64
        self.a = np.exp(cum[:, :, -1]).astype(cdt)
        cum -= tot  # ... up to the start of each chunk
        self._e = np.exp(cum).astype(cdt)  # [B, H, N, K] decay from the slice start to chunk n's start
        self.S_local = np.ascontiguousarray(self._Sst[:, :, N])

    def _states(self, units, tot) -> None:
        geo = self._geo
        K, V, C, T, N, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.Cp
        G = _group_size_light(geo)
        dt = self.dtype
        blocks = _blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        X = np.empty((nb_, G, Cp + 1, K), dt)
        Kd = np.empty((nb_, G, Cp, K), dt)
        Vb = np.empty((G, Cp, V), dt)
        U = np.empty((G, K, V), dt)
        for b, h in units:
            self._Sst[b, h, 0] = 0
        for n0 in range(0, N, G):
            gc = min(G, N - n0)
            for part, ub, uh in blocks:
                m = len(part)
                _suffix_exponents(self._g, ub, uh, n0, gc, T, C, Cp, X, tot)
                np.exp(X[:m, :gc], out=X[:m, :gc])
                _scaled_rows(self._k, ub, uh, n0, gc, T, C, Cp, dt.type(1), X, Kd)
                for j, (b, h) in enumerate(part):
                    vr = _rows(self._v, b, h, n0, gc, geo, Vb)
                    np.matmul(Kd[j, :gc].transpose(0, 2, 1), vr, out=U[:gc])
                    _kn.state_chain(U, X[j], Cp, gc, self._Sst[b, h], n0)

    def intra(self, poll: Poll = None) -> None:
        """The state-independent work: the intra-chunk attention ``A V`` of every chunk (and the q-side
        operand of the inter-chunk product). Calls ``poll()`` about every millisecond. Idempotent."""
        if self._intra_done:
            return
        geo = self._geo
        if geo is not None:
            B, T, H, K, V = self.shape
            self._o = np.empty((B, T, H, V), self.dtype)
            self._Qs = np.empty((B, H, geo.N, geo.Cp, K), self.dtype)
            _run_polled(B, H, self._intra_units, poll)
        elif poll is not None:
            poll()
        self._intra_done = True

    def _intra_units(self, units, tick) -> None:
        geo = self._geo
        K, V, C, T, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.ns, geo.c, geo.Cp
        G = _group_size(geo)
        dt, s = self.dtype, self.scale
        q, k, g = self._q, self._k, self._g
        limit = _SPAN_LIMIT[dt]
        LX = _kn.layout(ns, c)[4]
        X = np.empty((G, LX, K), dt)
        bad = np.empty((G, ns), np.bool_)
        Qp = np.empty((G, Cp, K), dt)
        KX = np.empty((G, c * ns * (ns + 1) // 2, K), dt)
        L = np.zeros((G, Cp, Cp), dt)  # blocks above the diagonal stay zero
        Vb = np.empty((G, Cp, V), dt)
        Ot = np.empty((G, Cp, V), dt)
        for n0 in range(0, geo.N, G):
            gc = min(G, geo.N - n0)
            for b, h in units:
                _kn.prep_exponents(g, b, h, n0, gc, T, C, ns, c, limit, X, bad)
                np.exp(X[:gc], out=X[:gc])
                _prep_intra(q, k, b, h, n0, gc, T, C, ns, c, s, X, bad, Qp, KX, self._Qs[b, h, n0 : n0 + gc])
                for i in range(ns):
                    off = c * i * (i + 1) // 2
                    np.matmul(
                        Qp[:gc, i * c : (i + 1) * c],
                        KX[:gc, off : off + (i + 1) * c].transpose(0, 2, 1),
                        out=L[:gc, i * c : (i + 1) * c, : (i + 1) * c],
                    )
                _kn.mask_diag(L, gc, ns, c)
                if bad[:gc].any():
                    _pairwise_A(q, k, g, b, h, n0, bad[:gc], geo, float(s), L)
                vr = _rows(self._v, b, h, n0, gc, geo, Vb)
                t0, t1 = n0 * C, (n0 + gc) * C
                if Cp == C and t1 <= T:  # whole chunks: BLAS writes the strided rows of o[b, :, h] directly
                    np.matmul(L[:gc], vr, out=self._o[b, t0:t1, h].reshape(gc, C, V))
                else:
                    np.matmul(L[:gc], vr, out=Ot[:gc])
                    _kn.write_rows(Ot, self._o, b, h, n0, gc, T, C)
                tick()

    @property
    def states(self) -> np.ndarray:
        """``[B, H, N + 1, K, V]`` (compute dtype, ``N`` chunks): the state entering every chunk, then the final
        state, with the incoming state given to :meth:`finish`; set by :meth:`finish`."""
        if self._states_out is None:
            raise RuntimeError("ForwardSplit.states is set by finish(); call finish first")
        return self._states_out

    def finish(self, S_in: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(o [B, T, H, V] input dtype, final [B, H, K, V] compute dtype)`` with the incoming state
        ``S_in [B, H, K, V]`` (None: zeros): the chunk states are corrected in place,
        ``S_n = S_n^loc + diag(exp(G_n)) S_in``, their inter-chunk product added to the intra part in place, and
        ``final = diag(a) S_in + S_local``. Runs :meth:`intra` first if it has not run. Once per object."""
        if self._finished:
            raise RuntimeError("ForwardSplit.finish() was already called (it works in place): make a new ForwardSplit")
        B, T, H, K, V = self.shape
        if S_in is not None:
            _check_state("S_in", S_in, B, H, K, V, self.in_dtype, self._check_values)
        S0 = None if S_in is None else np.ascontiguousarray(S_in, dtype=self.dtype)
        self.intra()
        self._finished = True
        if self._geo is None:
            o = np.zeros((B, T, H, V), self.in_dtype)
            final = np.zeros((B, H, K, V), self.dtype) if S0 is None else S0.copy()
            self._states_out = final[:, :, None].copy()
            return o, final
        o = self._o
        _run_units(B, H, lambda units: self._finish_units(units, S0))
        final = self.S_local.copy() if S0 is None else (self.a[..., None] * S0 + self.S_local).astype(self.dtype)
        self._Sst[:, :, self._geo.N] = final
        self._states_out = self._Sst
        del self._o, self._Qs, self._Sst, self._q, self._k, self._v, self._g, self._e
        return o.astype(self.in_dtype, copy=False), final

    def _finish_units(self, units, S0) -> None:
        geo = self._geo
        V, C, T, Cp = geo.V, geo.C, geo.T, geo.Cp
        G = _group_size(geo)
        blocks = _blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        Ot = np.empty((nb_, G, Cp, V), self.dtype)
        for n0 in range(0, geo.N, G):
            gc = min(G, geo.N - n0)
            for part, ub, uh in blocks:
                if S0 is not None:
                    _correct_states(self._Sst, self._e, S0, ub, uh, n0, gc)
                for j, (b, h) in enumerate(part):
                    np.matmul(self._Qs[b, h, n0 : n0 + gc], self._Sst[b, h, n0 : n0 + gc], out=Ot[j, :gc])
                _add_rows(Ot, self._o, ub, uh, n0, gc, T, C)


# --------------------------------------------------------------------------------------------- backward


class BackwardSplit:
    """Chunked GLA backward in three phases (numpy): :meth:`finish` returns ``(dq, dk, dv, dg, dh0)`` equal
    (to rounding) to ``chunk_gla_bwd(q, k, v, g, do, scale, initial_state, dht, chunk_size)``.

    The constructor computes ``U [B, H, K, V]`` (compute dtype): the gradient into the initial state when
    ``dht = 0``, ``scale sum_t (q_t exp(G_t))^T do_t`` — and ``a [B, H, K]`` as :class:`ForwardSplit`.
    Shapes, validation and dtypes as :func:`hpczeco.gla.chunk_gla_bwd`. ``states`` (optional): the
    forward's chunk states ``[B, H, N + 1, K, V]`` (:attr:`ForwardSplit.states` with the same inputs, chunk
    size and ``S_in = initial_state``); :meth:`local` then uses them instead of recomputing them (its first
    slot must equal ``initial_state``, zeros if None). ``check_values=False`` skips the NaN/Inf and
    ``g <= 0`` scans. Local: no communication.
    """

    U: np.ndarray
    a: np.ndarray

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        do: Any,
        scale: float | None = None,
        initial_state: Any = None,
        chunk_size: int = 64,
        *,
        states: Any = None,
        check_values: bool = True,
    ):
        _check_numpy(q=q, k=k, v=v, g=g, do=do, initial_state=initial_state, states=states)
        B, T, H, K, V, s, chunk_size, cdt = _validate(
            q, k, v, g, scale, initial_state, chunk_size, do=do, check_values=check_values
        )
        self.shape = (B, T, H, K, V)
        self.chunk_size, self.dtype, self.in_dtype = chunk_size, cdt, q.dtype
        self.scale = cdt.type(s)
        self._check_values = bool(check_values)  # also for the state handed to finish()
        self._dh0_dtype = cdt if initial_state is None else initial_state.dtype
        self._h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
        self._local_done = self._finished = False
        self._given_states = None
        if states is not None:
            check_array("states", states, ndim=5)
            N = _Geom(B, T, H, K, V, chunk_size).N if T and B * H else 0
            check_shape("states", states, (B, H, N + 1, K, V), f"([B, H, N + 1, K, V] with N = {N} chunks)")
            if states.dtype != cdt:
                raise TypeError(f"states has dtype {states.dtype}, expected {cdt} (the compute dtype)")
            first = np.zeros((B, H, K, V), cdt) if self._h0 is None else self._h0
            if not np.array_equal(states[:, :, 0], first):
                raise ValueError(
                    "states[:, :, 0] must equal initial_state (zeros when None): states of another forward?"
                )
            self._given_states = states
        if T == 0 or B * H == 0:
            self._geo = None
            self.U = np.zeros((B, H, K, V), cdt)
            self.a = np.ones((B, H, K), cdt)
            return
        geo = self._geo = _Geom(B, T, H, K, V, chunk_size)
        self._q, self._k, self._v, self._g, self._do = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g, do))
        N = geo.N
        self._dHl = np.empty((B, H, N, K, V), cdt)  # gradient into every chunk's end state when dht = 0
        self._ac = np.empty((B, H, N, K), cdt)  # exp(gate summed over chunk n)
        self.U = np.empty((B, H, K, V), cdt)
        tot = np.empty((B, H, N, K), np.float64)
        _run_units(B, H, lambda units: self._ctor_units(units, tot))
        cum = np.cumsum(tot[:, :, ::-1], axis=2)[:, :, ::-1]  # gate summed from chunk n's start to the end
        self._a64 = cum[:, :, 0].copy()
        self.a = np.exp(self._a64).astype(cdt)
        self._a64 = np.exp(self._a64)
        cum -= tot  # ... from chunk n's end to the end
        self._e = np.exp(cum).astype(cdt)  # [B, H, N, K] decay from chunk n's end to the slice end

    def _ctor_units(self, units, tot) -> None:
        """Per chunk ``W_n = scale (q exp(b))^T dO``, reverse time order with the recurrence
        ``dH <- exp(b_C) dH + W_n`` from dH = 0: ``_dHl[n]`` = dH entering from the right, ``U`` = the end."""
        geo = self._geo
        K, V, C, T, N, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.Cp
        G = _group_size_light(geo)
        dt = self.dtype
        blocks = _blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        X = np.empty((nb_, G, Cp + 1, K), dt)
        Qe = np.empty((nb_, G, Cp, K), dt)
        dOb = np.empty((G, Cp, V), dt)
        W = np.empty((G, K, V), dt)
        dH = {u: np.zeros((K, V), dt) for u in units}
        for n0 in range(((N - 1) // G) * G, -1, -G):
            gc = min(G, N - n0)
            for part, ub, uh in blocks:
                m = len(part)
                _prefix_exponents(self._g, ub, uh, n0, gc, T, C, Cp, X, tot)
                np.exp(X[:m, :gc], out=X[:m, :gc])
                _scaled_rows(self._q, ub, uh, n0, gc, T, C, Cp, self.scale, X, Qe)
                for j, (b, h) in enumerate(part):
                    self._ac[b, h, n0 : n0 + gc] = X[j, :gc, Cp]
                    dor = _rows(self._do, b, h, n0, gc, geo, dOb)
                    np.matmul(Qe[j, :gc].transpose(0, 2, 1), dor, out=W[:gc])
                    _kn.state_bwd(W, X[j], Cp, gc, dH[(b, h)], self._dHl[b, h, n0 : n0 + gc])
        for b, h in units:
            self.U[b, h] = dH[(b, h)]

    def local(self, poll: Poll = None) -> None:
        """All dht-independent work: the chunk states from ``initial_state``, ``A``, ``dA``, dq (complete)
        and the intra-chunk parts of dk, dv, dg. Calls ``poll()`` about every millisecond. Idempotent."""
        if self._local_done:
            return
        geo = self._geo
        if geo is not None:
            B, T, H, K, V = self.shape
            cdt = self.dtype
            given = self._given_states is not None
            self._Sst = self._given_states if given else np.empty((B, H, geo.N + 1, K, V), cdt)
            self._E = np.empty((B, H, geo.N, geo.Cp, K), cdt)
            self._dq, self._dk, self._dg = (np.empty((B, T, H, K), cdt) for _ in range(3))
            self._dv = np.empty((B, T, H, V), cdt)
            _run_polled(B, H, self._local_units, poll)
        elif poll is not None:
            poll()
        self._local_done = True

    def _local_units(self, units, tick) -> None:
        geo = self._geo
        K, V, C, T, N, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.ns, geo.c, geo.Cp
        G = _group_size_bwd(geo)
        dt, s = self.dtype, self.scale
        q, k, g = self._q, self._k, self._g
        limit = _SPAN_LIMIT[dt]
        oA, LX = _kn.layout(ns, c)[3:]
        nx = c * ns * (ns + 1) // 2
        blocks = _blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        X = np.empty((G, LX, K), dt)
        bad = np.empty((G, ns), np.bool_)
        Qp, Kd, M1 = (np.empty((G, Cp, K), dt) for _ in range(3))
        DQ, DK = np.empty((nb_, G, Cp, K), dt), np.empty((nb_, G, Cp, K), dt)
        KX, QX = np.empty((G, nx, K), dt), np.empty((G, nx, K), dt)
        Vb, dOb = np.empty((G, Cp, V), dt), np.empty((G, Cp, V), dt)
        DV = np.empty((nb_, G, Cp, V), dt)
        LA, dA = np.zeros((G, Cp, Cp), dt), np.empty((G, Cp, Cp), dt)  # LA: blocks above the diagonal stay zero
        dd = np.empty((nb_, G, Cp), dt)
        U = np.empty((G, K, V), dt)
        recompute = self._given_states is None
        if recompute:
            for b, h in units:
                self._Sst[b, h, 0] = 0 if self._h0 is None else self._h0[b, h]
        for n0 in range(0, N, G):
            gc = min(G, N - n0)
            for part, ub, uh in blocks:
                for j, (b, h) in enumerate(part):
                    Sst = self._Sst[b, h]
                    DQj, DKj = DQ[j], DK[j]
                    _kn.prep_exponents(g, b, h, n0, gc, T, C, ns, c, limit, X, bad)
                    np.exp(X[:gc], out=X[:gc])
                    E = self._E[b, h, n0 : n0 + gc]
                    _prep_local(q, k, b, h, n0, gc, T, C, ns, c, s, X, bad, Qp, KX, QX, Kd, recompute, E)
                    vr = _rows(self._v, b, h, n0, gc, geo, Vb)
                    dor = _rows(self._do, b, h, n0, gc, geo, dOb)
                    if recompute:
                        np.matmul(Kd[:gc].transpose(0, 2, 1), vr, out=U[:gc])
                        _kn.state_chain(U, X, oA, gc, Sst, n0)
                    for i in range(ns):  # A (scaled, lower triangular) as in the forward
                        off = c * i * (i + 1) // 2
                        np.matmul(
                            Qp[:gc, i * c : (i + 1) * c],
                            KX[:gc, off : off + (i + 1) * c].transpose(0, 2, 1),
                            out=LA[:gc, i * c : (i + 1) * c, : (i + 1) * c],
                        )
                    _kn.mask_diag(LA, gc, ns, c)
                    pw = _pairwise_A(q, k, g, b, h, n0, bad[:gc], geo, float(s), LA) if bad[:gc].any() else None
                    np.matmul(dor, vr.transpose(0, 2, 1), out=dA[:gc])  # dO V^T (unscaled)
                    _kn.mask_dA(dA, dd[j], gc, ns, c)
                    np.matmul(LA[:gc].transpose(0, 2, 1), dor, out=DV[j, :gc])
                    np.matmul(dor, Sst[n0 : n0 + gc].transpose(0, 2, 1), out=M1[:gc])
                    for i in range(ns):
                        off = c * i * (i + 1) // 2
                        np.matmul(
                            dA[:gc, i * c : (i + 1) * c, : (i + 1) * c],
                            KX[:gc, off : off + (i + 1) * c],
                            out=DQj[:gc, i * c : (i + 1) * c],
                        )
                        oq = _kn.qx_offset(i, ns, c)
                        np.matmul(
                            dA[:gc, i * c :, i * c : (i + 1) * c].transpose(0, 2, 1),
                            QX[:gc, oq : oq + (ns - i) * c],
                            out=DKj[:gc, i * c : (i + 1) * c],
                        )
                    _local_combine(X, gc, ns, c, s, M1, DQj, DKj)
                    if pw is not None:
                        _pairwise_dqdk(pw, c, float(s), dA, DQj, DKj)
                    tick()
                _local_write(q, k, ub, uh, n0, gc, T, C, s, DQ, DK, dd, DV, self._dq, self._dk, self._dv, self._dg)

    def finish(self, dht: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(dq, dk, dv, dg, dh0)`` of ``chunk_gla_bwd`` with the gradient ``dht [B, H, K, V]`` into the final
        state (None: zeros): the dH terms with ``dH_n = dH_n^loc + diag(exp(G_T - G_{n+1})) dht`` added in
        place, and ``dh0 = U + diag(a) dht``. Gradients in the input dtype, dh0 in ``initial_state``'s dtype
        (compute dtype without one). Runs :meth:`local` first if it has not run. Once per object."""
        if self._finished:
            raise RuntimeError("BackwardSplit.finish() was already called (it works in place): make a new one")
        B, T, H, K, V = self.shape
        if dht is not None:
            _check_state("dht", dht, B, H, K, V, self.in_dtype, self._check_values)
        D0 = None if dht is None else np.ascontiguousarray(dht, dtype=self.dtype)
        self.local()
        self._finished = True
        if self._geo is None:
            dq = np.zeros((B, T, H, K), self.in_dtype)
            dh0 = np.zeros((B, H, K, V), self._dh0_dtype) if D0 is None else D0.astype(self._dh0_dtype)
            return dq, dq.copy(), np.zeros((B, T, H, V), self.in_dtype), dq.copy(), dh0
        _run_units(B, H, lambda units: self._finish_units(units, D0))
        if D0 is None:
            dh0 = self.U.astype(self._dh0_dtype)
        else:
            dh0 = (self.U + self._a64[..., None] * D0).astype(self._dh0_dtype)
        it = self.in_dtype
        out = tuple(x.astype(it, copy=False) for x in (self._dq, self._dk, self._dv, self._dg))
        del self._dq, self._dk, self._dv, self._dg, self._E, self._Sst, self._dHl, self._q, self._k, self._v, self._g
        del self._do
        return (*out, dh0)

    def _finish_units(self, units, D0) -> None:
        geo = self._geo
        K, V, C, T, N, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.Cp
        G = _group_size_bwd(geo)
        dt = self.dtype
        blocks = _blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        dHt = np.empty((nb_, G, K, V), dt)
        Kd, VdH = np.empty((nb_, G, Cp, K), dt), np.empty((nb_, G, Cp, K), dt)
        Vb, DV2 = np.empty((G, Cp, V), dt), np.empty((nb_, G, Cp, V), dt)
        D0a = self.U if D0 is None else D0  # (unused when D0 is None)
        for n0 in range(0, N, G):
            gc = min(G, N - n0)
            for part, ub, uh in blocks:
                _corrected(self._dHl, self._e, D0a, D0 is not None, ub, uh, n0, gc, dHt)
                _kd_rows(self._k, ub, uh, n0, gc, T, C, Cp, self._E, Kd)
                for j, (b, h) in enumerate(part):
                    dH = dHt[j, :gc]
                    np.matmul(Kd[j, :gc], dH, out=DV2[j, :gc])
                    vr = _rows(self._v, b, h, n0, gc, geo, Vb)
                    np.matmul(vr, dH.transpose(0, 2, 1), out=VdH[j, :gc])
                _bwd_finish(
                    self._k, ub, uh, n0, gc, T, C, self._E, VdH, DV2, self._ac, self._Sst, dHt,
                    self._dk, self._dv, self._dg,
                )  # fmt: skip
