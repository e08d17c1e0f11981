"""Launching (hpczeco.drivers.mpienv): the oversubscription settings start more ranks than cores with the
MPI in use; the srun plugin rules; mpi4py checked against mpicc; a launcher/library mismatch reported by
`hpczeco info` and refused by `hpczeco train`; SIGUSR1 through mpiexec makes `hpczeco train` checkpoint
and stop. Every test launches its own processes: serial stage only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hpczeco.drivers import mpienv
from hpczeco.drivers.checkpoint import list_checkpoints, load_latest

HERE = Path(__file__).parent
PY = sys.executable
SMOKE = ["--seq", "96", "--batch", "1", "--dtype", "float32", "--corpus-bytes", "200000", "--d-model", "16",
         "--layers", "2", "--heads", "2", "--chunk-size", "16", "--lr", "1e-2", "--no-progress"]


def _mpiexec() -> str:
    sys.path.insert(0, str(HERE))
    from run_suite import find_mpiexec

    return find_mpiexec()


def _family() -> str:
    return mpienv.mpi_family(mpienv.library_version())


def test_launch_env_starts_more_ranks_than_cores():
    n = (os.cpu_count() or 1) + 1
    # one write(2) per rank: the ranks share mpiexec's stdout, and print's several writes can interleave
    code = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "os.write(1, f'world {c.Get_size()} {c.allreduce(1)}\\n'.encode())")
    env = dict(mpienv.launch_env(), MPIEXEC_TIMEOUT="100")
    out = subprocess.run([_mpiexec(), "-n", str(n), PY, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n").count(f"world {n} {n}") == n, out.stdout + out.stderr
    # values already set win over the defaults
    assert mpienv.launch_env({"OMPI_MCA_rmaps_base_oversubscribe": "0"})["OMPI_MCA_rmaps_base_oversubscribe"] == "0"
    assert set(mpienv.OVERSUBSCRIBE_ENV) <= set(mpienv.launch_env({}))


@pytest.mark.parametrize(("family", "types", "want"), [
    ("openmpi", ["pmix", "none", "cray_shasta", "pmi2", "pmix_v4"], "pmix"),
    ("openmpi", ["none", "pmix_v3"], "pmix"),
    ("openmpi", ["none", "pmi2"], None),       # Debian's Open MPI has no Slurm PMI-2 support
    ("mpich", ["pmix", "none", "pmi2"], "pmi2"),
    ("intel", ["pmi2"], "pmi2"),
    ("mpich", ["none", "pmix"], None),
    ("cray", ["cray_shasta", "pmi2"], "cray_shasta"),
    ("mpich", None, None),                     # no srun / no Slurm configuration
])
def test_srun_plugin_follows_the_mpi_library(family, types, want):
    plugin, why = mpienv.srun_mpi_plugin(family, types)
    assert plugin == want, why
    if want is None:
        assert why and ("srun" in why), why


def test_mpicc_check_against_the_build_and_another_mpi():
    lib_family = _family()
    if os.environ.get("MPICC"):  # make MPI=system: mpi4py was built against it, the check must agree
        assert mpienv.mpicc_mismatch(os.environ["MPICC"]) is None
    others = []
    for name in ("mpicc", "mpicc.openmpi", "mpicc.mpich"):
        exe = shutil.which(name)
        if exe and mpienv.mpicc_info(exe)["family"] not in (lib_family, "unknown"):
            others.append(exe)
    if not others:
        pytest.skip(f"no mpicc of another MPI than mpi4py's ({lib_family}) on PATH to check the refusal")
    for exe in others:
        msg = mpienv.mpicc_mismatch(exe)
        assert msg and exe in msg and "--no-cache-dir" in msg and "--no-binary=mpi4py" in msg, msg


@pytest.mark.parametrize(("size", "env", "bad"), [
    (1, {"PMI_SIZE": "4"}, "PMI_SIZE=4"),
    (1, {"OMPI_COMM_WORLD_SIZE": "3"}, "OMPI_COMM_WORLD_SIZE=3"),
    (1, {"PMIX_RANK": "2"}, "PMIX_RANK=2"),
    (1, {"SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8"}, "SLURM_STEP_NUM_TASKS=8"),
    (1, {"SLURM_NTASKS": "8"}, None),                          # a batch shell, not an srun step
    (1, {"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"}, None),  # the launcher itself says 1
    (1, {"PMIX_RANK": "0"}, None),
    (4, {"PMI_SIZE": "4", "SLURM_STEP_NUM_TASKS": "4"}, None),
])
def test_launcher_mismatch_rules(size, env, bad):
    msg = mpienv.launcher_mismatch(size, env)
    if bad is None:
        assert msg is None, msg
    else:
        assert msg and msg.startswith("launcher/library mismatch") and bad in msg and "size 1" in msg, msg


def _foreign_launcher_env() -> tuple[str, dict[str, str]]:
    """A launcher variable of the MPI that mpi4py does NOT use (as a foreign mpiexec would set it)."""
    return ("PMI_SIZE", {"PMI_SIZE": "3"}) if _family() == "openmpi" else ("OMPI_COMM_WORLD_SIZE",
                                                                          {"OMPI_COMM_WORLD_SIZE": "3"})


def test_mismatch_reported_by_info_and_refused_by_train(tmp_path):
    var, extra = _foreign_launcher_env()
    env = dict(os.environ, **extra)
    info = subprocess.run([PY, "-m", "hpczeco", "info"], env=env, capture_output=True, text=True, timeout=120)
    assert info.returncode == 1, info.stdout + info.stderr
    warn = [line for line in info.stdout.splitlines() if "launcher/library mismatch" in line]
    assert len(warn) == 1 and f"{var}=3" in warn[0] and "started 3 processes" in warn[0], info.stdout
    train = subprocess.run([PY, "-m", "hpczeco", "train", "--steps", "2", *SMOKE, "--ckpt-dir", str(tmp_path / "c")],
                           env=env, capture_output=True, text=True, timeout=120)
    assert train.returncode == 2, train.stdout + train.stderr
    errors = [line for line in train.stderr.splitlines() if line.startswith("hpczeco train: error:")]
    assert len(errors) == 1 and "launcher/library mismatch" in errors[0] and f"{var}=3" in errors[0], train.stderr
    assert "rank(s)" not in train.stdout and not (tmp_path / "c").exists(), train.stdout
    # the same variables saying 1 process: no complaint
    ok = subprocess.run([PY, "-m", "hpczeco", "info"], env=dict(os.environ, **{var: "1"}), capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "mismatch" not in ok.stdout, ok.stdout + ok.stderr


def test_real_foreign_launcher_is_reported():
    """Where both Debian MPIs are installed: the other MPI's mpiexec starting this python never gives a
    silent world of size 1: either every process reports the mismatch, or the library itself refuses the
    foreign runtime at MPI_Init (MPICH 5 does so for PMIx)."""
    other = {"openmpi": "mpiexec.mpich", "mpich": "mpiexec.openmpi"}.get(_family())
    exe = shutil.which(other) if other else None
    if exe is None:
        pytest.skip(f"no launcher of another MPI than mpi4py's ({_family()}) installed")
    env = dict(mpienv.launch_env(), MPIEXEC_TIMEOUT="100")
    out = subprocess.run([exe, "-n", "2", PY, "-m", "hpczeco", "info"], env=env, capture_output=True, text=True,
                         timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    warn = [line for line in out.stdout.splitlines() if "launcher/library mismatch" in line]
    if not warn:
        assert "MPI_Init" in text and "PMI" in text and "ranks   " not in text, text
    else:
        assert len(warn) == 2 and all("started 2 processes" in w for w in warn), text


def test_sigusr1_through_mpiexec_checkpoints_and_stops(tmp_path):
    """What the job scripts do before the walltime: SIGUSR1 to the launcher, which passes it to the ranks."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "train.jsonl"
    cmd = [_mpiexec(), "-n", "2", PY, "-m", "hpczeco", "train", "--steps", "100000", *SMOKE, "--ckpt-dir", str(ckpt),
           "--ckpt-every", "100000", "--log", str(log)]
    env = dict(mpienv.launch_env(), MPIEXEC_TIMEOUT="170", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while not (log.exists() and '"event": "step"' in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    end = records[-1]
    assert end["event"] == "end" and end["stopped_by"] == "SIGUSR1" and 1 <= end["step"] < 100000, records[-3:]
    assert f"SIGUSR1 received: checkpoint at step {end['step']}, then stop" in out, out
    assert [s for s, _ in list_checkpoints(ckpt)] == [end["step"]]
    step, _, attrs = load_latest(ckpt)
    assert step == end["step"] and attrs["nranks"] == 2
