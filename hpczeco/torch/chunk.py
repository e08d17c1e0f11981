"""``chunk_gla`` for torch tensors: flash-linear-attention's signature, hpczeco's kernels, autograd.

Per batch ``b`` and head ``h`` (``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``, states ``[N, H, K, V]``)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t      S_{-1} = initial_state (zeros if None)
    o_t = (scale * q_t) S_t                       scale = K ** -0.5 by default

CPU tensors run :func:`hpczeco.gla.chunk_gla` / :func:`hpczeco.gla.chunk_gla_bwd` on numpy views;
CUDA tensors run :func:`hpczeco.gpu.gla.chunk_gla` / :func:`hpczeco.gpu.gla.chunk_gla_bwd` on zero-copy
CuPy views on torch's current stream (with ``cu_seqlens`` through :mod:`hpczeco.gpu.gla_varlen`). The
backward recomputes the chunk states from the saved inputs (nothing per token is kept).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..base.checks import check_scale
from ._arrays import compute_dtype, cuda_stream, device_index, from_device, from_host, to_device, to_host
from ._checks import check_tensors

__all__ = ["chunk_gla", "supports_cu_seqlens"]

_CHUNK = 64  # chunk length of hpczeco's kernels (the GPU kernels take at most 64)


# ------------------------------------------------------------------------------------------------ backends


@functools.cache
def _host_functions() -> tuple[Callable, Callable]:
    from .. import gla  # noqa: PLC0415

    return gla.chunk_gla, gla.chunk_gla_bwd


@functools.cache
def _cuda_functions() -> tuple[Callable, Callable]:
    from ..gpu import gla_varlen  # noqa: PLC0415 - hpczeco.gpu.gla's functions, with cu_seqlens

    return gla_varlen.chunk_gla, gla_varlen.chunk_gla_bwd


@functools.cache
def _takes_cu_seqlens(device_type: str) -> bool:
    fns = _cuda_functions() if device_type == "cuda" else _host_functions()
    return all("cu_seqlens" in inspect.signature(f).parameters for f in fns)


def supports_cu_seqlens(device_type: str = "cpu") -> bool:
    """True when hpczeco's forward and backward for ``device_type`` ("cpu" or "cuda") accept ``cu_seqlens``."""
    return _takes_cu_seqlens(device_type)


def _check_cu_seqlens(cu_seqlens: Any, q: torch.Tensor, initial_state: torch.Tensor | None) -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of integers [N + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point or cu_seqlens.is_complex():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1] (N >= 1), got {cu_seqlens.dtype} of "
                         f"shape {list(cu_seqlens.shape)}")
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (packed documents), got q of shape {list(q.shape)}")
    n = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape[0] != n:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states, expected one per document: "
                         f"{n} (len(cu_seqlens) - 1)")
    device = "cuda" if q.is_cuda else "cpu"
    if not _takes_cu_seqlens(device):
        where = "hpczeco.gpu.gla.chunk_gla" if device == "cuda" else "hpczeco.gla.chunk_gla"
        raise ValueError(f"cu_seqlens: {where} has no cu_seqlens yet (packed documents are not supported by this "
                         "hpczeco); pass one document per batch row instead")


# ------------------------------------------------------------------------------------------------ host


def _host_forward(q, k, v, g, h0, scale, want_final, cu_seqlens, views=None):  # views: as the CUDA one's, unused
    fwd, _ = _host_functions()
    cdt = compute_dtype(q.dtype)
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.detach().cpu().numpy()}
    o, ht = fwd(*(to_host(x) for x in (q, k, v, g)), scale=scale,
                initial_state=None if h0 is None else to_host(h0.to(cdt)), output_final_state=want_final, **extra)
    return from_host(o, q.dtype), from_host(ht)


def _host_backward(q, k, v, g, h0, do, dht, scale, cu_seqlens, views=None):
    _, bwd = _host_functions()
    cdt = compute_dtype(q.dtype)
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.detach().cpu().numpy()}
    grads = bwd(*(to_host(x) for x in (q, k, v, g, do)), scale=scale,
                initial_state=None if h0 is None else to_host(h0.to(cdt)),
                dht=None if dht is None else to_host(dht.to(cdt)), **extra)
    dq, dk, dv, dg = (from_host(x, q.dtype) for x in grads[:4])
    return dq, dk, dv, dg, from_host(grads[4], cdt if h0 is None else h0.dtype)


# ------------------------------------------------------------------------------------------------ CUDA


def _cuda_forward(q, k, v, g, h0, scale, want_final, cu_seqlens, views=None):
    """``(o, final)``; ``views``: a list that receives the CuPy views of q, k, v, g (the backward reuses those that
    own a contiguous copy)."""
    fwd, _ = _cuda_functions()
    with cuda_stream(device_index(q.device)):
        extra = {} if cu_seqlens is None else {"cu_seqlens": to_device(cu_seqlens)}
        arrays = [to_device(x, cached=True) for x in (q, k, v, g)]  # kept alive: the caller's, then saved
        if views is not None:
            views.extend(arrays)
        o, ht = fwd(*arrays, scale=scale, chunk_size=_CHUNK,
                    initial_state=None if h0 is None else to_device(h0.to(torch.float32)),
                    output_final_state=want_final, **extra)
        return from_device(o, q.dtype), from_device(ht)


def _cuda_backward(q, k, v, g, h0, do, dht, scale, cu_seqlens, views=None):
    """``(dq, dk, dv, dg, dh0)``; ``views``: the forward's CuPy views of q, k, v, g (their copies reused)."""
    _, bwd = _cuda_functions()
    with cuda_stream(device_index(q.device)):
        extra = {} if cu_seqlens is None else {"cu_seqlens": to_device(cu_seqlens)}
        # views of the saved tensors (cached: a lookup): saved-tensor hooks (checkpointing, save_on_cpu) may give
        # back other memory than the forward's; only the forward's copies of non-contiguous inputs, which their
        # views own, are reused
        views = views or (None,) * 4
        arrays = [w if w is not None and not x.is_contiguous() else to_device(x, cached=True)
                  for x, w in zip((q, k, v, g), views)]
        grads = bwd(*arrays, to_device(do, cached=True), scale=scale, chunk_size=_CHUNK,
                    initial_state=None if h0 is None else to_device(h0.to(torch.float32)),
                    dht=None if dht is None else to_device(dht.to(torch.float32)), **extra)
        dq, dk, dv, dg = (from_device(x, q.dtype) for x in grads[:4])
        return dq, dk, dv, dg, from_device(grads[4], torch.float32 if h0 is None else h0.dtype)


# ------------------------------------------------------------------------------------------------ autograd


class ChunkGLAFunction(torch.autograd.Function):
    """``(o, final_state or None)`` from ``(q, k, v, g, initial_state, scale, output_final_state, cu_seqlens, done)``;
    gradients for q, k, v, g and initial_state. Call it through :func:`chunk_gla` (which checks the arguments).

    ``done``: ``(o, final_state, views)`` of a forward already run on these inputs (:func:`chunk_gla` launches the
    kernels first, so that the GPU works while autograd records the call), or None: run it here.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, output_final_state, cu_seqlens, done=None):
        ctx.set_materialize_grads(False)  # an unused output gives None, not a tensor of zeros
        if done is None:
            done = _run_forward(q, k, v, g, initial_state, scale, output_final_state, cu_seqlens)
        o, ht, ctx.views = done  # CUDA: the CuPy views of q, k, v, g for the backward (their memory, or a copy)
        ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens)  # torch then catches in-place changes
        ctx.scale = scale
        return o, ht

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, h0, cu_seqlens = ctx.saved_tensors
        if do is None:  # only the final state was used
            do = torch.zeros(q.shape[:3] + v.shape[3:], dtype=q.dtype, device=q.device)
        run = _cuda_backward if q.is_cuda else _host_backward
        # saved_tensors (above) has checked that q, k, v, g were not changed in place since the forward
        dq, dk, dv, dg, dh0 = run(q, k, v, g, h0, do, dht, ctx.scale, cu_seqlens, ctx.views)
        ctx.views = None
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                dg if need[3] else None, dh0 if need[4] else None, None, None, None, None)


def _run_forward(q, k, v, g, h0, scale, want_final, cu_seqlens) -> tuple[Any, Any, list]:
    """``(o, final state, views)``: the forward's kernels on these tensors, no autograd history recorded."""
    views: list = []
    run = _cuda_forward if q.is_cuda else _host_forward
    with torch.no_grad():
        o, ht = run(q, k, v, g, h0, scale, want_final, cu_seqlens, views)
    return o, ht, views


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated linear attention with autograd: ``(o [B, T, H, V], final_state [N, H, K, V] or None)``.

    The signature and semantics of flash-linear-attention's ``chunk_gla``: ``q, k, g: [B, T, H, K]``,
    ``v: [B, T, H, V]``, ``g`` the log forget gate (<= 0), ``scale`` defaulting to ``K ** -0.5``,
    ``initial_state [N, H, K, V]`` (N = B, or the number of documents with ``cu_seqlens``), the final state
    only when ``output_final_state``. ``o`` has the dtype of q; states are float32 (float64 for float64
    inputs); the gradient of ``initial_state`` has its dtype. ``cu_seqlens`` (``[N + 1]`` integers, B == 1):
    packed documents, where hpczeco's kernels take them (:func:`supports_cu_seqlens`), else ``ValueError``.

    Devices and dtypes: CUDA bfloat16/float16/float32 (zero-copy, torch's current stream); CPU float32/float64
    (zero-copy numpy views; float16/bfloat16 are computed on float32 copies). q, k, v, g share one dtype
    (fla also takes a float32 ``g`` with bf16 q: cast it here). Gradients for q, k, v, g and initial_state.
    """
    dev, _ = check_tensors(q=q, k=k, v=v, g=g, initial_state=initial_state)
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, q, initial_state)
    scale = check_scale(scale, int(q.shape[-1]))
    want_final = bool(output_final_state)
    # the kernels first (on the GPU they run while the host records the autograd node), then the node
    done = _run_forward(q, k, v, g, initial_state, scale, want_final, cu_seqlens)
    o, ht = ChunkGLAFunction.apply(q, k, v, g, initial_state, scale, want_final, cu_seqlens, done)
    return o, (ht if output_final_state else None)
