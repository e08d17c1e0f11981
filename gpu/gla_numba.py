"""The float64 GPU path of the GLA and of ZeCO's per-rank glue: Numba CUDA kernels (the CuPy RawKernels of
:mod:`hpczeco.gpu.gla` take float32 and 16-bit inputs).

Same semantics as :mod:`hpczeco.gpu.gla` (``q, k, g: [B, T, H, K]``, ``v, o, do: [B, T, H, V]``, states
``[B, H, K, V]``, ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``), every array float64
and every product in float64. :mod:`hpczeco.gpu.gla` dispatches float64 CuPy arrays here (``impl="numba"``),
so :func:`hpczeco.gla.chunk_gla` and the ZeCO layer run in float64 on a GPU. The chunked form, chunk size ``C``
<= 64, ``b`` the gate's cumulative sum inside a chunk (inclusive), ``bL`` its chunk total::

    chunk states from zero   st_n = sum_t (k_t exp(bL - b_t))^T v_t        (_chunk_outer, mode 0)
    state scan over chunks   S_n = exp(bL_{n-1}) S_{n-1} + st_{n-1}         (_state_scan)
    outputs                  o_t = scale ((q_t exp(b_t)) S_n + sum_{s <= t} (q_t . k_s exp(b_t - b_s)) v_s)

and the backward by the same pieces (the gradients into the chunk ends by the reverse scan of
``scale sum_t (q_t exp(b_t))^T do_t``, then dq, dk, dv per chunk and ``dg = reverse_cumsum(q dq - k dk) +
rowsum(S_T dht)``). Every ``exp`` is of a non-positive number. Simple kernels (one thread per output element,
the 64 x 64 score blocks in shared memory): correctness first, speed second.

Kernels launch on CuPy's current stream (:mod:`hpczeco.gpu.numba_util`); :data:`LAUNCHES` counts them by name
(the tests check that this path ran). Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) they run on host
arrays. The caller (:mod:`hpczeco.gpu.gla`) checks shapes, dtypes, ``chunk_size`` and ``scale``. Nothing here
talks MPI.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numba

from .numba_util import SIMULATOR, cuda, dev, stream

__all__ = ["LAUNCHES", "NumbaForward", "NumbaBackward", "decay_cumsum", "state_correction", "combine",
           "initial_state_grad", "SIMULATOR"]

_CACHE = not SIMULATOR
_CMAX = 64  # the largest chunk (the shared score block is _CMAX x _CMAX float64: 32 KB)
_F64 = numba.float64

#: kernel name -> launches since import (how the tests see that the float64 path ran on these kernels)
LAUNCHES: collections.Counter[str] = collections.Counter()


def _threads(n: int) -> int:
    """Threads per block for ``n`` work items per block: a power of two in [32, 128]."""
    return max(32, min(128, 1 << max(0, (int(n) - 1).bit_length())))


def _launch(kernel: Any, name: str, grid: Any, block: int, *args: Any) -> None:
    st = stream(*args)
    LAUNCHES[name] += 1
    kernel[grid, block, st](*(dev(a) for a in args))


# ---------------------------------------------------------------------------------------------- kernels


@cuda.jit(cache=_CACHE)
def _gate_cumsum(g, b, gtot, C):
    # grid (NT, B*H), threads over K: b = the gate's cumulative sum inside chunk n, gtot[bh, n] its total
    n = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = g.shape[2]
    T = g.shape[1]
    K = g.shape[3]
    bb = bh // H
    h = bh % H
    kk = cuda.threadIdx.x
    while kk < K:
        acc = 0.0
        for t in range(n * C, min(T, (n + 1) * C)):
            acc += g[bb, t, h, kk]
            b[bb, t, h, kk] = acc
        gtot[bh, n, kk] = acc
        kk += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _chunk_outer(left, right, b, gtot, st, mode, scale, C):
    # grid (NT, B*H), threads over K*V: st[bh, n] = sum_t (left_t w_t)^T right_t, w = exp(bL - b_t) (mode 0,
    # the chunk's state from zero) or scale exp(b_t) (mode 1, its d-state)
    n = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = left.shape[2]
    T = left.shape[1]
    K = left.shape[3]
    V = right.shape[3]
    bb = bh // H
    h = bh % H
    e = cuda.threadIdx.x
    while e < K * V:
        kk = e // V
        j = e % V
        bL = gtot[bh, n, kk]
        acc = 0.0
        for t in range(n * C, min(T, (n + 1) * C)):
            w = math.exp(bL - b[bb, t, h, kk]) if mode == 0 else scale * math.exp(b[bb, t, h, kk])
            acc += left[bb, t, h, kk] * w * right[bb, t, h, j]
        st[bh, n, kk, j] = acc
        e += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _state_scan(st, gtot, fin, reverse):
    # one thread per (bh, k, v), in place over chunks: st[n] <- the state entering chunk n from zero (reverse:
    # the gradient into chunk n's end from its successors); fin[bh] = the final state (reverse: into the start)
    e = cuda.grid(1)
    BH = st.shape[0]
    NT = st.shape[1]
    K = st.shape[2]
    V = st.shape[3]
    if e >= BH * K * V:
        return
    bh = e // (K * V)
    kk = (e // V) % K
    j = e % V
    run = 0.0
    for i in range(NT):
        n = NT - 1 - i if reverse else i
        x = st[bh, n, kk, j]
        st[bh, n, kk, j] = run
        run = math.exp(gtot[bh, n, kk]) * run + x
    fin[bh, kk, j] = run


@cuda.jit(cache=_CACHE)
def _decay_sums(gtot, pre, suf, total):
    # one thread per (bh, k): the log decay before chunk n (pre), after it (suf), and over everything (total)
    e = cuda.grid(1)
    BH = gtot.shape[0]
    NT = gtot.shape[1]
    K = gtot.shape[2]
    if e >= BH * K:
        return
    bh = e // K
    kk = e % K
    run = 0.0
    for n in range(NT):
        pre[bh, n, kk] = run
        run += gtot[bh, n, kk]
    total[bh, kk] = run
    run = 0.0
    for i in range(NT):
        n = NT - 1 - i
        suf[bh, n, kk] = run
        run += gtot[bh, n, kk]


@cuda.jit(cache=_CACHE)
def _carry(Sloc, logd, S0, out):
    # one thread per (bh, n, k, v): out[bh, n] = Sloc[bh, n] + exp(logd[bh, n]) S0[bh] (an incoming state or
    # gradient carried to every chunk)
    e = cuda.grid(1)
    BH = Sloc.shape[0]
    NT = Sloc.shape[1]
    K = Sloc.shape[2]
    V = Sloc.shape[3]
    if e >= BH * NT * K * V:
        return
    j = e % V
    kk = (e // V) % K
    n = (e // (V * K)) % NT
    bh = e // (V * K * NT)
    out[bh, n, kk, j] = Sloc[bh, n, kk, j] + math.exp(logd[bh, n, kk]) * S0[bh, kk, j]


@cuda.jit(cache=_CACHE)
def _combine(a, S_in, S_local, out, is_log):
    # one thread per state element of [N, K, V]: out = a * S_in + S_local (a = exp(a) when is_log)
    e = cuda.grid(1)
    N = S_in.shape[0]
    K = S_in.shape[1]
    V = S_in.shape[2]
    if e >= N * K * V:
        return
    j = e % V
    kk = (e // V) % K
    i = e // (V * K)
    f = a[i, kk]
    if is_log:
        f = math.exp(f)
    out[i, kk, j] = f * S_in[i, kk, j] + S_local[i, kk, j]


@cuda.jit(device=True)
def _score(q, k, b, bb, h, t, s, K):
    # sum_k q_t k_s exp(b_t - b_s) (s <= t in one chunk: every exponent <= 0)
    acc = 0.0
    for kk in range(K):
        acc += q[bb, t, h, kk] * k[bb, s, h, kk] * math.exp(b[bb, t, h, kk] - b[bb, s, h, kk])
    return acc


@cuda.jit(cache=_CACHE)
def _fwd_output(q, k, v, b, Sn, o, scale, C):
    # grid (NT, B*H): o of chunk n from the state entering it, Sn[bh, n]; A (scores, lower triangle) in shared
    A = cuda.shared.array((_CMAX, _CMAX), dtype=_F64)
    n = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = q.shape[2]
    T = q.shape[1]
    K = q.shape[3]
    V = v.shape[3]
    bb = bh // H
    h = bh % H
    t0 = n * C
    L = min(C, T - t0)
    e = cuda.threadIdx.x
    while e < L * L:
        i = e // L
        s = e % L
        acc = 0.0
        if s <= i:
            acc = _score(q, k, b, bb, h, t0 + i, t0 + s, K)
        A[i, s] = acc
        e += cuda.blockDim.x
    cuda.syncthreads()
    e = cuda.threadIdx.x
    while e < L * V:
        i = e // V
        j = e % V
        acc = 0.0
        for kk in range(K):
            acc += q[bb, t0 + i, h, kk] * math.exp(b[bb, t0 + i, h, kk]) * Sn[bh, n, kk, j]
        for s in range(i + 1):
            acc += A[i, s] * v[bb, t0 + s, h, j]
        o[bb, t0 + i, h, j] = scale * acc
        e += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _bwd_dqdk(q, k, v, b, gtot, do, Sn, dHn, dq, dk, dG, scale, C):
    # grid (NT, B*H): dq, dk and q dq - k dk of chunk n; dA = scale do v^T (lower triangle) in shared memory.
    # Sn: the state entering chunk n, dHn: the gradient into its end
    dA = cuda.shared.array((_CMAX, _CMAX), dtype=_F64)
    n = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = q.shape[2]
    T = q.shape[1]
    K = q.shape[3]
    V = v.shape[3]
    bb = bh // H
    h = bh % H
    t0 = n * C
    L = min(C, T - t0)
    e = cuda.threadIdx.x
    while e < L * L:
        i = e // L
        s = e % L
        acc = 0.0
        if s <= i:
            for j in range(V):
                acc += do[bb, t0 + i, h, j] * v[bb, t0 + s, h, j]
        dA[i, s] = scale * acc
        e += cuda.blockDim.x
    cuda.syncthreads()
    e = cuda.threadIdx.x
    while e < L * K:
        i = e // K
        kk = e % K
        bi = b[bb, t0 + i, h, kk]
        x = 0.0
        for j in range(V):
            x += Sn[bh, n, kk, j] * do[bb, t0 + i, h, j]
        gq = scale * math.exp(bi) * x
        for s in range(i + 1):
            gq += dA[i, s] * k[bb, t0 + s, h, kk] * math.exp(bi - b[bb, t0 + s, h, kk])
        x = 0.0
        for j in range(V):
            x += dHn[bh, n, kk, j] * v[bb, t0 + i, h, j]
        gk = math.exp(gtot[bh, n, kk] - bi) * x
        for t in range(i, L):
            gk += dA[t, i] * q[bb, t0 + t, h, kk] * math.exp(b[bb, t0 + t, h, kk] - bi)
        dq[bb, t0 + i, h, kk] = gq
        dk[bb, t0 + i, h, kk] = gk
        dG[bb, t0 + i, h, kk] = q[bb, t0 + i, h, kk] * gq - k[bb, t0 + i, h, kk] * gk
        e += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _bwd_dv(q, k, b, gtot, do, dHn, dv, scale, C):
    # grid (NT, B*H): dv of chunk n; A (scores, lower triangle) in shared memory
    A = cuda.shared.array((_CMAX, _CMAX), dtype=_F64)
    n = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = q.shape[2]
    T = q.shape[1]
    K = q.shape[3]
    V = do.shape[3]
    bb = bh // H
    h = bh % H
    t0 = n * C
    L = min(C, T - t0)
    e = cuda.threadIdx.x
    while e < L * L:
        i = e // L
        s = e % L
        acc = 0.0
        if s <= i:
            acc = _score(q, k, b, bb, h, t0 + i, t0 + s, K)
        A[i, s] = acc
        e += cuda.blockDim.x
    cuda.syncthreads()
    e = cuda.threadIdx.x
    while e < L * V:
        s = e // V
        j = e % V
        acc = 0.0
        for kk in range(K):
            acc += k[bb, t0 + s, h, kk] * math.exp(gtot[bh, n, kk] - b[bb, t0 + s, h, kk]) * dHn[bh, n, kk, j]
        x = 0.0
        for t in range(s, L):
            x += A[t, s] * do[bb, t0 + t, h, j]
        dv[bb, t0 + s, h, j] = acc + scale * x
        e += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _seg_sum(x, tot, C):
    # grid (NT, B*H), threads over K: tot[bh, n] = sum of x over chunk n
    n = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = x.shape[2]
    T = x.shape[1]
    K = x.shape[3]
    bb = bh // H
    h = bh % H
    kk = cuda.threadIdx.x
    while kk < K:
        acc = 0.0
        for t in range(n * C, min(T, (n + 1) * C)):
            acc += x[bb, t, h, kk]
        tot[bh, n, kk] = acc
        kk += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _seg_carry(tot, base, reverse):
    # one thread per (bh, k), in place: tot[bh, n] <- base[bh] + the sum over the chunks before n (reverse: after)
    e = cuda.grid(1)
    BH = tot.shape[0]
    NT = tot.shape[1]
    K = tot.shape[2]
    if e >= BH * K:
        return
    bh = e // K
    kk = e % K
    run = base[bh, kk]
    for i in range(NT):
        n = NT - 1 - i if reverse else i
        x = tot[bh, n, kk]
        tot[bh, n, kk] = run
        run += x


@cuda.jit(cache=_CACHE)
def _seg_finish(x, carry, out, C, reverse):
    # grid (NT, B*H), threads over K: the inclusive cumulative sum of x along T (reverse: suffix sum) from the carry
    n = cuda.blockIdx.x
    bh = cuda.blockIdx.y
    H = x.shape[2]
    T = x.shape[1]
    K = x.shape[3]
    bb = bh // H
    h = bh % H
    lo = n * C
    hi = min(T, (n + 1) * C)
    kk = cuda.threadIdx.x
    while kk < K:
        acc = carry[bh, n, kk]
        for i in range(hi - lo):
            t = hi - 1 - i if reverse else lo + i
            acc += x[bb, t, h, kk]
            out[bb, t, h, kk] = acc
        kk += cuda.blockDim.x


@cuda.jit(cache=_CACHE)
def _correction(o, q, G, S, scale):
    # one thread per element of o [B, T, H, V]: o += scale (q exp(G)) S
    e = cuda.grid(1)
    B = o.shape[0]
    T = o.shape[1]
    H = o.shape[2]
    V = o.shape[3]
    K = q.shape[3]
    if e >= B * T * H * V:
        return
    j = e % V
    h = (e // V) % H
    t = (e // (V * H)) % T
    bb = e // (V * H * T)
    acc = 0.0
    for kk in range(K):
        acc += q[bb, t, h, kk] * math.exp(G[bb, t, h, kk]) * S[bb, h, kk, j]
    o[bb, t, h, j] += scale * acc


# ---------------------------------------------------------------------------------------------- passes


def _grid1(n: int) -> tuple[int, int]:
    nt = _threads(n)
    return -(-n // nt), nt


def _chunk_gates(xp: Any, g: Any, C: int) -> tuple[Any, Any]:
    """``(b [B, T, H, K], gtot [B*H, NT, K])``: the gate's cumulative sum inside each chunk and its chunk totals."""
    B, T, H, K = g.shape
    NT = -(-T // C)
    b = xp.empty(g.shape, dtype=xp.float64)
    gtot = xp.empty((B * H, NT, K), dtype=xp.float64)
    _launch(_gate_cumsum, "gate_cumsum", (NT, B * H), _threads(K), g, b, gtot, C)
    return b, gtot


def _states(xp: Any, left: Any, right: Any, b: Any, gtot: Any, C: int, mode: int, scale: float) -> tuple[Any, Any]:
    """Chunk states (mode 0: from zero; mode 1: d-states), scanned: ``(per chunk [B*H, NT, K, V], final
    [B*H, K, V])`` -- mode 0: the states entering each chunk and the final state; mode 1: the gradients into each
    chunk's end and into the initial state (``dht = 0``)."""
    BH, NT, K = gtot.shape
    V = right.shape[3]
    st = xp.empty((BH, NT, K, V), dtype=xp.float64)
    _launch(_chunk_outer, "chunk_outer", (NT, BH), _threads(K * V), left, right, b, gtot, st, mode, scale, C)
    fin = xp.empty((BH, K, V), dtype=xp.float64)
    _launch(_state_scan, "state_scan", *_grid1(BH * K * V), st, gtot, fin, mode)
    return st, fin


def _decays(xp: Any, gtot: Any) -> tuple[Any, Any, Any]:
    """``(pre, suf [B*H, NT, K], total [B*H, K])``: log decays before / after each chunk and over everything."""
    BH, NT, K = gtot.shape
    pre, suf = xp.empty_like(gtot), xp.empty_like(gtot)
    total = xp.empty((BH, K), dtype=xp.float64)
    _launch(_decay_sums, "decay_sums", *_grid1(BH * K), gtot, pre, suf, total)
    return pre, suf, total


def _carried(xp: Any, Sloc: Any, logd: Any, S0: Any) -> Any:
    """``Sloc + exp(logd) S0`` per chunk (``S0 [B, H, K, V]`` or None: ``Sloc`` itself)."""
    if S0 is None:
        return Sloc
    BH, NT, K, V = Sloc.shape
    out = xp.empty_like(Sloc)
    _launch(_carry, "carry", *_grid1(BH * NT * K * V), Sloc, logd, S0.reshape(BH, K, V), out)
    return out


def _cumsum(xp: Any, x: Any, C: int, reverse: bool, base: Any = None) -> Any:
    """Inclusive (reverse: suffix) cumulative sum of ``x [B, T, H, K]`` along T plus ``base [B*H, K]`` (float64)."""
    B, T, H, K = x.shape
    NT = -(-T // C)
    tot = xp.empty((B * H, NT, K), dtype=xp.float64)
    _launch(_seg_sum, "seg_sum", (NT, B * H), _threads(K), x, tot, C)
    base = xp.zeros((B * H, K), dtype=xp.float64) if base is None else base
    _launch(_seg_carry, "seg_carry", *_grid1(B * H * K), tot, base, reverse)
    out = xp.empty((B, T, H, K), dtype=xp.float64)
    _launch(_seg_finish, "seg_finish", (NT, B * H), _threads(K), x, tot, out, C, reverse)
    return out


def _state64(xp: Any, x: Any, shape: tuple[int, ...], name: str) -> Any:
    """``x`` as a contiguous float64 ``shape`` array (None stays None)."""
    if x is None:
        return None
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(x.shape)}, expected {list(shape)}")
    return xp.ascontiguousarray(x, dtype=xp.float64)


def combine(xp: Any, a: Any, S_in: Any, S_local: Any, out: Any = None, is_log: bool = False) -> Any:
    """``diag(a) S_in + S_local`` per (b, h) (``a [B, H, K]``; ``exp(a)`` with ``is_log``), float64, into ``out``."""
    B, H, K, V = S_local.shape
    res = xp.empty((B, H, K, V), dtype=xp.float64) if out is None else out
    if B * H * K * V:
        _launch(_combine, "combine", *_grid1(B * H * K * V), a.reshape(B * H, K), S_in.reshape(B * H, K, V),
                S_local.reshape(B * H, K, V), res.reshape(B * H, K, V), is_log)
    return res


# ---------------------------------------------------------------------------------------------- GLA


class NumbaForward:
    """A float64 GLA forward whose local pass is done (the interface of :class:`hpczeco.gpu.gla.GLAForward`).

    ``local_final_state [B, H, K, V]``: the final state from a zero initial state; ``decay [B, H, K]``: ``exp`` of
    the gate summed over T (float64). :meth:`finish` writes ``o`` for an initial state. ``q, k, v, g``: contiguous
    float64 device arrays, T >= 1, ``C <= 64``; ``scale`` a float. Keeps references to the inputs.
    """

    impl = "numba"
    tensor_cores = False

    def __init__(self, xp: Any, q: Any, k: Any, v: Any, g: Any, scale: float, C: int):
        B, T, H, K = q.shape
        V = v.shape[3]
        self._xp, self._q, self._k, self._v, self.scale, self._C = xp, q, k, v, float(scale), int(C)
        self._b, gtot = _chunk_gates(xp, g, C)
        self._Sin, fin = _states(xp, k, v, self._b, gtot, C, 0, 1.0)
        self._pre, _, total = _decays(xp, gtot)
        self.local_final_state = fin.reshape(B, H, K, V)
        self.decay = xp.exp(total).reshape(B, H, K)

    def finish(self, initial_state: Any = None, output_final_state: bool = False) -> tuple[Any, Any]:
        """``(o [B, T, H, V], final_state [B, H, K, V] or None)`` with ``initial_state`` (float64, or None: zeros)."""
        xp, q, v = self._xp, self._q, self._v
        B, T, H, K = q.shape
        V = v.shape[3]
        NT = -(-T // self._C)
        initial_state = _state64(xp, initial_state, (B, H, K, V), "initial_state")
        Sn = _carried(xp, self._Sin, self._pre, initial_state)
        o = xp.empty((B, T, H, V), dtype=xp.float64)
        _launch(_fwd_output, "fwd_output", (NT, B * H), _threads(min(T, self._C) * max(V, min(T, self._C))),
                q, self._k, v, self._b, Sn, o, self.scale, self._C)
        if not output_final_state:
            return o, None
        if initial_state is None:
            return o, self.local_final_state.copy()
        return o, combine(xp, self.decay, initial_state, self.local_final_state)


class NumbaBackward:
    """A float64 GLA backward whose state passes are done (the interface of :class:`hpczeco.gpu.gla.GLABackward`).

    ``dh0_local [B, H, K, V]``: the gradient into the initial state when ``dht`` is zero; ``decay [B, H, K]``;
    ``local_final_state``: the final state from a zero initial state. :meth:`finish` writes the gradients.
    """

    impl = "numba"
    reused_forward = False

    def __init__(self, xp: Any, q: Any, k: Any, v: Any, g: Any, do: Any, scale: float, C: int):
        B, T, H, K = q.shape
        V = v.shape[3]
        self._xp, self._arrays, self.scale, self._C = xp, (q, k, v, g, do), float(scale), int(C)
        self._b, self._gtot = _chunk_gates(xp, g, C)
        self._Sin, fin = _states(xp, k, v, self._b, self._gtot, C, 0, 1.0)
        self._dH, U = _states(xp, q, do, self._b, self._gtot, C, 1, self.scale)
        self._pre, self._suf, total = _decays(xp, self._gtot)
        self.local_final_state = fin.reshape(B, H, K, V)
        self.dh0_local = U.reshape(B, H, K, V)
        self.decay = xp.exp(total).reshape(B, H, K)

    def finish(self, initial_state: Any = None, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` (float64) with this ``initial_state`` and ``dht`` (float64 or None: zeros)."""
        xp, C = self._xp, self._C
        q, k, v, g, do = self._arrays
        B, T, H, K = q.shape
        V = v.shape[3]
        NT = -(-T // C)
        initial_state = _state64(xp, initial_state, (B, H, K, V), "initial_state")
        dht = _state64(xp, dht, (B, H, K, V), "dht")
        Sn = _carried(xp, self._Sin, self._pre, initial_state)
        dHn = _carried(xp, self._dH, self._suf, dht)
        L = min(T, C)
        dq, dk, dG = (xp.empty((B, T, H, K), dtype=xp.float64) for _ in range(3))
        _launch(_bwd_dqdk, "bwd_dqdk", (NT, B * H), _threads(L * max(L, K)), q, k, v, self._b, self._gtot, do, Sn,
                dHn, dq, dk, dG, self.scale, C)
        dv = xp.empty((B, T, H, V), dtype=xp.float64)
        _launch(_bwd_dv, "bwd_dv", (NT, B * H), _threads(L * max(L, V)), q, k, self._b, self._gtot, do, dHn, dv,
                self.scale, C)
        base = None
        if dht is not None:  # dg at every position gets rowsum(S_T * dht)
            S_T = self.local_final_state if initial_state is None else combine(xp, self.decay, initial_state,
                                                                                self.local_final_state)
            base = xp.ascontiguousarray((S_T * dht).sum(axis=-1).reshape(B * H, K))
        dg = _cumsum(xp, dG, C, reverse=True, base=base)
        dh0 = self.dh0_local.copy() if dht is None else combine(xp, self.decay, dht, self.dh0_local)
        return dq, dk, dv, dg, dh0


# ---------------------------------------------------------------------------------------------- ZeCO glue


def decay_cumsum(xp: Any, g: Any, C: int) -> Any:
    """``G = cumsum(g, axis=1)`` (inclusive, float64, ``[B, T, H, K]``): the log decay from the slice start."""
    return _cumsum(xp, g, C, reverse=False)


def state_correction(o: Any, q: Any, G: Any, S_in: Any, scale: float) -> Any:
    """In place ``o += scale * (q * exp(G)) @ S_in`` per (b, h) (all float64); returns ``o``."""
    n = int(o.size)
    if n:
        _launch(_correction, "correction", *_grid1(n), o, q, G, S_in, float(scale))
    return o


def initial_state_grad(xp: Any, q: Any, g: Any, do: Any, scale: float, C: int) -> Any:
    """``U = scale * sum_t (q_t * exp(G_t))^T do_t``: ``[B, H, K, V]`` float64."""
    B, T, H, K = q.shape
    V = do.shape[3]
    b, gtot = _chunk_gates(xp, g, C)
    _, U = _states(xp, q, do, b, gtot, C, 1, float(scale))
    return U.reshape(B, H, K, V)
