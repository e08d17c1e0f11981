"""Numba CUDA kernels for ZeCO's per-rank glue (float32/float64 arrays):

- :func:`decay_cumsum`: ``G = cumsum(g, axis=1)`` for ``g [B, T, H, K]`` (chunk sums, carry, finish);
- :func:`state_correction`: ``o += scale * (q * exp(G)) @ S_in`` per (b, h), in place;
- :func:`final_state`: ``diag(exp(G_T)) S_in + S_local`` with ``G_T [B, H, K]``;
- :func:`scan_combine`: the scan operator's state part ``a * S_in + S_local`` (``a [B, H, K]``).

They take CuPy arrays (through ``numba.cuda.as_cuda_array``, launched on CuPy's current stream via
``numba.cuda.external_stream``), Numba device arrays, or numpy arrays (copied by Numba; this is also
how they run under the CUDA simulator, ``NUMBA_ENABLE_CUDASIM=1``, in the tests). bf16/fp16 arrays
belong to the CuPy kernels in :mod:`hpczeco.gpu.gla`, which have the same functions for every dtype.
"""

from __future__ import annotations

import math
from typing import Any

import numba

from .numba_util import SIMULATOR, cuda, dev, is_cupy, stream

__all__ = ["decay_cumsum", "state_correction", "final_state", "scan_combine", "SIMULATOR"]

_CACHE = not SIMULATOR
_SEG = 64  # tokens per segment of the cumulative sum
_TOK = 16  # tokens per block of the correction
_KMAX = 256  # largest K of the correction (shared-memory tile)
_VT = 64  # threads per block of the correction (over V)


@cuda.jit(cache=_CACHE)
def _seg_sum(g, tot):
    # grid (nseg, B*H), block over K: tot[bh, s, k] = sum of g over segment s
    s = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = g.shape[2]
    b = bh // H
    h = bh % H
    T = g.shape[1]
    K = g.shape[3]
    kk = cuda.threadIdx.x
    while kk < K:
        acc = 0.0
        for t in range(s * _SEG, min(T, (s + 1) * _SEG)):
            acc += g[b, t, h, kk]
        tot[bh, s, kk] = acc
        kk += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _seg_carry(tot):
    # one thread per (bh, k): exclusive prefix over segments, in place
    e = cuda.grid(1)
    BH = tot.shape[0]
    K = tot.shape[2]
    if e >= BH * K:
        return
    bh = e // K
    kk = e % K
    run = 0.0
    for s in range(tot.shape[1]):
        x = tot[bh, s, kk]
        tot[bh, s, kk] = run
        run += x


@cuda.jit(cache=_CACHE)
def _seg_finish(g, carry, G):
    s = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = g.shape[2]
    b = bh // H
    h = bh % H
    T = g.shape[1]
    K = g.shape[3]
    kk = cuda.threadIdx.x
    while kk < K:
        acc = carry[bh, s, kk]
        for t in range(s * _SEG, min(T, (s + 1) * _SEG)):
            acc += g[b, t, h, kk]
            G[b, t, h, kk] = acc
        kk += cuda.blockDim.x


def _make_correction(nbtype):
    """The correction kernel for one float type (shared/local array dtypes must be compile-time types)."""

    @cuda.jit  # a closure over the dtype: not cached on disk
    def _correction(o, q, G, S, scale):
        # grid (ceil(T / _TOK), B*H), block _VT threads over V; q*exp(G) of _TOK tokens in shared memory
        qe = cuda.shared.array((_TOK, _KMAX), dtype=nbtype)
        t0 = cuda.blockIdx.x * _TOK
        bh = cuda.blockIdx.y
        H = q.shape[2]
        b = bh // H
        h = bh % H
        T = q.shape[1]
        K = q.shape[3]
        V = o.shape[3]
        tx = cuda.threadIdx.x
        e = tx
        while e < _TOK * K:
            tt = e // K
            kk = e % K
            t = t0 + tt
            if t < T:
                qe[tt, kk] = q[b, t, h, kk] * math.exp(G[b, t, h, kk])
            else:
                qe[tt, kk] = 0.0
            e += cuda.blockDim.x
        cuda.syncthreads()
        j = tx
        while j < V:
            acc = cuda.local.array(_TOK, dtype=nbtype)
            for tt in range(_TOK):
                acc[tt] = 0.0
            for kk in range(K):
                sv = S[b, h, kk, j]
                for tt in range(_TOK):
                    acc[tt] += qe[tt, kk] * sv
            for tt in range(_TOK):
                t = t0 + tt
                if t < T:
                    o[b, t, h, j] += scale * acc[tt]
            j += cuda.blockDim.x

    return _correction


_CORRECTION = {"float32": _make_correction(numba.float32), "float64": _make_correction(numba.float64)}


@cuda.jit(cache=_CACHE)
def _combine(a, S_in, S_local, out, is_log):
    # one thread per state element: out = a * S_in + S_local (a = exp(a) when is_log)
    e = cuda.grid(1)
    B, H, K, V = S_in.shape
    if e >= B * H * K * V:
        return
    j = e % V
    kk = (e // V) % K
    h = (e // (V * K)) % H
    b = e // (V * K * H)
    f = a[b, h, kk]
    if is_log:
        f = math.exp(f)
    out[b, h, kk, j] = f * S_in[b, h, kk, j] + S_local[b, h, kk, j]


# ------------------------------------------------------------------------------------------ wrappers


def _empty_like(x: Any, shape, dtype=None):
    dt = dtype or x.dtype
    if is_cupy(x):
        import cupy  # noqa: PLC0415

        return cupy.empty(shape, dtype=dt)
    import numpy as np  # noqa: PLC0415

    return np.empty(shape, dtype=dt)


def _check4(name: str, x: Any) -> None:
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"{name} must have 4 dimensions, got {getattr(x, 'shape', None)}")
    if str(x.dtype) not in ("float32", "float64"):
        raise TypeError(f"{name} must be float32 or float64 for the Numba kernels, got {x.dtype}")


def decay_cumsum(g: Any, out: Any = None) -> Any:
    """``G = cumsum(g, axis=1)`` for ``g [B, T, H, K]`` (same dtype), into ``out`` if given."""
    _check4("g", g)
    B, T, H, K = g.shape
    G = out if out is not None else _empty_like(g, g.shape)
    if B * T * H * K == 0:
        return G
    nseg = -(-T // _SEG)
    tot = _empty_like(g, (B * H, nseg, K))
    st = stream(g, G)
    dg, dtot, dG = dev(g), dev(tot), dev(G)
    kb = min(128, K)
    _seg_sum[(nseg, B * H), kb, st](dg, dtot)
    _seg_carry[-(-B * H * K // 128), 128, st](dtot)
    _seg_finish[(nseg, B * H), kb, st](dg, dtot, dG)
    return G


def state_correction(o: Any, q: Any, G: Any, S_in: Any, scale: float | None = None) -> Any:
    """In place ``o[b, t, h] += scale * (q[b, t, h] * exp(G[b, t, h])) @ S_in[b, h]``; returns ``o``.

    ``o [B, T, H, V]``, ``q, G [B, T, H, K]`` (K <= 256), ``S_in [B, H, K, V]``, one float dtype.
    """
    for name, x in (("o", o), ("q", q), ("G", G), ("S_in", S_in)):
        _check4(name, x)
    B, T, H, K = q.shape
    V = o.shape[3]
    if tuple(G.shape) != (B, T, H, K) or tuple(o.shape[:3]) != (B, T, H) or tuple(S_in.shape) != (B, H, K, V):
        raise ValueError(f"shapes disagree: o {o.shape}, q {q.shape}, G {G.shape}, S_in {S_in.shape}")
    if K > _KMAX:
        raise ValueError(f"K={K} exceeds {_KMAX}, the shared-memory tile of the Numba correction")
    if len({str(x.dtype) for x in (o, q, G, S_in)}) != 1:
        raise TypeError("o, q, G and S_in must share one dtype")
    sc = float(K) ** -0.5 if scale is None else float(scale)
    if B * T * H == 0:
        return o
    st = stream(o, q, G, S_in)
    _CORRECTION[str(q.dtype)][(-(-T // _TOK), B * H), _VT, st](dev(o), dev(q), dev(G), dev(S_in), sc)
    return o


def _combine_call(a: Any, S_in: Any, S_local: Any, out: Any, is_log: bool) -> Any:
    for name, x in (("S_in", S_in), ("S_local", S_local)):
        _check4(name, x)
    B, H, K, V = S_in.shape
    if tuple(S_local.shape) != (B, H, K, V) or tuple(a.shape) != (B, H, K):
        raise ValueError(
            f"shapes disagree: a {a.shape} (expected [B, H, K]), S_in {S_in.shape}, S_local {S_local.shape}"
        )
    res = out if out is not None else _empty_like(S_in, S_in.shape)
    n = B * H * K * V
    if n:
        st = stream(a, S_in, S_local, res)
        _combine[-(-n // 256), 256, st](dev(a), dev(S_in), dev(S_local), dev(res), is_log)
    return res


def final_state(G_T: Any, S_in: Any, S_local: Any, out: Any = None) -> Any:
    """``diag(exp(G_T)) S_in + S_local`` per (b, h): ``G_T [B, H, K]`` the slice's total log decay."""
    return _combine_call(G_T, S_in, S_local, out, True)


def scan_combine(a: Any, S_in: Any, S_local: Any, out: Any = None) -> Any:
    """``diag(a) S_in + S_local`` per (b, h) (the scan operator's state part), ``a [B, H, K]``."""
    return _combine_call(a, S_in, S_local, out, False)
