"""Chunked gated linear attention: forward ``chunk_gla`` and backward ``chunk_gla_bwd`` (flash-linear-attention's
``chunk_gla`` signatures, with ``cu_seqlens`` for packed documents).

Semantics and layout as :mod:`hpczeco.gla.naive` (``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``,
states ``[B, H, K, V]``). One batch of sequences runs in :mod:`hpczeco.gla.fused` (the chunked form, its
maths and execution; CuPy inputs go to :mod:`hpczeco.gpu.gla`); ``cu_seqlens`` runs each packed document
alone through :mod:`hpczeco.gla.varlen`. Local: no communication.
"""

from __future__ import annotations

from typing import Any

from .fused import fused_gla, fused_gla_bwd
from .varlen import chunk_gla_varlen, chunk_gla_varlen_bwd

__all__ = ["chunk_gla", "chunk_gla_bwd"]


def chunk_gla(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Any = None,
) -> tuple[Any, Any]:
    """Chunked GLA forward: ``(o [B, T, H, V], final_state [B, H, K, V] or None)``.

    ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g`` the log forget gate (<= 0),
    ``initial_state: [B, H, K, V]`` or None (zeros), ``scale`` defaults to ``K**-0.5``. float32/float64
    inputs are computed in their own precision; float16/bfloat16 in float32. ``o`` has the input dtype,
    the final state the compute dtype (float32 for half inputs). CuPy inputs run on the device
    (:func:`hpczeco.gpu.gla.chunk_gla`). Local: no communication. ``cu_seqlens [N + 1]`` (B == 1): packed
    documents, each run alone, ``initial_state`` and the final state ``[N, H, K, V]`` (:mod:`hpczeco.gla.varlen`).
    """
    if cu_seqlens is not None:
        return chunk_gla_varlen(q, k, v, g, cu_seqlens, scale, initial_state, output_final_state, chunk_size)
    return fused_gla(q, k, v, g, scale, initial_state, output_final_state, chunk_size)


def chunk_gla_bwd(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    do: Any,
    scale: float | None = None,
    initial_state: Any = None,
    dht: Any = None,
    chunk_size: int = 64,
    cu_seqlens: Any = None,
) -> tuple[Any, Any, Any, Any, Any]:
    """Analytic backward of :func:`chunk_gla`: ``(dq, dk, dv, dg, dh0)``.

    Gradients of ``L = sum(o * do) + sum(S_T * dht)`` (``dht: [B, H, K, V]`` or None for zeros) with
    respect to ``q, k, v, g`` (``[B, T, H, K]``, ``[B, T, H, V]`` for dv, in the input dtype) and the
    initial state ``dh0 [B, H, K, V]`` — returned as an array even when ``initial_state`` is None (it is
    then the gradient with respect to a zero initial state), in the dtype of ``initial_state`` if given,
    else the compute dtype. The chunk states are recomputed (``[N, K, V]`` per head, never per token).
    CuPy inputs run on the device (:func:`hpczeco.gpu.gla.chunk_gla_bwd`). Local: no communication. With
    ``cu_seqlens`` (B == 1): packed documents, ``initial_state``, ``dht`` and ``dh0`` ``[N, H, K, V]``.
    """
    if cu_seqlens is not None:
        return chunk_gla_varlen_bwd(q, k, v, g, do, cu_seqlens, scale, initial_state, dht, chunk_size)
    return fused_gla_bwd(q, k, v, g, do, scale, initial_state, dht, chunk_size)
