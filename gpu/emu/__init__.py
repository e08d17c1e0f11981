"""CPU emulation of the CUDA kernels in ``gpu/*.cu`` (tests only; see ``cuda_emu.h``).

:class:`EmuRuntime` compiles a kernel source with g++ after ``cuda_emu.h`` into a shared library and
launches its kernels by name, with numpy arrays as device memory: it has the methods of
:class:`hpczeco.gpu.runtime.CupyRuntime` the wrappers use, so :mod:`hpczeco.gpu.gla` and
:mod:`hpczeco.gpu.daaf` run unchanged on a machine without a GPU once it is put in their runtime slot
(tiny shapes: the threads of a block run one at a time, as fibers, each until it waits). bfloat16 arrays are
``uint16`` bit patterns here.
A launch that breaks a rule the emulation checks (``cuda_emu.h``, ``wgmma_emu.h``: e.g. a wgmma reading
shared memory written by cp.async without ``fence.proxy.async``) raises :class:`EmuCheckError`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

_HERE = Path(__file__).resolve().parent
HEADER = _HERE / "cuda_emu.h"
HEADERS = (HEADER, _HERE / "emu_core.h", _HERE / "wgmma_emu.h")  # cuda_emu.h and the headers it includes

__all__ = ["EmuCheckError", "EmuRuntime", "build", "compiler", "tensor_map", "HEADER", "HEADERS", "TMAP_MAGIC"]

TMAP_MAGIC = 0x70616D54756D45  # EMU_TMAP_MAGIC of emu_core.h


def tensor_map(ptr: int, dims, strides, box, elem: int, swizzle: int) -> ctypes.Array:
    """The emulation's tensor map (``EmuTensorMap`` of emu_core.h, 128 bytes, passed by value as CUtensorMap is):
    a tensor at ``ptr`` of ``dims`` elements (innermost first) with byte ``strides`` of dims 1.. (dim 0: contiguous
    elements of ``elem`` bytes), tiles of ``box`` elements, ``swizzle`` 0 (none) or 3 (128-byte), as
    ``cuTensorMapEncodeTiled`` takes them."""
    rank = len(dims)
    if not (1 <= rank <= 5 and len(box) == rank and len(strides) == rank - 1):
        raise ValueError(f"tensor map: rank {rank}, box {box}, strides {strides}")
    pad = [0] * (5 - rank)
    fields = struct.pack("<QQ5Q5Q5IIII", TMAP_MAGIC, int(ptr), *[int(d) for d in dims], *pad,
                         int(elem), *[int(x) for x in strides], *pad, *[int(b) for b in box], *pad, rank, int(elem),
                         int(swizzle))
    return (ctypes.c_ubyte * 128).from_buffer_copy(fields)


class EmuCheckError(RuntimeError):
    """A launch broke a rule the emulation checks (the message names the first one)."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build(source: str, names: list[str], cache_dir: str | None = None) -> Path:
    """Compile ``source`` (kernels) plus a registry of ``names`` into a shared library; cached by hash."""
    reg = "\n".join(f'EMU_REGISTER("{n}", {n})' for n in names)
    full = f'#include "{HEADER}"\n{source}\n{reg}\nEMU_DEFINE_ENTRY\n'
    # keyed by the contents, not by where this checkout lives (a fresh clone elsewhere reuses the build)
    body = full.replace(str(HEADER), HEADER.name)
    digest = hashlib.sha256((body + "".join(h.read_text() for h in HEADERS)).encode()).hexdigest()[:16]
    out_dir = Path(cache_dir or os.path.join(tempfile.gettempdir(), "hpczeco-emu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"kernels_emu_{digest}.so"
    if lib.exists():
        return lib
    src = out_dir / f"kernels_emu_{digest}.cpp"
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


def _c_arg(name: str, a: Any):
    if a is None:
        return ctypes.c_void_p(0)
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: non-contiguous array argument")
        return ctypes.c_void_p(a.ctypes.data)
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    if isinstance(a, (ctypes.Array, ctypes.Structure, ctypes._SimpleCData)):  # by value (a tensor map: 128 bytes)
        return a
    raise TypeError(f"{name}: unsupported kernel argument {type(a).__name__}")


class EmuRuntime:
    """Drop-in for :class:`hpczeco.gpu.runtime.CupyRuntime`: numpy arrays, the kernels of ``source`` on the CPU.

    ``names``: the kernel names (name expressions) to make launchable. ``launched`` records every launch.
    A launch whose emulation checks fail raises :class:`EmuCheckError` (after it ran: outputs are written).
    """

    xp: Any = np
    sm_count = 2  # multiprocessors the persistent kernels size their grid by (blocks run one after another here)

    def __init__(self, source: str, names: list[str]):
        self.lib = ctypes.CDLL(str(build(source, names)))
        self.lib.emu_launch_by_name.restype = ctypes.c_int
        self.lib.emu_last_error_count.restype = ctypes.c_int
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.names = set(names)
        self.errors: dict[str, str] = {}
        self.launched: list[str] = []

    @staticmethod
    def is_native(x: Any) -> bool:
        return isinstance(x, np.ndarray)

    @staticmethod
    def ptr(x: np.ndarray) -> int:
        return int(x.ctypes.data)

    def available(self, file: str, group: str | None = None) -> bool:
        """Every kernel of the build is there (one not built raises ``KeyError`` at launch)."""
        return True

    @staticmethod
    def tensor_map(ptr: int, dims, strides, box, elem: int, swizzle: int) -> ctypes.Array:
        """An emulated tensor map (:func:`tensor_map`), where CuPy's runtime would encode a CUtensorMap."""
        return tensor_map(ptr, dims, strides, box, elem, swizzle)

    def bind(self, name: str, grid, block, args, shared_mem: int = 0) -> Callable[[], None]:
        keep = [_c_arg(name, a) for a in args]
        arr = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in keep])
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
        smem = ctypes.c_ulonglong(int(shared_mem))
        alive = (args, keep, arr)  # the arrays and ctypes values ``arr`` points to

        def run() -> None:
            rc = self.lib.emu_launch_by_name(name.encode(), *g, *b, smem, alive[2])
            if rc != 0:
                raise KeyError(f"kernel {name!r} is not in the emulation build")
            self.launched.append(name)
            n_bad = self.lib.emu_last_error_count()
            if n_bad:
                raise EmuCheckError(f"{name}: {n_bad} emulation check(s) failed, the first: "
                                    f"{self.lib.emu_last_error().decode()}")

        return run

    def launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
        self.bind(name, grid, block, args, shared_mem)()
