"""Steps on one group of chunks of one (batch, head) sequence, shared by the fused chunked GLA
(:mod:`hpczeco.gla.fused`) and the phase-split one (:mod:`hpczeco.gla.split`): the exponents, the intra-chunk
attention matrix ``A``, the output rows, and the dht-independent backward of a group (the backward's local
loop, which both forms run).

Conventions as :mod:`hpczeco.gla._kernels`: a group is ``gc`` chunks from chunk ``n0``; scratch arrays are
``[G, ...]`` with ``G >= gc``; ``X`` is the exponent buffer (exponentiated by :func:`exponents`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels as _kn
from . import _kernels_grad as _kg
from ._geometry import Geom
from ._pairwise import pairwise_A, pairwise_dqdk

__all__ = ["OperandBuffers", "exponents", "a_matrix", "rows", "matmul_rows", "intra_grads"]


class OperandBuffers:
    """Scratch of the full operand kernels for groups of up to ``G`` chunks: the exponent buffer
    ``X [G, LX, K]``, the flags ``bad [G, ns]``, ``Qp [G, Cp, K]``, ``KX [G, c ns(ns+1)/2, K]`` and, with
    ``qx``, ``QX`` (same shape as ``KX``)."""

    def __init__(self, geo: Geom, G: int, dt: np.dtype, qx: bool = False):
        ns, c, K = geo.ns, geo.c, geo.K
        nx = c * ns * (ns + 1) // 2
        self.X = np.empty((G, _kn.layout(ns, c)[4], K), dt)
        self.bad = np.empty((G, ns), np.bool_)
        self.Qp = np.empty((G, geo.Cp, K), dt)
        self.KX = np.empty((G, nx, K), dt)
        self.QX = np.empty((G, nx, K), dt) if qx else None


def exponents(g: np.ndarray, b: int, h: int, n0: int, gc: int, geo: Geom, X: np.ndarray, bad: np.ndarray) -> None:
    """``X[:gc]`` = exp of the exponents of the group, ``bad[:gc]`` = the sub-chunks past the span limit."""
    limit = geo.span_limit(X.dtype)
    _kn.prep_exponents(g, b, h, n0, gc, geo.T, geo.C, geo.ns, geo.c, limit, X, bad)
    np.exp(X[:gc], out=X[:gc])


def a_matrix(q, k, g, b: int, h: int, n0: int, gc: int, geo: Geom, s: Any, bad: np.ndarray, Qp: np.ndarray,
             KX: np.ndarray, L: np.ndarray):
    """The scaled lower-triangular intra-chunk attention ``A`` of the group into ``L[:gc, :Cp, :Cp]`` (blocks
    above the diagonal are never written: ``L`` starts zeroed): the row blocks ``Qp_I KX_I^T``, the masked
    diagonal, and the exact pairwise diagonal blocks where ``bad``. Returns the pairwise data (or None)."""
    ns, c = geo.ns, geo.c
    for i in range(ns):
        off = c * i * (i + 1) // 2
        np.matmul(
            Qp[:gc, i * c : (i + 1) * c],
            KX[:gc, off : off + (i + 1) * c].transpose(0, 2, 1),
            out=L[:gc, i * c : (i + 1) * c, : (i + 1) * c],
        )
    _kn.mask_diag(L, gc, ns, c)
    return pairwise_A(q, k, g, b, h, n0, bad[:gc], geo, float(s), L) if bad[:gc].any() else None


def rows(x: np.ndarray, b: int, h: int, n0: int, gc: int, geo: Geom, buf: np.ndarray) -> np.ndarray:
    """The group's token rows of ``x[b, :, h]`` as ``[gc, Cp, D]``: a strided view for whole chunks, else
    gathered into ``buf`` with zero rows for no-op tokens."""
    if geo.whole(n0, gc):
        return x[b, n0 * geo.C : (n0 + gc) * geo.C, h].reshape(gc, geo.C, x.shape[3])
    _kn.gather_rows(x, b, h, n0, gc, geo.T, geo.C, geo.Cp, buf)
    return buf[:gc]


def matmul_rows(lhs: np.ndarray, rhs: np.ndarray, out: np.ndarray, b: int, h: int, n0: int, gc: int, geo: Geom,
                buf: np.ndarray) -> None:
    """``out[b, t, h] = (lhs @ rhs)`` rows of the group's tokens (``lhs [gc, Cp, *]``, ``rhs [gc, *, D]``):
    BLAS writes the strided rows of ``out[b, :, h]`` directly for whole chunks, else through ``buf``."""
    C, V = geo.C, out.shape[3]
    if geo.whole(n0, gc):
        np.matmul(lhs, rhs, out=np.reshape(out[b, n0 * C : (n0 + gc) * C, h], (gc, C, V), copy=False))
    else:
        np.matmul(lhs, rhs, out=buf[:gc])
        _kn.write_rows(buf, out, b, h, n0, gc, geo.T, C)


def intra_grads(q, k, g, b: int, h: int, n0: int, gc: int, geo: Geom, s: Any, ob: OperandBuffers,
                vr: np.ndarray, dor: np.ndarray, S_prev: np.ndarray, LA: np.ndarray, dA: np.ndarray,
                dd: np.ndarray, DV: np.ndarray, M1: np.ndarray, DQ: np.ndarray, DK: np.ndarray,
                VdH: np.ndarray | None = None) -> None:
    """The dht-independent backward of a group, operands ready in ``ob`` (exponentiated ``X``, ``Qp``,
    ``KX``, ``QX``): ``A`` into ``LA [G, Cp, Cp]``, ``dA = dO V^T`` (strictly lower, unscaled) with its
    diagonal in ``dd [G, Cp]``, ``DV = A^T dO``, and ``DQ`` (dq less its diagonal term), ``DK`` (the intra
    part of dk less its diagonal term), ``[G, Cp, K]``; ``vr, dor [gc, Cp, V]`` are the group's rows of v and
    do, ``S_prev [gc, K, V]`` the states entering its chunks, ``M1 [G, Cp, K]`` scratch. ``VdH`` (the
    ``V dH^T`` rows, if given) is scaled in place into the inter part of dk."""
    ns, c = geo.ns, geo.c
    KX, QX = ob.KX, ob.QX
    pw = a_matrix(q, k, g, b, h, n0, gc, geo, s, ob.bad, ob.Qp, KX, LA)
    np.matmul(dor, vr.transpose(0, 2, 1), out=dA[:gc])  # dO V^T (unscaled)
    _kg.mask_dA(dA, dd, gc, ns, c)
    np.matmul(LA[:gc].transpose(0, 2, 1), dor, out=DV[:gc])
    np.matmul(dor, S_prev.transpose(0, 2, 1), out=M1[:gc])
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
    _kg.combine(ob.X, gc, ns, c, s, M1, DQ, DK, VdH)
    if pw is not None:
        pairwise_dqdk(pw, c, float(s), dA, DQ, DK)
