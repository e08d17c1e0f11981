"""Dry run of devtools/daaf_device_check.py's check stages without a GPU: the wgmma unit check, the probe and
the small (sanitizer) cases of each kernel, run in-process on the numpy stand-in for CuPy (gpu/emu/fake_cupy)
with the kernels in the CPU emulation, at tiny shapes (fewer probe cases). Checks that the harness's Python
runs and that its checks pass; the timing stage needs PyTorch on a GPU and is not covered (its summary,
``targets`` and ``table``, is: tests/test_daaf_hopper_emu.py). Slow (minutes): every CUDA thread is an OS thread.

    PYTHONPATH=. python devtools/daaf_device_check_dryrun.py [--impls hws,hwin] [--out /tmp/dry]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "gpu" / "emu" / "fake_cupy"))
sys.path.insert(0, str(ROOT / "devtools"))

import cupy  # noqa: E402 - the numpy stand-in

cupy.cuda.runtime.deviceSynchronize = staticmethod(lambda: None)

import daaf_device_check as H  # noqa: E402
from hpczeco.gpu import daaf_hopper as dh  # noqa: E402
from hpczeco.gpu import emu as gemu  # noqa: E402

SMALL_CASES = [(1, 0, "none"), (65, 16, "regions"), (130, 128, "first"), (200, 1, "scattered")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=H.DEFAULT_IMPLS)
    ap.add_argument("--out", default="/tmp/hpczeco-daaf-dryrun")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    rt = gemu.EmuRuntime(dh.KERNELS.source(), list(dh.GROUPS))
    rt.xp = cupy
    dh.RUNTIME.set(rt)
    H.probe_cases = lambda quick: SMALL_CASES
    rec = H.Recorder(Path(a.out) / "dryrun.jsonl")
    t0 = time.perf_counter()
    H.child_unit(rec, a.seed)
    for impl in a.impls.split(","):
        H.child_probe(rec, impl, a.seed + dh.IMPLS.index(impl), quick=True)
        H.child_small(rec, impl, a.seed)
    n = sum(1 for r in rec.records if r.get("kind") == "check")
    print(f"{n - rec.n_fail} of {n} checks passed, {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if rec.n_fail == 0 and n else 1


if __name__ == "__main__":
    sys.exit(main())
