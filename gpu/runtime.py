"""The kernel runtime of the CuPy wrappers in ``gpu/`` (GLA and DAAF): source loading, compilation, launch.

A :class:`KernelSet` names the kernels of some ``gpu/*.cu`` files and how they compile (NVRTC options,
name expressions, how kernels group into modules). :class:`CupyRuntime` compiles one ``cupy.RawModule`` per
device, file and group on first use of one of its kernels and launches on CuPy's current stream.
:func:`kernel_source` inlines the local ``#include "..."`` of a file, so NVRTC needs no include path.

The wrappers reach their runtime through a :class:`RuntimeSlot`; a test puts another object with the same
methods there (``xp``, ``is_native``, ``ptr``, ``available``, ``launch``, ``bind``): the CPU emulation
:class:`hpczeco.gpu.emu.EmuRuntime` runs the very wrappers on numpy arrays. Nothing here talks MPI.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HERE", "KernelSet", "CupyRuntime", "RuntimeSlot", "kernel_source"]

HERE = Path(__file__).resolve().parent


def kernel_source(files: Sequence[str]) -> str:
    """``files`` (names in ``gpu/``) as one translation unit: local ``#include "..."`` inlined once each."""
    seen: set[str] = set()

    def inline(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        out = []
        for line in (HERE / name).read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith('#include "') and stripped.endswith('"'):
                out.append(inline(stripped[len('#include "') : -1]))
            elif stripped != "#pragma once":
                out.append(line)
        return "\n".join(out)

    return "\n".join(inline(f) for f in files if (HERE / f).exists())


def _one_group(name: str) -> str:
    return "all"


@dataclass(frozen=True)
class KernelSet:
    """Kernels of some ``gpu/*.cu`` files: ``names(file)`` lists a file's kernel names (name expressions of
    template instantiations, or ``extern "C"`` names with ``name_expressions=False``); ``group(name)`` says
    which module of its file a kernel compiles in; ``options`` are the NVRTC options; ``label`` names the
    wrapper module in errors."""

    label: str
    files: tuple[str, ...]
    names: Callable[[str], list[str]]
    options: tuple[str, ...] = ("-std=c++17",)
    group: Callable[[str], str] = _one_group
    name_expressions: bool = True

    def present(self) -> list[str]:
        """The files of the set that exist in this checkout."""
        return [f for f in self.files if (HERE / f).exists()]

    def kernel_names(self, file: str | None = None) -> list[str]:
        """Kernel names of ``file``, or of every present file."""
        return [n for f in ([file] if file is not None else self.present()) for n in self.names(f)]

    def source(self, files: Sequence[str] | None = None) -> str:
        return kernel_source(tuple(files) if files else self.files)


class CupyRuntime:
    """Kernels of one :class:`KernelSet` from ``cupy.RawModule`` objects, on CuPy's current device and stream.

    A module (one per device, file and group) compiles on first use of one of its kernels, so a bf16 run never
    compiles the fp32/fp16 instantiations; one that fails to compile leaves the others usable
    (:meth:`available` says which). Dynamic shared memory above the default is opted into per kernel and device.
    """

    def __init__(self, kernels: KernelSet):
        import cupy  # noqa: PLC0415

        self.xp = cupy
        self.kernels = kernels
        self.owner = {n: (f, kernels.group(n)) for f in kernels.present() for n in kernels.names(f)}
        self.modules: dict[tuple[int, str, str], Any] = {}
        self.errors: dict[str, str] = {}  # "file:group" -> why it did not compile
        self._fns: dict[tuple[int, str], Any] = {}
        self._smem: dict[tuple[int, str], int] = {}

    def _device(self) -> int:
        return int(self.xp.cuda.runtime.getDevice())

    def module(self, file: str, group: str, device: int | None = None):
        """The compiled module of ``file``'s kernels in ``group`` on ``device`` (default: the current one)."""
        dev = self._device() if device is None else device
        mod = self.modules.get((dev, file, group))
        if mod is None:
            names = [n for n in self.kernels.names(file) if self.kernels.group(n) == group]
            with self.xp.cuda.Device(dev):
                mod = self.xp.RawModule(
                    code=kernel_source((file,)),
                    options=self.kernels.options,
                    name_expressions=names if self.kernels.name_expressions else None,
                )
            self.modules[(dev, file, group)] = mod
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
        names = [n for n in self.kernels.names(file) if group is None or self.kernels.group(n) == group]
        key = f"{file}:{self.kernels.group(names[0])}" if names else file
        if key in self.errors:
            return False
        try:
            self.function(names[0])
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
    """The runtime one kernel set's wrappers launch on: a :class:`CupyRuntime` made on first use, unless a test
    has put another one (e.g. the CPU emulation) in with :meth:`set`."""

    def __init__(self, kernels: KernelSet):
        self.kernels = kernels
        self.current: Any = None

    def get(self) -> Any:
        if self.current is None:
            self.current = CupyRuntime(self.kernels)
        return self.current

    def set(self, rt: Any) -> Any:
        """Use ``rt`` from now on (``None``: a CuPy runtime again on next use); returns the previous one."""
        old, self.current = self.current, rt
        return old
