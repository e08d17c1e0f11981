"""Packed sequences (``cu_seqlens``) on the GPU: :func:`chunk_gla` / :func:`chunk_gla_bwd` of :mod:`hpczeco.gpu.gla`
with flash-linear-attention's ``cu_seqlens``.

``B == 1``, ``cu_seqlens [N + 1]`` (CuPy, numpy or a list of ints; read on the host: one small copy and a
synchronisation for a CuPy array), ``initial_state``, the final state, ``dht`` and ``dh0`` ``[N, H, K, V]`` fp32;
each document runs alone. The simplest correct form: the documents are grouped by length into padded batches
(:mod:`hpczeco.base.packing`; zero tokens are no-ops of GLA) and each batch is one call of the kernels of
:mod:`hpczeco.gpu.gla`, which do not reset the state at document starts themselves. A batch of one document is a
view of the input; other batches cost one gather and one scatter per array. Without ``cu_seqlens`` these are
:func:`hpczeco.gpu.gla.chunk_gla` / ``chunk_gla_bwd``. Dtypes, streams and checks as there (no value scans).
"""

from __future__ import annotations

from typing import Any

from ..base.packing import check_cu_seqlens, packed_backward, packed_forward
from . import gla

__all__ = ["chunk_gla", "chunk_gla_bwd"]


def _check_states(cu, q: Any, v: Any, **states: Any) -> None:
    N, H, K, V = len(cu) - 1, int(q.shape[2]), int(q.shape[3]), int(v.shape[3])
    for name, x in states.items():
        if x is not None and tuple(x.shape) != (N, H, K, V):
            raise ValueError(f"{name} has shape {list(x.shape)}, expected {[N, H, K, V]} (one state per document)")


def chunk_gla(q: Any, k: Any, v: Any, g: Any, scale: float | None = None, initial_state: Any = None,
              output_final_state: bool = False, chunk_size: int = 64, *, cu_seqlens: Any = None,
              impl: str = "auto") -> tuple[Any, Any]:
    """:func:`hpczeco.gpu.gla.chunk_gla` with ``cu_seqlens``: ``(o [1, T, H, V], final [N, H, K, V] fp32 or None)``."""
    if cu_seqlens is None:
        return gla.chunk_gla(q, k, v, g, scale, initial_state, output_final_state, chunk_size, impl=impl)
    cu = check_cu_seqlens(cu_seqlens, int(q.shape[0]), int(q.shape[1]))
    _check_states(cu, q, v, initial_state=initial_state)

    def run(q, k, v, g, h0, poll):
        return gla.chunk_gla(q, k, v, g, scale, h0, True, chunk_size, impl=impl)

    o, final = packed_forward(run, q, k, v, g, cu, initial_state, chunk_size)
    return o, (final if output_final_state else None)


def chunk_gla_bwd(q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, initial_state: Any = None,
                  dht: Any = None, chunk_size: int = 64, *, cu_seqlens: Any = None) -> tuple[Any, Any, Any, Any, Any]:
    """:func:`hpczeco.gpu.gla.chunk_gla_bwd` with ``cu_seqlens``: ``(dq, dk, dv, dg [1, T, H, *], dh0 [N, H, K, V])``
    (fp32 ``dh0``)."""
    if cu_seqlens is None:
        return gla.chunk_gla_bwd(q, k, v, g, do, scale, initial_state, dht, chunk_size)
    cu = check_cu_seqlens(cu_seqlens, int(q.shape[0]), int(q.shape[1]))
    _check_states(cu, q, v, initial_state=initial_state, dht=dht)

    def run(q, k, v, g, do, h0, dht, poll):
        return gla.chunk_gla_bwd(q, k, v, g, do, scale, h0, dht, chunk_size)

    return packed_backward(run, q, k, v, g, do, cu, initial_state, dht, chunk_size)
