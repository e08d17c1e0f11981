"""Across a network: the scans, the ZeCO layer and `hpczeco train` with MPI ranks on separate "hosts".

Each test makes network namespaces joined by a bridge with ``tests/netns/netns.sh`` (one MPI rank per
namespace, TCP only: MPICH ch4:ofi over libfabric's tcp provider with ``MPIR_CVAR_NOLOCAL=1``, or
Open MPI ``btl tcp,self``), runs the job there and checks, besides the job's own assertions, that the
traffic really crossed every host's virtual NIC (byte counters of the veths). Skips with the script's
reason where namespaces cannot be made (not root, no iproute2, no namespace support).

Default (``make test``): 3 hosts, MPICH, the mpi-marked tests of test_scan.py and test_zeco.py, and a
train / checkpoint / resume run. ``HPCZECO_NETNS_HOSTS="2 3 4"`` and ``HPCZECO_NETNS_MPI="mpich openmpi"``
widen it (``make test-net``); Open MPI needs Debian's ``mpirun.openmpi`` and its ``libmpi.so.40``
(mpi4py's wheel loads it through ``MPI4PY_LIBMPI``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
NETNS = ROOT / "tests" / "netns" / "netns.sh"
OPENMPI_LIB = "/usr/lib/x86_64-linux-gnu/libmpi.so.40"
OPENMPI_RUN = "/usr/bin/mpirun.openmpi"

HOSTS = [int(x) for x in os.environ.get("HPCZECO_NETNS_HOSTS", "3").split()]
MPIS = os.environ.get("HPCZECO_NETNS_MPI", "mpich").split()

pytestmark = pytest.mark.slow


def _can_run() -> str | None:
    """None, or why the namespaces cannot be made here."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    proc = subprocess.run(["bash", str(NETNS), "check"], capture_output=True, text=True, timeout=30)
    return None if proc.returncode == 0 else (proc.stderr.strip() or proc.stdout.strip() or "netns.sh check failed")


_REASON = _can_run()


def _env(mpi: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("HPCZECO_COLLECTIVE_TIMEOUT", "HPCZECO_FAULT_KILL", "HPCZECO_FAULT_CKPT", "HYDRA_LAUNCHER",
              "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(k, None)
    if mpi == "openmpi":
        env["MPI4PY_LIBMPI"] = OPENMPI_LIB
    else:
        env.pop("MPI4PY_LIBMPI", None)
    return env


def _netns(tmp_path: Path, hosts: int, mpi: str, job: str, timeout: int = 500) -> tuple[str, list[dict]]:
    """Run the shell line ``job`` (which uses ``$NETNS_MPIEXEC``) on ``hosts`` namespaces; its output and
    the bytes each host's NIC sent / received."""
    if mpi == "openmpi" and not (os.path.exists(OPENMPI_RUN) and os.path.exists(OPENMPI_LIB)):
        pytest.skip(f"Open MPI not installed ({OPENMPI_RUN}, {OPENMPI_LIB})")
    stats = tmp_path / f"stats_{hosts}_{mpi}.json"
    cmd = ["bash", str(NETNS), "-n", str(hosts), "--mpi", mpi, "--timeout", str(timeout), "--stats", str(stats),
           "--", "sh", "-c", job]
    proc = subprocess.run(cmd, env=_env(mpi), capture_output=True, text=True, timeout=timeout + 60, cwd=ROOT)
    text = proc.stdout + proc.stderr
    if proc.returncode == 77:
        pytest.skip(text.strip().splitlines()[-1])
    assert proc.returncode == 0, text[-6000:]
    return text, json.loads(stats.read_text())["hosts"]


def _crossed(nics: list[dict], at_least: int) -> None:
    """Every host's NIC sent and received at least ``at_least`` bytes (the job's messages went over TCP)."""
    assert nics, "no NIC counters"
    for nic in nics:
        assert nic["tx_bytes"] >= at_least and nic["rx_bytes"] >= at_least, nics


@pytest.mark.skipif(_REASON is not None, reason=f"netns: {_REASON}")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mpi", MPIS)
@pytest.mark.parametrize("hosts", HOSTS)
def test_scans_and_zeco_across_hosts(tmp_path, hosts, mpi):
    """Every scan topology (forward and reverse, every dtype, with and without ``initial``) and the ZeCO layer
    (forward and backward, every topology) against their float64 references, one rank per host."""
    job = ('"$NETNS_MPIEXEC" -n ' + str(hosts) + ' "$PYTHON" -m pytest -q -p no:cacheprovider -m mpi '
           "tests/test_scan.py tests/test_zeco.py")
    text, nics = _netns(tmp_path, hosts, mpi, job)
    m = re.search(r"(\d+) passed", text)
    assert m and int(m.group(1)) >= 30 and not re.search(r"\d+ (failed|error)", text), text[-4000:]
    _crossed(nics, 200_000)


@pytest.mark.skipif(_REASON is not None, reason=f"netns: {_REASON}")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mpi", MPIS)
def test_train_checkpoint_resume_across_hosts(tmp_path, mpi):
    """3 hosts: 4 steps with checkpoints at 2 and 4, then --resume to 6, equal bitwise (parameters and Adam
    moments) to an uninterrupted 6-step run; the text file and checkpoints live on the shared file system."""
    from hpczeco.drivers.checkpoint import load_checkpoint
    from hpczeco.drivers.data import read_corpus

    text_file = tmp_path / "text.txt"
    text_file.write_bytes(read_corpus(None, 24 << 10)[0])
    common = (f'"$NETNS_MPIEXEC" -n 3 "$PYTHON" -m hpczeco train --text {text_file} --d-model 32 --layers 1 '
              "--heads 2 --seq 384 --ckpt-every 2 --no-progress --quiet --dtype float64 --topology ring")
    full, part = tmp_path / "full", tmp_path / "part"
    job = (f"{common} --steps 6 --ckpt-dir {full} && {common} --steps 4 --ckpt-dir {part} && "
           f"{common} --steps 6 --ckpt-dir {part} --resume")
    _, nics = _netns(tmp_path, 3, mpi, job)
    step_a, xa, _ = load_checkpoint(full / "ckpt_00000006.h5")
    step_b, xb, attrs = load_checkpoint(part / "ckpt_00000006.h5")
    assert step_a == step_b == 6 and attrs["nranks"] == 3 and sorted(xa) == sorted(xb)
    for name in xa:
        assert np.array_equal(xa[name], xb[name]), f"{name} differs after the resume"
    _crossed(nics, 50_000)
