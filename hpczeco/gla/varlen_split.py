"""The split protocol (:mod:`hpczeco.gla.protocol`) over a slice of packed documents (``cu_seqlens``), numpy or CuPy.

A sequence-parallel layer hands a rank's slice with the slice's own offsets ``cu_seqlens [N + 1]`` (``N >= 1``
documents or pieces of documents, ``B == 1``); only the first document can continue a document of the ranks
before, and only the last one can continue into the ranks after. So, with the per-document states
``[N, H, K, V]``:

Forward (:class:`PackedForwardSplit`): ``finish(S_in)`` returns what ``chunk_gla(q, k, v, g, cu_seqlens=...,
initial_state=h0', output_final_state=True)`` returns, ``h0'`` being ``initial_state`` (zeros if None) with
``S_in`` added to row 0. The scan element: ``a = exp(sum of g)`` when ``N == 1``, else 0 (a document start is a
zero decay for everything before it); ``S_local`` the last document's final state with ``S_in = 0``.

Backward (:class:`PackedBackwardSplit`): ``finish(D)`` returns ``chunk_gla_bwd(..., initial_state, dht=dht')``
with ``D`` added to row ``N - 1`` of ``dht`` (the gradient into the slice's end state flows only into its last
document); ``a`` as above, ``U`` the first document's ``dh0`` with ``D = 0``.

Pieces: the first document is a plain split (its ``finish`` needs ``S_in``), the last one (``N >= 2``) a plain
split whose scan element ``S_local + a h0`` is ready after its local pass, and the documents between them run
whole (:func:`hpczeco.gla.varlen.packed_forward`, split runners without value scans) in :meth:`overlap`; in the
backward the roles of first and last swap. So only the first document's (forward) or the last document's
(backward) finish waits for the scan. The constructors check shapes, dtypes and ``cu_seqlens``, and the values
unless ``check_values=False`` (the ZeCO layer validates collectively); the state handed to ``finish`` is not
checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.backend import get_array_module
from ._runner import Poll
from .plain_split import plain_split_backward, plain_split_forward
from .validate import check_cu_seqlens, check_device_values, check_document_states, validate_gla_inputs

__all__ = ["PackedForwardSplit", "PackedBackwardSplit"]


def _row(x: Any, i: int) -> Any:
    return None if x is None else x[i : i + 1]


def _add(x: Any, y: Any) -> Any:
    """``x + y`` where None means zeros."""
    if x is None:
        return y
    return x if y is None else x + y


def _tokens(x: Any, a: int, b: int) -> Any:
    return x[:, a:b]


class _Packed:
    def _setup(self, q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, states: dict[str, Any], do: Any,
               check_values: bool) -> None:
        B, T, H, K, V = validate_gla_inputs(q, k, v, g, do=do, check_values=check_values)
        self.cu = cu = check_cu_seqlens(cu_seqlens, B, T)
        self.N = N = len(cu) - 1
        for name, x in states.items():
            if x is not None:
                check_document_states(name, x, N, H, K, V, q, check_values=check_values)
        if check_values and self._device(q):
            present = {n: x for n, x in states.items() if x is not None}
            if present:
                check_device_values(present)
        self.xp = get_array_module(q)
        self.shape = (B, T, H, K, V)
        self._first = (0, int(cu[1]))
        self._last = (int(cu[N - 1]), T)
        self._mid = (int(cu[1]), int(cu[N - 1]))  # documents 1 .. N - 2

    @staticmethod
    def _device(x: Any) -> bool:
        return get_array_module(x) is not np


class PackedForwardSplit(_Packed):
    """:class:`~hpczeco.gla.protocol.SplitForward` of a slice of packed documents (module docstring): ``q, k, g
    [1, T, H, K]``, ``v [1, T, H, V]``, ``cu_seqlens [N + 1]`` (the slice's offsets), ``initial_state [N, H, K, V]``
    or None. ``a [1, H, K]``, ``S_local [1, H, K, V]``; ``finish(S_in [1, H, K, V] or None)`` returns ``(o [1, T,
    H, V], final [N, H, K, V])``. ``states`` is None (the backward recomputes its chunk states)."""

    states = None

    def __init__(self, q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, scale: float | None = None,
                 initial_state: Any = None, chunk_size: int = 64, *, check_values: bool = True):
        self._setup(q, k, v, g, cu_seqlens, {"initial_state": initial_state}, None, check_values)
        self._args = (q, k, v, g)
        self._scale, self._chunk, self._h0 = scale, chunk_size, initial_state
        self._fs = plain_split_forward(*(_tokens(x, *self._first) for x in self._args), scale=scale,
                                       chunk_size=chunk_size, check_values=False)
        self._mid_out = self._last_out = None
        self._done = False
        if self.N == 1:
            self.a = self._fs.a
            self.S_local = _add(self._fs.S_local, _scaled(self._fs.a, _row(initial_state, 0)))
            self._ls = None
        else:
            self._ls = plain_split_forward(*(_tokens(x, *self._last) for x in self._args), scale=scale,
                                           chunk_size=chunk_size, check_values=False)
            self.a = self.xp.zeros_like(self._fs.a)
            self.S_local = _add(self._ls.S_local, _scaled(self._ls.a, _row(initial_state, self.N - 1)))

    def overlap(self, poll: Poll = None) -> None:
        """The first document's intra-chunk work, the documents after it whole. Idempotent."""
        if self._done:
            return
        self._fs.overlap(poll)
        if self.N >= 2:
            self._ls.overlap(poll)
            self._last_out = self._ls.finish(_row(self._h0, self.N - 1))
        if self.N >= 3:
            from .varlen import _split_runners, packed_forward  # noqa: PLC0415

            a, b = self._mid
            h0 = None if self._h0 is None else self._h0[1 : self.N - 1]
            fwd, _ = _split_runners(self._scale, self._chunk)
            self._mid_out = packed_forward(fwd, *(_tokens(x, a, b) for x in self._args), self.cu[1:-1] - a, h0,
                                           self._chunk, poll)  # fmt: skip
        self._done = True

    def finish(self, S_in: Any = None) -> tuple[Any, Any]:
        """``(o [1, T, H, V], final [N, H, K, V])`` with ``S_in`` added to the first document's initial state."""
        self.overlap()
        o0, f0 = self._fs.finish(_add(_row(self._h0, 0), S_in))
        if self.N == 1:
            return o0, f0
        pieces = [(self._first, o0)]
        finals = [f0]
        if self._mid_out is not None:
            pieces.append((self._mid, self._mid_out[0]))
            finals.append(self._mid_out[1])
        pieces.append((self._last, self._last_out[0]))
        finals.append(self._last_out[1])
        B, T, H, K, V = self.shape
        o = self.xp.empty((B, T, H, V), dtype=o0.dtype)
        for (a, b), x in pieces:
            o[:, a:b] = x
        sdt = np.result_type(*(f.dtype for f in finals))
        return o, self.xp.concatenate([f.astype(sdt, copy=False) for f in finals])


class PackedBackwardSplit(_Packed):
    """:class:`~hpczeco.gla.protocol.SplitBackward` of a slice of packed documents (module docstring): shapes as
    :class:`PackedForwardSplit`, ``do [1, T, H, V]``, ``initial_state`` and ``dht`` ``[N, H, K, V]`` or None.
    ``a [1, H, K]``, ``U [1, H, K, V]``; ``finish(D [1, H, K, V] or None)`` returns ``(dq, dk, dv, dg [1, T, H, *],
    dh0 [N, H, K, V])``."""

    def __init__(self, q: Any, k: Any, v: Any, g: Any, do: Any, cu_seqlens: Any, scale: float | None = None,
                 initial_state: Any = None, dht: Any = None, chunk_size: int = 64, *, check_values: bool = True):
        self._setup(q, k, v, g, cu_seqlens, {"initial_state": initial_state, "dht": dht}, do, check_values)
        self._args = (q, k, v, g, do)
        self._scale, self._chunk, self._h0, self._dht = scale, chunk_size, initial_state, dht
        N = self.N
        self._ls = plain_split_backward(*(_tokens(x, *self._last) for x in self._args), scale=scale,
                                        initial_state=_row(initial_state, N - 1), chunk_size=chunk_size,
                                        check_values=False)
        self._mid_out = self._first_out = None
        self._done = False
        if N == 1:
            self.a = self._ls.a
            self.U = _add(self._ls.U, _scaled(self._ls.a, _row(dht, 0)))
            self._fs = None
        else:
            self._fs = plain_split_backward(*(_tokens(x, *self._first) for x in self._args), scale=scale,
                                            initial_state=_row(initial_state, 0), chunk_size=chunk_size,
                                            check_values=False)
            self.a = self.xp.zeros_like(self._fs.a)
            self.U = _add(self._fs.U, _scaled(self._fs.a, _row(dht, 0)))

    def overlap(self, poll: Poll = None) -> None:
        """The last document's local work, the documents before it whole. Idempotent."""
        if self._done:
            return
        self._ls.overlap(poll)
        if self.N >= 2:
            self._fs.overlap(poll)
            self._first_out = self._fs.finish(_row(self._dht, 0))
        if self.N >= 3:
            from .varlen import _split_runners, packed_backward  # noqa: PLC0415

            a, b = self._mid
            sl = slice(1, self.N - 1)
            h0 = None if self._h0 is None else self._h0[sl]
            dht = None if self._dht is None else self._dht[sl]
            _, bwd = _split_runners(self._scale, self._chunk)
            self._mid_out = packed_backward(bwd, *(_tokens(x, a, b) for x in self._args), self.cu[1:-1] - a, h0, dht,
                                            self._chunk, poll)  # fmt: skip
        self._done = True

    def finish(self, D: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0 [N, H, K, V])`` with ``D`` added to the last document's ``dht``."""
        self.overlap()
        last = self._ls.finish(_add(_row(self._dht, self.N - 1), D))
        if self.N == 1:
            return last
        pieces = [(self._first, self._first_out)]
        if self._mid_out is not None:
            pieces.append((self._mid, self._mid_out))
        pieces.append((self._last, last))
        B, T, H, K, V = self.shape
        xp = self.xp
        grads = [xp.empty((B, T, H, K if i != 2 else V), dtype=last[i].dtype) for i in range(4)]
        for (a, b), res in pieces:
            for out, x in zip(grads, res[:4]):
                out[:, a:b] = x
        sdt = np.result_type(*(r[4].dtype for _, r in pieces))
        return (*grads, xp.concatenate([r[4].astype(sdt, copy=False) for _, r in pieces]))


def _scaled(a: Any, x: Any) -> Any:
    """``diag(a) x`` for a decay ``a [1, H, K]`` and a state row ``x [1, H, K, V]`` (None: None)."""
    return None if x is None else a[..., None] * x
