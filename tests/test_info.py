"""`hpczeco info`: runs, prints the MPI library, gathers every rank, never needs CuPy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hpczeco.drivers import info
from mpi4py import MPI

REPO = Path(__file__).resolve().parents[1]


def _mpiexec() -> str:
    return os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


def test_info_text_names_the_mpi_library(capsys):
    assert info.main([]) == 0
    out = capsys.readouterr().out
    first = " ".join(MPI.Get_library_version().replace("\x00", "").splitlines()[0].split())
    assert f"MPI library     {first}" in out
    assert "HDF5 mode" in out and "transports      host: yes" in out and "mpi4py" in out


def test_info_json_fields(capsys, monkeypatch):
    monkeypatch.delenv(info.CUDA_AWARE_ENV, raising=False)
    assert info.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mpi"]["library_version"] == MPI.Get_library_version().replace("\x00", "").strip()
    assert data["mpi"]["thread_level"].startswith("MPI_THREAD_")
    assert data["ranks"]["size"] == 1 and len(data["ranks"]["per_rank"]) == 1
    assert data["transports"]["host"] == "yes"
    lib = data["mpi"]["library_path"]
    assert lib is None or Path(lib).exists()
    h5py = pytest.importorskip("h5py")
    want = "mpio" if h5py.get_config().mpi else "serial"
    assert want in data["hdf5_mode"]
    if data["gpus"]["count"] == 0:
        assert data["transports"]["staged"].startswith("no")


@pytest.mark.parametrize("value,expect", [("1", True), ("0", False)])
def test_cuda_aware_opt_in_env(monkeypatch, value, expect):
    monkeypatch.setenv(info.CUDA_AWARE_ENV, value)
    data = info.collect(MPI.COMM_SELF)
    assert data["cuda_aware"]["effective"] is expect
    assert data["cuda_aware"][info.CUDA_AWARE_ENV] == value


def test_cli_help_and_mpiexec_ranks():
    env = dict(os.environ, HYDRA_LAUNCHER="fork", MPIEXEC_TIMEOUT="60")
    out = subprocess.run([sys.executable, "-m", "hpczeco", "info", "--help"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "--json" in out.stdout
    run = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-m", "hpczeco", "info", "--json"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)  # only rank 0 prints
    assert data["ranks"]["size"] == 2
    assert [r["rank"] for r in data["ranks"]["per_rank"]] == [0, 1]
    assert len({r["pid"] for r in data["ranks"]["per_rank"]}) == 2


@pytest.mark.mpi
def test_collect_gathers_every_rank(comm):
    data = info.collect(comm)
    assert data["ranks"]["size"] == comm.Get_size()
    if comm.Get_rank() == 0:
        assert [r["rank"] for r in data["ranks"]["per_rank"]] == list(range(comm.Get_size()))
    else:
        assert data["ranks"]["per_rank"] is None
    assert data["mpi"]["library_version"] == MPI.Get_library_version().replace("\x00", "").strip()
