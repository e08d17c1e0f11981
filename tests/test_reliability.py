"""Reliability: stalled peers abort with a message naming them, a killed rank ends the job and the run
resumes bitwise, a crash during a checkpoint write never corrupts what --resume loads, no leaks over a
long run. All tests launch their own processes (``mpiexec`` or ``python -m hpczeco``): serial stage only.
Figures: docs/RELIABILITY.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import job_env, mpiexec_command
from hpczeco.drivers.checkpoint import FAULT_EXIT_CODE, list_checkpoints, load_checkpoint, load_latest
from hpczeco.drivers.data import read_corpus

HERE = Path(__file__).parent
PY = sys.executable




def _env(**extra: str) -> dict[str, str]:
    return job_env(**extra)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    data, _ = read_corpus(None, 48 << 10)
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(data)
    return str(path)


# --------------------------------------------------------------------------------------------- stalled peers


@pytest.mark.parametrize("mode, op, silent", [
    ("absent", r"scan \(arrival/validation\)", r"rank\(s\) \[2\], which did not call scan"),
    ("poll", r"scan\(ring\) wait", r"rank 1 \(the previous rank in scan order"),
])  # fmt: skip
def test_stalled_peer_aborts_with_message(mode, op, silent):
    """3 ranks, timeout 2 s: one rank never calls the scan (or never progresses it); the job must end
    non-zero within the timeout + a few seconds, and stderr names the operation and the silent rank."""
    timeout = 2.0
    t0 = time.monotonic()
    out = subprocess.run([mpiexec_command(), "-n", "3", PY, str(HERE / "reliability" / "stall.py"), mode, str(timeout)],
                         env=_env(), capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "finished (unexpected)" not in text or mode == "poll"  # rank 0 (first in the ring) may finish
    assert re.search(op + r" exceeded the collective timeout of 2 s; still waiting for " + silent, text), text
    assert took < timeout + 15, f"the stalled job took {took:.1f} s to end"
    print(f"stall[{mode}]: job ended after {took:.2f} s (timeout {timeout} s, rc {out.returncode})")


# --------------------------------------------------------------------------------------------- rank death

TRAIN = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "512", "--ckpt-every", "2",
         "--no-progress", "--quiet", "--dtype", "float64"]  # fmt: skip


def _train_cmd(n: int, text_file: str, ckpt: Path, *extra: str) -> list[str]:
    return [mpiexec_command(), "-n", str(n), PY, "-m", "hpczeco", "train", "--text", text_file, *TRAIN,
            "--ckpt-dir", str(ckpt), *extra]  # fmt: skip


def _same_arrays(a: Path, b: Path) -> None:
    sa, xa, _ = load_checkpoint(a)
    sb, xb, _ = load_checkpoint(b)
    assert sa == sb and sorted(xa) == sorted(xb)
    for name in xa:
        assert np.array_equal(xa[name], xb[name]), f"{name} differs between {a} and {b}"


def test_rank_death_ends_job_and_resume_is_bitwise(tmp_path, text_file):
    """4 ranks; rank 2 SIGKILLs itself in step 5 (checkpoints at 2 and 4 exist). The job ends non-zero in
    bounded time, the newest checkpoint (4) loads with every checksum, and --resume to step 8 gives
    final parameters and Adam moments bitwise equal to an uninterrupted 8-step run."""
    full, crash = tmp_path / "full", tmp_path / "crash"
    ref = subprocess.run(_train_cmd(4, text_file, full, "--steps", "8"), env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    proc = subprocess.run(_train_cmd(4, text_file, crash, "--steps", "8"), capture_output=True, text=True,
                          env=_env(HPCZECO_FAULT_KILL="2:5", HPCZECO_COLLECTIVE_TIMEOUT="10"), timeout=120)
    t_end = time.time()
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    m = re.search(r"fault injection: rank 2 SIGKILLs itself in step 5 at t=([\d.]+)", text)
    assert m, text
    exit_s = t_end - float(m.group(1))
    assert exit_s < 30, f"the job took {exit_s:.1f} s to end after the kill"
    print(f"rank death: job ended {exit_s:.2f} s after the SIGKILL (rc {proc.returncode})")
    assert [s for s, _ in list_checkpoints(crash)] == [2, 4]
    step, _, attrs = load_checkpoint(crash / "ckpt_00000004.h5")  # every checksum verified
    assert step == 4 and attrs["nranks"] == 4
    _same_arrays(crash / "ckpt_00000004.h5", full / "ckpt_00000004.h5")
    res = subprocess.run(_train_cmd(4, text_file, crash, "--steps", "8", "--resume"), env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _same_arrays(crash / "ckpt_00000008.h5", full / "ckpt_00000008.h5")


# --------------------------------------------------------------------------------------------- checkpoint crash

ONE = ["--d-model", "16", "--layers", "1", "--heads", "1", "--seq", "64", "--chunk-size", "16",
       "--no-progress", "--quiet", "--ckpt-every", "2", "--steps", "6"]  # fmt: skip


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory, text_file):
    ref = tmp_path_factory.mktemp("ref")
    out = subprocess.run([PY, "-m", "hpczeco", "train", "--text", text_file, *ONE, "--ckpt-dir", str(ref)],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return ref


@pytest.mark.parametrize("mode", ["mid-write", "before-rename"])
def test_crash_during_checkpoint_write(tmp_path, text_file, one_rank_reference, mode):
    """The process dies while writing checkpoint 4: checkpoint 2 stays the newest valid one, the leftover
    hidden temporary is never taken as a checkpoint, and --resume finishes bitwise equal to an
    uninterrupted run."""
    d = tmp_path / "ck"
    cmd = [PY, "-m", "hpczeco", "train", "--text", text_file, *ONE, "--ckpt-dir", str(d)]
    out = subprocess.run(cmd, env=_env(HPCZECO_FAULT_CKPT=f"{mode}:4"), capture_output=True, text=True, timeout=120)
    assert out.returncode == FAULT_EXIT_CODE, out.stdout + out.stderr
    assert f"fault injection: exiting abruptly ({mode}) while writing step 4" in out.stderr
    names = sorted(p.name for p in d.iterdir())
    temps = [n for n in names if n.startswith(".ckpt_00000004.h5.tmp-")]
    assert len(temps) == 1 and "ckpt_00000002.h5" in names and "ckpt_00000004.h5" not in names, names
    assert [s for s, _ in list_checkpoints(d)] == [2]
    msgs: list[str] = []
    step, _, _ = load_latest(d, report=msgs.append)
    assert step == 2 and msgs == []  # nothing rejected: the temporary is not a candidate at all
    _same_arrays(d / "ckpt_00000002.h5", one_rank_reference / "ckpt_00000002.h5")
    res = subprocess.run([*cmd, "--resume"], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    _same_arrays(d / "ckpt_00000006.h5", one_rank_reference / "ckpt_00000006.h5")


# --------------------------------------------------------------------------------------------- soak

SOAK_STEPS = int(os.environ.get("HPCZECO_SOAK_STEPS", "500"))  # the issue asks 500 (~30-40 s here)


def test_soak_no_growth(tmp_path, text_file):
    """4 ranks, SOAK_STEPS tiny training steps: on every rank VmRSS grows < 5 % between step 20 and the
    end, and the scan handles in flight, buffers pooled and pooled bytes are the same at both points."""
    cmd = [mpiexec_command(), "-n", "4", PY, "-m", "hpczeco", "train", "--text", text_file, "--d-model", "16",
           "--layers", "1", "--heads", "1", "--seq", "256", "--steps", str(SOAK_STEPS), "--no-progress",
           "--quiet"]  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=_env(HPCZECO_SOAK_REPORT="20"), capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {}
    for m in re.finditer(r"soak: rank (\d+) step (\d+) rss_kb (\d+) inflight (-?\d+) started (\d+) pooled (\d+) "
                         r"pooled_bytes (\d+)", out.stderr):
        r, s, rss, infl, started, pooled, pbytes = map(int, m.groups())
        rows[(r, s)] = (rss, infl, started, pooled, pbytes)
    assert sorted(rows) == sorted((r, s) for r in range(4) for s in (20, SOAK_STEPS)), out.stderr
    for r in range(4):
        a, b = rows[(r, 20)], rows[(r, SOAK_STEPS)]
        growth = (b[0] - a[0]) / a[0]
        print(f"soak rank {r}: VmRSS {a[0]} kB at step 20 -> {b[0]} kB at step {SOAK_STEPS} ({100 * growth:+.2f} %), "
              f"in flight {a[1]}/{b[1]}, pooled {a[3]}/{b[3]} ({a[4]}/{b[4]} B), scans started {a[2]}->{b[2]}")
        assert growth < 0.05, f"rank {r}: RSS grew {100 * growth:.1f} %"
        assert a[1] == b[1] == 0, "scan handles left in flight"
        assert (a[3], a[4]) == (b[3], b[4]), "pooled buffers grew"
        assert b[2] > a[2]  # the scans did run
    print(f"soak: {SOAK_STEPS} steps on 4 ranks in {took:.1f} s")
