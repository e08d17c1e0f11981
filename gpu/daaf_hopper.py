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

``sched`` (kernel argument): bit 0 reverses the query tiles (longest rows first), bit 1 makes heads
vary fastest in the 1-D grid. :func:`prepare` returns a :class:`Prepared` (``p()`` launches on the
current CuPy stream and returns ``out``), like :func:`hpczeco.gpu.daaf.prepare`.

Built with NVRTC for ``sm_90a`` (CuPy's RawModule would add its own ``-arch=sm_90``, under which
wgmma does not exist), else with ``nvcc`` when NVRTC fails; one cubin per compile group (:data:`GROUPS`,
built in parallel by :func:`prebuild`), cached on disk by source hash (:func:`cache_dir`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "KERNEL_SOURCE",
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
    "prebuild",
    "kernel_info",
    "kernel_name",
    "kernel_names",
    "prepare",
    "resolve",
    "smem_bytes",
    "unit_kernel_name",
    "UNIT_SMEM_BYTES",
    "wgmma_unit",
]

HERE = Path(__file__).resolve().parent
KERNEL_SOURCE = HERE / "daaf_hopper.cu"
PTX_HEADER = HERE / "daaf_hopper_ptx.cuh"
ARCH = "sm_90a"
SCHED_DEFAULT = 3  # reverse (longest rows first), heads fastest: every head's long key-region rows start first


@dataclass(frozen=True)
class Variant:
    """One compiled kernel family: ``kind`` "wg" (wgmma) or "fa2" (mma.sync)."""

    kind: str
    bn: int  # keys per tile
    nwg: int  # warpgroups (wg); 0 for fa2
    stages: int
    swizzle: bool
    elems: tuple[str, ...]
    dims: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Query rows per CTA."""
        return 64 * self.nwg if self.kind == "wg" else 128

    @property
    def threads(self) -> int:
        return 128 * self.nwg if self.kind == "wg" else 256


VARIANTS: dict[str, Variant] = {
    "hwg": Variant("wg", 128, 2, 3, True, ("bf16", "f16"), (64, 128)),
    "hwg64": Variant("wg", 64, 2, 4, True, ("bf16",), (128,)),
    "hwg3": Variant("wg", 64, 3, 3, True, ("bf16",), (128,)),
    "hwg1": Variant("wg", 128, 1, 3, True, ("bf16",), (128,)),
    "hwg_nosw": Variant("wg", 128, 2, 3, False, ("bf16",), (128,)),
    "hfa2": Variant("fa2", 64, 0, 3, False, ("bf16", "f16"), (64, 128)),
    "hfa2s2": Variant("fa2", 64, 0, 2, False, ("bf16",), (128,)),
}
IMPLS = tuple(VARIANTS)
UNIT_SMEM_BYTES = (64 + 128) * 128 * 2 + 1024  # DH_UNIT_SMEM_BYTES


def kernel_name(impl: str, elem: str, D: int) -> str:
    """The extern "C" name of ``impl`` for element type ``elem`` ("bf16"/"f16") and head dim ``D``."""
    v = VARIANTS[impl]
    if v.kind == "wg":
        return f"daaf_hwg_{elem}_d{D}_n{v.bn}_w{v.nwg}_s{v.stages}" + ("" if v.swizzle else "_nosw")
    return f"daaf_hfa2_{elem}_d{D}_s{v.stages}"


def kernel_names() -> list[str]:
    """Every attention kernel the source defines (the unit kernels: :func:`unit_kernel_name`)."""
    return [kernel_name(i, e, d) for i, v in VARIANTS.items() for e in v.elems for d in v.dims]


def unit_kernel_name(elem: str = "bf16", swizzle: bool = True) -> str:
    return f"daaf_wgmma_unit_{elem}_{'sw128' if swizzle else 'nosw'}"


def smem_bytes(impl: str, D: int) -> int:
    """Dynamic shared memory of a kernel (DhWgCfg / DhFa2Cfg::SMEM_BYTES)."""
    v = VARIANTS[impl]
    flags = (v.stages * v.bn + 15) // 16 * 16
    if v.kind == "wg":
        return v.rows * D * 2 + v.stages * 2 * v.bn * D * 2 + flags + 1024
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


# --------------------------------------------------------------------------- build (NVRTC for sm_90a, else nvcc)

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
}
N_GROUPS = max(GROUPS.values())


def _source() -> tuple[str, str]:
    return KERNEL_SOURCE.read_text(), PTX_HEADER.read_text()


def cache_dir() -> Path:
    """Where built cubins are kept (``$HPCZECO_HOPPER_CACHE``, else a folder in the temp directory)."""
    d = Path(os.environ.get("HPCZECO_HOPPER_CACHE") or Path(tempfile.gettempdir()) / "hpczeco-hopper-cubins")
    d.mkdir(parents=True, exist_ok=True)
    return d


def cubin_path(group: int = 0, arch: str = ARCH) -> Path:
    """The cache file of compile group ``group`` (0: every kernel) for the current sources."""
    src, hdr = _source()
    key = hashlib.sha256((src + "\0" + hdr + "\0" + arch).encode()).hexdigest()[:16]
    return cache_dir() / f"daaf_hopper-{key}-{arch}-g{group}.cubin"


def build_cubin(arch: str = ARCH, use_nvcc: bool | None = None, group: int = 0) -> tuple[bytes, str]:
    """Compile ``daaf_hopper.cu`` (compile group ``group``; 0: all) to a cubin: ``(cubin, how)``, ``how``
    "nvrtc" or "nvcc". ``use_nvcc``: None tries NVRTC (CuPy's binding) first and nvcc when that fails."""
    errors = []
    define = [f"-DDH_GROUP={group}"]
    if not use_nvcc:
        try:
            from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

            src, hdr = _source()
            prog = nvrtc.createProgram(src, KERNEL_SOURCE.name, [hdr], [PTX_HEADER.name])
            try:
                try:
                    nvrtc.compileProgram(prog, ["-std=c++17", f"--gpu-architecture={arch}", *define])
                except Exception as exc:
                    raise RuntimeError(f"NVRTC: {exc}\n{nvrtc.getProgramLog(prog)[-4000:]}") from exc
                return nvrtc.getCUBIN(prog), "nvrtc"
            finally:
                nvrtc.destroyProgram(prog)
        except Exception as exc:
            if use_nvcc is False:
                raise
            errors.append(f"{type(exc).__name__}: {exc}")
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not shutil.which(nvcc):
        raise RuntimeError(f"cannot build daaf_hopper.cu: {'; '.join(errors)}; and no nvcc")
    with tempfile.TemporaryDirectory(prefix="hpczeco-hopper-") as d:
        out = Path(d) / "daaf_hopper.cubin"
        cmd = [nvcc, "-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-std=c++17", f"-I{HERE}", *define,
               str(KERNEL_SOURCE), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}; earlier: {'; '.join(errors)}")
        return out.read_bytes(), "nvcc"


def cached_cubin(group: int = 0, arch: str = ARCH) -> tuple[Path, str]:
    """The cubin of ``group`` from the cache, built (and stored) when missing: ``(path, how)``."""
    path = cubin_path(group, arch)
    if path.exists():
        return path, "cache"
    data, how = build_cubin(arch, group=group)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path, how


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


def _cupy():
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(f"hpczeco.gpu.daaf_hopper needs CuPy ({exc})") from exc
    return cupy


@functools.cache
def _module(device_id: int, group: int):
    cupy = _cupy()
    with cupy.cuda.Device(device_id):
        cc = cupy.cuda.Device(device_id).compute_capability
        if cc != "90":
            raise RuntimeError(f"daaf_hopper kernels are built for sm_90a (Hopper); device {device_id} is sm_{cc}")
        path, how = cached_cubin(group)
        return cupy.RawModule(path=str(path)), how


def build_method(device_id: int = 0, group: int = 1) -> str:
    """How the module of ``group`` was obtained: "nvrtc", "nvcc" or "cache" (loads it)."""
    return _module(device_id, group)[1]


@functools.cache
def _kernel_on(device_id: int, name: str, smem: int):
    cupy = _cupy()
    with cupy.cuda.Device(device_id):
        kern = _module(device_id, GROUPS[name])[0].get_function(name)
        if smem > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = smem
        return kern


def _kernel(name: str, smem: int):
    return _kernel_on(_cupy().cuda.Device().id, name, smem)


def kernel_info() -> dict[str, dict]:
    """Per kernel: registers, local (spill) bytes, dynamic shared bytes (builds the module)."""
    info = {}
    for impl, v in VARIANTS.items():
        for e in v.elems:
            for d in v.dims:
                name = kernel_name(impl, e, d)
                kern = _kernel(name, smem_bytes(impl, d))
                info[name] = {"num_regs": int(kern.num_regs), "local_size_bytes": int(kern.local_size_bytes),
                              "dynamic_smem_bytes": smem_bytes(impl, d), "impl": impl}
    return info


# --------------------------------------------------------------------------- launches


class Prepared:
    """One ready launch: ``p()`` runs the kernel on the current stream and returns the output array."""

    def __init__(self, kern, grid, block, args, smem: int, out, impl: str, name: str):
        self.kern, self.grid, self.block, self.args, self.smem = kern, grid, block, args, smem
        self.out, self.impl, self.name = out, impl, name

    def __call__(self):
        self.kern(self.grid, self.block, self.args, shared_mem=self.smem)
        return self.out


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
    """Check shapes once and return a :class:`Prepared` launch of ``impl`` on CuPy arrays.

    ``q, k, v: [B, T, H, D]`` (C-contiguous, 16-byte aligned, one 16-bit dtype); ``plan``: a
    :class:`hpczeco.gpu.daaf.DevicePlan` for the same ``T`` (its arrays are used as they are: validate
    them when building the plan); ``scale`` defaults to ``D ** -0.5``.
    """
    cupy = _cupy()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, cupy.ndarray) or x.ndim != 4 or not x.flags.c_contiguous or x.data.ptr % 16:
            raise ValueError(f"{name} must be a C-contiguous, 16-byte aligned 4-d CuPy array [B, T, H, D]")
    if not (q.dtype == k.dtype == v.dtype) or tuple(q.shape) != tuple(k.shape) or tuple(v.shape) != tuple(q.shape):
        raise ValueError(f"q, k, v must share dtype and shape [B, T, H, D]; got {q.shape}, {k.shape}, {v.shape}")
    B, T, H, D = (int(s) for s in q.shape)
    elem = _elem_of(q, storage)
    var = resolve(impl, elem, D, int(v.shape[3]))
    if int(plan.T) != T:
        raise ValueError(f"plan covers T={plan.T} tokens, q has T={T}")
    if T >= 2**31 - 256 or B * H * T >= 2**31:
        raise ValueError(f"shape out of range: B={B}, T={T}, H={H}")
    scale = D**-0.5 if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if out is None:
        out = cupy.empty_like(v)
    elif not (isinstance(out, cupy.ndarray) and out.shape == v.shape and out.dtype == v.dtype
              and out.flags.c_contiguous and out.data.ptr % 16 == 0):
        raise ValueError(f"out must be a C-contiguous CuPy array of shape {tuple(v.shape)} and dtype {v.dtype}")
    gidx = getattr(plan, "_gidx_arg", None)
    if gidx is None:
        gidx = plan.global_idx if plan.global_idx.size else cupy.zeros(1, dtype=np.int32)
    name = kernel_name(impl, elem, D)
    smem = smem_bytes(impl, D)
    nqt = (T + var.rows - 1) // var.rows
    args = (q, k, v, out, gidx, plan.gmask, np.int32(B), np.int32(T), np.int32(H), np.int32(plan.n_global),
            np.int32(min(int(plan.local_window), T)), np.float32(scale * math.log2(math.e)), np.int32(sched))
    return Prepared(_kernel(name, smem), (nqt * H * B,), (var.threads,), args, smem, out, impl, name)


def wgmma_unit(a_bits, b_bits, mode: int, elem: str = "bf16", swizzle: bool = True):
    """Run the wgmma unit kernel: ``a_bits`` uint16 ``[64, 128]``, ``b_bits`` uint16 ``[128, 128]``
    (mode bit 0: B as ``[k][n]`` (MN-major, the V tile), else ``[n][k]`` (K-major, the K tile);
    bit 1: A from registers). Returns ``d`` float32 ``[64, 128]`` (a CuPy array) = A @ B."""
    cupy = _cupy()
    a = cupy.ascontiguousarray(cupy.asarray(a_bits, dtype=cupy.uint16))
    b = cupy.ascontiguousarray(cupy.asarray(b_bits, dtype=cupy.uint16))
    if a.shape != (64, 128) or b.shape != (128, 128):
        raise ValueError(f"a must be [64, 128] and b [128, 128], got {a.shape}, {b.shape}")
    d = cupy.full((64, 128), np.nan, dtype=cupy.float32)
    kern = _kernel(unit_kernel_name(elem, swizzle), UNIT_SMEM_BYTES)
    kern((1,), (128,), (a, b, d, np.int32(mode)), shared_mem=UNIT_SMEM_BYTES)
    return d
