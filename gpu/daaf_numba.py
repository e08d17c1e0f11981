"""Numba CUDA kernels for DAAF planning on the device.

- :func:`window_entropy`: the entropy scan. Windows as ``hpczeco.daaf.window_starts`` (start at
  ``0, stride, 2 stride, ...`` while they fit, plus one window aligned to the end if the last stops
  short); score = Shannon entropy (bits) of the window's token-id histogram / ``log2(min(window,
  vocab_size))`` (``vocab_size=None``: ``log2(window)``), optional Miller-Madow term, clipped to
  ``[0, 1]`` -- the CPU planner's rule. One block per window; no vocabulary-sized histogram: each
  position counts the equal ids of its window (shared-memory chunks of ``ENTROPY_CHUNK`` ids), and
  ``H = -sum_p log2(c_p / N) / N``, ``distinct = sum_p 1 / c_p``.
- :func:`windows_to_mask`: key windows -> per-token key-region mask ``[T]`` (uint8).
- :func:`mask_to_index`: mask -> ``global_idx`` int32 ``[G]`` (sorted) and ``n_global_before``
  int32 ``[T + 1]`` (block counts, a scan of the counts, a block-local scan and scatter).
- :func:`threshold_plan`: tokens -> the threshold rule's arrays, all on the device.

The planner the attention API uses is :mod:`hpczeco.daaf.device_planner` (the two CuPy RawKernels of
:mod:`hpczeco.gpu.daaf_plan`, one host read); these
kernels (several launches and host reads per plan) stay as its former version, for comparison.

Arrays: CuPy arrays (launched on CuPy's current stream), or numpy arrays (copied by Numba; this is
how the tests run them under the CUDA simulator, ``NUMBA_ENABLE_CUDASIM=1``). Knows nothing of MPI.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from ..base.checks import check_int
from ..base.windows import window_starts
from .numba_util import SIMULATOR, cuda, dev, is_cupy, stream

__all__ = ["window_entropy", "windows_to_mask", "mask_to_index", "threshold_plan", "window_starts", "SIMULATOR"]

_CACHE = not SIMULATOR
ENTROPY_CHUNK = 1024  # window ids staged in shared memory at a time
MAX_THREADS = 256  # largest block of the entropy and scan kernels (power of two)
SCAN_ITEMS = 4  # mask entries per thread in the compaction
ENTROPY_THREADS = 128 if not SIMULATOR else 16
SCAN_THREADS = 256 if not SIMULATOR else 16


@cuda.jit(cache=_CACHE)
def _entropy_kernel(tok, starts, window, out_h, out_m):
    # block w: out_h[w] = plug-in entropy (bits) of tok[starts[w] : starts[w] + window], out_m[w] = distinct ids
    w = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(ENTROPY_CHUNK, dtype=numba.int64)
    red_h = cuda.shared.array(MAX_THREADS, dtype=numba.float64)
    red_m = cuda.shared.array(MAX_THREADS, dtype=numba.float64)
    s0 = starts[w]
    acc_h = 0.0
    acc_m = 0.0
    n_outer = (window + nt - 1) // nt
    for o in range(n_outer):  # the same count on every thread: the barriers below line up
        p = o * nt + tid
        mine = numba.int64(-1)
        if p < window:
            mine = numba.int64(tok[s0 + p])
        c = 0
        for c0 in range(0, window, ENTROPY_CHUNK):
            n = min(ENTROPY_CHUNK, window - c0)
            cuda.syncthreads()
            for x in range(tid, n, nt):
                buf[x] = tok[s0 + c0 + x]
            cuda.syncthreads()
            for x in range(n):
                if buf[x] == mine:
                    c += 1
        if p < window:
            acc_h -= math.log2(c / window) / window
            acc_m += 1.0 / c
    red_h[tid] = acc_h
    red_m[tid] = acc_m
    cuda.syncthreads()
    step = nt // 2
    while step > 0:
        if tid < step:
            red_h[tid] += red_h[tid + step]
            red_m[tid] += red_m[tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        out_h[w] = red_h[0]
        out_m[w] = red_m[0]


@cuda.jit(cache=_CACHE)
def _windows_mask_kernel(starts, chosen, window, mask):
    # block w marks its window's tokens when chosen (several windows may write the same 1: benign)
    w = cuda.blockIdx.x
    if chosen[w] != 0:
        s0 = starts[w]
        for x in range(cuda.threadIdx.x, window, cuda.blockDim.x):
            mask[s0 + x] = 1


@cuda.jit(device=True)
def _count_items(mask, n, base):
    # set entries of mask[base : base + SCAN_ITEMS] (within [0, n)): one thread's share of the compaction
    c = 0
    for i in range(SCAN_ITEMS):
        x = base + i
        if x < n and mask[x] != 0:
            c += 1
    return c


@cuda.jit(cache=_CACHE)
def _count_kernel(mask, n, counts):
    # block b covers [b * nt * SCAN_ITEMS, (b + 1) * nt * SCAN_ITEMS): counts[b] = its set entries
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    red = cuda.shared.array(MAX_THREADS, dtype=numba.int32)
    red[tid] = _count_items(mask, n, (b * nt + tid) * SCAN_ITEMS)
    cuda.syncthreads()
    step = nt // 2
    while step > 0:
        if tid < step:
            red[tid] += red[tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        counts[b] = red[0]


@cuda.jit(cache=_CACHE)
def _scan_counts_kernel(counts, nblocks, offsets, before, n):
    # one thread: exclusive scan of the block counts (a few hundred at most); before[n] = total
    if cuda.grid(1) == 0:
        run = 0
        for b in range(nblocks):
            offsets[b] = run
            run += counts[b]
        offsets[nblocks] = run
        before[n] = run


@cuda.jit(cache=_CACHE)
def _scatter_kernel(mask, n, offsets, idx, before):
    # block-local inclusive scan of the per-thread counts (Hillis-Steele), then each thread writes
    # n_global_before for its entries and the positions of its set entries
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sh = cuda.shared.array(MAX_THREADS, dtype=numba.int32)
    base = (b * nt + tid) * SCAN_ITEMS
    c = _count_items(mask, n, base)
    sh[tid] = c
    cuda.syncthreads()
    d = 1
    while d < nt:
        add = 0
        if tid >= d:
            add = sh[tid - d]
        cuda.syncthreads()
        sh[tid] += add
        cuda.syncthreads()
        d *= 2
    run = offsets[b] + sh[tid] - c
    for i in range(SCAN_ITEMS):
        x = base + i
        if x < n:
            before[x] = run
            if mask[x] != 0:
                idx[run] = x
                run += 1


# ------------------------------------------------------------------------------------------ wrappers


def _xp(x: Any):
    if is_cupy(x):
        import cupy  # noqa: PLC0415

        return cupy
    return np


def _pow2(n: int, name: str) -> int:
    if not (isinstance(n, (int, np.integer)) and 1 <= n <= MAX_THREADS and n & (n - 1) == 0):
        raise ValueError(f"{name} must be a power of two in [1, {MAX_THREADS}], got {n}")
    return int(n)


def _tokens(tokens: Any):
    xp = _xp(tokens)
    tok = tokens if is_cupy(tokens) else np.asarray(tokens)
    if tok.dtype.kind not in "iu":
        raise TypeError(f"tokens must hold int token ids, got dtype {tok.dtype}")
    if tok.ndim != 1 or tok.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D [T] array, got shape {tuple(tok.shape)}")
    return xp.ascontiguousarray(tok, dtype=np.int64), xp


def window_entropy(tokens: Any, window: int = 512, stride: int | None = None, vocab_size: int | None = None,
                   bias_correction: str = "none", threads: int | None = None):
    """Normalised window entropies ``[n_windows]`` (float64, same array kind as ``tokens [T]``).

    The CPU planner's ``window_entropy`` on the device (rule in the module docstring).
    ``ValueError`` if ``window`` exceeds the text or a token id is negative or ``>= vocab_size``.
    """
    tok, xp = _tokens(tokens)
    window = check_int("window", window, 1)
    if bias_correction not in ("none", "miller-madow"):
        raise ValueError(f"bias_correction must be 'none' or 'miller-madow', got {bias_correction!r}")
    lo, hi = int(tok.min()), int(tok.max())
    if lo < 0:
        raise ValueError(f"tokens must be non-negative ids, got min {lo}")
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, 1)
        if hi >= vocab_size:
            raise ValueError(f"tokens holds id {hi} >= vocab_size ({vocab_size})")
    starts_h = window_starts(int(tok.size), window, stride)
    nt = _pow2(threads or ENTROPY_THREADS, "threads")
    starts = xp.asarray(starts_h)
    h = xp.zeros(len(starts_h), dtype=np.float64)
    m = xp.zeros(len(starts_h), dtype=np.float64)
    _entropy_kernel[len(starts_h), nt, stream(tok)](dev(tok), dev(starts), window, dev(h), dev(m))
    if bias_correction == "miller-madow":
        h = h + (xp.rint(m) - 1.0) / (2.0 * window * math.log(2.0))
    cap = window if vocab_size is None else min(window, vocab_size)
    if cap <= 1:
        return xp.zeros_like(h)
    return xp.clip(h / math.log2(cap), 0.0, 1.0)


def windows_to_mask(T: int, starts: Any, chosen: Any, window: int, threads: int | None = None):
    """uint8 ``[T]``: 1 on every token of a chosen window (``starts``/``chosen`` ``[n_windows]``).

    The result is a CuPy array when ``chosen`` is one, else numpy."""
    xp = _xp(chosen)
    T = check_int("T", T, 1)
    window = check_int("window", window, 1)
    st = xp.ascontiguousarray(xp.asarray(starts), dtype=np.int64)
    ch = xp.ascontiguousarray(xp.asarray(chosen)).astype(np.uint8)
    if st.shape != ch.shape or st.ndim != 1:
        raise ValueError(f"starts and chosen must be 1-D of one length, got {tuple(st.shape)} and {tuple(ch.shape)}")
    if st.size and (int(st.min()) < 0 or int(st.max()) + window > T):
        raise ValueError(f"windows must lie in [0, {T}) (starts + window <= T)")
    mask = xp.zeros(T, dtype=np.uint8)
    if st.size:
        nt = _pow2(threads or SCAN_THREADS, "threads")
        _windows_mask_kernel[int(st.size), nt, stream(ch)](dev(st), dev(ch), window, dev(mask))
    return mask


def mask_to_index(mask: Any, threads: int | None = None):
    """``(global_idx int32 [G], n_global_before int32 [T + 1])`` of a key-region mask ``[T]`` (bool/uint8).

    ``global_idx`` lists the set positions in ascending order; ``n_global_before[i]`` counts set
    entries at positions ``< i`` (``hpczeco.daaf.plan_arrays``' arrays, computed on the device)."""
    xp = _xp(mask)
    mk = mask if is_cupy(mask) else np.asarray(mask)
    if mk.ndim != 1 or mk.size == 0:
        raise ValueError(f"mask must be a non-empty 1-D [T] array, got shape {tuple(mk.shape)}")
    if mk.dtype != np.bool_ and mk.dtype.kind not in "iu":
        raise TypeError(f"mask must be bool or integer, got dtype {mk.dtype}")
    mk = xp.ascontiguousarray(mk).astype(np.uint8, copy=False) if mk.dtype == np.bool_ else (mk != 0).astype(np.uint8)
    T = int(mk.size)
    nt = _pow2(threads or SCAN_THREADS, "threads")
    per = nt * SCAN_ITEMS
    nb = (T + per - 1) // per
    counts = xp.zeros(nb, dtype=np.int32)
    offsets = xp.zeros(nb + 1, dtype=np.int32)
    before = xp.zeros(T + 1, dtype=np.int32)
    s = stream(mk)
    _count_kernel[nb, nt, s](dev(mk), T, dev(counts))
    _scan_counts_kernel[1, 1, s](dev(counts), nb, dev(offsets), dev(before), T)
    G = int(offsets[nb])  # one synchronisation: the size of global_idx
    idx = xp.zeros(max(G, 1), dtype=np.int32)
    _scatter_kernel[nb, nt, s](dev(mk), T, dev(offsets), dev(idx), dev(before))
    return idx[:G], before


def threshold_plan(tokens: Any, window: int = 512, threshold: float = 0.8, local_window: int = 128, *,
                   stride: int | None = None, vocab_size: int | None = None) -> dict:
    """The planner's threshold rule on the device: windows with score ``>= threshold`` are key windows.

    Returns ``{"weights", "selected", "window_starts", "global_mask" (bool [T]), "global_idx",
    "n_global_before", "local_window", "T"}`` (device arrays for CuPy ``tokens``). No fallback policies
    (those live in ``hpczeco.daaf.plan``); a text shorter than ``window`` is planned dense.
    """
    tok, xp = _tokens(tokens)
    T = int(tok.size)
    if T < window:
        gm = xp.ones(T, dtype=np.uint8)
        weights = window_entropy(tok, T, None, vocab_size)
        starts = np.zeros(1, np.int64)
        sel = xp.ones(1, dtype=bool)
    else:
        starts = window_starts(T, window, stride)
        weights = window_entropy(tok, window, stride, vocab_size)
        sel = weights >= threshold
        gm = windows_to_mask(T, starts, sel, window)
    gidx, before = mask_to_index(gm)
    return {"T": T, "local_window": int(local_window), "window_starts": starts, "weights": weights,
            "selected": sel, "global_mask": gm.astype(bool), "global_idx": gidx, "n_global_before": before}
