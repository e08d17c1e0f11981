"""The harness itself: a failure on one rank fails the run; a deadlock times out with a message."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).parent


def _mpiexec():
    sys.path.insert(0, str(HERE))
    from run_suite import find_mpiexec

    return find_mpiexec()


def _run_pytest_under_mpi(tmp_path: Path, body: str, n: int, extra: list[str], timeout: float = 120):
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_LAUNCHER="fork", MPIEXEC_TIMEOUT="60")
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-m", "mpi", "--rootdir", str(tmp_path), *extra, str(tmp_path / "test_probe.py")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_failure_on_one_rank_fails_the_run(tmp_path):
    body = """
        import pytest
        from mpi4py import MPI
        @pytest.mark.mpi
        def test_only_rank_one_fails():
            assert MPI.COMM_WORLD.Get_rank() != 1, "planted failure on rank 1"
        @pytest.mark.mpi
        def test_passes_everywhere():
            assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()
    """
    res = _run_pytest_under_mpi(tmp_path, body, 2, [])
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
