"""Views between torch tensors and the arrays hpczeco's kernels take (one concern: conversion).

- CPU tensors -> numpy arrays: ``tensor.detach().numpy()`` (zero-copy) for float32/float64; float16 and
  bfloat16 are copied to float32 (the CPU kernels compute half inputs in float32 anyway).
- CUDA tensors -> CuPy arrays, zero-copy: float32/float16 as they are, bfloat16 as its raw bits (``uint16``,
  the form :mod:`hpczeco.gpu.gla` takes); a view of the tensor's pointer (``cupy.cuda.UnownedMemory``, which
  keeps the tensor alive), else DLPack. Results come back through DLPack, bits viewed as ``torch.bfloat16``.
- :func:`cuda_stream`: torch's current CUDA stream of a device as the current CuPy stream, so the kernels
  run in order with the surrounding torch work. The DLPack exchanges then name the same stream on both
  sides, so neither library records an event or waits.

Layouts are whatever the caller passes (``[B, T, H, K]`` for q, k, g ...): nothing here reshapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "HOST_DTYPES",
    "CUDA_DTYPES",
    "compute_dtype",
    "to_host",
    "from_host",
    "cupy_module",
    "device_index",
    "cuda_stream",
    "to_device",
    "from_device",
]

#: dtypes accepted on the CPU (float16/bfloat16 are computed in float32, on a float32 copy)
HOST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: dtypes accepted on CUDA devices (zero-copy)
CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NUMPY_DTYPE = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
                torch.int32: np.int32, torch.int64: np.int64, torch.int16: np.int16, torch.uint8: np.uint8}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype hpczeco computes in, and keeps its states in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------ host


def to_host(t: torch.Tensor | None) -> np.ndarray | None:
    """A numpy view of a CPU tensor (float16/bfloat16: a float32 copy). No autograd history is kept."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.to(torch.float32)
    return t.resolve_conj().resolve_neg().numpy()


def from_host(a: np.ndarray | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A tensor sharing ``a``'s memory (copied only where numpy's layout or flags forbid it), cast to ``dtype``."""
    if a is None:
        return None
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = np.array(a)  # torch.from_numpy wants writable memory and non-negative strides
    t = torch.from_numpy(a)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


# ------------------------------------------------------------------------------------------------ CUDA


def cupy_module() -> Any:
    """``cupy`` (``ImportError`` with the extra to install when it is missing)."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            f"hpczeco.torch needs CuPy for CUDA tensors ({exc}); install the 'gpu' extra (pip install hpczeco[gpu])"
        ) from exc
    return cupy


_STREAMS: dict[tuple[int, int], Any] = {}  # (device, stream pointer) -> cupy.cuda.ExternalStream


def device_index(device: torch.device) -> int:
    """The CUDA device number of ``device`` (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def cuda_stream(device: int) -> Iterator[None]:
    """Run the enclosed CuPy work on ``device`` and on torch's current stream there."""
    cupy = cupy_module()
    ptr = int(torch.cuda.current_stream(device).cuda_stream)
    stream = _STREAMS.get((device, ptr))
    if stream is None:
        with cupy.cuda.Device(device):
            stream = _STREAMS[(device, ptr)] = cupy.cuda.ExternalStream(ptr)
    with cupy.cuda.Device(device), stream:
        yield


def to_device(t: torch.Tensor | None) -> Any:
    """A zero-copy CuPy view of a CUDA tensor (made contiguous first; bfloat16 as ``uint16`` raw bits).

    Call inside :func:`cuda_stream`.
    """
    if t is None:
        return None
    cupy = cupy_module()
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    bf16 = t.dtype == torch.bfloat16
    unowned = getattr(cupy.cuda, "UnownedMemory", None)
    dtype = np.uint16 if bf16 else _NUMPY_DTYPE.get(t.dtype)
    if unowned is not None and t.is_cuda and dtype is not None:  # a view of the pointer, kept alive by ``t``
        if t.numel() == 0:
            return cupy.empty(tuple(t.shape), dtype)
        nbytes = t.numel() * t.element_size()
        mem = cupy.cuda.MemoryPointer(unowned(t.data_ptr(), nbytes, t, t.device.index), 0)
        return cupy.ndarray(tuple(t.shape), dtype, mem)  # C order: t is contiguous
    if bf16:
        t = t.view(torch.int16)
    arr = cupy.from_dlpack(t)  # the consumer's stream is torch's current one: no event is recorded
    return arr.view(cupy.uint16) if bf16 else arr


def from_device(a: Any, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A torch tensor sharing the CuPy array ``a``'s memory; ``uint16`` raw bits come back as ``torch.bfloat16``.

    ``dtype``: cast to it if the result has another dtype (a copy). Call inside :func:`cuda_stream`.
    """
    if a is None:
        return None
    cupy = cupy_module()
    bits = a.dtype == cupy.uint16
    if bits:
        a = a.view(cupy.int16)
    t = torch.from_dlpack(a)  # torch's current stream is CuPy's current one here: no event is recorded
    if bits:
        t = t.view(torch.bfloat16)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)
