"""Dry run of devtools/gla_device_check.py without a GPU: its Python logic on the numpy stand-in for CuPy
(gpu/emu/fake_cupy) with every kernel in the CPU emulation, at tiny shapes. Checks that the script runs end to
end and that its checks pass; not speed (each "timing" calls its function once). Slow (minutes): the emulation
runs every CUDA thread as an OS thread.

    PYTHONPATH=. python devtools/gla_device_check_dryrun.py --out /tmp/dry [--grid] [--variants all]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "gpu" / "emu" / "fake_cupy"))

import cupy  # noqa: E402 - the numpy stand-in
import numpy as np  # noqa: E402


class _RandomState:  # cupy.random.RandomState's calls used by the harness
    def __init__(self, seed):
        self.g = np.random.default_rng(seed)

    def standard_normal(self, size, dtype=np.float64):
        return self.g.standard_normal(size).astype(dtype).view(cupy.ndarray)

    def uniform(self, low=0.0, high=1.0, size=None):
        return np.asarray(self.g.uniform(low, high, size)).view(cupy.ndarray)


cupy.random = type(sys)("cupy.random")
cupy.random.RandomState = _RandomState
cupy.get_default_memory_pool = lambda: type("Pool", (), {"free_all_blocks": lambda self: None})()
cupy.from_dlpack = lambda x: np.asarray(x).view(cupy.ndarray)

import gla_device_check as H  # noqa: E402
from hpczeco.gpu import emu as gemu  # noqa: E402
from hpczeco.gpu import gla as G  # noqa: E402
from hpczeco.gpu import gla_tc_states as st  # noqa: E402
from hpczeco.gpu.runtime import kernel_source  # noqa: E402

_GROUP = H.NvrtcRuntime.group


class EmuNvrtc:
    """Stands in for gla_device_check.NvrtcRuntime: every kernel in the CPU emulation (defines ignored)."""

    _shared = None
    group = staticmethod(_GROUP)

    def __init__(self, cp, defines=(), base=None, own=None):
        if EmuNvrtc._shared is None:
            EmuNvrtc._shared = st.emu_runtime(types=("bf16", "f16"), kms=(64, 128), f32_states=(False, True))
            EmuNvrtc._shared.xp = cp
        self._rt, self.xp, self.compile_s = EmuNvrtc._shared, cp, {}

    def fn(self, name):
        return name

    def launch(self, name, grid, block, args, shared_mem=0):
        self._rt.launch(name, grid, block, args, shared_mem)

    @staticmethod
    def ptr(x):
        return int(x.ctypes.data)


def main() -> int:
    H.NvrtcRuntime = EmuNvrtc
    H.BENCH = [(1, 130, 2, 32, 32), (2, 70, 1, 64, 64), (1, 66, 1, 16, 16)]
    H.SMALL = [(1, 1, 1, 16, 32, False, None, False), (1, 70, 2, 32, 48, True, 1, False),
               (1, 66, 1, 128, 64, False, 1, True)]  # fmt: skip
    H.SMALL_FP16 = [(1, 70, 1, 32, 32, False, 1, None)]
    H.TWO_SLICES = (1, 100, 1, 32, 16, 37)
    H.VARIANT_SMALL = (1, 70, 1, 32, 32)
    H.GRID_T, H.GRID_KV, H.GRID_GN = (1, 70), ((64, 64),), (0.1, 1.0)
    H.cuda_time = lambda cp, fn, reps=20, warmup=3, sets=2: (fn(0), 1.0)[1]
    names = ["gla_chunk_outer<bf16>", "gla_state_scan", "gla_bwd_scores<bf16>", "gla_bwd_dqdk<bf16>",
             "gla_bwd_dv<bf16>", "seg_chunk_sum<float>", "seg_carry", "seg_finish<float, bf16>",
             "gla_chunk_output<bf16>"]  # fmt: skip
    old = gemu.EmuRuntime(kernel_source(("gla_kernels.cu",)), names)
    old.xp = cupy
    G.RUNTIME.set(old)
    return H.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
