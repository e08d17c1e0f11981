"""DAAF windowed attention on NVIDIA GPUs (CuPy RawKernels from ``daaf_attention.cu``).

Semantics (causal; the same rule as ``hpczeco.daaf.plan_arrays``): with ``W = local_window`` and the
key-region set ``G`` (``global_idx``, sorted; ``is_global_query_mask[t]`` is ``t in G``), query ``t``
attends to key ``j <= t`` iff ``t - j <= W`` or ``j in G`` or ``t in G``; softmax over that set,
each key once. ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]`` -> ``o: [B, T, H, Dv]`` (``v``'s dtype).

Kernels (``impl``):

* ``"tc"``: flash-attention style, tensor cores (mma.sync bf16/fp16, fp32 accumulation), ``D == Dv``
  in {64, 128}; a block owns 64 query rows and visits only the 64-key tiles it needs: key-region
  keys gathered by index, then the local range (a tile holding a key-region query: full causal).
* ``"tc2"``: the same with 128 query rows per block: each warp owns two 16-row tiles that share every
  K/V fragment read from shared memory (half the shared-memory traffic per mma, more registers).
* ``"tc3"``: ``"tc"`` compiled for 3 resident blocks per SM (register cap; D = 128 only).
* ``"simple"``: one warp per query row, fp32 online softmax, any ``D, Dv <= 256``, float32 too.
* ``"auto"``: :data:`AUTO_TC` (``"tc"``) where it applies (16-bit inputs, D == Dv in {64, 128}), else
  ``"simple"``.

16-bit inputs: CuPy ``float16``, CuPy ``bfloat16`` (CuPy with ml_dtypes), or raw 16-bit integer
arrays with ``storage="bfloat16"``/``"float16"`` (bf16 bits without ml_dtypes). PyTorch tensors go
through :func:`attention_torch` (zero-copy DLPack views). The kernels load and launch through
:mod:`hpczeco.gpu.runtime` (so the CPU emulation runs these very wrappers on numpy arrays); the float64
reference they must equal is :mod:`hpczeco.daaf.reference`. This module knows nothing of MPI.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..base.backend import to_numpy
from .args import check_int
from .runtime import HERE, KernelSet, RuntimeSlot
from .runtime import kernel_source as _source

__all__ = [
    "AUTO_TC",
    "IMPLS",
    "KERNEL_SOURCE",
    "DevicePlan",
    "Prepared",
    "attention",
    "attention_torch",
    "device_plan",
    "kernel_info",
    "prepare",
    "prepare_torch",
    "resolve_impl",
    "tc_smem_bytes",
]

KERNEL_SOURCE = HERE / "daaf_attention.cu"
IMPLS = ("auto", "tc", "tc2", "tc3", "simple")
AUTO_TC = "tc"  # the tensor-core variant "auto" picks
TC_MTILES = {"tc": 1, "tc2": 2, "tc3": 1}  # 16-row m-tiles per warp
TC_BLOCK_Q = 64  # query rows per block per m-tile (DAAF_TC_BR)
TC_BLOCK_K = 64  # keys per tile (DAAF_TC_BC)
TC_THREADS = 128
TC_DIMS = (64, 128)
SIMPLE_MAX_DIM = 256
SIMPLE_ROWS_PER_BLOCK = 4  # 128 threads, one warp per query row
_STORAGE = ("bfloat16", "float16")


# --------------------------------------------------------------------------- kernel geometry


def tc_smem_bytes(D: int, mtiles: int = 1) -> int:
    """Dynamic shared memory of a tensor-core kernel: 2 stages x (K + V) tiles of 64 padded rows, plus
    the Q tile when ``mtiles == 2`` (DaafTcShape::SMEM_BYTES)."""
    return 4 * TC_BLOCK_K * (D + 8) * 2 + (0 if mtiles == 1 else TC_BLOCK_Q * mtiles * (D + 8) * 2)


def resolve_impl(impl: str, elem: str, D: int, Dv: int) -> str:
    """The kernel family ``impl`` means for element type ``elem`` ("f32"/"f16"/"bf16") and head dims."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    tc_ok = elem in ("f16", "bf16") and D == Dv and D in TC_DIMS
    if impl == "auto":
        return AUTO_TC if tc_ok else "simple"
    if impl in TC_MTILES and not tc_ok:
        raise ValueError(f"impl={impl!r} needs float16/bfloat16 inputs with D == Dv in {TC_DIMS}; got {elem}, "
                         f"D={D}, Dv={Dv} (use impl='simple' or 'auto')")
    if impl == "tc3" and D != 128:
        raise ValueError(f"impl='tc3' exists for D=128 only, got D={D}")
    if impl == "simple" and max(D, Dv) > SIMPLE_MAX_DIM:
        raise ValueError(f"impl='simple' supports D, Dv <= {SIMPLE_MAX_DIM}, got D={D}, Dv={Dv}")
    return impl


# --------------------------------------------------------------------------- kernels and their runtime


def kernel_names() -> list[str]:
    """The ``extern "C"`` kernel names of ``daaf_attention.cu``."""
    out = [f"daaf_simple_{e}" for e in ("f32", "f16", "bf16")]
    out += [f"daaf_{kind}_{e}_d{d}" for kind in ("tc", "tc2") for d in TC_DIMS for e in ("bf16", "f16")]
    out += [f"daaf_tc3_{e}_d128" for e in ("bf16", "f16")]
    return out


def kernel_source() -> str:
    """The kernel source as NVRTC and the CPU emulation compile it."""
    return _source((KERNEL_SOURCE.name,))


#: the DAAF kernels: one NVRTC module per device (plain names, no name expressions)
KERNELS = KernelSet(
    label="hpczeco.gpu.daaf", files=(KERNEL_SOURCE.name,), names=lambda file: kernel_names(), name_expressions=False
)
_SLOT = RuntimeSlot(KERNELS)


def _runtime():
    try:
        return _SLOT.get()
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(f"hpczeco.gpu.daaf needs CuPy ({exc})") from exc


def _set_runtime(rt: Any) -> Any:
    """Testing hook: run the wrappers on another runtime (e.g. the CPU emulation); returns the old one."""
    return _SLOT.set(rt)


def _smem_of(name: str) -> int:
    """Dynamic shared memory a kernel is launched with (0 for the simple kernels)."""
    if not name.startswith("daaf_tc"):
        return 0
    return tc_smem_bytes(int(name.rsplit("_d", 1)[1]), TC_MTILES[name.split("_")[1]])


def kernel_info() -> dict[str, dict]:
    """Per kernel: registers, local (spill) bytes, static shared bytes, the block limit (compiles the module;
    CuPy only)."""
    rt = _runtime()
    info = {}
    for name in kernel_names():
        kern = rt.function(name, _smem_of(name))
        info[name] = {
            "num_regs": int(kern.num_regs),
            "local_size_bytes": int(kern.local_size_bytes),
            "shared_size_bytes": int(kern.shared_size_bytes),
            "max_threads_per_block": int(kern.max_threads_per_block),
            "max_dynamic_shared_size_bytes": int(kern.max_dynamic_shared_size_bytes),
        }
    return info


# --------------------------------------------------------------------------- plan arrays on the device


class DevicePlan:
    """Key-region index arrays on the device for one ``T``: ``global_idx`` int32 ``[G]`` (sorted),
    ``gmask`` uint8 ``[T]`` (1 at key-region tokens), ``local_window``."""

    def __init__(self, global_idx, gmask, T: int, local_window: int):
        self.global_idx = global_idx
        self.gmask = gmask
        self.T = int(T)
        self.local_window = int(local_window)
        self.n_global = int(global_idx.size)
        self._gidx_arg = global_idx if global_idx.size else _runtime().xp.zeros(1, dtype=np.int32)


def _as_device(x: Any, name: str):
    """CuPy view/copy of numpy, CuPy, torch (CUDA) or list input."""
    rt = _runtime()
    cupy = rt.xp
    if rt.is_native(x):
        return x
    if type(x).__module__.startswith("torch"):
        import torch  # noqa: PLC0415

        if not x.is_cuda:
            x = x.cuda()
        if x.dtype == torch.bool:
            x = x.to(dtype=torch.uint8)
        return cupy.from_dlpack(x.contiguous())
    try:
        return cupy.asarray(np.asarray(x))
    except Exception as exc:
        raise TypeError(f"{name} must be an array (numpy, CuPy or torch), got {type(x).__name__}") from exc


def device_plan(global_idx: Any, local_window: int, T: int, is_global_query_mask: Any = None,
                validate: bool = True) -> DevicePlan:
    """Check and upload the plan arrays (see :class:`DevicePlan`).

    ``global_idx``: integer ``[G]``, strictly increasing, in ``[0, T)``. ``is_global_query_mask``: bool
    ``[T]``, True exactly at ``global_idx`` (built from it when None). ``validate`` checks the contents
    (one device reduction and one synchronisation); shapes and dtypes are always checked.
    """
    cupy = _runtime().xp
    T = check_int("T", T, 1)
    W = min(check_int("local_window", local_window, 0), T)
    gi = _as_device(global_idx, "global_idx")
    if gi.ndim != 1:
        raise ValueError(f"global_idx must be 1-D [G], got shape {tuple(gi.shape)}")
    if gi.size and gi.dtype.kind not in "iu":
        raise TypeError(f"global_idx must hold integers, got dtype {gi.dtype}")
    if gi.size > T:
        raise ValueError(f"global_idx has {gi.size} entries but T={T}")
    gi = cupy.ascontiguousarray(gi, dtype=np.int32)
    if is_global_query_mask is None:
        gm = cupy.zeros(T, dtype=np.uint8)
        if gi.size:
            if validate and (int(gi.min()) < 0 or int(gi.max()) >= T):
                raise ValueError(f"global_idx must lie in [0, {T}), got [{int(gi.min())}, {int(gi.max())}]")
            gm[gi] = 1
    else:
        gm = _as_device(is_global_query_mask, "is_global_query_mask")
        if gm.ndim != 1 or gm.shape[0] != T:
            raise ValueError(f"is_global_query_mask must have shape [{T}], got {tuple(gm.shape)}")
        if gm.dtype != np.bool_ and gm.dtype != np.uint8:
            raise TypeError(f"is_global_query_mask must be bool, got dtype {gm.dtype}")
        gm = cupy.ascontiguousarray(gm).view(np.uint8)
    if validate and gi.size:
        bad = cupy.zeros(4, dtype=np.int32)
        bad[0] = (gi < 0).any() | (gi >= T).any()
        if gi.size > 1:
            bad[1] = (gi[1:] <= gi[:-1]).any()
        bad[2] = (gm[cupy.clip(gi, 0, T - 1)] == 0).any()
        bad[3] = int(gi.size) != gm.astype(np.int64).sum()
        b = to_numpy(bad)
        if b[0]:
            raise ValueError(f"global_idx must lie in [0, {T})")
        if b[1]:
            raise ValueError("global_idx must be strictly increasing (sorted, no repeats)")
        if b[2] or b[3]:
            raise ValueError("is_global_query_mask must be True exactly at global_idx")
    elif validate and is_global_query_mask is not None and bool((gm != 0).any()):
        raise ValueError("is_global_query_mask must be True exactly at global_idx (global_idx is empty)")
    return DevicePlan(gi, gm, T, W)


# --------------------------------------------------------------------------- launches


def _elem_of(x: Any, storage: str | None) -> str:
    dt = str(x.dtype)
    if dt == "float32":
        return "f32"
    if dt == "float16":
        return "f16"
    if dt == "bfloat16":
        return "bf16"
    if dt in ("uint16", "int16"):
        if storage not in _STORAGE:
            raise TypeError(f"16-bit integer arrays need storage='bfloat16' or 'float16' (raw bits), got {storage!r}")
        return "bf16" if storage == "bfloat16" else "f16"
    raise TypeError(f"q, k, v must be float32, float16 or bfloat16 (or raw 16-bit bits with storage=...), got {dt}"
                    " (float64: use the CPU path hpczeco.daaf.attention)")


class Prepared:
    """One ready launch: ``p()`` runs the kernel on the current stream and returns the output array."""

    def __init__(self, launch, out, impl: str, name: str):
        self.launch, self.out, self.impl, self.name = launch, out, impl, name

    def __call__(self):
        self.launch()
        return self.out


def prepare(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
            is_global_query_mask: Any = None, *, impl: str = "auto", storage: str | None = None,
            validate: bool = True, out=None, reverse: bool = True, plan: DevicePlan | None = None) -> Prepared:
    """Check everything once and return a :class:`Prepared` launch (for repeated calls and timing).

    ``reverse`` schedules the last query tiles (the longest rows) first. ``plan`` reuses a
    :class:`DevicePlan` (then ``global_idx``/``is_global_query_mask`` are ignored).
    """
    rt = _runtime()
    cupy = rt.xp
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not rt.is_native(x):
            raise TypeError(f"{name} must be a CuPy array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, T, H, D], got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k has shape {list(k.shape)}, expected q's shape {list(q.shape)} [B, T, H, D]")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v has shape {list(v.shape)}, expected [B, T, H, Dv] with [B, T, H] = {list(q.shape[:3])}")
    B, T, H, D = (int(s) for s in q.shape)
    Dv = int(v.shape[3])
    if min(B, T, H, D, Dv) < 1:
        raise ValueError(f"empty input: q {tuple(q.shape)}, v {tuple(v.shape)}")
    if T >= 2**31 - TC_BLOCK_Q or H > 65535 or B > 65535:
        raise ValueError(f"shape out of range for the kernels: B={B} (<= 65535), T={T}, H={H} (<= 65535)")
    elem = _elem_of(q, storage)
    kind = resolve_impl(impl, elem, D, Dv)
    if scale is None:
        scale = D**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if plan is None:
        plan = device_plan(global_idx, local_window, T, is_global_query_mask, validate=validate)
    elif plan.T != T:
        raise ValueError(f"plan covers T={plan.T} tokens, q has T={T}")

    def prep(x):
        x = cupy.ascontiguousarray(x)
        if rt.ptr(x) % 16:
            x = x.copy()
        return x

    q, k, v = prep(q), prep(k), prep(v)
    if out is None:
        out = cupy.empty((B, T, H, Dv), dtype=v.dtype)
    elif not (rt.is_native(out) and out.shape == (B, T, H, Dv) and out.dtype == v.dtype
              and out.flags.c_contiguous and rt.ptr(out) % 16 == 0):
        raise ValueError(f"out must be a C-contiguous CuPy array of shape {(B, T, H, Dv)} and dtype {v.dtype}")
    if kind == "simple":
        name = f"daaf_simple_{elem}"
        rows = B * T * H
        grid = ((rows + SIMPLE_ROWS_PER_BLOCK - 1) // SIMPLE_ROWS_PER_BLOCK,)
        args = (q, k, v, out, plan._gidx_arg, plan.gmask, np.int32(B), np.int32(T), np.int32(H), np.int32(D),
                np.int32(Dv), np.int32(plan.n_global), np.int32(plan.local_window), np.float32(scale))
        return Prepared(rt.bind(name, grid, (32 * SIMPLE_ROWS_PER_BLOCK,), args), out, kind, name)
    name = f"daaf_{kind}_{elem}_d{D}"
    rows_per_block = TC_BLOCK_Q * TC_MTILES[kind]
    grid = ((T + rows_per_block - 1) // rows_per_block, H, B)
    args = (q, k, v, out, plan._gidx_arg, plan.gmask, np.int32(T), np.int32(H), np.int32(plan.n_global),
            np.int32(plan.local_window), np.float32(scale * math.log2(math.e)), np.int32(1 if reverse else 0))
    return Prepared(rt.bind(name, grid, (TC_THREADS,), args, tc_smem_bytes(D, TC_MTILES[kind])), out, kind, name)


def attention(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
              is_global_query_mask: Any = None, *, impl: str = "auto", storage: str | None = None,
              validate: bool = True, out=None):
    """DAAF causal attention on the GPU (CuPy arrays). See the module docstring for the rule and shapes.

    ``global_idx``: sorted key-region positions ``[G]`` (numpy/CuPy ints); ``is_global_query_mask``:
    bool ``[T]``, True exactly there (built from ``global_idx`` when None); ``scale`` defaults to
    ``D ** -0.5``. Runs on the current CuPy stream; returns ``o`` ``[B, T, H, Dv]``.
    """
    return prepare(q, k, v, global_idx, local_window, scale, is_global_query_mask, impl=impl,
                   storage=storage, validate=validate, out=out)()


# --------------------------------------------------------------------------- PyTorch tensors (DLPack)


def _torch_views(q, k, v):
    import torch  # noqa: PLC0415

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor")
    dt = q.dtype
    if dt == torch.bfloat16:
        storage, bits = "bfloat16", torch.int16
    elif dt == torch.float16:
        storage, bits = "float16", torch.int16
    elif dt == torch.float32:
        storage, bits = None, None
    else:
        raise TypeError(f"q, k, v must be bfloat16, float16 or float32 tensors, got {dt}")
    return storage, bits


class _TorchPrepared:
    def __init__(self, prepared: Prepared, out_t, stream_ptr: int, device: int, keep):
        self.prepared, self.out_t, self.stream_ptr, self.device, self._keep = prepared, out_t, stream_ptr, device, keep
        self.impl, self.name = prepared.impl, prepared.name

    def __call__(self):
        cupy = _runtime().xp
        with cupy.cuda.Device(self.device), cupy.cuda.ExternalStream(self.stream_ptr):
            self.prepared()
        return self.out_t


def prepare_torch(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
                  is_global_query_mask: Any = None, *, impl: str = "auto", validate: bool = True,
                  reverse: bool = True, plan: DevicePlan | None = None):
    """:func:`prepare` for PyTorch CUDA tensors ``[B, T, H, D]`` (zero-copy DLPack views; launches on
    torch's current stream). Calling the result returns the output tensor (the same tensor each call).
    ``plan``: a :class:`DevicePlan` to reuse (e.g. across layers)."""
    import torch  # noqa: PLC0415

    cupy = _runtime().xp
    storage, bits = _torch_views(q, k, v)
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out_t = torch.empty(q.shape[:3] + (v.shape[3],), dtype=v.dtype, device=v.device)
    stream_ptr = torch.cuda.current_stream(q.device).cuda_stream

    def view(x):
        return cupy.from_dlpack(x.view(bits) if bits is not None else x)

    with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(stream_ptr):
        cq, ck, cv, co = view(q), view(k), view(v), view(out_t)
        p = prepare(cq, ck, cv, global_idx, local_window, scale, is_global_query_mask, impl=impl,
                    storage=storage, validate=validate, out=co, reverse=reverse, plan=plan)
    return _TorchPrepared(p, out_t, stream_ptr, dev, (q, k, v))


def attention_torch(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
                    is_global_query_mask: Any = None, *, impl: str = "auto", validate: bool = True,
                    plan: DevicePlan | None = None):
    """DAAF attention for PyTorch CUDA tensors (bf16/fp16/fp32) ``[B, T, H, D]`` -> ``[B, T, H, Dv]``."""
    return prepare_torch(q, k, v, global_idx, local_window, scale, is_global_query_mask, impl=impl,
                         validate=validate, plan=plan)()
