"""Compile ``gpu/daaf_hopper.cu`` with NVRTC (libnvrtc through ctypes, no GPU and no CuPy needed).

``python devtools/nvrtc_compile_check.py /path/to/libnvrtc.so.13 [--arch sm_90a]`` checks that the
source builds under NVRTC as gpu/daaf_hopper.py builds it on the device (the local headers inlined by
gpu/runtime.py, the options of its kernel set, ``--gpu-architecture=sm_90a``). libnvrtc-builtins must be
on LD_LIBRARY_PATH, e.g. from the ``nvidia-cuda-nvrtc`` wheel: ``LD_LIBRARY_PATH=<site-packages>/nvidia/cu13/lib``.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hpczeco.gpu import daaf_hopper as dh  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libnvrtc")
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args(argv)
    lib = ctypes.CDLL(a.libnvrtc)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), dh.KERNELS.source().encode(), dh.KERNEL_SOURCE.name.encode(), 0,
                              None, None) != 0:
        print("nvrtcCreateProgram failed")
        return 1
    opts = [o.encode() for o in dh.KERNELS.compile_options("0")] + [f"--gpu-architecture={a.arch}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = "\n".join(x for x in log.value.decode().splitlines() if "C7519" not in x)
    print(f"nvrtcCompileProgram rc={rc}\n{text[-3000:]}")
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        print(f"cubin: {n.value} bytes")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
