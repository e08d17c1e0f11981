"""CPU emulation of the CUDA kernels in ``gpu/*.cu`` (tests only; see ``cuda_emu.h``).

:class:`EmuRuntime` compiles the kernel sources with g++ against ``cuda_emu.h`` into a shared
library and launches kernels by name expression with numpy arrays as device memory, so the very
wrappers of :mod:`hpczeco.gpu.gla` run unchanged on a machine without a GPU (tiny shapes: every CUDA
thread is an OS thread). bfloat16 arrays are ``uint16`` bit patterns here.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

_HERE = Path(__file__).resolve().parent


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build(source: str, names: list[str], cache_dir: str | None = None) -> Path:
    """Compile ``source`` (kernels) plus a registry of ``names`` into a shared library; cached by hash."""
    reg = "\n".join(f'EMU_REGISTER("{n}", {n})' for n in names)
    full = f'#include "{_HERE / "cuda_emu.h"}"\n{source}\n{reg}\nEMU_DEFINE_ENTRY\n'
    digest = hashlib.sha256((full + (_HERE / "cuda_emu.h").read_text()).encode()).hexdigest()[:16]
    out_dir = Path(cache_dir or os.path.join(tempfile.gettempdir(), "hpczeco-emu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"gla_emu_{digest}.so"
    if lib.exists():
        return lib
    src = out_dir / f"gla_emu_{digest}.cpp"
    src.write_text(full)
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) for the CUDA emulation")
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", str(tmp), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
    os.replace(tmp, lib)
    return lib


class EmuRuntime:
    """Drop-in for the CuPy runtime of :mod:`hpczeco.gpu.gla`: numpy arrays, kernels on the CPU."""

    xp = np

    def __init__(self, source: str, names: list[str]):
        self.lib = ctypes.CDLL(str(build(source, names)))
        self.lib.emu_launch_by_name.restype = ctypes.c_int
        self.launched: list[str] = []

    @staticmethod
    def is_native(x: Any) -> bool:
        return isinstance(x, np.ndarray)

    @staticmethod
    def ptr(x: np.ndarray) -> int:
        return int(x.ctypes.data)

    def launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
        keep = []
        for a in args:
            if a is None:
                keep.append(ctypes.c_void_p(0))
            elif isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError(f"{name}: non-contiguous array argument")
                keep.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int32):
                keep.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.float32):
                keep.append(ctypes.c_float(float(a)))
            elif isinstance(a, np.uint64):
                keep.append(ctypes.c_uint64(int(a)))
            else:
                raise TypeError(f"{name}: unsupported kernel argument {type(a).__name__}")
        arr = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in keep])
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
        rc = self.lib.emu_launch_by_name(name.encode(), *g, *b, arr)
        if rc != 0:
            raise KeyError(f"kernel {name!r} is not in the emulation build")
        self.launched.append(name)
