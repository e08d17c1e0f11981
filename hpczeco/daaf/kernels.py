"""Blockwise CPU building blocks of DAAF and exact attention (numpy + BLAS, online softmax).

Arrays here are in head-major layout ``[B, H, T, D]`` (contiguous), positions are absolute token
positions, and every function returns the *unnormalised* online-softmax state
``(m, l, acc)`` = (row max ``[B, H, n]``, sum of ``exp(s - m)`` ``[B, H, n]``,
``sum exp(s - m) v`` ``[B, H, n, Dv]``) so that partial results over disjoint key sets can be merged
(across blocks, or across MPI ranks). :func:`finalize` turns a state into ``acc / l``.

Nothing here allocates an O(T^2) mask: a score block is at most ``rows x key_block``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["State", "new_state", "merge_scores", "finalize", "causal_rows", "local_rows", "key_block_for"]

#: elements of one score block [B, H, rows, keys] (about 1 MB in float32: cache-sized)
SCORE_BLOCK_ELEMS = 1 << 18


class State:
    """Online-softmax accumulator for ``n`` query rows: ``m, l: [B, H, n]``, ``acc: [B, H, n, Dv]``."""

    __slots__ = ("m", "l", "acc")

    def __init__(self, m: np.ndarray, l: np.ndarray, acc: np.ndarray):
        self.m, self.l, self.acc = m, l, acc


def new_state(B: int, H: int, n: int, Dv: int, dtype) -> State:
    return State(np.full((B, H, n), -np.inf, dtype), np.zeros((B, H, n), dtype), np.zeros((B, H, n, Dv), dtype))


def merge_scores(st: State, s: np.ndarray, v: np.ndarray) -> None:
    """Fold scores ``s`` ``[B, H, n, k]`` (scaled; ``-inf`` where not allowed) and values ``v``
    ``[B, H, k, Dv]`` into ``st`` in place. ``s`` is overwritten (it becomes the probabilities).
    Rows with no allowed key so far keep ``m = -inf``."""
    if s.shape[-1] == 0:
        return
    m_new = np.maximum(st.m, s.max(axis=-1))
    m_safe = np.where(np.isneginf(m_new), 0.0, m_new).astype(s.dtype, copy=False)
    alpha = np.exp(st.m - m_safe)
    s -= m_safe[..., None]
    np.exp(s, out=s)
    st.l *= alpha
    st.l += s.sum(axis=-1)
    st.acc *= alpha[..., None]
    st.acc += s @ v
    st.m = m_new


def finalize(st: State) -> np.ndarray:
    """``acc / l`` ``[B, H, n, Dv]`` (every row must have had at least one allowed key)."""
    return st.acc / st.l[..., None]


def key_block_for(B: int, H: int, n: int, minimum: int = 256) -> int:
    return max(minimum, SCORE_BLOCK_ELEMS // max(1, B * H * n))


def causal_rows(
    qr: np.ndarray,
    qpos: np.ndarray,
    kh: np.ndarray,
    vh: np.ndarray,
    k_pos0: int,
    scale: float,
    st: State | None = None,
    key_block: int | None = None,
) -> State:
    """Rows ``qr`` ``[B, H, n, D]`` at sorted positions ``qpos`` ``[n]`` against every key of ``kh``/``vh``
    ``[B, H, Tk, *]`` (positions ``k_pos0 + j``) with position ``<= qpos`` (full causal rows)."""
    B, H, n, _ = qr.shape
    Tk = kh.shape[2]
    if st is None:
        st = new_state(B, H, n, vh.shape[-1], qr.dtype)
    if n == 0 or Tk == 0:
        return st
    stop = min(Tk, int(qpos[-1]) - k_pos0 + 1)  # keys beyond the last row are never allowed
    if stop <= 0:
        return st
    kb = key_block or key_block_for(B, H, n)
    first_masked = int(qpos[0]) - k_pos0 + 1  # keys j < first_masked are allowed for every row
    qs = qr * np.asarray(scale, dtype=qr.dtype)
    for a in range(0, stop, kb):
        b = min(stop, a + kb)
        s = qs @ kh[:, :, a:b].swapaxes(-1, -2)
        if b > first_masked:
            jpos = k_pos0 + np.arange(a, b)
            np.copyto(s, -np.inf, where=jpos[None, :] > qpos[:, None])
        merge_scores(st, s, vh[:, :, a:b])
    return st


def local_rows(
    qr: np.ndarray,
    qpos: np.ndarray,
    kh: np.ndarray,
    vh: np.ndarray,
    k_pos0: int,
    kglobal: np.ndarray,
    kg: np.ndarray,
    vg: np.ndarray,
    gpos: np.ndarray,
    local_window: int,
    scale: float,
    key_block: int | None = None,
) -> State:
    """Non-global query rows ``qr`` ``[B, H, n, D]`` at sorted positions ``qpos`` ``[n]`` (spanning less
    than about one block) under the DAAF rule.

    Local span: keys of ``kh``/``vh`` (positions ``k_pos0 + j``; ``kglobal`` ``[Tk]`` marks key-region
    keys) in ``[max(0, qpos[0] - W), qpos[-1]]``: allowed where ``j <= t`` and (``t - j <= W`` or
    ``kglobal[j]``). The span must lie inside ``kh``. Prefix: the key-region keys ``kg``/``vg``
    ``[B, H, G, *]`` at sorted positions ``gpos`` strictly before the span start (all allowed).
    """
    B, H, n, _ = qr.shape
    W = local_window
    st = new_state(B, H, n, vh.shape[-1], qr.dtype)
    if n == 0:
        return st
    lo = max(0, int(qpos[0]) - W)
    hi = int(qpos[-1]) + 1
    a, b = lo - k_pos0, hi - k_pos0
    if a < 0 or b > kh.shape[2]:
        raise ValueError(f"local span [{lo}, {hi}) is not inside the key array [{k_pos0}, {k_pos0 + kh.shape[2]})")
    # key-region prefix first (positions < lo): all allowed
    npre = int(np.searchsorted(gpos, lo, side="left"))
    kb = key_block or key_block_for(B, H, n)
    qs = qr * np.asarray(scale, dtype=qr.dtype)
    for c in range(0, npre, kb):
        d = min(npre, c + kb)
        merge_scores(st, qs @ kg[:, :, c:d].swapaxes(-1, -2), vg[:, :, c:d])
    # the local span, with the band | key-region mask
    s = qs @ kh[:, :, a:b].swapaxes(-1, -2)
    jpos = np.arange(lo, hi)
    dist = qpos[:, None] - jpos[None, :]
    allowed = (dist >= 0) & ((dist <= W) | kglobal[a:b][None, :])
    np.copyto(s, -np.inf, where=~allowed)
    merge_scores(st, s, vh[:, :, a:b])
    return st
