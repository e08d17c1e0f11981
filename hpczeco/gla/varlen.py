"""Packed sequences (``cu_seqlens``) for the chunked GLA, on numpy and CuPy arrays alike.

As flash-linear-attention's ``chunk_gla(..., cu_seqlens=...)``: ``B == 1`` and ``cu_seqlens [N + 1]`` (starting
at 0, non-decreasing, ending at T) cuts the T tokens into N documents, document ``i`` being tokens
``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` (length 0 allowed). The state is reset at every document start: each
document is run alone, with its own initial state ``initial_state[i]`` and final state ``final[i]`` (states
``[N, H, K, V]``; ``dht`` and ``dh0`` likewise). Layout ``q, k, g: [1, T, H, K]``, ``v, o, do: [1, T, H, V]``.

Approach (:mod:`hpczeco.base.packing`, the same on both backends): the documents are grouped into buckets of
similar length, and each bucket runs as one batched call of the plain chunked GLA on a padded copy ``[n, P, H,
*]``. Padding tokens ``q = k = v = g = 0`` (and ``do = 0``) leave the state unchanged (decay ``exp(0) = 1``, no
``k^T v``), so row ``j``'s final state is its document's, the padding's outputs are dropped and the real
tokens' gradients are exact; nothing inside the chunk kernels changes. Short documents so share one call (and
its threads over ``n H`` sequences) instead of paying a call each; a long document runs alone on a view of the
input; a document joins a bucket only when its padding and copies cost less than the call it saves.

Runners: :func:`chunk_gla_varlen` / :func:`chunk_gla_varlen_bwd` (what :func:`hpczeco.gla.chunk_gla` calls with
``cu_seqlens``) check everything first. On the host, with ``check_values=True`` every bucket runs the fused
:func:`hpczeco.gla.chunk_gla` (which scans its own values: every token and state row is in one bucket), with
``check_values=False`` (inputs validated by the caller, e.g. the ZeCO layer) the phase-split forms of
:mod:`hpczeco.gla.protocol` without value scans, so a NaN propagates and nothing raises on one rank only. CuPy
arrays go to :func:`hpczeco.gpu.gla_varlen.chunk_gla` (per-bucket calls of the device kernels, which do not
reset the state at document starts themselves) after the device value checks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.backend import is_device_array
from ..base.packing import BackwardRunner, ForwardRunner, packed_backward, packed_forward
from .fused import fused_gla, fused_gla_bwd
from .plain_split import plain_split_backward, plain_split_forward
from .validate import check_chunk_size, check_cu_seqlens, check_document_states, check_scale, validate_gla_inputs

__all__ = ["chunk_gla_varlen", "chunk_gla_varlen_bwd", "check_varlen_call"]


# --------------------------------------------------------------------------------------------- runners


def _split_runners(scale: float | None, chunk_size: int) -> tuple[ForwardRunner, BackwardRunner]:
    """The plain GLA through the split protocol without value scans (numpy: hpczeco.gla.split, CuPy: the device
    kernels' prepare/finish): the host ``check_values=False`` calls and the packed splits' middle documents."""

    def fwd(q, k, v, g, h0, poll):
        fs = plain_split_forward(q, k, v, g, scale=scale, chunk_size=chunk_size, check_values=False)
        fs.overlap(poll)
        return fs.finish(h0)

    def bwd(q, k, v, g, do, h0, dht, poll):
        bs = plain_split_backward(q, k, v, g, do, scale=scale, initial_state=h0, chunk_size=chunk_size,
                                  check_values=False)
        bs.overlap(poll)
        return bs.finish(dht)

    return fwd, bwd


def _checked_host_runners(scale: float | None, chunk_size: int) -> tuple[ForwardRunner, BackwardRunner]:
    """The fused host kernels (:mod:`hpczeco.gla.fused`), which scan their values per bucket."""

    def fwd(q, k, v, g, h0, poll):
        return fused_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, chunk_size=chunk_size)

    def bwd(q, k, v, g, do, h0, dht, poll):
        return fused_gla_bwd(q, k, v, g, do, scale=scale, initial_state=h0, dht=dht, chunk_size=chunk_size)

    return fwd, bwd


def _host_runners(scale: float | None, chunk_size: int, check_values: bool) -> tuple[ForwardRunner, BackwardRunner]:
    return (_checked_host_runners if check_values else _split_runners)(scale, chunk_size)


def _gpu_varlen():
    from ..gpu import gla_varlen  # noqa: PLC0415

    return gla_varlen


def check_varlen_call(q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, scale: Any, chunk_size: Any,
                      initial_state: Any = None, do: Any = None, dht: Any = None,
                      check_values: bool = True) -> np.ndarray:
    """The checks of a packed call, before any work: the token arrays (``validate_gla_inputs``), ``cu_seqlens``
    (:func:`~hpczeco.gla.validate.check_cu_seqlens`), the per-document states ``[N, H, K, V]``, ``scale`` and
    ``chunk_size``. Values (with ``check_values``): of device arrays here; host values are scanned by the fused
    kernels of each bucket (every token and state row is in one bucket). Returns the host offsets. Local."""
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
    if is_device_array(q):
        return _gpu_varlen().chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state, chunk_size=chunk_size, cu_seqlens=cu)
    fwd, _ = _host_runners(scale, chunk_size, check_values)
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
    if is_device_array(q):
        return _gpu_varlen().chunk_gla_bwd(q, k, v, g, do, scale=scale, initial_state=initial_state, dht=dht,
                                           chunk_size=chunk_size, cu_seqlens=cu)
    _, bwd = _host_runners(scale, chunk_size, check_values)
    return packed_backward(bwd, q, k, v, g, do, cu, initial_state, dht, chunk_size)
