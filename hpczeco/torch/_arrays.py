"""Views between torch tensors and the arrays hpczeco's kernels take (one concern: conversion).

- CPU tensors -> numpy arrays: ``tensor.detach().numpy()`` (zero-copy) for float32/float64; float16 and
  bfloat16 are copied to float32 (the CPU kernels compute half inputs in float32 anyway).
- CUDA tensors -> CuPy arrays, zero-copy: float32/float16 as they are, bfloat16 as its raw bits (``uint16``,
  the form :mod:`hpczeco.gpu.gla` takes); a view of the tensor's pointer (``cupy.cuda.UnownedMemory``, which
  keeps the tensor alive), else DLPack. Results come back through DLPack, bits viewed as ``torch.bfloat16``.
- :func:`cuda_stream`: torch's current CUDA stream of a device as the current CuPy stream, so the kernels
  run in order with the surrounding torch work. The DLPack exchanges then name the same stream on both
  sides, so neither library records an event or waits.
- One memory pool: inside :func:`cuda_stream` CuPy allocates from PyTorch's caching allocator
  (:func:`torch_allocator`, CuPy's thread-local allocator for the block), so every buffer the kernels and the ZeCO
  layer allocate under ``hpczeco.torch`` -- outputs, workspaces, chunk states -- is torch's: counted by
  ``torch.cuda.memory_allocated`` / ``max_memory_allocated``, reused by torch after it is freed, and no second pool
  holds memory beside torch's. CuPy used outside ``hpczeco.torch`` keeps its own allocator.

Layouts are whatever the caller passes (``[B, T, H, K]`` for q, k, g ...): nothing here reshapes.
"""

from __future__ import annotations

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
    "current_stream_ptr",
    "cuda_stream",
    "torch_allocator",
    "to_device",
    "from_device",
]

#: dtypes accepted on the CPU (float16/bfloat16 are computed in float32, on a float32 copy)
HOST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: dtypes accepted on CUDA devices (zero-copy)
CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NUMPY_DTYPE = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
                torch.int32: np.int32, torch.int64: np.int64, torch.int16: np.int16, torch.uint8: np.uint8}
_VIEW_DTYPE = {t: np.dtype(d) for t, d in {**_NUMPY_DTYPE, torch.bfloat16: np.uint16}.items()}  # bf16: raw bits


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


_CUPY: Any = None


def cupy_module() -> Any:
    """``cupy`` (``ImportError`` with the extra to install when it is missing)."""
    global _CUPY  # noqa: PLW0603 - imported once: the views are made on every call
    if _CUPY is None:
        try:
            import cupy  # noqa: PLC0415
        except ImportError as exc:
            raise ImportError(f"hpczeco.torch needs CuPy for CUDA tensors ({exc}); install the 'gpu' extra "
                              "(pip install hpczeco[gpu])") from exc
        _CUPY = cupy
    return _CUPY


_STREAMS: dict[tuple[int, int], Any] = {}  # (device, stream pointer) -> cupy.cuda.ExternalStream
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds: device -> cudaStream_t as an int


def device_index(device: torch.device) -> int:
    """The CUDA device number of ``device`` (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current_stream_ptr(device: int) -> int:
    """torch's current CUDA stream on ``device`` as a ``cudaStream_t`` integer.

    Through torch's raw getter where the build has it (one C call; ``torch.cuda.current_stream`` builds a
    ``Stream`` object under a device guard, several microseconds per call), else that public function.
    """
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device)
    return int(torch.cuda.current_stream(device).cuda_stream)


_ALLOCATOR: Any = None  # CuPy's allocator over torch's caching allocator (made once)
_RAW_ALLOC = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)  # CUDA builds: (size, stream) -> ptr


def _torch_malloc(size: int, device: int) -> int:
    """``size`` bytes from torch's caching allocator on ``device``, for CuPy's current stream (torch's, inside
    :func:`cuda_stream`): torch orders the block's reuse on that stream, as for its own tensors."""
    stream = cupy_module().cuda.get_current_stream().ptr
    if _RAW_ALLOC is not None and torch.cuda.current_device() == device:
        return int(_RAW_ALLOC(size, stream))  # what caching_allocator_alloc calls, without its device switch
    return int(torch.cuda.caching_allocator_alloc(size, device, stream))


def _torch_free(ptr: int, device: int) -> None:
    torch.cuda.caching_allocator_delete(ptr)


def torch_allocator() -> Any:
    """A CuPy allocator (``malloc(size) -> MemoryPointer``) whose memory comes from PyTorch's caching allocator (on
    CuPy's current stream) and goes back to it when the CuPy array is freed; :func:`cuda_stream` installs it as
    CuPy's thread-local allocator for its block."""
    global _ALLOCATOR  # noqa: PLW0603 - one allocator object for the process
    if _ALLOCATOR is None:
        _ALLOCATOR = cupy_module().cuda.memory.PythonFunctionAllocator(_torch_malloc, _torch_free).malloc
    return _ALLOCATOR


class cuda_stream:  # noqa: N801 - used as a function: ``with cuda_stream(device):``
    """Run the enclosed CuPy work on ``device``, on torch's current stream there, with CuPy's memory from torch's
    caching allocator (a context manager; :func:`torch_allocator`, thread-local: other threads' CuPy work and CuPy
    outside the block keep their own allocator).

    No device or stream is switched when CuPy's current device and stream are those already (torch's default stream
    is CuPy's null stream): entering costs a device and a stream query and the allocator's switch then.
    """

    __slots__ = ("device", "_entered")

    def __init__(self, device: int):
        self.device = device
        self._entered: tuple = ()

    def __enter__(self) -> None:
        cuda = cupy_module().cuda
        pool = cuda.using_allocator(torch_allocator())
        pool.__enter__()
        try:
            ptr = current_stream_ptr(self.device)
            if cuda.runtime.getDevice() == self.device and cuda.get_current_stream().ptr == ptr:
                self._entered = (pool,)
                return
            stream = _STREAMS.get((self.device, ptr))
            if stream is None:
                with cuda.Device(self.device):
                    stream = _STREAMS[(self.device, ptr)] = cuda.ExternalStream(ptr)
            device = cuda.Device(self.device)
            device.__enter__()
            try:
                stream.__enter__()
            except BaseException:
                device.__exit__(None, None, None)
                raise
        except BaseException:
            pool.__exit__(None, None, None)
            raise
        self._entered = (pool, device, stream)

    def __exit__(self, *exc: Any) -> bool:
        entered, self._entered = self._entered, ()
        for cm in reversed(entered):  # stream, device, then the allocator
            cm.__exit__(*exc)
        return False


_VIEWS: dict[tuple, Any] = {}  # (pointer, dtype, shape, device) -> a CuPy view that owns nothing (cached=True)
_VIEWS_MAX = 256


def to_device(t: torch.Tensor | None, cached: bool = False) -> Any:
    """A zero-copy CuPy view of a CUDA tensor (made contiguous first; bfloat16 as ``uint16`` raw bits).

    Call inside :func:`cuda_stream`. The view keeps ``t`` alive. ``cached``: the caller keeps ``t`` alive while
    the view is used (torch's allocator then orders the reuse of its memory on the stream, as for torch's own
    kernels); the view is then one that owns nothing, looked up by the tensor's address, dtype and shape (a
    view is only those, so one made for an earlier tensor at the same address is the same view). Tensors of
    the same address recur in training loops: the lookup costs a fraction of making a view.
    """
    if t is None:
        return None
    cupy = cupy_module()
    if not t.is_contiguous():
        t, cached = t.detach().contiguous(), False  # a copy that only the view keeps alive
    dtype = _VIEW_DTYPE.get(t.dtype)
    unowned = getattr(cupy.cuda, "UnownedMemory", None)
    if unowned is not None and dtype is not None and t.is_cuda:  # a view of the pointer
        n = t.numel()
        if n == 0:
            return cupy.empty(tuple(t.shape), dtype)
        key = (t.data_ptr(), dtype, t.shape, t.get_device())
        view = _VIEWS.get(key) if cached else None
        if view is None:
            mem = cupy.cuda.MemoryPointer(unowned(key[0], n * dtype.itemsize, None if cached else t, key[3]), 0)
            view = cupy.ndarray(tuple(t.shape), dtype, mem)  # C order: t is contiguous
            if cached:
                if len(_VIEWS) >= _VIEWS_MAX:
                    _VIEWS.clear()
                _VIEWS[key] = view
        return view
    t = t.detach()
    if t.dtype == torch.bfloat16:
        arr = cupy.from_dlpack(t.view(torch.int16))  # the consumer's stream is torch's current one: no event
        return arr.view(cupy.uint16)
    return cupy.from_dlpack(t)


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
