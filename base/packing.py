"""Documents packed along T (``cu_seqlens``, as flash-linear-attention and FlashAttention) run as padded batches
of a plain per-sequence function, on any array module (numpy or CuPy). Knows nothing of attention: it moves
token rows and per-document state rows, and calls what it is given.

``cu_seqlens [N + 1]`` (starting at 0, non-decreasing, ending at T; ``B == 1``) cuts the tokens of arrays
``[1, T, H, D]`` into N documents, document ``i`` being tokens ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1``
(length 0 allowed); per-document states are ``[N, ...]``.

Buckets: the documents are grouped by length, and each group runs as one call of the plain function on a
padded copy ``[n, P, H, D]`` (``n`` documents, ``P`` the longest of them; padding rows zero). Documents sorted by
length, longest first, join the current bucket while the work each adds (its padding ``w(P) - w(L)``, ``w(L)``
its cost alone: ``L`` rounded up to whole chunks, plus the cost of copying it) stays below what one call costs
(``MERGE_TOKENS``): short documents share a call (and its threads), long ones run alone. A bucket of one document
is a view of the input (no copy), documents all of one length are one reshape (no copy), other buckets gather
their tokens (host: a slice copy per document and array; device: one indexed copy per array) and scatter the
outputs back likewise. The documents of
length 0 form one bucket of ``P = 0`` (run like the others, so that results keep the plain function's dtypes).
Where zero padding is a no-op of the function (gated linear attention: ``q = k = v = g = 0`` leave the state
unchanged, give ``o = 0``, and ``do = 0`` adds no gradient), the results are exactly each document alone.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backend import get_array_module, is_device_array

__all__ = ["MERGE_TOKENS", "COPY_COST", "COPY_COST_DEVICE", "Bucket", "check_cu_seqlens", "plan_buckets",
           "packed_forward", "packed_backward"]

ForwardRunner = Callable[..., tuple[Any, Any]]  # (x..., states, poll) -> (y [n, P, ...], final [n, ...])
BackwardRunner = Callable[..., tuple[Any, ...]]  # (x..., states, dstates, poll) -> (grads [n, P, ...]..., d0 [n, ...])
Poll = Callable[[], Any] | None

def check_cu_seqlens(cu_seqlens: Any, B: int, T: int | None = None) -> np.ndarray:
    """Packed documents (flash-linear-attention's / FlashAttention's ``cu_seqlens``): an integer array ``[N + 1]``
    (numpy, CuPy -- copied to the host -- or a sequence of ints) with ``cu_seqlens[0] == 0``, non-decreasing,
    ``N >= 1``, ending at ``T`` (when ``T`` is given; the ZeCO layer checks the global end collectively), and
    ``B == 1`` (the documents are packed along T). Document ``i`` is the tokens ``cu_seqlens[i] .. cu_seqlens[i+1]
    - 1`` (length 0 allowed). Returns the offsets as a host ``int64`` array. Raises ``TypeError`` (not integers) or
    ``ValueError``, naming ``cu_seqlens``. Local."""
    if is_device_array(cu_seqlens):
        cu_seqlens = cu_seqlens.get()
    if isinstance(cu_seqlens, np.ndarray):
        cu = cu_seqlens
    elif isinstance(cu_seqlens, (list, tuple)):
        if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in cu_seqlens):
            raise TypeError("cu_seqlens must hold integers (document offsets [N + 1])")
        cu = np.asarray(cu_seqlens, dtype=np.int64)
    else:
        raise TypeError(f"cu_seqlens must be an integer array [N + 1] (numpy, cupy or a list), got "
                        f"{type(cu_seqlens).__name__}")
    if cu.dtype.kind not in "iu":
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries (N documents), got shape {list(cu.shape)}")
    cu = cu.astype(np.int64)
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (documents packed along T), got B={B}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    steps = np.diff(cu)
    if (steps < 0).any():
        i = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"cu_seqlens must be non-decreasing, got {int(cu[i])} then {int(cu[i + 1])} at index {i}")
    if T is not None and cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at the sequence length T={T}, got {int(cu[-1])}")
    return cu


MERGE_TOKENS = 64  # extra work (tokens) worth one call saved: a call costs about 64 tokens (one chunk) of work
COPY_COST = 0.05  # work (tokens) per token of a gather copy, host: one memcpy per array and document
COPY_COST_DEVICE = 0.02  # ... on a device: one indexed copy kernel per array for the whole bucket


@dataclass(frozen=True)
class Bucket:
    """Documents run together: ``docs`` (indices, ascending), padded to ``length`` tokens (their longest)."""

    docs: np.ndarray
    length: int


def _work(L: int, C: int) -> int:
    """Tokens of work of a document of ``L`` tokens run alone: whole chunks (one short chunk below ``C``)."""
    return L if L <= C else -(-L // C) * C


def plan_buckets(cu_seqlens: np.ndarray, chunk_size: int, copy_cost: float = COPY_COST) -> list[Bucket]:
    """The buckets of the documents of ``cu_seqlens`` (host int64 ``[N + 1]``): the non-empty documents longest
    first; a document joins the current bucket (of longest document ``P``) while what it adds -- its padding
    ``w(P) - w(L)`` plus ``copy_cost L`` for gathering it (and ``copy_cost P`` for the first document, once, when
    the bucket stops being a view) -- is at most ``MERGE_TOKENS``, the work one call costs. Then one bucket of the
    empty documents (``length`` 0), if any. Every document is in exactly one bucket, so long documents run alone
    (views, no copy) and short ones share a call."""
    lengths = np.diff(cu_seqlens)
    nonempty = np.flatnonzero(lengths > 0)
    order = nonempty[np.argsort(-lengths[nonempty], kind="stable")]
    sizes = [int(L) for L in lengths[order]]
    buckets, i = [], 0
    while i < len(order):
        P = sizes[i]
        wP, j = _work(P, chunk_size), i + 1
        while j < len(order):
            L = sizes[j]
            extra = wP - _work(L, chunk_size) + copy_cost * (L + (P if j == i + 1 else 0))
            if extra > MERGE_TOKENS:
                break
            j += 1
        buckets.append(Bucket(np.sort(order[i:j]), P))
        i = j
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        buckets.append(Bucket(empty, 0))
    return buckets


class _Layout:
    """How a bucket's rows map to the packed tokens: a view (one document, or all of one length), or a gather
    into a zero-padded batch and a scatter back -- on the host one slice copy per document (memcpy-like), on a
    device one indexed copy (``tok`` packed positions, ``jj, tt`` row and column in the bucket)."""

    def __init__(self, xp: Any, cu: np.ndarray, bucket: Bucket, all_equal: bool):
        self.xp, self.n, self.P = xp, len(bucket.docs), bucket.length
        self.bos = int(cu[bucket.docs[0]])
        self.kind = "reshape" if all_equal else ("slice" if self.n == 1 or self.P == 0 else "gather")
        if self.kind == "gather":
            starts, lens = cu[bucket.docs], np.diff(cu)[bucket.docs]
            self.spans = [(int(a), int(L)) for a, L in zip(starts, lens)]
            self.host = xp is np
            if not self.host:
                mask = np.arange(self.P)[None, :] < lens[:, None]
                jj, tt = np.nonzero(mask)
                tok = starts[jj] + tt
                self.jj, self.tt, self.tok = (xp.asarray(a.astype(np.int64)) for a in (jj, tt, tok))

    def rows(self, x: Any) -> Any:
        """``x [1, T, H, D]`` -> the bucket's ``[n, P, H, D]`` (padding zeros)."""
        if self.kind == "reshape":
            return x.reshape((self.n, self.P) + tuple(x.shape[2:]))
        if self.kind == "slice":
            if self.P == 0:
                return self.xp.zeros((self.n, 0) + tuple(x.shape[2:]), dtype=x.dtype)
            return x[:, self.bos : self.bos + self.P]
        out = self.xp.zeros((self.n, self.P) + tuple(x.shape[2:]), dtype=x.dtype)
        if self.host:
            for j, (a, L) in enumerate(self.spans):
                out[j, :L] = x[0, a : a + L]
        else:
            out[self.jj, self.tt] = x[0, self.tok]
        return out

    def put(self, out: Any, y: Any) -> None:
        """Write the bucket's ``y [n, P, H, D]`` into the packed ``out [1, T, H, D]`` (padding dropped)."""
        if self.P == 0:
            return
        if self.kind == "reshape":
            out[...] = y.reshape(out.shape)
        elif self.kind == "slice":
            out[:, self.bos : self.bos + self.P] = y
        elif self.host:
            for j, (a, L) in enumerate(self.spans):
                out[0, a : a + L] = y[j, :L]
        else:
            out[0, self.tok] = y[self.jj, self.tt]


def _layouts(xp: Any, cu: np.ndarray, chunk_size: int) -> list[tuple[Bucket, _Layout]]:
    lengths = np.diff(cu)
    all_equal = len(lengths) > 1 and bool(lengths[0] > 0) and bool((lengths == lengths[0]).all())
    if all_equal:
        buckets = [Bucket(np.arange(len(lengths)), int(lengths[0]))]
    else:
        buckets = plan_buckets(cu, chunk_size, COPY_COST if xp is np else COPY_COST_DEVICE)
    # non-empty buckets first: their results fix the output dtypes before the empty documents' bucket
    return [(b, _Layout(xp, cu, b, all_equal)) for b in buckets]


def _state_rows(x: Any, docs: np.ndarray, xp: Any) -> Any:
    if x is None:
        return None
    if len(docs) and int(docs[-1]) - int(docs[0]) == len(docs) - 1:
        return x[int(docs[0]) : int(docs[-1]) + 1]  # consecutive documents: a view
    return x[xp.asarray(docs)]


def packed_forward(run: ForwardRunner, q: Any, k: Any, v: Any, g: Any, cu: np.ndarray, initial_state: Any = None,
                   chunk_size: int = 64, poll: Poll = None) -> tuple[Any, Any]:
    """``(o [1, T, H, V], final [N, H, K, V])`` of the packed documents ``cu`` (host int64 ``[N + 1]``, checked),
    by buckets (module docstring); ``run(q, k, v, g, initial_state, poll)`` is the plain forward of a batch
    (``q, k, g [n, P, H, K]``, ``v [n, P, H, V]``, ``initial_state [n, H, K, V]`` rows or None) returning
    ``(o, final)``; ``chunk_size`` is its chunk length (for the bucket costs). No checks."""
    xp = get_array_module(q, initial_state)
    T, H, V = q.shape[1], q.shape[2], v.shape[3]
    o = final = None
    for bucket, lay in _layouts(xp, cu, chunk_size):
        ob, fb = run(lay.rows(q), lay.rows(k), lay.rows(v), lay.rows(g), _state_rows(initial_state, bucket.docs, xp),
                     poll)  # fmt: skip
        if o is None:
            o = xp.empty((1, T, H, V), dtype=ob.dtype)
            final = xp.empty((len(cu) - 1,) + tuple(fb.shape[1:]), dtype=fb.dtype)
        lay.put(o, ob)
        final[xp.asarray(bucket.docs)] = fb
    return o, final


def packed_backward(run: BackwardRunner, q: Any, k: Any, v: Any, g: Any, do: Any, cu: np.ndarray,
                    initial_state: Any = None, dht: Any = None, chunk_size: int = 64,
                    poll: Poll = None) -> tuple[Any, Any, Any, Any, Any]:
    """``(dq, dk, dv, dg [1, T, H, *], dh0 [N, H, K, V])`` of the packed documents, by buckets as
    :func:`packed_forward`; ``run(q, k, v, g, do, initial_state, dht, poll)`` is the plain backward of a batch.
    No checks."""
    xp = get_array_module(q, initial_state, dht)
    grads = dh0 = None
    for bucket, lay in _layouts(xp, cu, chunk_size):
        docs = bucket.docs
        res = run(*(lay.rows(x) for x in (q, k, v, g, do)), _state_rows(initial_state, docs, xp),
                  _state_rows(dht, docs, xp), poll)  # fmt: skip
        if grads is None:
            grads = [xp.empty(x.shape, dtype=r.dtype) for x, r in zip((q, k, v, g), res[:4])]
            dh0 = xp.empty((len(cu) - 1,) + tuple(res[4].shape[1:]), dtype=res[4].dtype)
        for out, r in zip(grads, res[:4]):
            lay.put(out, r)
        dh0[xp.asarray(docs)] = res[4]
    return (*grads, dh0)
