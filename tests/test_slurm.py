"""The real batch scripts in jobs/ under a real single-node Slurm.

tests/slurm/start_slurm.sh starts a private slurmctld + slurmd (auth/none, task/affinity, everything in
a temporary folder). The tests submit, with the tiny config jobs/configs/smoke.env:

1. jobs/slurm_cpu.sbatch three times into one output folder:
   a. 2 tasks, default launcher: srun with the ``--mpi`` plugin of this python's MPI (pmi2 for MPICH,
      pmix for Open MPI); each rank bound to its own core (``hpczeco info`` per rank and srun's
      ``--cpu-bind=verbose`` lines); 4 steps, checkpoints at 2 and 4;
   b. 3 tasks through mpiexec with ``HPCZECO_THREADS=2``: resumes from step 4 (written by 2 ranks);
   c. 1 task with ``--cpus-per-task=2`` through srun: the rank gets both CPUs and 2 OpenMP threads;
      SIGUSR1 to the batch shell (what ``--signal=B:USR1@120`` does before the walltime) makes the
      ranks checkpoint and stop and the job requeue itself; the restarted job resumes and finishes.
2. jobs/submit_scan_array.sh: one array element per rank count P, each asking ``--ntasks=P``, then
   the report job over their results.

Skips with the reason where Slurm is not installed or not run as root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hpczeco.drivers.checkpoint import list_checkpoints, load_latest
from hpczeco.drivers.mpienv import launch_env

REPO = Path(__file__).resolve().parents[1]
START = REPO / "tests" / "slurm" / "start_slurm.sh"
STOP = REPO / "tests" / "slurm" / "stop_slurm.sh"
JOB_TIMEOUT = 240

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("sbatch") is None or shutil.which("slurmctld") is None,
                       reason="Slurm not installed (sbatch/slurmctld not on PATH): "
                       "apt-get install --no-install-recommends slurm-wlm"),
    pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() != 0,
                       reason="the private test Slurm (auth/none) must be started as root"),
]


def _job_env(base: dict) -> dict:
    """What every job gets (sbatch --export=ALL): this python and its venv, this run's mpiexec."""
    env = launch_env(base)
    env["HPCZECO_REPO"] = str(REPO)
    env["HPCZECO_PYTHON"] = sys.executable
    if sys.prefix != sys.base_prefix:
        env["HPCZECO_VENV"] = sys.prefix
    if os.environ.get("MPIEXEC"):
        env["HPCZECO_MPIEXEC"] = os.environ["MPIEXEC"]
    for var in ("HPCZECO_LAUNCHER", "HPCZECO_SRUN_MPI", "HPCZECO_THREADS", "HPCZECO_OUT", "HPCZECO_CONFIG"):
        env.pop(var, None)
    return env


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
        yield _job_env(env), folder
    finally:
        subprocess.run(["bash", str(STOP), str(folder / "cluster")], capture_output=True, timeout=60)
        if os.environ.get("HPCZECO_TEST_KEEP_SLURM") == "1":  # keep the jobs' outputs to read them
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


def _expected_srun_mpi(env: dict) -> str:
    """The plugin srun must use for this python's MPI; skips where this Slurm has none for it."""
    from mpi4py import MPI

    version = MPI.Get_library_version()
    listing = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, env=env, timeout=30)
    offered = listing.stdout + listing.stderr
    if "Open MPI" in version:
        if "pmix" not in offered:
            pytest.skip(f"Open MPI starts under srun only through --mpi=pmix, which this Slurm lacks: {offered!r}")
        return "pmix"
    if "pmi2" not in offered:
        pytest.skip(f"MPICH starts under srun through --mpi=pmi2, which this Slurm lacks: {offered!r}")
    return "pmi2"


def _job_fields(env: dict, job: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (empty if Slurm does not know the job)."""
    q = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=env, timeout=30)
    return dict(f.split("=", 1) for f in q.stdout.split() if "=" in f)


_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "")


def _wait(env: dict, job: str, name: str, out_file: Path) -> str:
    """Wait (bounded) until Slurm job ``job`` ends; assert it COMPLETED with exit 0; return its output."""
    deadline = time.monotonic() + JOB_TIMEOUT
    fields = _job_fields(env, job)
    while fields.get("JobState", "") in _ACTIVE:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, timeout=30)
            pytest.fail(f"job {name} ({job}) still {fields.get('JobState')} after {JOB_TIMEOUT}s; output so far:\n"
                        + (out_file.read_text() if out_file.exists() else "(none)"))
        time.sleep(0.5)
        fields = _job_fields(env, job)
    text = out_file.read_text() if out_file.exists() else ""
    state, code = fields.get("JobState"), fields.get("ExitCode")
    assert state == "COMPLETED" and code == "0:0", f"job {name} ({job}): {state} exit {code}\n--- output ---\n{text}"
    return text


CRED_EXPIRE = 10  # AuthInfo=cred_expire of tests/slurm/start_slurm.sh


def _release_requeued(env: dict, job: str) -> None:
    """Once the job script has requeued ``job`` (``Restarts=1``, ``PENDING``), make it eligible as soon as
    its old credential has expired (``CRED_EXPIRE`` + 1 s later: an earlier start is killed with "Job
    credential revoked"), instead of waiting for Slurm's hold and the next scheduling pass (~37 s with
    cred_expire=10, ~160 s with the default 120). That hold is the scheduler's policy, not the script's.
    Bounded; a job that never shows as requeued is left to ``_wait`` to report."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline:
        fields = _job_fields(env, job)
        if fields.get("Restarts") == "1" and fields.get("JobState") == "PENDING":
            time.sleep(CRED_EXPIRE + 1)
            if _job_fields(env, job).get("JobState") == "PENDING":
                upd = subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True,
                                     text=True, env=env, timeout=30)
                assert upd.returncode == 0, upd.stderr
            return
        if fields.get("JobState", "") not in _ACTIVE:
            return
        time.sleep(0.2)


def _sbatch(env: dict, folder: Path, args: list[str]) -> str:
    cmd = ["sbatch", "--parsable", f"--time={JOB_TIMEOUT // 60 + 1}", "--export=ALL", *args]
    sub = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, cwd=folder)
    assert sub.returncode == 0, f"sbatch refused {args}: {sub.stderr}"
    return sub.stdout.strip().split(";")[0]


def _submit_train(env: dict, folder: Path, name: str, sbatch_args: list[str], **variables: str) -> tuple[str, Path]:
    """Submit the real jobs/slurm_cpu.sbatch with the smoke config; returns (job id, output file)."""
    out_file = folder / f"{name}.out"
    job_env = dict(env, HPCZECO_CONFIG=str(REPO / "jobs/configs/smoke.env"), **variables)
    job = _sbatch(job_env, folder, [*sbatch_args, f"--output={out_file}", str(REPO / "jobs" / "slurm_cpu.sbatch")])
    return job, out_file


def _rank_lines(text: str) -> dict[int, tuple[str, int, str]]:
    """From `hpczeco info`: rank -> (cpus, number of cpus, OMP_NUM_THREADS)."""
    found = re.findall(r"^\s+rank (\d+)\s+\S+ pid \d+ cpus (\S+) \((\d+)\) OMP_NUM_THREADS=(\S+)", text, re.M)
    return {int(r): (cpus, int(n), omp) for r, cpus, n, omp in found}


@pytest.mark.timeout(5 * JOB_TIMEOUT)
def test_cpu_job_srun_binding_resume_and_walltime_signal(slurm):
    env, folder = slurm
    plugin = _expected_srun_mpi(env)
    out = folder / "run"

    # a. srun (the default under Slurm) with the plugin of this MPI; one core per rank, bound
    job, log = _submit_train(env, folder, "a", ["--ntasks-per-node=2", "--cpus-per-task=1"], HPCZECO_OUT=str(out),
                             HPCZECO_CPU_BIND="verbose,cores")
    text = _wait(env, job, "a", log)
    assert f"launcher  srun (--mpi={plugin}" in text, text
    assert "ranks           2 on 1 host(s)" in text and "launcher/library mismatch" not in text, text
    ranks = _rank_lines(text)
    assert sorted(ranks) == [0, 1] and all(n == 1 for _, n, _ in ranks.values()), text
    assert ranks[0][0] != ranks[1][0], f"both ranks bound to the same CPU:\n{text}"
    assert "cpu-bind=" in text, text  # srun's own report of the binding
    assert f"outputs   {out}" in text
    assert "hpczeco train: steps 1..4 on 2 rank(s)" in text, text
    steps = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if r["event"] == "step"]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses)
    assert [s for s, _ in list_checkpoints(out / "ckpt")] == [2, 4]
    step, arrays, attrs = load_latest(out / "ckpt")  # checksums verified
    assert step == 4 and attrs["nranks"] == 2 and attrs["data_pos"] == 4
    assert "params/blocks.0.attn.q_proj.weight" in arrays and "adam/m/blocks.1.down_proj.weight" in arrays

    # b. mpiexec on 3 ranks, HPCZECO_THREADS overriding the job's 1 CPU per task: resumes from step 4
    job, log = _submit_train(env, folder, "b", ["--ntasks-per-node=3", "--cpus-per-task=1"], HPCZECO_OUT=str(out),
                             HPCZECO_LAUNCHER="mpiexec", HPCZECO_THREADS="2", TRAIN_STEPS="6")
    text = _wait(env, job, "b", log)
    assert "launcher  mpiexec" in text and "threads   2 per rank (from HPCZECO_THREADS)" in text, text
    ranks = _rank_lines(text)
    assert sorted(ranks) == [0, 1, 2] and all(omp == "2" for _, _, omp in ranks.values()), text
    assert "resume: step 4" in text and "written by 2 rank(s), now 3" in text, text
    assert "hpczeco train: steps 5..6 on 3 rank(s)" in text, text
    step, _, attrs = load_latest(out / "ckpt")
    assert step == 6 and attrs["nranks"] == 3 and attrs["data_pos"] == 6

    # c. srun, 1 task with 2 CPUs: srun gets --cpus-per-task passed on (Slurm >= 22.05 would give it 1 CPU);
    #    then the pre-walltime signal: checkpoint, requeue, resume, finish
    total = 6 + 150
    job, log = _submit_train(env, folder, "c", ["--ntasks-per-node=1", "--cpus-per-task=2"], HPCZECO_OUT=str(out),
                             TRAIN_STEPS=str(total), TRAIN_CKPT_EVERY="1000")
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:  # signal once training is under way (a step after 6 is in the log)
        complete = (out / "train.jsonl").read_text().split("\n")[:-1]  # lines still being written excluded
        records = [json.loads(line) for line in complete if line.strip()]
        if any(r["event"] == "step" and r["step"] > 6 for r in records):
            break
        assert time.monotonic() < deadline, "job c never trained:\n" + (log.read_text() if log.exists() else "")
        time.sleep(0.2)
    sig = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True, env=env,
                         timeout=30)
    assert sig.returncode == 0, sig.stderr
    _release_requeued(env, job)
    text = _wait(env, job, "c", log)
    assert _job_fields(env, job).get("Restarts") == "1", _job_fields(env, job)
    assert f"launcher  srun (--mpi={plugin}, --cpus-per-task=2, --cpu-bind=cores)" in text, text
    assert "threads   2 per rank (from --cpus-per-task)" in text, text
    ranks = _rank_lines(text)
    assert ranks and ranks[0][1] == min(2, os.cpu_count() or 1) and ranks[0][2] == "2", text
    m = re.search(r"SIGUSR1 received: checkpoint at step (\d+), then stop", text)
    assert m and 6 < int(m.group(1)) < total, text
    stopped = int(m.group(1))
    assert "== requeue: scontrol requeue" in text, text
    assert f"resume: step {stopped} from" in text, text
    assert f"hpczeco train: steps {stopped + 1}..{total} on 1 rank(s)" in text, text
    ends = [r for r in map(json.loads, (out / "train.jsonl").read_text().splitlines()) if r["event"] == "end"]
    assert [(r["step"], r["stopped_by"]) for r in ends[-2:]] == [(stopped, "SIGUSR1"), (total, None)], ends
    assert [s for s, _ in list_checkpoints(out / "ckpt")] == [6, stopped, total]  # keep 3
    step, _, attrs = load_latest(out / "ckpt")
    assert step == total and attrs["nranks"] == 1


@pytest.mark.timeout(4 * JOB_TIMEOUT)
def test_scan_sweep_each_element_sized_to_its_rank_count(slurm):
    """jobs/submit_scan_array.sh: one `sbatch --array=i --ntasks=P_i` per P, one folder, then the report."""
    env, folder = slurm
    config = folder / "scan.env"
    config.write_text('SCAN_RANKS="2 3"\nSCAN_TOPOLOGIES=ring,tree\nSCAN_SIZES=4K\nSCAN_BLOCKS=2\n'
                      "SCAN_REPEATS=3\nSCAN_DTYPE=float32\nSCAN_EXTRA=--no-plot\n")
    out = folder / "scan"
    sub = subprocess.run(["bash", str(REPO / "jobs" / "submit_scan_array.sh"), f"--time={JOB_TIMEOUT // 60 + 1}",
                          f"--output={folder}/scan-%a.out"], capture_output=True, text=True, timeout=60, cwd=folder,
                         # no core binding: the test node advertises SLURM_TEST_CPUS=4 CPUs on what may be 2
                         env=dict(env, HPCZECO_CONFIG=str(config), HPCZECO_OUT=str(out), HPCZECO_CPU_BIND=""))
    assert sub.returncode == 0, sub.stdout + sub.stderr
    elements = re.findall(r"^P=(\d+): job (\d+)_(\d+) --ntasks=(\d+)$", sub.stdout, re.M)
    assert [(int(p), int(i), int(n)) for p, _, i, n in elements] == [(2, 0, 2), (3, 1, 3)], sub.stdout
    for P, job, idx, _ in elements:
        text = _wait(env, f"{job}_{idx}", f"scan P={P}", folder / f"scan-{idx}.out")
        assert f"== hpczeco bench scan on P={P} ranks (array index {idx}, {P} tasks allocated)" in text, text
        result = json.loads((out / f"scan_P{P}.json").read_text())
        assert f"scan_P{P}.csv" in text and (out / f"scan_P{P}.csv").exists()
        assert result["P"] == int(P)
        assert {r["topology"] for r in result["results"]} >= {"ring", "tree"}
        assert all(r["median_s"] > 0 and r["P"] == int(P) for r in result["results"])
    m = re.search(r"^report: job (\d+) -> (.+)$", sub.stdout, re.M)
    assert m and m.group(2) == f"{out}/report", sub.stdout
    text = _wait(env, m.group(1), "report", out / f"report-{m.group(1)}.out")
    report = (out / "report" / "report.md").read_text()
    assert "## P = 2" in report and "## P = 3" in report, text + report
