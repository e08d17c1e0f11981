"""Packed documents (``cu_seqlens``) across the ranks of the ZeCO layer: which pieces of which documents a rank
holds, and the per-rank states that follow from it. Pure bookkeeping (numpy and CuPy arrays); no communication.

The sequence is ``T`` tokens cut into ``N`` documents by the global ``cu_seqlens [N + 1]`` (the same on every
rank); rank ``p`` owns tokens ``[bounds[p], bounds[p + 1])``. A document may start, end or cross inside any slice.
On rank ``p`` (:func:`rank_documents`):

- *pieces*: the non-empty documents with tokens in the slice, in order, cut to the slice (local offsets
  ``cu_local``). Only the first piece can continue a document begun on an earlier rank (``continues``), only the
  last one can go on after the slice (``continues_after``).
- *starts*: the documents whose initial state this rank uses (and returns ``dh0`` for): the pieces that begin
  here. *ends*: the documents whose final state is here (and that take their ``dht`` here): the pieces that end
  here. A document of length 0 at position ``x`` starts and ends on the rank whose slice holds token ``x`` (the
  last rank for ``x = T``): its final state is its initial state, its ``dh0`` its ``dht``.

The scan element of the slice is the local packed split's (:class:`hpczeco.gla.split.PackedForwardSplit`),
zeroed where the first piece begins here (a document start is a zero decay for everything before it): forward
``(a, S_local)`` with ``a = 0`` unless one document covers the slice and began before it, ``S_local`` the last
piece's state; backward ``(a, U)`` with both zero unless the first piece continues (``U`` is then the gradient into
the state at the slice start). So ``S_in`` reaches only the first piece's tokens and ``D`` only the last piece's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RankDocuments", "rank_documents", "local_rows", "owned_rows"]


@dataclass(frozen=True)
class RankDocuments:
    """One rank's share of the packed documents (module docstring). Index arrays are int64, ascending."""

    lo: int  #: first token of the slice (global position)
    hi: int  #: one past its last token
    pieces: np.ndarray  #: global indices of the documents with tokens in the slice
    cu_local: np.ndarray  #: ``[len(pieces) + 1]`` offsets of their pieces inside the slice
    continues: bool  #: the first piece continues a document begun before ``lo``
    continues_after: bool  #: the last piece's document goes on after ``hi``
    starts: np.ndarray  #: documents whose initial state is used here (``dh0`` rows)
    ends: np.ndarray  #: documents whose final state is here (``final_state`` rows, ``dht`` rows used here)
    empty: np.ndarray  #: documents of length 0 owned here (in both ``starts`` and ``ends``)


def rank_documents(cu_seqlens: np.ndarray, bounds: np.ndarray, rank: int) -> RankDocuments:
    """Rank ``rank``'s :class:`RankDocuments` for the global offsets ``cu_seqlens [N + 1]`` (checked, host int64)
    and the slice offsets ``bounds [P + 1]`` (``bounds[0] = 0``, ``bounds[P] = T = cu_seqlens[-1]``)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    bounds = np.asarray(bounds, dtype=np.int64)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    bos, eos = cu[:-1], cu[1:]
    pieces = np.flatnonzero(np.minimum(eos, hi) > np.maximum(bos, lo))  # non-empty intersections
    cu_local = np.concatenate([np.clip(bos[pieces], lo, hi), np.clip(eos[pieces[-1:]], lo, hi)]) - lo
    continues = bool(len(pieces)) and bool(bos[pieces[0]] < lo)
    continues_after = bool(len(pieces)) and bool(eos[pieces[-1]] > hi)
    # a document of length 0 at x belongs to the rank holding token x (the last rank for x = T)
    zero = np.flatnonzero(eos == bos)
    owner = np.searchsorted(bounds, bos[zero], side="right") - 1  # the last p with bounds[p] <= x
    owner = np.minimum(owner, len(bounds) - 2)
    empty = zero[owner == rank]
    starts = np.union1d(pieces[1:] if continues else pieces, empty).astype(np.int64)
    ends = np.union1d(pieces[:-1] if continues_after else pieces, empty).astype(np.int64)
    return RankDocuments(lo, hi, pieces.astype(np.int64), cu_local.astype(np.int64), continues, continues_after,
                         starts, ends, empty.astype(np.int64))


def local_rows(xp: Any, states: Any, docs: RankDocuments, drop_first: bool = False, drop_last: bool = False,
               first: Any = None, last: Any = None, shape: tuple[int, ...] | None = None, dtype: Any = None) -> Any:
    """The per-piece rows ``[len(pieces), H, K, V]`` of a per-document state ``states [N, H, K, V]`` (or None):
    ``states[pieces]``, with row 0 replaced by ``first`` (a ``[1, H, K, V]`` state or None: zeros) when
    ``drop_first``, the last row by ``last`` when ``drop_last``. None when nothing is there (no states, nothing
    put in). ``shape``/``dtype``: of one row, for building rows from zeros."""
    n = len(docs.pieces)
    if states is None and first is None and last is None:
        return None
    if states is None:
        rows = xp.zeros((n,) + tuple(shape), dtype=dtype)
    else:
        rows = xp.array(states[xp.asarray(docs.pieces)], dtype=dtype)
    if drop_first:
        rows[0] = 0 if first is None else first[0]
    if drop_last:
        rows[n - 1] = 0 if last is None else last[0]
    return rows


def owned_rows(xp: Any, wanted: np.ndarray, docs: RankDocuments, piece_rows: Any, states: Any,
               shape: tuple[int, ...], dtype: Any) -> Any:
    """The rows ``[len(wanted), H, K, V]`` of the documents ``wanted`` (a subset of the pieces and the empty
    documents, ascending): a piece's row from ``piece_rows [len(pieces), ...]``, an empty document's from
    ``states [N, ...]`` (zeros when None: its final state is its initial state, its ``dh0`` its ``dht``)."""
    out = xp.zeros((len(wanted),) + tuple(shape), dtype=dtype)
    if not len(wanted):
        return out
    at_piece = np.searchsorted(docs.pieces, wanted)
    is_piece = (at_piece < len(docs.pieces)) & (docs.pieces[np.minimum(at_piece, len(docs.pieces) - 1)] == wanted) \
        if len(docs.pieces) else np.zeros(len(wanted), bool)
    if is_piece.any():
        out[xp.asarray(np.flatnonzero(is_piece))] = piece_rows[xp.asarray(at_piece[is_piece])]
    if states is not None and (~is_piece).any():
        out[xp.asarray(np.flatnonzero(~is_piece))] = states[xp.asarray(wanted[~is_piece])].astype(dtype)
    return out
