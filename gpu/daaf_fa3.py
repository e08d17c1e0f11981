"""DAAF attention with key regions in FlashAttention-3's design for Hopper (``daaf_fa3.cu``): build, prepare, launch.

The semantics and plan are those of :mod:`hpczeco.gpu.daaf_hopper` (any object with ``global_idx``, ``gmask``,
``n_global``, ``local_window``, ``T``, e.g. a :class:`hpczeco.gpu.daaf.DevicePlan`). ``q, k, v, o: [B, T, H, D]``
16-bit (bf16/f16 bits), ``D == Dv`` in {64, 128, 256}. Kernels (:data:`VARIANTS`): ``"hfa3"`` and ``"hfa3p"``
(ping-pong between the two consumer warpgroups), ``"hfa3s3"`` (bf16, D = 128: 3 K/V stages, one Q buffer): a
producer warp loads Q, K and V by TMA (tensor maps of the 4-d
tensors made here per pointer, passed by value) into mbarrier rings, two consumer warpgroups of 64 rows run the
wgmma loop, persistent CTAs (one per multiprocessor) take query tiles from a queue in the order of
:data:`SCHED_DEFAULT` (the longest rows first). Per D (:data:`CONFIG`): 128 keys per tile, 2 K/V stages and 2 Q
buffers at D = 128; 4 stages at D = 64; 64 keys, 2 stages, 1 Q buffer at D = 256 (shared memory).

A launch goes through :class:`hpczeco.gpu.daaf_launch.Launcher` (tensor maps are struct parameters, which CuPy's
kernel call cannot pass): the driver's ``cuLaunchKernel`` with a parameter block, or ``rt.launch`` under the CPU
emulation (:class:`hpczeco.gpu.emu.EmuRuntime`, whose ``tensor_map`` makes emulated maps). The queue's counter is one
small device array per (device, stream), reset by the kernel's last CTA. Cubins for ``sm_90a`` through
:mod:`hpczeco.gpu.runtime` (NVRTC, nvcc when NVRTC fails), one per compile group (:data:`GROUPS`).
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import daaf_launch
from .runtime import HERE, KernelSet, Prepared, RuntimeSlot
from .runtime import cached_cubin as runtime_cached_cubin

__all__ = ["ARCH", "CONFIG", "DIMS", "ELEMS", "GROUPS", "IMPLS", "KERNELS", "KERNEL_SOURCE", "SCHED_DEFAULT",
           "VARIANTS", "Fa3Variant", "kernel_name", "kernel_names", "prebuild", "prepare", "resolve",
           "smem_bytes", "tensor_map"]

KERNEL_SOURCE = HERE / "daaf_fa3.cu"
ARCH = "sm_90a"
SCHED_DEFAULT = 3  # dh_tile_of: query tiles in reverse (the longest rows first), heads fastest
ELEMS = ("bf16", "f16")
DIMS = (64, 128, 256)
#: D -> (keys per tile BN, K/V stages ST, Q buffers NQ): the FA3_KERNEL instantiations of daaf_fa3.cu
CONFIG = {64: (128, 4, 2), 128: (128, 2, 2), 256: (64, 2, 1)}
BM = 128  # query rows per tile (2 consumer warpgroups)
THREADS = 384


@dataclass(frozen=True)
class Fa3Variant:
    """``pingpong``: the consumer warpgroups take turns issuing their wgmma batches; ``config``: D -> (keys per tile,
    K/V stages, Q buffers) where it differs from :data:`CONFIG`; ``suffix`` of its kernel names."""

    pingpong: bool
    elems: tuple[str, ...] = ELEMS
    dims: tuple[int, ...] = DIMS
    config: tuple[tuple[int, tuple[int, int, int]], ...] = ()
    suffix: str = ""
    kind: str = "fa3"
    rows: int = BM
    threads: int = THREADS

    def shape(self, D: int) -> tuple[int, int, int]:
        """(keys per tile BN, K/V stages ST, Q buffers NQ) at head dim ``D``."""
        return dict(self.config).get(D, CONFIG[D])


VARIANTS: dict[str, Fa3Variant] = {
    "hfa3": Fa3Variant(False),
    "hfa3p": Fa3Variant(True, suffix="_pp"),
    "hfa3s3": Fa3Variant(False, elems=("bf16",), dims=(128,), config=((128, (128, 3, 1)),), suffix="_s3"),
}
IMPLS = tuple(VARIANTS)


def kernel_name(impl: str, elem: str, D: int) -> str:
    """The extern "C" name of ``impl`` for ``elem`` ("bf16"/"f16") and head dim ``D``."""
    return f"daaf_hfa3_{elem}_d{D}" + VARIANTS[impl].suffix


def kernel_names() -> list[str]:
    return [kernel_name(i, e, d) for i, v in VARIANTS.items() for e in v.elems for d in v.dims]


def _group_of(name: str) -> int:
    if name.endswith("_s3"):
        return 6
    D = int(name.split("_d")[1].split("_")[0])
    pp = name.endswith("_pp")
    return {(128, False): 1, (128, True): 2, (64, False): 3, (64, True): 3, (256, False): 4, (256, True): 5}[(D, pp)]


#: kernel -> compile group (FA3_GROUP in daaf_fa3.cu)
GROUPS: dict[str, int] = {n: _group_of(n) for n in kernel_names()}
N_GROUPS = max(GROUPS.values())


def smem_bytes(D: int, impl: str = "hfa3") -> int:
    """Dynamic shared memory of ``impl``'s kernels at head dim ``D`` (Fa3Cfg::SMEM_BYTES)."""
    BN, ST, NQ = VARIANTS[impl].shape(D)
    n_bar = 4 * ST + 2 * NQ + 4
    off_flag = NQ * BM * D * 2 + 2 * ST * BN * D * 2 + 8 * n_bar + 2 * 16 * 4
    return off_flag + (2 * ST * 4 + 15) // 16 * 16 + 1024


def resolve(impl: str, elem: str, D: int, Dv: int) -> Fa3Variant:
    """The :class:`Fa3Variant` of ``impl``; ``ValueError`` when it does not exist for these inputs."""
    if impl not in VARIANTS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    v = VARIANTS[impl]
    if D != Dv or D not in v.dims or elem not in v.elems:
        raise ValueError(f"impl={impl!r} needs {'/'.join(v.elems)} inputs with D == Dv in {v.dims}; got {elem}, "
                         f"D={D}, Dv={Dv}")
    return v


KERNELS = KernelSet(
    label="hpczeco.gpu.daaf_fa3",
    files=(KERNEL_SOURCE.name,),
    names=lambda file: list(GROUPS),
    name_expressions=False,
    group=lambda name: str(GROUPS[name]),
    arch=ARCH,
    group_options=lambda group: (f"-DFA3_GROUP={group}",),
)
#: the runtime the wrappers launch on (CuPy unless a test has set another, e.g. the CPU emulation)
RUNTIME = RuntimeSlot(KERNELS)


def cached_cubin(group: int) -> tuple[Any, str]:
    return runtime_cached_cubin(KERNELS, KERNEL_SOURCE.name, str(group))


def _build_one(group: int):
    import time  # noqa: PLC0415

    t0 = time.perf_counter()
    path, how = cached_cubin(group)
    return group, str(path), how, time.perf_counter() - t0


def prebuild(groups: list[int] | None = None, workers: int | None = None) -> list[tuple[int, str, str, float]]:
    """Build the cubins of ``groups`` (default: all) in parallel processes (before any CUDA use in this process)."""
    import concurrent.futures as cf  # noqa: PLC0415
    import multiprocessing as mp  # noqa: PLC0415

    groups = list(range(1, N_GROUPS + 1)) if groups is None else groups
    with cf.ProcessPoolExecutor(max_workers=workers or len(groups), mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_build_one, groups))


# --------------------------------------------------------------------------- tensor maps

_CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1  # the 16-bit bits as they are (bf16 and f16 alike; out-of-bounds: zeros)
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_256B = 3
_LIBCUDA: Any = None


def _encode_tiled(ptr: int, dims, strides, box) -> ctypes.Array:
    """``cuTensorMapEncodeTiled`` (the driver, through ctypes) of a 16-bit tensor, 128-byte swizzle: 128 bytes."""
    global _LIBCUDA  # noqa: PLW0603 - loaded once
    if _LIBCUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _LIBCUDA = f
    rank = len(dims)
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63  # CUtensorMap is 64-byte aligned
    rc = _LIBCUDA(addr, _CU_TENSOR_MAP_DATA_TYPE_UINT16, rank, ptr, (ctypes.c_uint64 * rank)(*dims),
                  (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
                  (ctypes.c_uint32 * rank)(*([1] * rank)), 0, _CU_TENSOR_MAP_SWIZZLE_128B,
                  _CU_TENSOR_MAP_L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {dims}, strides {strides}, "
                           f"box {box} at {ptr:#x}")
    out = (ctypes.c_ubyte * 128)()
    ctypes.memmove(out, addr, 128)
    return out


_MAPS: OrderedDict[tuple, ctypes.Array] = OrderedDict()
_MAPS_MAX = 512
_MAPS_LOCK = threading.Lock()


def tensor_map(rt: Any, ptr: int, B: int, T: int, H: int, D: int, rows: int) -> ctypes.Array:
    """The tensor map of a [B, T, H, D] 16-bit tensor at ``ptr``: dims (D, H, T, B), boxes of 64 columns x 1 head x
    ``rows`` tokens x 1 batch, 128-byte swizzle (tokens past T read as zeros). Cached by all of these (a few
    microseconds to encode; layers reuse addresses)."""
    key = (id(rt), ptr, B, T, H, D, rows)
    m = _MAPS.get(key)
    if m is not None:
        return m
    dims, strides, box = (D, H, T, B), (D * 2, H * D * 2, T * H * D * 2), (64, 1, rows, 1)
    own = getattr(rt, "tensor_map", None)
    m = own(ptr, dims, strides, box, 2, _CU_TENSOR_MAP_SWIZZLE_128B) if own is not None else _encode_tiled(
        ptr, dims, strides, box)
    with _MAPS_LOCK:
        _MAPS[key] = m
        while len(_MAPS) > _MAPS_MAX:
            _MAPS.popitem(last=False)
    return m


# --------------------------------------------------------------------------- launches

_QUEUES: dict[tuple, Any] = {}  # (runtime, device, stream) -> int32 [2] device array: the tile queue's counter
_SMS: dict[tuple, int] = {}  # (runtime, device) -> multiprocessors


def _device(rt: Any) -> int:
    cuda = getattr(rt.xp, "cuda", None)
    return int(cuda.runtime.getDevice()) if cuda is not None and hasattr(cuda, "runtime") else 0


def _sm_count(rt: Any, dev: int) -> int:
    key = (id(rt), dev)
    n = _SMS.get(key)
    if n is None:
        n = getattr(rt, "sm_count", None)
        if n is None:
            n = int(rt.xp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
        _SMS[key] = n = int(n)
    return n


def _queue(rt: Any, dev: int, stream: int) -> Any:
    """The tile queue's counter for launches on (device, stream): zeros, left at zero by every launch."""
    key = (id(rt), dev, stream)
    qa = _QUEUES.get(key)
    if qa is None:
        cuda = getattr(rt.xp, "cuda", None)
        if cuda is None or stream == _current_stream(rt.xp):
            qa = rt.xp.zeros(2, dtype=np.int32)
        else:  # zeroed on the stream the kernels will run on (ordered before them, no host sync)
            with cuda.ExternalStream(stream):
                qa = rt.xp.zeros(2, dtype=np.int32)
        _QUEUES[key] = qa
    return qa


def _current_stream(xp: Any) -> int:
    cuda = getattr(xp, "cuda", None)
    return int(getattr(cuda.get_current_stream(), "ptr", 0)) if cuda is not None else 0


def _elem_of(x: Any, storage: str | None) -> str:
    dt = str(x.dtype)
    if dt == "float16":
        return "f16"
    if dt == "bfloat16":
        return "bf16"
    if dt in ("uint16", "int16") and storage in ("bfloat16", "float16"):
        return "bf16" if storage == "bfloat16" else "f16"
    raise TypeError(f"q, k, v must be float16/bfloat16 (or raw 16-bit bits with storage='bfloat16'/'float16'), "
                    f"got {dt} with storage={storage!r}")


def prepare(q, k, v, plan, scale: float | None = None, *, impl: str = "hfa3", storage: str | None = None,
            out=None, sched: int = SCHED_DEFAULT) -> Prepared:
    """Check shapes once and return a :class:`Prepared` launch of ``impl`` (``p()`` launches on the current stream).

    ``q, k, v: [B, T, H, D]`` (C-contiguous, 16-byte aligned, one 16-bit dtype; CuPy arrays, numpy under the CPU
    emulation); ``plan``: a :class:`hpczeco.gpu.daaf.DevicePlan` for the same ``T``; ``scale`` defaults to
    ``D ** -0.5``; ``sched``: the queue's order (bit 0 longest rows first, bit 1 heads fastest).
    """
    rt = RUNTIME.get()
    xp = rt.xp
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not rt.is_native(x) or x.ndim != 4 or not x.flags.c_contiguous or rt.ptr(x) % 16:
            raise ValueError(f"{name} must be a C-contiguous, 16-byte aligned 4-d device array [B, T, H, D]")
    if not (q.dtype == k.dtype == v.dtype) or tuple(q.shape) != tuple(k.shape) or tuple(v.shape) != tuple(q.shape):
        raise ValueError(f"q, k, v must share dtype and shape [B, T, H, D]; got {q.shape}, {k.shape}, {v.shape}")
    B, T, H, D = (int(s) for s in q.shape)
    elem = _elem_of(q, storage)
    resolve(impl, elem, D, int(v.shape[3]))
    if int(plan.T) != T:
        raise ValueError(f"plan covers T={plan.T} tokens, q has T={T}")
    if T >= 2**31 - 256 or B * H * T >= 2**31 or B > 65535 or H > 65535:
        raise ValueError(f"shape out of range: B={B}, T={T}, H={H}")
    if not 0 <= int(sched) <= 3:
        raise ValueError(f"sched must be in [0, 3], got {sched}")
    W = min(int(plan.local_window), T)
    scale = D**-0.5 if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if out is None:
        out = xp.empty_like(v)
    elif not (rt.is_native(out) and out.shape == v.shape and out.dtype == v.dtype
              and out.flags.c_contiguous and rt.ptr(out) % 16 == 0):
        raise ValueError(f"out must be a C-contiguous device array of shape {tuple(v.shape)} and dtype {v.dtype}")
    gidx = getattr(plan, "_gidx_arg", None)
    if gidx is None:
        gidx = plan.global_idx if plan.global_idx.size else xp.zeros(1, dtype=np.int32)
    name = kernel_name(impl, elem, D)
    BN = VARIANTS[impl].shape(D)[0]
    n_work = (T + BM - 1) // BM * H * B
    dev = _device(rt)
    grid = (min(n_work, _sm_count(rt, dev)),)
    smem = smem_bytes(D, impl)
    stream0 = _current_stream(xp)

    def maps(ptrs: tuple[int, int, int, int]) -> tuple:
        return (tensor_map(rt, ptrs[0], B, T, H, D, BM), tensor_map(rt, ptrs[1], B, T, H, D, BN),
                tensor_map(rt, ptrs[2], B, T, H, D, BN))

    def retarget(ptrs: tuple[int, int, int, int], stream: int) -> dict:
        mq, mk, mv = maps(ptrs)
        return {0: mq, 1: mk, 2: mv, 9: ctypes.c_uint64(rt.ptr(_queue(rt, dev, stream)))}

    ptrs = (rt.ptr(q), rt.ptr(k), rt.ptr(v), rt.ptr(out))
    args = (*maps(ptrs), q, k, v, out, gidx, plan.gmask, _queue(rt, dev, stream0), np.int32(B), np.int32(T),
            np.int32(H), np.int32(plan.n_global), np.int32(W), np.float32(scale * math.log2(math.e)), np.int32(sched),
            np.int32(n_work))
    p = Prepared(None, out, impl, name, sched)
    daaf_launch.record(p, rt, name, grid, (THREADS,), args, smem, io=(3, 4, 5, 6), retarget=retarget)
    launcher = daaf_launch.Launcher(p.spec)
    p.launch = lambda: launcher(ptrs, _current_stream(xp))
    return p
