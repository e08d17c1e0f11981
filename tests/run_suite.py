#!/usr/bin/env python3
"""Run the whole test suite: once in one process, then the ``mpi``-marked tests under
``mpiexec -n N`` for each N in ``--ranks``. Prints each stage's pytest summary and a total line
``N passed, N failed, N skipped``; exits non-zero if any stage failed or timed out.

Environment: ``MPIEXEC`` (default: the venv's mpiexec, else ``mpiexec`` on PATH),
``MPIEXEC_TIMEOUT`` (seconds per MPI stage, default 600), ``HPCZECO_TEST_RANKS`` (e.g. ``2 3 4``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

_WORDS = "passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?"
SUMMARY = re.compile(rf"^=*\s*((?:\d+ (?:{_WORDS})(?:, )?)+) in [\d.]+s")


def find_mpiexec() -> str:
    if os.environ.get("MPIEXEC"):
        return os.environ["MPIEXEC"]
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        sys.exit("run_suite: no mpiexec found (set MPIEXEC)")
    return found


def counts(line: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line):
        key = "errors" if word.startswith("error") else word
        out[key] = out.get(key, 0) + int(n)
    return out


def run_stage(name: str, cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, dict[str, int]]:
    print(f"\n### stage {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    summary: dict[str, int] = {}
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            m = SUMMARY.search(line)
            if m:
                summary = counts(m.group(1))
        rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        print(f"### stage {name}: TIMED OUT after {timeout:.0f}s (deadlock?)", flush=True)
        return 124, summary
    print(f"### stage {name}: exit {rc} in {time.time() - t0:.1f}s", flush=True)
    return rc, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=os.environ.get("HPCZECO_TEST_RANKS", "2 3 4 5"))
    ap.add_argument("--serial-only", action="store_true")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k scan)")
    args = ap.parse_args()

    py = sys.executable
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # mpi4py's own CI settings for oversubscribed runs of the MPICH wheel (harmless elsewhere).
    env.setdefault("HYDRA_LAUNCHER", "fork")
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "true")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    stage_timeout = float(env.setdefault("MPIEXEC_TIMEOUT", "600"))

    results = []
    rc, summ = run_stage("serial (1 process)", [py, "-m", "pytest", "-q", *args.pytest_args], env, 3 * stage_timeout)
    results.append(("serial", rc, summ))
    if not args.serial_only:
        mpiexec = find_mpiexec()
        for n in args.ranks.split():
            cmd = [mpiexec, "-n", n, py, "-m", "pytest", "-q", "-m", "mpi", "-p", "no:cacheprovider", *args.pytest_args]
            rc, summ = run_stage(f"mpiexec -n {n}", cmd, env, stage_timeout)
            results.append((f"n={n}", rc, summ))

    total: dict[str, int] = {}
    print("\n### summary")
    ok = True
    for name, rc, summ in results:
        for k, v in summ.items():
            total[k] = total.get(k, 0) + v
        bad = rc not in (0, 5)
        ok &= not bad
        desc = ", ".join(f"{v} {k}" for k, v in summ.items()) or "no summary"
        print(f"  {name:10s} exit {rc:3d}  {desc}{'  <-- FAILED' if bad else ''}")
    failed = total.get("failed", 0) + total.get("errors", 0) + (0 if ok else 1 if not total.get("failed") else 0)
    print(f"{total.get('passed', 0)} passed, {failed} failed, {total.get('skipped', 0)} skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
