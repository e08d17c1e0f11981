"""Compile gpu/daaf_hopper.cu with NVRTC (libnvrtc via ctypes) for a given arch: the check of NVRTC compatibility."""
import ctypes, sys
from pathlib import Path
lib = ctypes.CDLL(sys.argv[1])
gpu = Path(sys.argv[2]); arch = sys.argv[3]
src = (gpu / "daaf_hopper.cu").read_bytes(); hdr = (gpu / "daaf_hopper_ptx.cuh").read_bytes()
prog = ctypes.c_void_p()
H = (ctypes.c_char_p * 1)(hdr); N = (ctypes.c_char_p * 1)(b"daaf_hopper_ptx.cuh")
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"daaf_hopper.cu", 1, H, N) == 0
opts = [b"-std=c++17", f"--gpu-architecture={arch}".encode()]
O = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), O)
n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n)); log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log)
print("rc", rc, log.value.decode()[-3000:])
if rc == 0:
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)); print("cubin bytes", n.value)
