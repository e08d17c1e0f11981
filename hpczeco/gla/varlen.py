"""Packed sequences (``cu_seqlens``) for the chunked GLA, on numpy and CuPy arrays alike.

As flash-linear-attention's ``chunk_gla(..., cu_seqlens=...)``: ``B == 1`` and ``cu_seqlens [N + 1]`` (starting
at 0, non-decreasing, ending at T) cuts the T tokens into N documents, document ``i`` being tokens
``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` (length 0 allowed). The state is reset at every document start: each
document is run alone, with its own initial state ``initial_state[i]`` and final state ``final[i]`` (states
``[N, H, K, V]``; ``dht`` and ``dh0`` likewise). Layout ``q, k, g: [1, T, H, K]``, ``v, o, do: [1, T, H, V]``.

Approach (the same on both backends): the documents are grouped into *buckets* of similar length, and each
bucket runs as one batched call of the plain chunked GLA on a padded copy ``[n, P, H, *]`` (``n`` documents,
``P`` the longest of them). Padding tokens ``q = k = v = g = 0`` (and ``do = 0``) leave the state unchanged
(decay ``exp(0) = 1``, no ``k^T v``), so row ``j``'s final state is its document's, the padding's outputs are
dropped and the real tokens' gradients are exact; nothing inside the chunk kernels changes. Buckets: documents
sorted by length, longest first, join the current bucket while its padded work ``n w(P)`` stays within
``1 + PAD_WASTE`` times ``sum w(L_i)``, with ``w(L)`` a document's cost alone (``L`` rounded up to whole
chunks); short documents so share one call (and its threads over ``n H`` sequences) instead of paying a call
each. Copies: a bucket of one document is a view of the input (no copy), all documents of one length are one
reshape (no copy), other buckets gather their tokens with one indexed copy per array and scatter the outputs
back with one. Documents of length 0 go through the same call with ``T = 0`` (final state = initial state,
``dh0 = dht``), so every result has the dtype of the plain path.

On CuPy arrays this is per-bucket calls of :func:`hpczeco.gpu.gla.chunk_gla` / ``chunk_gla_bwd`` (the kernels do
not reset the state at document starts themselves); ``cu_seqlens`` is read on the host (one small copy).

Runners: :func:`chunk_gla_varlen` / :func:`chunk_gla_varlen_bwd` (what :func:`hpczeco.gla.chunk_gla` calls with
``cu_seqlens``) check everything first; with ``check_values=True`` host buckets run the fused
:func:`hpczeco.gla.chunk_gla` (which scans its values), with ``check_values=False`` (inputs validated by the
caller, e.g. the ZeCO layer) every bucket runs the phase-split forms of :mod:`hpczeco.gla.protocol` without value
scans, so a NaN propagates and nothing raises on one rank only. :func:`packed_forward` / :func:`packed_backward`
are the bucketing itself over any runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base.backend import get_array_module, is_device_array
from ._runner import Poll
from .validate import check_chunk_size, check_cu_seqlens, check_document_states, check_scale, validate_gla_inputs

__all__ = [
    "PAD_WASTE",
    "Bucket",
    "plan_buckets",
    "packed_forward",
    "packed_backward",
    "chunk_gla_varlen",
    "chunk_gla_varlen_bwd",
    "check_varlen_call",
]

PAD_WASTE = 0.125  # padded work a bucket may add over its documents' own work (fraction)

ForwardRunner = Callable[..., tuple[Any, Any]]  # (q, k, v, g, initial_state, poll) -> (o, final)
BackwardRunner = Callable[..., tuple[Any, Any, Any, Any, Any]]  # (q, k, v, g, do, initial_state, dht, poll)


@dataclass(frozen=True)
class Bucket:
    """Documents run together: ``docs`` (indices, ascending), padded to ``length`` tokens (their longest)."""

    docs: np.ndarray
    length: int


def _work(L: int, C: int) -> int:
    """Tokens of work of a document of ``L`` tokens run alone: whole chunks (one short chunk below ``C``)."""
    return L if L <= C else -(-L // C) * C


def plan_buckets(cu_seqlens: np.ndarray, chunk_size: int) -> list[Bucket]:
    """The buckets of the documents of ``cu_seqlens`` (host int64 ``[N + 1]``): non-empty documents longest first,
    each bucket's padded work at most ``1 + PAD_WASTE`` times its documents' own; then one bucket of the empty
    documents (``length`` 0), if any. Every document is in exactly one bucket."""
    lengths = np.diff(cu_seqlens)
    nonempty = np.flatnonzero(lengths > 0)
    order = nonempty[np.argsort(-lengths[nonempty], kind="stable")]
    works = [_work(int(L), chunk_size) for L in lengths[order]]
    buckets, i = [], 0
    while i < len(order):
        j, acc = i + 1, works[i]
        while j < len(order) and (j - i + 1) * works[i] <= (1 + PAD_WASTE) * (acc + works[j]):
            acc += works[j]
            j += 1
        buckets.append(Bucket(np.sort(order[i:j]), int(lengths[order[i]])))
        i = j
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        buckets.append(Bucket(empty, 0))
    return buckets


class _Layout:
    """How a bucket's rows map to the packed tokens: a view (one document, or all of one length), or an
    index gather/scatter (``tok`` packed positions, ``jj, tt`` row and column in the padded bucket)."""

    def __init__(self, xp: Any, cu: np.ndarray, bucket: Bucket, all_equal: bool):
        self.xp, self.n, self.P = xp, len(bucket.docs), bucket.length
        self.bos = int(cu[bucket.docs[0]])
        self.kind = "reshape" if all_equal else ("slice" if self.n == 1 or self.P == 0 else "gather")
        if self.kind == "gather":
            starts, lens = cu[bucket.docs], np.diff(cu)[bucket.docs]
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
        else:
            out[0, self.tok] = y[self.jj, self.tt]


def _layouts(xp: Any, cu: np.ndarray, chunk_size: int) -> list[tuple[Bucket, _Layout]]:
    lengths = np.diff(cu)
    all_equal = len(lengths) > 1 and bool(lengths[0] > 0) and bool((lengths == lengths[0]).all())
    buckets = [Bucket(np.arange(len(lengths)), int(lengths[0]))] if all_equal else plan_buckets(cu, chunk_size)
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
    (``[n, P, H, *]``, states ``[n, H, K, V]``) returning ``(o, final)``. No checks."""
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


# --------------------------------------------------------------------------------------------- runners


def _split_runners(scale: float | None, chunk_size: int) -> tuple[ForwardRunner, BackwardRunner]:
    """The plain GLA through the split protocol without value scans (numpy: hpczeco.gla.split, CuPy: the device
    kernels): what the ZeCO layer and ``check_values=False`` calls use."""
    from .protocol import split_backward, split_forward  # noqa: PLC0415

    def fwd(q, k, v, g, h0, poll):
        fs = split_forward(q, k, v, g, scale=scale, chunk_size=chunk_size, check_values=False)
        fs.overlap(poll)
        return fs.finish(h0)

    def bwd(q, k, v, g, do, h0, dht, poll):
        bs = split_backward(q, k, v, g, do, scale=scale, initial_state=h0, chunk_size=chunk_size, check_values=False)
        bs.overlap(poll)
        return bs.finish(dht)

    return fwd, bwd


def _checked_host_runners(scale: float | None, chunk_size: int) -> tuple[ForwardRunner, BackwardRunner]:
    """The fused host kernels (:func:`hpczeco.gla.chunk_gla`), which scan their values per bucket."""
    from .chunk import chunk_gla, chunk_gla_bwd  # noqa: PLC0415

    def fwd(q, k, v, g, h0, poll):
        return chunk_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, chunk_size=chunk_size)

    def bwd(q, k, v, g, do, h0, dht, poll):
        return chunk_gla_bwd(q, k, v, g, do, scale=scale, initial_state=h0, dht=dht, chunk_size=chunk_size)

    return fwd, bwd


def _runners(q: Any, scale: float | None, chunk_size: int, check_values: bool) -> tuple[ForwardRunner, BackwardRunner]:
    if check_values and not is_device_array(q):
        return _checked_host_runners(scale, chunk_size)
    return _split_runners(scale, chunk_size)


def check_varlen_call(q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, scale: Any, chunk_size: Any,
                      initial_state: Any = None, do: Any = None, dht: Any = None,
                      check_values: bool = True) -> np.ndarray:
    """The checks of a packed call: the token arrays (:func:`~hpczeco.gla.validate.validate_gla_inputs`; values of
    host arrays only when the per-bucket kernels will not scan them, i.e. with ``check_values=False`` never, of
    device arrays here), ``cu_seqlens`` (:func:`~hpczeco.gla.validate.check_cu_seqlens`), the per-document states
    ``[N, H, K, V]``, ``scale`` and ``chunk_size``. Returns the host offsets. Local."""
    device = is_device_array(q)
    chunk_size = check_chunk_size(chunk_size, device=device)
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, do=do, check_values=check_values and device)
    check_scale(scale, K)
    cu = check_cu_seqlens(cu_seqlens, B, T)
    for name, x in (("initial_state", initial_state), ("dht", dht)):
        if x is not None:
            check_document_states(name, x, len(cu) - 1, H, K, V, q, check_values=False)
    if check_values and device:
        from .validate import check_device_values  # noqa: PLC0415

        states = {n: x for n, x in (("initial_state", initial_state), ("dht", dht)) if x is not None}
        if states:
            check_device_values(states)
    return cu


def chunk_gla_varlen(q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, scale: float | None = None,
                     initial_state: Any = None, output_final_state: bool = False, chunk_size: int = 64, *,
                     check_values: bool = True) -> tuple[Any, Any]:
    """Chunked GLA forward of packed documents: ``(o [1, T, H, V], final_state [N, H, K, V] or None)``.

    ``q, k, g: [1, T, H, K]``, ``v: [1, T, H, V]``, ``cu_seqlens [N + 1]``, ``initial_state [N, H, K, V]`` or
    None (zeros). Equal to running each document alone through :func:`hpczeco.gla.chunk_gla` (dtypes as there).
    ``check_values=False`` skips the NaN/Inf and ``g <= 0`` scans (shapes, dtypes and ``cu_seqlens`` are always
    checked). numpy or CuPy arrays. Local."""
    cu = check_varlen_call(q, k, v, g, cu_seqlens, scale, chunk_size, initial_state, check_values=check_values)
    fwd, _ = _runners(q, scale, chunk_size, check_values)
    o, final = packed_forward(fwd, q, k, v, g, cu, initial_state, chunk_size)
    return o, (final if output_final_state else None)


def chunk_gla_varlen_bwd(q: Any, k: Any, v: Any, g: Any, do: Any, cu_seqlens: Any, scale: float | None = None,
                         initial_state: Any = None, dht: Any = None, chunk_size: int = 64, *,
                         check_values: bool = True) -> tuple[Any, Any, Any, Any, Any]:
    """Backward of :func:`chunk_gla_varlen`: ``(dq, dk, dv, dg, dh0 [N, H, K, V])``, the gradients of
    ``sum(o * do) + sum(final * dht)`` (``dht [N, H, K, V]`` or None), each document's as
    :func:`hpczeco.gla.chunk_gla_bwd` alone gives it. Local."""
    cu = check_varlen_call(q, k, v, g, cu_seqlens, scale, chunk_size, initial_state, do=do, dht=dht,
                           check_values=check_values)
    _, bwd = _runners(q, scale, chunk_size, check_values)
    return packed_backward(bwd, q, k, v, g, do, cu, initial_state, dht, chunk_size)
