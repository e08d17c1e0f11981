"""The kernel runtime of the CuPy wrappers in ``gpu/`` (GLA and DAAF): source loading, compilation, launch.

A :class:`KernelSet` names the kernels of some ``gpu/*.cu`` files and how they compile (NVRTC options,
name expressions, how kernels group into modules, a target architecture). :class:`CupyRuntime` compiles one
``cupy.RawModule`` per device, file and group on first use of one of its kernels and launches on CuPy's
current stream. :func:`kernel_source` inlines the local ``#include "..."`` of a file, so NVRTC needs no
include path. A set with an ``arch`` (e.g. ``"sm_90a"``, which ``cupy.RawModule`` cannot target: it adds
its own ``-arch``) compiles to cubins with NVRTC directly (nvcc when NVRTC fails), kept on disk by source
hash (:func:`compile_cubin`, :func:`cached_cubin`), and loads them.

The wrappers reach their runtime through their module's :class:`RuntimeSlot` ``RUNTIME``; a test puts another
object with the same methods there (``xp``, ``is_native``, ``ptr``, ``available``, ``launch``, ``bind``): the CPU
emulation :class:`hpczeco.gpu.emu.EmuRuntime` runs the very wrappers on numpy arrays. A :class:`Prepared` is one bound
launch (the DAAF wrappers return it). Nothing here talks MPI.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HERE", "KernelSet", "CupyRuntime", "Prepared", "RuntimeSlot", "cached_cubin", "compile_cubin",
           "cubin_cache_dir", "kernel_source"]

HERE = Path(__file__).resolve().parent
_LOCAL_INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')  # a file of gpu/ (a trailing comment may follow)


def kernel_source(files: Sequence[str]) -> str:
    """``files`` (names in ``gpu/``) as one translation unit: local ``#include "..."`` inlined once each."""
    seen: set[str] = set()

    def inline(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        out = []
        for line in (HERE / name).read_text().splitlines():
            m = _LOCAL_INCLUDE.match(line)
            if m:
                out.append(inline(m.group(1)))
            elif line.strip() != "#pragma once":
                out.append(line)
        return "\n".join(out)

    return "\n".join(inline(f) for f in files if (HERE / f).exists())


def _one_group(name: str) -> str:
    return "all"


def _no_options(group: str) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class KernelSet:
    """Kernels of some ``gpu/*.cu`` files: ``names(file)`` lists a file's kernel names (name expressions of
    template instantiations, or ``extern "C"`` names with ``name_expressions=False``); ``group(name)`` says
    which module of its file a kernel compiles in; ``options`` are the NVRTC options, ``group_options(group)``
    more of them for one group's module (e.g. a ``-D`` that selects its kernels); ``label`` names the wrapper
    module in errors. ``arch``: build cubins for this target (``"sm_90a"``) instead of letting
    ``cupy.RawModule`` compile the source (see :func:`cached_cubin`; only ``extern "C"`` names then)."""

    label: str
    files: tuple[str, ...]
    names: Callable[[str], list[str]]
    options: tuple[str, ...] = ("-std=c++17",)
    group: Callable[[str], str] = _one_group
    name_expressions: bool = True
    arch: str | None = None
    group_options: Callable[[str], tuple[str, ...]] = _no_options

    def present(self) -> list[str]:
        """The files of the set that exist in this checkout."""
        return [f for f in self.files if (HERE / f).exists()]

    def kernel_names(self, file: str | None = None) -> list[str]:
        """Kernel names of ``file``, or of every present file."""
        return [n for f in ([file] if file is not None else self.present()) for n in self.names(f)]

    def source(self, files: Sequence[str] | None = None) -> str:
        return kernel_source(tuple(files) if files else self.files)

    def compile_options(self, group: str) -> tuple[str, ...]:
        """The compiler options of ``group``'s module: ``options``, then ``group_options(group)``."""
        return (*self.options, *self.group_options(group))


# --------------------------------------------------------------------------- cubins for a named architecture


def cubin_cache_dir() -> Path:
    """Where :func:`cached_cubin` keeps cubins (``$HPCZECO_CUBIN_CACHE``, else a folder in the temp directory)."""
    d = Path(os.environ.get("HPCZECO_CUBIN_CACHE") or Path(tempfile.gettempdir()) / "hpczeco-cubins")
    d.mkdir(parents=True, exist_ok=True)
    return d


def compile_cubin(source: str, name: str, options: Sequence[str], arch: str,
                  use_nvcc: bool | None = None) -> tuple[bytes, str]:
    """``source`` (one translation unit, as :func:`kernel_source` gives it; ``name`` its file name) compiled
    for ``arch`` to a cubin: ``(cubin, how)``, ``how`` "nvrtc" or "nvcc". ``use_nvcc``: None tries NVRTC
    (CuPy's binding, called directly with ``--gpu-architecture=arch``) first and nvcc when that fails; True
    only nvcc, False only NVRTC."""
    errors = []
    if not use_nvcc:
        try:
            from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

            prog = nvrtc.createProgram(source, name, [], [])
            try:
                try:
                    nvrtc.compileProgram(prog, [*options, f"--gpu-architecture={arch}"])
                except Exception as exc:
                    raise RuntimeError(f"NVRTC: {exc}\n{nvrtc.getProgramLog(prog)[-4000:]}") from exc
                return nvrtc.getCUBIN(prog), "nvrtc"
            finally:
                nvrtc.destroyProgram(prog)
        except Exception as exc:
            if use_nvcc is False:
                raise
            errors.append(f"{type(exc).__name__}: {exc}")
    from .build import nvcc_path  # noqa: PLC0415

    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError(f"cannot build {name} for {arch}: {'; '.join(errors)}; and no nvcc (set $NVCC)")
    with tempfile.TemporaryDirectory(prefix="hpczeco-cubin-") as d:
        src, out = Path(d) / name, Path(d) / (Path(name).stem + ".cubin")
        src.write_text(source)
        cmd = [nvcc, "-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", *options, str(src), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}; earlier: {'; '.join(errors)}")
        return out.read_bytes(), "nvcc"


def cubin_path(kernels: KernelSet, file: str, group: str) -> Path:
    """The cache file of the cubin of ``file``'s ``group`` for the current sources and options."""
    if not kernels.arch:
        raise ValueError(f"{kernels.label}: the kernel set names no arch (its modules compile with CuPy)")
    opts = kernels.compile_options(group)
    key = hashlib.sha256("\0".join((kernel_source((file,)), *opts, kernels.arch)).encode()).hexdigest()[:16]
    return cubin_cache_dir() / f"{Path(file).stem}-{key}-{kernels.arch}-{group}.cubin"


def cached_cubin(kernels: KernelSet, file: str, group: str) -> tuple[Path, str]:
    """The cubin of ``file``'s ``group`` for ``kernels.arch`` from the cache, compiled (:func:`compile_cubin`)
    and stored when missing: ``(path, how)``, ``how`` "cache", "nvrtc" or "nvcc"."""
    path = cubin_path(kernels, file, group)
    if path.exists():
        return path, "cache"
    data, how = compile_cubin(kernel_source((file,)), file, kernels.compile_options(group), kernels.arch)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path, how


class CupyRuntime:
    """Kernels of one :class:`KernelSet` from ``cupy.RawModule`` objects, on CuPy's current device and stream.

    A module (one per device, file and group) compiles on first use of one of its kernels, so a bf16 run never
    compiles the fp32/fp16 instantiations; one that fails to compile leaves the others usable
    (:meth:`available` says which). Dynamic shared memory above the default is opted into per kernel and device.
    A set with an ``arch`` loads the cubins of :func:`cached_cubin`, on devices of that compute capability only;
    ``built`` says how each module was obtained ("cupy", or :func:`cached_cubin`'s "cache"/"nvrtc"/"nvcc").
    """

    def __init__(self, kernels: KernelSet):
        import cupy  # noqa: PLC0415

        self.xp = cupy
        self.kernels = kernels
        self.owner = {n: (f, kernels.group(n)) for f in kernels.present() for n in kernels.names(f)}
        self.modules: dict[tuple[int, str, str], Any] = {}
        self.errors: dict[str, str] = {}  # "file:group" -> why it did not compile
        self.built: dict[tuple[int, str, str], str] = {}
        self._fns: dict[tuple[int, str], Any] = {}
        self._smem: dict[tuple[int, str], int] = {}
        self._available: set[tuple[int, str, str | None]] = set()  # (device, file, group) known to build

    def _device(self) -> int:
        return int(self.xp.cuda.runtime.getDevice())

    def module(self, file: str, group: str, device: int | None = None):
        """The compiled module of ``file``'s kernels in ``group`` on ``device`` (default: the current one)."""
        dev = self._device() if device is None else device
        mod = self.modules.get((dev, file, group))
        if mod is None:
            ks = self.kernels
            names = [n for n in ks.names(file) if ks.group(n) == group]
            with self.xp.cuda.Device(dev):
                if ks.arch:
                    cc = self.xp.cuda.Device(dev).compute_capability
                    if cc != re.sub(r"\D", "", ks.arch):
                        raise RuntimeError(f"{ks.label} kernels are built for {ks.arch}; device {dev} is sm_{cc}")
                    path, how = cached_cubin(ks, file, group)
                    mod = self.xp.RawModule(path=str(path))
                else:
                    mod = self.xp.RawModule(
                        code=kernel_source((file,)),
                        options=ks.compile_options(group),
                        name_expressions=names if ks.name_expressions else None,
                    )
                    how = "cupy"
            self.modules[(dev, file, group)] = mod
            self.built[(dev, file, group)] = how
        return mod

    def function(self, name: str, shared_mem: int = 0):
        """The ``cupy.RawKernel`` of ``name`` on the current device, allowed ``shared_mem`` bytes of dynamic
        shared memory."""
        dev = self._device()
        key = (dev, name)
        f = self._fns.get(key)
        if f is None:
            with self.xp.cuda.Device(dev):
                f = self._fns[key] = self.module(*self.owner[name], device=dev).get_function(name)
        if shared_mem > self._smem.get(key, 0):  # opt in (needed above the default 48 KB)
            f.max_dynamic_shared_size_bytes = shared_mem
            self._smem[key] = shared_mem
        return f

    def available(self, file: str, group: str | None = None) -> bool:
        """Compile ``file``'s module for ``group`` (default: its first kernel's) now; False if NVRTC rejects it."""
        ok_key = (self._device(), file, group)
        if ok_key in self._available:  # asked on every call of the wrappers: the answer once per device
            return True
        names = [n for n in self.kernels.names(file) if group is None or self.kernels.group(n) == group]
        key = f"{file}:{self.kernels.group(names[0])}" if names else file
        if key in self.errors:
            return False
        try:
            self.function(names[0])
            self._available.add(ok_key)
            return True
        except Exception as exc:  # noqa: BLE001 - any compile/load failure
            self.errors[key] = f"{type(exc).__name__}: {exc}"
            return False

    def bind(self, name: str, grid, block, args, shared_mem: int = 0) -> Callable[[], None]:
        """A launch of ``name`` with these arguments (``None``: a null pointer), ready to call repeatedly."""
        f = self.function(name, shared_mem)
        g = tuple(int(x) for x in grid)
        b = tuple(int(x) for x in block)
        conv = tuple(np.uint64(0) if a is None else a for a in args)
        return lambda: f(g, b, conv, shared_mem=shared_mem)

    def launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
        """Launch ``name`` on the current stream (``grid``, ``block``: up to three ints each)."""
        f = self.function(name, shared_mem)
        conv = tuple(np.uint64(0) if a is None else a for a in args)
        f(tuple(int(x) for x in grid), tuple(int(x) for x in block), conv, shared_mem=shared_mem)

    @staticmethod
    def is_native(x: Any) -> bool:
        return type(x).__module__.startswith("cupy")

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data.ptr)


class RuntimeSlot:
    """The runtime one kernel set's wrappers launch on: a :class:`CupyRuntime` made on first use of :meth:`get`,
    unless a test has put another one (e.g. the CPU emulation) in with :meth:`set`. Each wrapper module of
    ``gpu/`` holds one, named ``RUNTIME``."""

    def __init__(self, kernels: KernelSet):
        self.kernels = kernels
        self.current: Any = None

    def get(self) -> Any:
        """The runtime; a missing CuPy is a ``RuntimeError`` that names the wrapper module."""
        if self.current is None:
            try:
                self.current = CupyRuntime(self.kernels)
            except ImportError as exc:  # pragma: no cover - depends on the machine
                raise RuntimeError(f"{self.kernels.label} needs CuPy ({exc})") from exc
        return self.current

    def set(self, rt: Any) -> Any:
        """Use ``rt`` from now on (``None``: a CuPy runtime again on next use); returns the previous one."""
        old, self.current = self.current, rt
        return old


class Prepared:
    """One ready launch: ``p()`` runs the kernel on the current stream and returns the output array."""

    def __init__(self, launch, out, impl: str, name: str, sched: int | None = None):
        self.launch, self.out, self.impl, self.name, self.sched = launch, out, impl, name, sched

    def __call__(self):
        self.launch()
        return self.out
