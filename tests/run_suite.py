#!/usr/bin/env python3
"""Run the whole test suite: once in one process, then the ``mpi``-marked tests under
``mpiexec -n N`` for each N in ``--ranks``. Prints each stage's pytest summary and a total line
``N passed, N failed, N skipped``; exits non-zero if any stage failed, timed out or left no summary.

Each stage's counts come from a JSON result file that rank 0 writes at the end of the stage (this
file is also loaded into pytest as a plugin, ``-p run_suite``), not from pytest's terminal text,
which Open MPI's ``mpiexec`` colours (its ranks see a terminal); every stage also runs with
``--color=no``. Stages run with the single-node oversubscription settings of
``hpczeco.drivers.mpienv`` (MPICH, Open MPI 4 and 5, as root).

Environment: ``MPIEXEC`` (default: the venv's mpiexec, else ``mpiexec`` on PATH),
``MPIEXEC_TIMEOUT`` (seconds per MPI stage, default 600), ``HPCZECO_TEST_RANKS`` (e.g. ``2 3 4``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT_ENV = "HPCZECO_SUITE_RESULT"
_WORDS = "passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?"
SUMMARY = re.compile(rf"^=*\s*((?:\d+ (?:{_WORDS})(?:, )?)+) in [\d.]+s")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_COUNTED = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")


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
    """Counts from a pytest summary line such as ``3 failed, 10 passed, 2 skipped in 4.1s``."""
    out: dict[str, int] = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", ANSI.sub("", line)):
        key = "errors" if word.startswith("error") else word
        out[key] = out.get(key, 0) + int(n)
    return out


# ------------------------------------------------------------------------------ pytest plugin (-p run_suite)


def _world_rank() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.COMM_WORLD.Get_rank() if mpi is not None and mpi.Is_initialized() else 0


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Rank 0 writes the stage's counts to ``$HPCZECO_SUITE_RESULT`` (JSON) when that is set. The
    harness (conftest.py) agrees every MPI test's outcome over the ranks, so rank 0's counts are the
    stage's."""
    path = os.environ.get(RESULT_ENV)
    if not path or _world_rank() != 0:
        return
    result: dict[str, int] = {}
    for category, reports in terminalreporter.stats.items():
        key = "errors" if category == "error" else category
        if key in _COUNTED:
            result[key] = sum(1 for r in reports if getattr(r, "count_towards_summary", True))
    result["exitstatus"] = int(exitstatus)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ stages


#: lines of a stage's output kept to be shown again in the summary when the stage fails (the CI log's tail is
#: often all one gets to read: a crash or a pytest-timeout stack dump early in a long stage scrolls away)
TAIL_LINES = 60


def run_stage(name: str, cmd: list[str], env: dict[str, str], timeout: float, result_file: Path):
    """Run one stage; returns ``(exit code, counts or {}, seconds, the last TAIL_LINES lines of its output)``.
    Its standard input is ``/dev/null``: no test waits on the terminal or on a CI runner's open pipe."""
    print(f"\n### stage {name}: {' '.join(cmd)}", flush=True)
    result_file.unlink(missing_ok=True)
    env = dict(env, **{RESULT_ENV: str(result_file)})
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    text_summary: dict[str, int] = {}
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    interesting: list[str] = []  # pytest-timeout's banner and the first lines after it
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line)
            if "Timeout" in line and "+++" in line or 0 < len(interesting) < TAIL_LINES:
                interesting.append(line)
            m = SUMMARY.search(ANSI.sub("", line))
            if m:
                text_summary = counts(m.group(1))
        rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"### stage {name}: TIMED OUT after {timeout:.0f}s (deadlock?)", flush=True)
        return 124, text_summary, time.time() - t0, [*interesting, *tail]
    seconds = time.time() - t0
    summary = text_summary
    if result_file.exists():
        data = json.loads(result_file.read_text())
        summary = {k: v for k, v in data.items() if k in _COUNTED and v}
        if not summary and data.get("exitstatus") == 5:  # no tests collected
            summary = {"passed": 0}
    print(f"### stage {name}: exit {rc} in {seconds:.1f}s", flush=True)
    return rc, summary, seconds, [*interesting, *tail]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=os.environ.get("HPCZECO_TEST_RANKS", "2 3 4 5"))
    ap.add_argument("--serial-only", action="store_true")
    ap.add_argument("--no-emulation", action="store_true",
                    help="leave the tests marked 'emulation' (GPU kernels in the CPU emulation: nothing MPI-specific) "
                         "out of the serial stage; CI's second MPI runs this, its first ran them")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k scan, or test files)")
    args = ap.parse_args()

    from hpczeco.drivers.mpienv import launch_env

    py = sys.executable
    env = launch_env()
    env.setdefault("PYTHONUNBUFFERED", "1")
    # this file is the plugin that writes each stage's result file
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    stage_timeout = float(env.setdefault("MPIEXEC_TIMEOUT", "600"))
    pytest = [py, "-m", "pytest", "-q", "--color=no", "-p", "run_suite", "-p", "no:cacheprovider"]
    t_all = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="hpczeco-suite-"))

    results = []
    try:
        serial = [*pytest, *(["-m", "not emulation"] if args.no_emulation else []), *args.pytest_args]
        rc, summ, sec, tail = run_stage("serial (1 process)", serial, env, 3 * stage_timeout,
                                        workdir / "serial.json")
        results.append(("serial", rc, summ, sec, tail))
        if not args.serial_only:
            mpiexec = find_mpiexec()
            for n in args.ranks.split():
                cmd = [mpiexec, "-n", n, *pytest, "-m", "mpi", *args.pytest_args]
                rc, summ, sec, tail = run_stage(f"mpiexec -n {n}", cmd, env, stage_timeout, workdir / f"n{n}.json")
                results.append((f"n={n}", rc, summ, sec, tail))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    total: dict[str, int] = {}
    bad = {name: rc not in (0, 5) or not summ for name, rc, summ, _, _ in results}
    for name, _, _, _, tail in results:
        if bad[name]:  # again, so that the end of the log says why
            print(f"\n### stage {name} failed; the end of its output (and a pytest-timeout dump, if any):")
            sys.stdout.write("".join(tail))
    print("\n### summary")
    ok = not any(bad.values())
    for name, rc, summ, sec, _ in results:
        for k, v in summ.items():
            total[k] = total.get(k, 0) + v
        desc = ", ".join(f"{v} {k}" for k, v in summ.items()) or "no summary"
        print(f"  {name:10s} exit {rc:3d}  {sec:6.0f} s  {desc}{'  <-- FAILED' if bad[name] else ''}")
    failed = total.get("failed", 0) + total.get("errors", 0)
    if not ok and failed == 0:
        failed = 1  # a stage crashed or timed out without reporting a failed test
    print(f"{total.get('passed', 0)} passed, {failed} failed, {total.get('skipped', 0)} skipped "
          f"in {(time.time() - t_all) / 60:.1f} min")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
