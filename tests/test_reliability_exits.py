"""Reliability, round three (issue 30), in whole launched jobs: a rank that leaves early (``sys.exit`` with any
status, ``MPI.Finalize``, a return from main, an uncaught exception) ends the job at once when the others wait in
the library, and after the collective timeout when they wait in MPI calls of their own; a stall in a guarded
blocking call ends within the timeout; bad settings, devices and FIFOs, a launcher mismatch and unwritable outputs
are one clean error before any work; the one-process commands print once under mpiexec.

Every test launches its own job (``mpiexec`` with 2-3 ranks, or one process), bounded twice -- ``MPIEXEC_TIMEOUT``
and the subprocess ``timeout=`` -- so a hang fails the test. Serial stage only. The times printed (``-s``) are the
figures of docs/RELIABILITY.md. (In process: test_reliability_inputs.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import job_env, mpiexec_command

HERE = Path(__file__).parent
PY = sys.executable
EARLY = str(HERE / "reliability" / "early_exit.py")
#: seconds the launcher may run a job, and the subprocess bound above it
JOB_LIMIT_S = 90
SUBPROCESS_LIMIT_S = 150




def _env(**extra: str) -> dict[str, str]:
    return job_env(JOB_LIMIT_S, **extra)


def _run(cmd: list[str], n: int | None = None, stdin=None, **env: str) -> tuple[subprocess.CompletedProcess, float,
                                                                                float]:
    """Run ``cmd`` (under ``mpiexec -n n`` when ``n``, reading ``stdin`` when given); returns (result, wall seconds,
    end time)."""
    full = [mpiexec_command(), "-n", str(n), *cmd] if n else cmd
    t0 = time.monotonic()
    out = subprocess.run(full, env=_env(**env), stdin=stdin, capture_output=True, text=True,
                         timeout=SUBPROCESS_LIMIT_S)
    return out, time.monotonic() - t0, time.time()


def _text(out: subprocess.CompletedProcess) -> str:
    return out.stdout + out.stderr


def _after_fault(out: subprocess.CompletedProcess, t_end: float) -> float:
    m = re.search(r"t_fault=([\d.]+)", _text(out))
    assert m, _text(out)
    return t_end - float(m.group(1))


# --------------------------------------------------------------------------------------------- leaving early


@pytest.mark.parametrize("mode, where, how", [
    ("exit0", "guarded", r"exit status 0"),
    ("exit3", "guarded", r"exit status 3"),
    ("finalize", "guarded", r"process exit"),
    ("return", "guarded", r"process exit"),
    ("raise", "bare", r"process exit"),
    ("exit0", "bare", r"process exit"),
])  # fmt: skip
def test_rank_leaving_early_ends_the_job_at_once(mode, where, how):
    """3 ranks, timeout 60 s: rank 1 leaves (sys.exit(0|3), MPI.Finalize, return, an uncaught exception; under
    ``abort_on_error`` or not) while the others wait in a library collective it never reaches: they end the job at
    once, naming it -- long before the timeout (sys.exit(0) and MPI.Finalize used to hang the job)."""
    out, took, t_end = _run([PY, EARLY, mode, where], 3, HPCZECO_COLLECTIVE_TIMEOUT="60")
    text = _text(out)
    assert out.returncode != 0, text
    assert "finished (unexpected)" not in text, text
    assert re.search(r"rank [02]: the script's barrier: rank 1 \(" + how + r"\) left the job before reaching it, so "
                     r"it can never complete; aborting the job", text), text
    exit_s = _after_fault(out, t_end)
    print(f"early exit [{mode}, {where}]: job ended {exit_s:.2f} s after rank 1 left (timeout 60 s), "
          f"rc {out.returncode}")
    assert exit_s < 30


def test_rank_leaving_while_others_block_in_their_own_mpi_call():
    """The others wait in a plain ``comm.Barrier()`` of the script (no library wait sees the notice): the leaving
    rank ends the job after the collective timeout (4 s), naming the ranks that did not end."""
    out, took, t_end = _run([PY, EARLY, "exit0", "guarded", "raw"], 3, HPCZECO_COLLECTIVE_TIMEOUT="4")
    text = _text(out)
    assert out.returncode != 0, text
    assert re.search(r"early_exit: rank 1: leaving the job \(exit status 0\) while rank\(s\) \[0, 2\] did not end "
                     r"within 4 s; aborting the job", text), text
    exit_s = _after_fault(out, t_end)
    print(f"early exit before a raw barrier: job ended {exit_s:.2f} s after rank 1 left (timeout 4 s)")
    assert 3.5 < exit_s < 40


@pytest.mark.parametrize("mode, message", [
    ("stall", r"the script's guarded barrier exceeded the collective timeout of 4 s; still waiting for a rank that "
              r"did not arrive or stopped inside it"),
    ("exit0", r"the script's guarded barrier: rank 1 \(exit status 0\) left the job before reaching it"),
])  # fmt: skip
def test_guarded_blocking_call_is_bounded(mode, message):
    """A blocking MPI call under ``lifeline.guard`` (the benchmarks' timed barriers, calibration, set-ups): a rank
    that stalls ends the job within the timeout; one that leaves, at once."""
    out, took, t_end = _run([PY, EARLY, mode, "guarded", "guard"], 3, HPCZECO_COLLECTIVE_TIMEOUT="4")
    text = _text(out)
    assert out.returncode != 0 and "finished (unexpected)" not in text, text
    assert re.search(message, text), text
    exit_s = _after_fault(out, t_end)
    print(f"guarded barrier [{mode}]: job ended {exit_s:.2f} s after the fault (timeout 4 s)")
    assert exit_s < 40


def test_ranks_ending_apart_end_normally():
    """The control: every rank ends normally, rank 0 two seconds after the others (which wait for it at exit)."""
    out, took, _ = _run([PY, EARLY, "late"], 3)
    text = _text(out)
    assert out.returncode == 0 and "aborting" not in text, text
    assert sorted(re.findall(r"rank (\d): done", text)) == ["0", "1", "2"], text


# --------------------------------------------------------------------------------------------- commands


@pytest.mark.parametrize("what", ["dev-zero", "fifo"])
def test_prefill_refuses_devices_and_fifos(tmp_path, what):
    """``/dev/zero`` used to be read without limit (5 GB in 11 s), a FIFO with no writer to hang the job: both are
    refused unopened, one line, status 2."""
    path = "/dev/zero"
    if what == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    out, took, _ = _run([PY, "-m", "hpczeco", "prefill", path], 2)
    text = _text(out)
    assert out.returncode == 2, text
    kind = "a character device" if what == "dev-zero" else r"a FIFO \(named pipe\)"
    lines = re.findall(rf"hpczeco prefill: refusing to start: the text: {re.escape(path)} is {kind}, not a regular "
                       r"file; pipe it through standard input \('-'\) instead", text)
    assert len(lines) == 1 and "Traceback" not in text, text
    print(f"prefill {path}: refused after {took:.1f} s")
    assert took < 60


def test_prefill_waiting_for_rank_0s_read_names_the_phase():
    """Rank 0 reads standard input that nobody writes: the other ranks end the job at the timeout with the phase
    named (they used to time out in the communicator's set-up, with a message naming nothing)."""
    writer = subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE)
    try:
        out, took, _ = _run([PY, "-m", "hpczeco", "prefill", "-"], 2, stdin=writer.stdout,
                            HPCZECO_COLLECTIVE_TIMEOUT="3")
    finally:
        writer.kill()
        writer.wait()
    text = _text(out)
    assert out.returncode != 0, text
    phase = r"prefill: the other ranks wait while rank 0 reads - exceeded the collective timeout of 3 s"
    assert re.search(phase, text), text
    print(f"prefill - with no writer: ended after {took:.1f} s")
    assert took < 60


def test_prefill_refuses_a_launcher_mismatch(tmp_path):
    """A launcher that started 2 processes while MPI sees one (faked: PMI_SIZE=2): refused like train and info (it
    used to prefill the whole text as one rank)."""
    f = tmp_path / "t.txt"
    f.write_text("a few words of text " * 20)
    out, took, _ = _run([PY, "-m", "hpczeco", "prefill", str(f)], None, PMI_SIZE="2")
    text = _text(out)
    assert out.returncode == 2, text
    assert re.search(r"hpczeco prefill: error: ValueError: launcher/library mismatch: a PMI launcher .* started 2 "
                     r"processes \(PMI_SIZE=2\) but MPI_COMM_WORLD has size 1", text), text


@pytest.mark.parametrize("case", ["transport-bogus", "cuda-aware-maybe", "transport-differs"])
def test_bad_settings_are_one_error_on_every_rank(case):
    """``hpczeco info`` on 2 ranks with HPCZECO_TRANSPORT=bogus / HPCZECO_CUDA_AWARE=maybe (they used to be ignored
    on the CPU and echoed by info), or HPCZECO_TRANSPORT different per rank: one line, status 2 on every rank."""
    cmd = [PY, "-m", "hpczeco", "info"]
    if case == "transport-differs":
        full = [mpiexec_command(), "-n", "1", "env", "HPCZECO_TRANSPORT=staged", *cmd, ":", "-n", "1", "env",
                "HPCZECO_TRANSPORT=nccl", *cmd]
        t0 = time.monotonic()
        out = subprocess.run(full, env=_env(), capture_output=True, text=True, timeout=SUBPROCESS_LIMIT_S)
        took = time.monotonic() - t0
        want = (r"configuration mismatch: \$HPCZECO_TRANSPORT differs between the ranks \('staged' on rank\(s\) \[0\]; "
                r"'nccl' on rank\(s\) \[1\]\)")
    else:
        var, value = {"transport-bogus": ("HPCZECO_TRANSPORT", "bogus"),
                      "cuda-aware-maybe": ("HPCZECO_CUDA_AWARE", "maybe")}[case]
        out, took, _ = _run(cmd, 2, **{var: value})
        want = rf"configuration: \${var} must be one of .*, got '{value}' on rank\(s\) \[0, 1\]"
    text = _text(out)
    assert out.returncode == 2, text
    lines = [ln for ln in text.splitlines() if ln.startswith("hpczeco info: error:")]
    assert len(lines) == 1 and re.search(want, lines[0]) and "Traceback" not in text, text
    assert "MPI library" not in out.stdout  # nothing reported with a bad configuration
    print(f"settings [{case}]: {lines[0]!r} after {took:.1f} s")


def test_bench_scan_checks_out_before_the_benchmark(tmp_path):
    """``--out`` naming a file: one line, status 2, before any calibration or timing (it used to fail after the
    whole benchmark)."""
    f = tmp_path / "afile"
    f.write_text("x")
    out, took, _ = _run([PY, "-m", "hpczeco", "bench", "scan", "--out", str(f), "--sizes", "4K"], 2)
    text = _text(out)
    assert out.returncode == 2, text
    assert text.count(f"hpczeco bench scan: error: CollectiveInputError: --out {f}: it exists and is not a folder") == 1
    assert "bench scan: P=" not in text and "Traceback" not in text, text
    print(f"bench scan --out FILE: refused after {took:.1f} s")


def test_one_process_commands_run_once_under_mpiexec(tmp_path):
    """``model`` and ``report`` launched on 2 ranks: rank 0 alone prints (and writes); every rank ends with its
    status (they used to print and write once per rank)."""
    out, took, _ = _run([PY, "-m", "hpczeco", "model", "--P", "2,8"], 2)
    assert out.returncode == 0, _text(out)
    assert out.stdout.count("cost model: state") == 1, out.stdout
    inp = tmp_path / "in"
    inp.mkdir()
    sys.path.insert(0, str(HERE))
    try:
        from test_reliability_inputs import _fake_run
    finally:
        sys.path.remove(str(HERE))
    (inp / "scan_P2.json").write_text(json.dumps(_fake_run(2)))
    out, took, _ = _run([PY, "-m", "hpczeco", "report", "--in", str(inp), "--out", str(tmp_path / "out"),
                         "--sim", str(tmp_path / "no-simulation")], 2)  # not the default runs/simulate of the cwd
    assert out.returncode == 0, _text(out)
    assert out.stdout.count("wrote ") == 1, out.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "report.md", "scan_over_p.png", "scan_presets.png", "scan_sizes.png"]
    out, took, _ = _run([PY, "-m", "hpczeco", "report", "--model-max-p", "-5"], 2)
    assert out.returncode == 2 and _text(out).count("argument --model-max-p: must be an integer >= 2") == 1, _text(out)
