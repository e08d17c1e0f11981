"""The real batch script jobs/slurm_cpu.sbatch under a real single-node Slurm.

tests/slurm/start_slurm.sh starts a private slurmctld + slurmd (auth/none, everything in a temporary
folder); the test submits jobs/slurm_cpu.sbatch with the tiny config jobs/configs/smoke.env, waits
for it (bounded), checks the job's output, the JSON-lines log and the HDF5 checkpoint, resubmits it
with srun on another rank count (which must resume from the checkpoint), then stops the daemons.
Skips with the reason where Slurm is not installed or not run as root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from hpczeco.drivers.checkpoint import list_checkpoints, load_latest

REPO = Path(__file__).resolve().parents[1]
START = REPO / "tests" / "slurm" / "start_slurm.sh"
STOP = REPO / "tests" / "slurm" / "stop_slurm.sh"
JOB_TIMEOUT = 180

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(2 * JOB_TIMEOUT + 120),
    pytest.mark.skipif(shutil.which("sbatch") is None or shutil.which("slurmctld") is None,
                       reason="Slurm not installed (sbatch/slurmctld not on PATH): "
                       "apt-get install --no-install-recommends slurm-wlm"),
    pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() != 0,
                       reason="the private test Slurm (auth/none) must be started as root"),
]


@pytest.fixture(scope="module")
def slurm():
    """Environment with SLURM_CONF pointing at a freshly started single-node cluster."""
    folder = Path(tempfile.mkdtemp(prefix="hpczeco-slurm-"))
    env = dict(os.environ, SLURM_TEST_CPUS=os.environ.get("SLURM_TEST_CPUS", "4"))
    started = subprocess.run(["bash", str(START), str(folder / "cluster")], capture_output=True, text=True,
                             env=env, timeout=120)
    if started.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"start_slurm.sh failed ({started.returncode}):\n{started.stdout}\n{started.stderr}")
    env["SLURM_CONF"] = str(folder / "cluster" / "slurm.conf")
    try:
        yield env, folder
    finally:
        subprocess.run(["bash", str(STOP), str(folder / "cluster")], capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def _job_state(env: dict, job: str) -> tuple[str, str]:
    """(JobState, ExitCode) from scontrol (empty strings if Slurm does not know the job)."""
    q = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=env, timeout=30)
    fields = dict(f.split("=", 1) for f in q.stdout.split() if "=" in f)
    return fields.get("JobState", ""), fields.get("ExitCode", "")


_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "")


def _wait(env: dict, job: str, name: str, out_file: Path) -> str:
    """Wait (bounded) until Slurm job ``job`` ends; assert it COMPLETED with exit 0; return its output."""
    deadline = time.monotonic() + JOB_TIMEOUT
    state, code = _job_state(env, job)
    while state in _ACTIVE:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, timeout=30)
            pytest.fail(f"job {name} ({job}) still {state} after {JOB_TIMEOUT}s; output so far:\n"
                        + (out_file.read_text() if out_file.exists() else "(none)"))
        time.sleep(0.5)
        state, code = _job_state(env, job)
    text = out_file.read_text() if out_file.exists() else ""
    assert state == "COMPLETED" and code == "0:0", f"job {name} ({job}): {state} exit {code}\n--- output ---\n{text}"
    return text


def _sbatch(env: dict, folder: Path, args: list[str]) -> str:
    cmd = ["sbatch", "--parsable", f"--time={JOB_TIMEOUT // 60 + 1}", *args]
    sub = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, cwd=folder)
    assert sub.returncode == 0, f"sbatch refused {args}: {sub.stderr}"
    return sub.stdout.strip().split(";")[0]


def _submit(env: dict, folder: Path, name: str, ntasks: int, **variables: str) -> str:
    """Submit the real jobs/slurm_cpu.sbatch and wait for it (bounded); returns the job's output."""
    out_file = folder / f"{name}.out"
    exports = ",".join(["ALL", f"HPCZECO_REPO={REPO}", f"HPCZECO_CONFIG={REPO / 'jobs/configs/smoke.env'}"]
                       + [f"{k}={v}" for k, v in variables.items()])
    job = _sbatch(env, folder, [f"--ntasks-per-node={ntasks}", f"--output={out_file}", f"--export={exports}",
                                str(REPO / "jobs" / "slurm_cpu.sbatch")])
    return _wait(env, job, name, out_file)


def test_cpu_job_trains_checkpoints_and_resumes_with_srun(slurm):
    env, folder = slurm
    out = folder / "run"
    text = _submit(env, folder, "first", 3, HPCZECO_OUT=str(out))
    assert "MPI library" in text and "ranks           3 on 1 host(s)" in text, text
    assert f"outputs   {out}" in text
    assert "hpczeco train: steps 1..4 on 3 rank(s)" in text, text
    assert f"== done: log {out}/train.jsonl" in text
    steps = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if r["event"] == "step"]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses)
    assert [s for s, _ in list_checkpoints(out / "ckpt")] == [2, 4]
    step, arrays, attrs = load_latest(out / "ckpt")  # checksums verified
    assert step == 4 and attrs["nranks"] == 3 and attrs["data_pos"] == 4
    assert "params/layer0/wq" in arrays and "adam/m/layer1/w2" in arrays

    # the same job again through srun --mpi=pmi2 on 2 ranks, 2 more steps: resumes from step 4
    text = _submit(env, folder, "second", 2, HPCZECO_OUT=str(out), HPCZECO_LAUNCHER="srun", TRAIN_STEPS="6")
    assert "launcher  srun (--mpi=pmi2)" in text, text
    assert "resume: step 4" in text and "written by 3 rank(s), now 2" in text, text
    assert "hpczeco train: steps 5..6 on 2 rank(s)" in text, text
    step, _, attrs = load_latest(out / "ckpt")
    assert step == 6 and attrs["nranks"] == 2 and attrs["data_pos"] == 6


def test_scan_job_array_one_rank_count_per_task(slurm):
    """jobs/ring_vs_tree_array.sbatch: array index -> P, every task's results in one folder."""
    env, folder = slurm
    config = folder / "scan.env"  # values with commas cannot travel through sbatch --export
    config.write_text('SCAN_RANKS="2 3"\nSCAN_TOPOLOGIES=ring,tree\nSCAN_SIZES=4K\nSCAN_BLOCKS=2\n'
                      "SCAN_REPEATS=3\nSCAN_DTYPE=float32\nSCAN_EXTRA=--no-plot\n")
    out = folder / "scan"
    exports = f"ALL,HPCZECO_REPO={REPO},HPCZECO_CONFIG={config},HPCZECO_OUT={out}"
    job = _sbatch(env, folder, ["--array=0-1", "--ntasks=3", f"--output={folder}/scan-%a.out", f"--export={exports}",
                                str(REPO / "jobs" / "ring_vs_tree_array.sbatch")])
    for idx, P in ((0, 2), (1, 3)):
        text = _wait(env, f"{job}_{idx}", f"scan task {idx}", folder / f"scan-{idx}.out")
        assert f"== hpczeco bench scan on P={P} ranks (array index {idx})" in text, text
        result = json.loads((out / f"scan_P{P}.json").read_text())
        assert f"scan_P{P}.csv" in text and (out / f"scan_P{P}.csv").exists()
        assert result["P"] == P
        assert {r["topology"] for r in result["results"]} >= {"ring", "tree"}
        assert all(r["median_s"] > 0 and r["P"] == P for r in result["results"])
