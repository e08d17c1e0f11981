"""Dry run of drivers/gpu_suite.py without a GPU: the suite's Python logic on a numpy stand-in for CuPy
(``gpu/emu/fake_cupy``) with every kernel in the CPU emulation. It checks that the script runs end to end
(and the kernels' results), not speed. Slow: use small ``--T``.

    python -m hpczeco.gpu.emu.dryrun [--fast] -- --out /tmp/dry --T 64 --repeats 2 --nc 2
    HPCZECO_CUDA_AWARE=1 mpiexec -n 2 python -m hpczeco.gpu.emu.dryrun --fast -- --multi --out /tmp/dry --T 64

``--fast`` times each call once and skips the small-shape correctness cases (which the emulation tests
in tests/test_cuda_build.py cover). NCCL is not emulated (its checks fail here).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    fast = "--fast" in argv[: argv.index("--")] if "--" in argv else "--fast" in argv
    suite_args = argv[argv.index("--") + 1 :] if "--" in argv else [a for a in argv if a != "--fast"]
    sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_cupy"))
    import cupy  # noqa: PLC0415 - the stand-in
    from hpczeco.drivers import gpu_suite  # noqa: PLC0415
    from hpczeco.gpu import gla  # noqa: PLC0415
    from hpczeco.gpu.emu import EmuRuntime  # noqa: PLC0415

    rt = EmuRuntime(gla.kernel_source(), gla.kernel_names())
    rt.xp = cupy
    gla._set_runtime(rt)
    if fast:
        gpu_suite.cuda_time = lambda cp, fn, repeats, warmup=3, sets=1: (fn(0), 1.0)[1]
        check = gpu_suite.Suite.check

        def quick(self, name, fn, tol=None):
            if name.startswith(("fwd ", "bwd ", "zeco", "prepare", "compile")):
                return {"ok": True}
            return check(self, name, fn, tol)

        gpu_suite.Suite.check = quick
    return gpu_suite.main(suite_args)


if __name__ == "__main__":
    sys.exit(main())
