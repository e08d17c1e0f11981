"""DAAF attention kernels for Hopper GPUs (sm_90a, ``daaf_hopper.cu``): build, prepare, launch.

The semantics are those of :mod:`hpczeco.gpu.daaf` (query ``t`` sees key ``j <= t`` iff ``t - j <= W``
or ``j`` or ``t`` is a key-region token; softmax over that set). ``q, k, v, o: [B, T, H, D]``, 16-bit
(bfloat16 or float16 bits), ``D == Dv``. The plan arrives as the device arrays of a
:class:`hpczeco.gpu.daaf.DevicePlan` (any object with ``global_idx`` int32 ``[G]`` sorted, ``gmask``
uint8 ``[T]``, ``n_global``, ``local_window``, ``T``): this module adds kernels, not planning.

Kernels (``impl``; :data:`VARIANTS` has the shapes):

* ``"hwg"``: warpgroup MMA (wgmma), 2 warpgroups x 64 query rows, 128-key tiles, 3 shared-memory
  stages (cp.async), P from registers; bf16/f16, D in {64, 128}. The Hopper kernel.
* ``"hwg64"`` (64-key tiles, 4 stages), ``"hwg3"`` (3 warpgroups, 64-key tiles), ``"hwg1"`` (one
  warpgroup), ``"hwg_nosw"`` (``hwg`` with unswizzled shared-memory tiles): variants for tuning and
  for diagnosis; bf16, D = 128.
* ``"hfa2"``: mma.sync fallback, 8 warps x 16 rows, 64-key tiles, 3 stages (bf16/f16, D in {64, 128});
  ``"hfa2s2"``: the same with 2 stages (bf16, D = 128).
* ``"hws"``: warp-specialised wgmma (``daaf_hopper_ws.cuh``): a producer warpgroup fills rings of 3 slots
  of 128-key K and V tiles by cp.async completing on mbarriers, 2 consumer warpgroups x 64 rows, setmaxnreg;
  bf16/f16, D in {64, 128}. ``"hwsp"``: the same with ping-pong between the consumers (FlashAttention-3's
  scheduler barrier); ``"hws64"``: 64-key tiles, 6 stages; ``"hws3"`` / ``"hws3p"``: 3 consumers
  (192 rows), 64-key tiles, 5 stages, without / with ping-pong (bf16, D = 128).
* ``"hwin"``: window-only plans (no key regions, ``local_window <= 128``; ``daaf_hopper_win.cuh``): one
  warpgroup x 64 rows loads Q and its whole 192-key band at once, one S product, an exact softmax, two CTAs
  per SM; bf16/f16, D in {64, 128}. ``"hwin2"``: two warpgroups (128 rows) sharing a 256-key band (bf16,
  D = 128). :func:`choose_impl` picks a kernel for a plan.

``sched`` (kernel argument): bit 0 reverses the query tiles (longest rows first), bit 1 makes heads
vary fastest in the 1-D grid. :func:`prepare` returns a :class:`hpczeco.gpu.daaf.Prepared` (``p()``
launches on the current CuPy stream and returns ``out``), like :func:`hpczeco.gpu.daaf.prepare`.

The kernels load and launch through :mod:`hpczeco.gpu.runtime` (:data:`KERNELS`, the runtime slot
:data:`RUNTIME`, as :mod:`hpczeco.gpu.daaf`), so the CPU emulation (:class:`hpczeco.gpu.emu.EmuRuntime`, with its wgmma
model) runs these very wrappers on numpy arrays. On the GPU they are built for ``sm_90a`` (the set's
``arch``: NVRTC called directly, since CuPy's RawModule would add its own ``-arch=sm_90``, under which
wgmma does not exist; ``nvcc`` when NVRTC fails), one cubin per compile group (:data:`GROUPS`, built in
parallel by :func:`prebuild`), cached on disk by source hash
(:func:`hpczeco.gpu.runtime.cubin_cache_dir`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..base.checks import check_scale
from . import daaf_launch
from .runtime import HERE, KernelSet, Prepared, RuntimeSlot, compile_cubin
from .runtime import cached_cubin as runtime_cached_cubin

__all__ = [
    "KERNEL_SOURCE",
    "KERNELS",
    "PTX_HEADER",
    "IMPLS",
    "SCHED_DEFAULT",
    "VARIANTS",
    "Prepared",
    "Variant",
    "GROUPS",
    "build_cubin",
    "build_method",
    "cached_cubin",
    "choose_impl",
    "AUTO_IMPLS",
    "WIN_MAX_WINDOW",
    "prebuild",
    "kernel_info",
    "kernel_name",
    "kernel_names",
    "prepare",
    "RUNTIME",
    "resolve",
    "smem_bytes",
    "unit_kernel_name",
    "UNIT_SMEM_BYTES",
    "wgmma_unit",
]

KERNEL_SOURCE = HERE / "daaf_hopper.cu"
PTX_HEADER = HERE / "daaf_hopper_ptx.cuh"
ARCH = "sm_90a"
SCHED_DEFAULT = 3  # reverse (longest rows first), heads fastest: every head's long key-region rows start first


@dataclass(frozen=True)
class Variant:
    """One compiled kernel family: ``kind`` "wg" (wgmma), "ws" (warp-specialised wgmma), "win" (window-only
    wgmma) or "fa2" (mma.sync)."""

    kind: str
    bn: int  # keys per tile (win: the band of a warpgroup, 192)
    nwg: int  # warpgroups owning query rows (wg, win; ws: the consumers); 0 for fa2
    stages: int  # shared-memory stages (win: 1, the band)
    swizzle: bool
    elems: tuple[str, ...]
    dims: tuple[int, ...]
    pingpong: bool = False  # ws: the consumers take turns issuing their wgmma batches

    @property
    def rows(self) -> int:
        """Query rows per CTA."""
        return 128 if self.kind == "fa2" else 64 * self.nwg

    @property
    def threads(self) -> int:
        if self.kind == "ws":
            return 128 * (self.nwg + 1)  # + the producer warpgroup
        return 256 if self.kind == "fa2" else 128 * self.nwg


VARIANTS: dict[str, Variant] = {
    "hwg": Variant("wg", 128, 2, 3, True, ("bf16", "f16"), (64, 128)),
    "hwg64": Variant("wg", 64, 2, 4, True, ("bf16",), (128,)),
    "hwg3": Variant("wg", 64, 3, 3, True, ("bf16",), (128,)),
    "hwg1": Variant("wg", 128, 1, 3, True, ("bf16",), (128,)),
    "hwg_nosw": Variant("wg", 128, 2, 3, False, ("bf16",), (128,)),
    "hfa2": Variant("fa2", 64, 0, 3, False, ("bf16", "f16"), (64, 128)),
    "hfa2s2": Variant("fa2", 64, 0, 2, False, ("bf16",), (128,)),
    "hws": Variant("ws", 128, 2, 3, True, ("bf16", "f16"), (64, 128)),
    "hwsp": Variant("ws", 128, 2, 3, True, ("bf16",), (128,), pingpong=True),
    "hws64": Variant("ws", 64, 2, 6, True, ("bf16",), (128,)),
    "hws3": Variant("ws", 64, 3, 5, True, ("bf16",), (128,)),
    "hws3p": Variant("ws", 64, 3, 5, True, ("bf16",), (128,), pingpong=True),
    "hwin": Variant("win", 192, 1, 1, True, ("bf16", "f16"), (64, 128)),
    "hwin2": Variant("win", 192, 2, 1, True, ("bf16",), (128,)),
}
IMPLS = tuple(VARIANTS)
UNIT_SMEM_BYTES = (64 + 128) * 128 * 2 + 1024  # DH_UNIT_SMEM_BYTES
WIN_MAX_WINDOW = 128  # DH_WIN_WMAX: the window kernels' band covers local_window <= 128
#: the kernels :func:`choose_impl` returns: plans without key regions (window <= WIN_MAX_WINDOW), key
#: regions in one span (e.g. a leading block), and the rest (several spans, or a count the plan does not
#: know). The fastest of each kind on one H200 (`hpczeco bench gpu-daaf`, 2026-12-03: the FA3-design kernel
#: ``hfa3`` of :mod:`.daaf_fa3` at 0.61-0.81x FlexAttention with key regions, against 1.07-1.34x for hws/hwg3).
AUTO_IMPLS = {"window": "hwin", "one_span": "hfa3", "key_regions": "hfa3"}


def kernel_name(impl: str, elem: str, D: int) -> str:
    """The extern "C" name of ``impl`` for element type ``elem`` ("bf16"/"f16") and head dim ``D``."""
    v = VARIANTS[impl]
    if v.kind == "wg":
        return f"daaf_hwg_{elem}_d{D}_n{v.bn}_w{v.nwg}_s{v.stages}" + ("" if v.swizzle else "_nosw")
    if v.kind == "ws":
        return f"daaf_hws_{elem}_d{D}_n{v.bn}_c{v.nwg}_s{v.stages}" + ("_pp" if v.pingpong else "")
    if v.kind == "win":
        return f"daaf_hwin_{elem}_d{D}_w{v.nwg}"
    return f"daaf_hfa2_{elem}_d{D}_s{v.stages}"


def kernel_names() -> list[str]:
    """Every attention kernel the source defines (the unit kernels: :func:`unit_kernel_name`)."""
    return [kernel_name(i, e, d) for i, v in VARIANTS.items() for e in v.elems for d in v.dims]


def unit_kernel_name(elem: str = "bf16", swizzle: bool = True) -> str:
    return f"daaf_wgmma_unit_{elem}_{'sw128' if swizzle else 'nosw'}"


def smem_bytes(impl: str, D: int) -> int:
    """Dynamic shared memory of a kernel (DhWgCfg / DhWsCfg / DhWinCfg / DhFa2Cfg::SMEM_BYTES)."""
    v = VARIANTS[impl]
    flags = (v.stages * v.bn + 15) // 16 * 16
    if v.kind == "wg":
        return v.rows * D * 2 + v.stages * 2 * v.bn * D * 2 + flags + 1024
    if v.kind == "ws":  # Q, the K and V rings, 4 mbarriers per stage, alignment slack
        return v.rows * D * 2 + v.stages * 2 * v.bn * D * 2 + 4 * v.stages * 8 + 1024
    if v.kind == "win":  # Q, the K and V bands of rows + 128 keys, alignment slack
        return v.rows * D * 2 + 2 * (v.rows + WIN_MAX_WINDOW) * D * 2 + 1024
    rowb = (D + 8) * 2
    return 128 * rowb + v.stages * 2 * v.bn * rowb + flags + 16


def resolve(impl: str, elem: str, D: int, Dv: int) -> Variant:
    """The :class:`Variant` of ``impl``; ``ValueError`` when it does not exist for these inputs."""
    if impl not in VARIANTS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    v = VARIANTS[impl]
    if D != Dv or D not in v.dims or elem not in v.elems:
        raise ValueError(f"impl={impl!r} needs {'/'.join(v.elems)} inputs with D == Dv in {v.dims}; got {elem}, "
                         f"D={D}, Dv={Dv}")
    return v


# --------------------------------------------------------------------------- kernels and their runtime

# kernel -> compile group (DH_GROUP in daaf_hopper.cu): the groups build in parallel (prebuild)
GROUPS: dict[str, int] = {
    "daaf_hwg_bf16_d128_n128_w2_s3": 1,
    "daaf_hwg_f16_d128_n128_w2_s3": 2,
    "daaf_hwg_bf16_d128_n64_w2_s4": 3,
    "daaf_hwg_bf16_d128_n64_w3_s3": 4,
    "daaf_hwg_bf16_d128_n128_w1_s3": 5,
    "daaf_hwg_bf16_d64_n128_w2_s3": 6,
    "daaf_hwg_f16_d64_n128_w2_s3": 6,
    "daaf_hwg_bf16_d128_n128_w2_s3_nosw": 7,
    "daaf_wgmma_unit_bf16_sw128": 8,
    "daaf_wgmma_unit_bf16_nosw": 8,
    "daaf_wgmma_unit_f16_sw128": 8,
    "daaf_hfa2_bf16_d128_s3": 9,
    "daaf_hfa2_bf16_d128_s2": 9,
    "daaf_hfa2_f16_d128_s3": 10,
    "daaf_hfa2_bf16_d64_s3": 10,
    "daaf_hfa2_f16_d64_s3": 10,
    "daaf_hws_bf16_d128_n128_c2_s3": 11,
    "daaf_hws_f16_d128_n128_c2_s3": 12,
    "daaf_hws_bf16_d64_n128_c2_s3": 12,
    "daaf_hws_f16_d64_n128_c2_s3": 12,
    "daaf_hws_bf16_d128_n128_c2_s3_pp": 13,
    "daaf_hws_bf16_d128_n64_c2_s6": 14,
    "daaf_hws_bf16_d128_n64_c3_s5": 15,
    "daaf_hws_bf16_d128_n64_c3_s5_pp": 16,
    "daaf_hwin_bf16_d128_w1": 17,
    "daaf_hwin_f16_d128_w1": 17,
    "daaf_hwin_bf16_d64_w1": 17,
    "daaf_hwin_f16_d64_w1": 17,
    "daaf_hwin_bf16_d128_w2": 18,
}
N_GROUPS = max(GROUPS.values())


#: the Hopper kernels: one cubin per compile group, for sm_90a (``group`` "0": every kernel)
KERNELS = KernelSet(
    label="hpczeco.gpu.daaf_hopper",
    files=(KERNEL_SOURCE.name,),
    names=lambda file: list(GROUPS),
    name_expressions=False,
    group=lambda name: str(GROUPS[name]),
    arch=ARCH,
    group_options=lambda group: (f"-DDH_GROUP={group}",),
)
#: the runtime the Hopper wrappers launch on (CuPy unless a test has set another, e.g. the CPU emulation)
RUNTIME = RuntimeSlot(KERNELS)


def _kernels_for(arch: str) -> KernelSet:
    return KERNELS if arch == KERNELS.arch else dataclasses.replace(KERNELS, arch=arch)


def build_cubin(arch: str = ARCH, use_nvcc: bool | None = None, group: int = 0) -> tuple[bytes, str]:
    """Compile ``daaf_hopper.cu`` (compile group ``group``; 0: all) to a cubin: ``(cubin, how)``, ``how``
    "nvrtc" or "nvcc" (:func:`hpczeco.gpu.runtime.compile_cubin`; None tries NVRTC first)."""
    return compile_cubin(KERNELS.source(), KERNEL_SOURCE.name, KERNELS.compile_options(str(group)), arch, use_nvcc)


def cached_cubin(group: int = 0, arch: str = ARCH) -> tuple[Path, str]:
    """The cubin of ``group`` from the cache (:func:`hpczeco.gpu.runtime.cubin_cache_dir`), built and stored
    when missing: ``(path, how)``."""
    return runtime_cached_cubin(_kernels_for(arch), KERNEL_SOURCE.name, str(group))


def _build_one(group: int) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    path, how = cached_cubin(group)
    return group, str(path), how, time.perf_counter() - t0


def prebuild(groups: list[int] | None = None, workers: int | None = None) -> list[tuple[int, str, str, float]]:
    """Build the cubins of ``groups`` (default: all) in parallel processes: ``[(group, path, how, seconds)]``.
    Call before any CUDA use in this process (the workers are spawned, not forked)."""
    import concurrent.futures as cf  # noqa: PLC0415
    import multiprocessing as mp  # noqa: PLC0415

    groups = list(range(1, N_GROUPS + 1)) if groups is None else groups
    with cf.ProcessPoolExecutor(max_workers=workers or len(groups), mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_build_one, groups))


def build_method(device_id: int = 0, group: int = 1) -> str:
    """How the module of ``group`` was obtained: "nvrtc", "nvcc" or "cache" (loads it)."""
    rt = RUNTIME.get()
    rt.module(KERNEL_SOURCE.name, str(group), device_id)
    return rt.built[(device_id, KERNEL_SOURCE.name, str(group))]


def kernel_info() -> dict[str, dict]:
    """Per kernel: registers, local (spill) bytes, dynamic shared bytes (builds the module; CuPy only)."""
    rt = RUNTIME.get()
    info = {}
    for impl, v in VARIANTS.items():
        for e in v.elems:
            for d in v.dims:
                name = kernel_name(impl, e, d)
                kern = rt.function(name, smem_bytes(impl, d))
                info[name] = {"num_regs": int(kern.num_regs), "local_size_bytes": int(kern.local_size_bytes),
                              "dynamic_smem_bytes": smem_bytes(impl, d), "impl": impl}
    return info


# --------------------------------------------------------------------------- launches


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


def prepare(q, k, v, plan, scale: float | None = None, *, impl: str = "hwg", storage: str | None = None,
            out=None, sched: int = SCHED_DEFAULT) -> Prepared:
    """Check shapes once and return a :class:`Prepared` launch of ``impl`` on device arrays.

    ``q, k, v: [B, T, H, D]`` (C-contiguous, 16-byte aligned, one 16-bit dtype; CuPy arrays, numpy under
    the CPU emulation); ``plan``: a :class:`hpczeco.gpu.daaf.DevicePlan` for the same ``T`` (its arrays are
    used as they are: validate them when building the plan); ``scale`` defaults to ``D ** -0.5``.
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
    var = resolve(impl, elem, D, int(v.shape[3]))
    if int(plan.T) != T:
        raise ValueError(f"plan covers T={plan.T} tokens, q has T={T}")
    W = min(int(plan.local_window), T)
    if var.kind == "win" and (int(plan.n_global) != 0 or W > WIN_MAX_WINDOW):
        raise ValueError(f"impl={impl!r} is for plans without key regions and local_window <= {WIN_MAX_WINDOW}; "
                         f"got n_global={plan.n_global}, local_window={W} (see choose_impl)")
    if T >= 2**31 - 256 or B * H * T >= 2**31:
        raise ValueError(f"shape out of range: B={B}, T={T}, H={H}")
    scale = check_scale(scale, D)
    if out is None:
        out = xp.empty_like(v)
    elif not (rt.is_native(out) and out.shape == v.shape and out.dtype == v.dtype
              and out.flags.c_contiguous and rt.ptr(out) % 16 == 0):
        raise ValueError(f"out must be a C-contiguous device array of shape {tuple(v.shape)} and dtype {v.dtype}")
    gidx = getattr(plan, "_gidx_arg", None)
    if gidx is None:
        gidx = plan.global_idx if plan.global_idx.size else xp.zeros(1, dtype=np.int32)
    name = kernel_name(impl, elem, D)
    nqt = (T + var.rows - 1) // var.rows
    args = (q, k, v, out, gidx, plan.gmask, np.int32(B), np.int32(T), np.int32(H), np.int32(plan.n_global),
            np.int32(W), np.float32(scale * math.log2(math.e)), np.int32(sched))
    launch = rt.bind(name, (nqt * H * B,), (var.threads,), args, smem_bytes(impl, D))
    if var.kind == "win" and var.nwg == 1:
        _prefer_max_shared(rt, name, smem_bytes(impl, D))
    return daaf_launch.record(Prepared(launch, out, impl, name), rt, name, (nqt * H * B,), (var.threads,), args,
                              smem_bytes(impl, D))


def _prefer_max_shared(rt: Any, name: str, smem: int) -> None:
    """Ask for the largest shared-memory carveout (two 113 KB CTAs of ``hwin`` per SM need 228 KB); CuPy's
    kernels only (the emulation has no carveout)."""
    function = getattr(rt, "function", None)
    if function is None:
        return
    kern = function(name, smem)
    if hasattr(kern, "preferred_shared_memory_carveout"):
        kern.preferred_shared_memory_carveout = 100


def choose_impl(plan: Any, T: int | None = None, D: int = 128, cc: str | int = "90", elem: str = "bf16") -> str | None:
    """The kernel of this module for a plan, from its host metadata only (no device access, no sync).

    ``plan``: anything with ``n_global`` and ``local_window`` (``T`` when ``T`` is None; optional ``n_regions``, the
    number of key-region spans, None when unknown), e.g. a :class:`hpczeco.gpu.daaf.DevicePlan`; ``cc``: the
    device's compute capability ("90"); ``elem``: "bf16" or "f16". Plans without key regions and ``local_window <=
    WIN_MAX_WINDOW`` get :data:`AUTO_IMPLS` ["window"]; key regions in one span ["one_span"]; the others
    ["key_regions"]; the first of that, "hws", "hwg" that exists for ``elem`` and ``D`` (the FA3-design kernels are
    variants of :mod:`.daaf_fa3`). None when no kernel here applies (not compute capability 9.0, no variant for
    ``elem`` / ``D``, or a window-only plan wider than the window kernels): use gpu/daaf.py's.
    """
    if str(cc).replace(".", "") != "90":
        return None
    T = int(plan.T) if T is None else int(T)
    if int(plan.n_global) == 0:
        if min(int(plan.local_window), T) > WIN_MAX_WINDOW:
            return None  # the window alone, wider than hwin's band: gpu/daaf.py's window kernel is faster
        key = "window"
    else:
        key = "one_span" if getattr(plan, "n_regions", None) == 1 else "key_regions"
    for impl in (AUTO_IMPLS[key], "hws", "hwg"):
        v = VARIANTS.get(impl)
        if v is None:  # a kernel of gpu/daaf_fa3.py (e.g. AUTO_IMPLS["key_regions"] = "hfa3")
            from . import daaf_fa3  # noqa: PLC0415

            v = daaf_fa3.VARIANTS[impl]
        if elem in v.elems and D in v.dims and (v.kind != "win" or key == "window"):
            return impl
    return None


def wgmma_unit(a_bits, b_bits, mode: int, elem: str = "bf16", swizzle: bool = True):
    """Run the wgmma unit kernel: ``a_bits`` uint16 ``[64, 128]``, ``b_bits`` uint16 ``[128, 128]``
    (mode bit 0: B as ``[k][n]`` (MN-major, the V tile), else ``[n][k]`` (K-major, the K tile);
    bit 1: A from registers). Returns ``d`` float32 ``[64, 128]`` (a device array) = A @ B."""
    rt = RUNTIME.get()
    xp = rt.xp
    a = xp.ascontiguousarray(xp.asarray(a_bits, dtype=xp.uint16))
    b = xp.ascontiguousarray(xp.asarray(b_bits, dtype=xp.uint16))
    if a.shape != (64, 128) or b.shape != (128, 128):
        raise ValueError(f"a must be [64, 128] and b [128, 128], got {a.shape}, {b.shape}")
    d = xp.full((64, 128), np.nan, dtype=xp.float32)
    rt.launch(unit_kernel_name(elem, swizzle), (1,), (128,), (a, b, d, np.int32(mode)), UNIT_SMEM_BYTES)
    return d
