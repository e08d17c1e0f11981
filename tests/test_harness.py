"""The harness itself: a failure on one rank fails the run; a deadlock times out with a message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hpczeco.drivers.mpienv import launch_env

HERE = Path(__file__).parent


def _mpiexec():
    sys.path.insert(0, str(HERE))
    from run_suite import find_mpiexec

    return find_mpiexec()


def _run_pytest_under_mpi(tmp_path: Path, body: str, n: int, extra: list[str], timeout: float = 120,
                          color: str = "no", env_extra: dict[str, str] | None = None):
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(body))
    env = dict(launch_env(), PYTHONUNBUFFERED="1", MPIEXEC_TIMEOUT="60", **(env_extra or {}))
    # --color=no by default: under Open MPI's mpiexec the ranks see a terminal and pytest colours its summary
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "pytest", "-q", f"--color={color}", "-p", "no:cacheprovider",
           "-m", "mpi", "--rootdir", str(tmp_path), *extra, str(tmp_path / "test_probe.py")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


_ONE_RANK_FAILS = """
    import pytest
    from mpi4py import MPI
    @pytest.mark.mpi
    def test_only_rank_one_fails():
        assert MPI.COMM_WORLD.Get_rank() != 1, "planted failure on rank 1"
    @pytest.mark.mpi
    def test_passes_everywhere():
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()
"""


def test_failure_on_one_rank_fails_the_run(tmp_path):
    res = _run_pytest_under_mpi(tmp_path, _ONE_RANK_FAILS, 2, [])
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "1 failed, 1 passed" in out, out
    assert "failed on rank(s) [1]" in out and "planted failure on rank 1" in out, out


def test_deadlock_fails_with_timeout(tmp_path):
    body = """
        import pytest
        from mpi4py import MPI
        @pytest.mark.mpi
        def test_rank_zero_waits_forever():
            c = MPI.COMM_WORLD
            if c.Get_rank() == 0:
                c.recv(source=1, tag=99)   # rank 1 never sends
    """
    res = _run_pytest_under_mpi(tmp_path, body, 2, ["--timeout=5", "-o", "timeout_method=thread"], timeout=90)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "Timeout" in out, out


def test_stage_counts_come_from_the_result_file_not_the_colours(tmp_path):
    """run_suite's plugin: rank 0 writes the counts as JSON, whatever colours the terminal text has."""
    result = tmp_path / "result.json"
    pythonpath = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    res = _run_pytest_under_mpi(tmp_path, _ONE_RANK_FAILS, 3, ["-p", "run_suite"], color="yes",
                                env_extra={"HPCZECO_SUITE_RESULT": str(result), "PYTHONPATH": pythonpath})
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "\x1b[" in out, out  # coloured on purpose
    data = json.loads(result.read_text())
    assert data["failed"] == 1 and data["passed"] == 1 and data["exitstatus"] == 1, data
    # and the text fallback reads the coloured summary line too
    sys.path.insert(0, str(HERE))
    from run_suite import counts

    summary = [line for line in out.splitlines() if "passed" in line and " in " in line]
    assert summary and counts(summary[-1]) == {"failed": 1, "passed": 1}, out


def test_a_stage_that_dies_keeps_its_reason_for_the_summary(tmp_path):
    """A stage that ends without a summary (pytest-timeout's os._exit after its stack dump, a crash): run_stage
    returns the dump's first lines and the output's last ones, which main() prints again before the summary; the
    stage's standard input is /dev/null (a test that reads it gets EOF at once instead of waiting on CI's pipe)."""
    sys.path.insert(0, str(HERE))
    from run_suite import TAIL_LINES, run_stage

    code = ("import sys\nprint('+' * 20, 'Timeout', '+' * 20)\nprint('File test_x.py, line 7 in test_hangs')\n"
            "for i in range(500): print('filler', i)\nprint('stdin gave', repr(sys.stdin.read()))\nsys.exit(1)\n")
    rc, summary, _, tail = run_stage("probe", [sys.executable, "-c", code], dict(os.environ), 60,
                                     tmp_path / "none.json")
    assert rc == 1 and summary == {}
    text = "".join(tail)
    assert "Timeout" in tail[0] and "line 7 in test_hangs" in tail[1], text
    assert "stdin gave ''" in tail[-1] and "filler 499" in text and "filler 250" not in text, text
    assert len(tail) <= 2 * TAIL_LINES
