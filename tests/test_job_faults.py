"""Faults in whole launched jobs: no hang from any single-rank failure, checkpoints checked before they are
chosen, bounded inputs (the same guards in process: test_fault_guards.py). Every test here launches its own job
(``mpiexec`` with 2-3 ranks, or one process) and is bounded twice -- ``MPIEXEC_TIMEOUT`` for the launcher and
``timeout=`` for the subprocess -- so a regression fails instead of hanging. Serial stage only. The times to
exit printed here (``-s``) are the figures of docs/RELIABILITY.md.

``HPCZECO_TEST_MPIEXEC`` / ``MPIEXEC`` pick the launcher (the tests also ran under Debian's MPICH and
Open MPI with an mpi4py built against each: docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import job_env, mpiexec_command
from hpczeco.drivers.checkpoint import LOCK_NAME, CheckpointWriter, array_sha256, list_checkpoints, load_checkpoint
from hpczeco.drivers.data import read_corpus

HERE = Path(__file__).parent
PY = sys.executable
#: seconds the launcher may run a job (MPIEXEC_TIMEOUT) and the subprocess bound above it
JOB_LIMIT_S = 90
SUBPROCESS_LIMIT_S = 150




def _env(**extra: str) -> dict[str, str]:
    return job_env(JOB_LIMIT_S, **extra)


def _run(cmd: list[str], n: int | None = None, **env: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd`` (under ``mpiexec -n n`` when ``n``); returns (result, wall seconds, end time)."""
    full = [mpiexec_command(), "-n", str(n), *cmd] if n else cmd
    t0 = time.monotonic()
    out = subprocess.run(full, env=_env(**env), capture_output=True, text=True, timeout=SUBPROCESS_LIMIT_S)
    return out, time.monotonic() - t0, time.time()


def _text(out: subprocess.CompletedProcess) -> str:
    return out.stdout + out.stderr


def _exit_after_fault(out: subprocess.CompletedProcess, t_end: float, pattern: str = r"t_fault=([\d.]+)") -> float:
    m = re.search(pattern, _text(out))
    assert m, _text(out)
    return t_end - float(m.group(1))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    data, _ = read_corpus(None, 48 << 10)
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(data)
    return str(path)


TRAIN = ["--d-model", "16", "--layers", "1", "--heads", "1", "--seq", "64", "--chunk-size", "16",
         "--dtype", "float64", "--no-progress", "--quiet"]  # fmt: skip


def _train(text_file: str, *extra: str) -> list[str]:
    return [PY, "-m", "hpczeco", "train", "--text", text_file, *TRAIN, *extra]


# --------------------------------------------------------------------------------------------- the common cause


def test_internal_error_on_one_rank_aborts_the_job(text_file):
    """3 ranks, no collective timeout: rank 1 raises an internal error in step 3 while the others wait for it
    in the gradient sum. The CLI prints that rank's traceback and one-line error and aborts the job."""
    out, took, t_end = _run(_train(text_file, "--steps", "6"), 3, HPCZECO_FAULT_RAISE="1:3")
    text = _text(out)
    assert out.returncode == 1, text
    assert "Traceback (most recent call last)" in text, text
    assert re.search(r"hpczeco train: rank 1: error: RuntimeError: fault injection: rank 1 raises in step 3 "
                     r"\(internal error: traceback above\)", text), text
    assert "hpczeco train: rank 1: aborting the job (MPI_Abort on MPI_COMM_WORLD)" in text, text
    exit_s = _exit_after_fault(out, t_end, r"rank 1 raises in step 3 at t=([\d.]+)")
    print(f"uncaught internal error (train, 3 ranks): job ended {exit_s:.2f} s after the raise, rc {out.returncode}")
    assert exit_s < 60


@pytest.mark.parametrize("kind", ["value", "bug"])
def test_library_script_under_abort_on_error(kind):
    """A user's script, one rank raises while the others wait in a barrier: ``abort_on_error`` ends the job;
    a one-line error for a ValueError, the traceback first for anything else."""
    out, took, t_end = _run([PY, str(HERE / "reliability" / "one_rank_raises.py"), kind], 3)
    text = _text(out)
    assert "finished (unexpected)" not in text
    if kind == "value":
        assert out.returncode == 2, text
        assert "one_rank_raises: rank 1: error: ValueError: a bad input on rank 1 only" in text, text
        assert "Traceback" not in text, text
    else:
        assert out.returncode == 1, text
        assert "Traceback (most recent call last)" in text and "KeyError" in text, text
    exit_s = _exit_after_fault(out, t_end)
    print(f"abort_on_error[{kind}]: job ended {exit_s:.2f} s after the raise, rc {out.returncode}")
    assert exit_s < 60


# --------------------------------------------------------------------------------------------- output paths


@pytest.mark.parametrize("where", ["missing-folder", "directory", "ckpt-dir-is-a-file"])
def test_bad_output_path_is_one_clean_error(tmp_path, text_file, where):
    """A log in a missing folder, a directory as --log, a file as --ckpt-dir: every rank stops before the first
    collective with the same one-line error (printed once), exit status 2, no traceback, no abort needed."""
    (tmp_path / "afile").write_text("x")
    opt = {"missing-folder": ["--log", str(tmp_path / "missing" / "log.jsonl")],
           "directory": ["--log", str(tmp_path)],
           "ckpt-dir-is-a-file": ["--ckpt-dir", str(tmp_path / "afile")]}[where]  # fmt: skip
    out, took, _ = _run(_train(text_file, "--steps", "2", *opt), 3)
    text = _text(out)
    assert out.returncode == 2, text
    assert "Traceback" not in text and "MPI_Abort" not in text, text
    want = {"missing-folder": "does not exist", "directory": "is a folder; give a file name",
            "ckpt-dir-is-a-file": "is not a folder"}
    lines = [ln for ln in text.splitlines() if ln.startswith("hpczeco train: error:")]
    assert len(lines) == 1 and want[where] in lines[0], text
    print(f"bad output path [{where}]: {lines[0]!r}, job ended after {took:.2f} s")


# --------------------------------------------------------------------------------------------- resume checks


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, text_file):
    """Checkpoints 2 and 4 of a 2-rank run, and the checkpoint 6 of an uninterrupted 6-step 2-rank run."""
    root = tmp_path_factory.mktemp("runs")
    base, ref = root / "base", root / "ref"
    for folder, steps in ((base, "4"), (ref, "6")):
        out, _, _ = _run(_train(text_file, "--steps", steps, "--ckpt-every", "2", "--ckpt-dir", str(folder)), 2)
        assert out.returncode == 0, _text(out)
    return base, ref


def _rewrite(path: Path, arrays: dict, attrs: dict) -> None:
    """Write ``arrays``/``attrs`` as checkpoint ``path`` with consistent checksums (a damaged but 'valid' file)."""
    step = int(attrs.pop("step"))
    attrs.pop("nranks")
    scratch = path.parent / "scratch"
    written = CheckpointWriter(scratch, keep=None).save(step, arrays, attrs)
    os.replace(written, path)
    shutil.rmtree(scratch)


def _tamper_model(path: Path, case: str) -> str:
    step, arrays, attrs = load_checkpoint(path)
    if case == "shape":
        arrays["params/embed.weight"] = arrays["params/embed.weight"][:-1].copy()
        reason = "array 'params/embed.weight' is <f8[255, 16], this run expects <f8[256, 16]"
    elif case == "missing-array":
        del arrays["adam/v/head.weight"]
        reason = "missing ['adam/v/head.weight']"
    elif case == "adam_t-missing":
        del attrs["adam_t"]
        reason = "attribute adam_t is NoneType None"
    elif case == "adam_t-string":
        attrs["adam_t"] = str(attrs["adam_t"])
        reason = "attribute adam_t is str '4'"
    elif case == "data_pos":
        attrs["data_pos"] = -3
        reason = "attribute data_pos is int -3, expected an int >= 0"
    elif case == "nan":
        arrays["params/head.weight"][0, 0] = np.nan
        reason = "array 'params/head.weight' holds NaN or Inf"
    else:
        raise ValueError(case)
    _rewrite(path, arrays, attrs)
    load_checkpoint(path)  # every checksum still passes: only the model-level checks can reject it
    return reason


def _tamper_storage(path: Path, case: str) -> str:
    with h5py.File(path, "a") as f:
        manifest = __import__("json").loads(f.attrs["_manifest"])
        if case == "huge-chunked":  # (10**12,) float64, never written: 8 TB declared in a small file
            f.create_dataset("params/huge", shape=(10**12,), dtype="f8", chunks=(1 << 16,))
            manifest["params/huge"] = {"shape": [10**12], "dtype": "<f8", "sha256": "0" * 64}
            reason = "unexpected ['params/huge']"
        elif case == "sparse-valid-checksum":  # the right shape, chunked and unwritten, with a valid checksum
            shape = f["params/embed.weight"].shape
            del f["params/embed.weight"]
            f.create_dataset("params/embed.weight", shape=shape, dtype="f8", chunks=(16, 16))
            manifest["params/embed.weight"]["sha256"] = array_sha256(np.zeros(shape))
            f["params/embed.weight"].attrs["sha256"] = manifest["params/embed.weight"]["sha256"]
            reason = "dataset 'params/embed.weight' is chunked"
        else:
            raise ValueError(case)
        f.attrs["_manifest"] = __import__("json").dumps(manifest, sort_keys=True)
    return reason


@pytest.mark.parametrize("case", ["shape", "missing-array", "adam_t-missing", "adam_t-string", "data_pos", "nan",
                                  "huge-chunked", "sparse-valid-checksum"])
def test_resume_skips_a_checkpoint_that_fails_any_check(tmp_path, text_file, two_rank_runs, case):
    """The newest checkpoint (4) passes every checksum but not the model's checks (3) or declares far more than
    it holds (4): --resume on 2 ranks reports the file and the reason, falls back to checkpoint 2, and ends
    equal (bitwise) to an uninterrupted run."""
    base, ref = two_rank_runs
    d = tmp_path / "ck"
    shutil.copytree(base, d)
    newest = d / "ckpt_00000004.h5"
    reason = _tamper_storage(newest, case) if case in ("huge-chunked", "sparse-valid-checksum") \
        else _tamper_model(newest, case)
    out, took, _ = _run(_train(text_file, "--steps", "6", "--ckpt-every", "2", "--ckpt-dir", str(d), "--resume",
                               "--keep", "5"), 2)
    text = _text(out)
    assert out.returncode == 0, text
    m = re.search(r"hpczeco checkpoint: rejected (\S+) \((.*)\); falls back to ckpt_00000002\.h5", text)
    assert m and m.group(1) == str(newest) and reason in m.group(2), text
    _, got, _ = load_checkpoint(d / "ckpt_00000006.h5")
    _, want, _ = load_checkpoint(ref / "ckpt_00000006.h5")
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    print(f"resume[{case}]: {m.group(2)[:110]!r} ({took:.1f} s)")


# --------------------------------------------------------------------------------------------- disk full


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1.4 MB tmpfs (needs root and mount(8)); skipped with the reason where it cannot be made."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here: cannot make a small tmpfs")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1400k", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip() or res.returncode}")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.parametrize("n", [1, 2])
def test_disk_full_is_a_clean_checkpoint_error(tiny_tmpfs, text_file, n):
    """Checkpoints (~390 KB) every step into a 1.4 MB tmpfs: the 4th does not fit. Every rank ends with the same
    CheckpointError (exit 2, one line naming the folder and the space needed; no segfault), the partial
    temporary is removed and the three previous checkpoints are intact."""
    cmd = [PY, "-m", "hpczeco", "train", "--text", text_file, "--d-model", "32", "--layers", "1", "--heads", "2",
           "--seq", "128", "--steps", "6", "--ckpt-every", "1", "--no-progress", "--quiet",
           "--ckpt-dir", str(tiny_tmpfs)]  # fmt: skip
    out, took, _ = _run(cmd, n if n > 1 else None)
    text = _text(out)
    assert out.returncode == 2, text
    m = re.search(r"hpczeco train: error: cannot write checkpoint ckpt_00000004\.h5 into (\S+): no space left on "
                  r"the device \(.*\): it needs ([\d,]+) bytes, ([\d,]+) bytes are free there; the previous "
                  r"checkpoints are kept", text)
    assert m and m.group(1) == str(tiny_tmpfs), text
    assert "Segmentation" not in text and "Traceback" not in text, text
    names = sorted(p.name for p in tiny_tmpfs.iterdir() if p.name != LOCK_NAME)
    assert names == [f"ckpt_0000000{i}.h5" for i in (1, 2, 3)]
    for _, path in list_checkpoints(tiny_tmpfs):
        load_checkpoint(path)  # every checksum passes
    print(f"disk full (n={n}): clean error after {took:.1f} s: needs {m.group(2)} B, {m.group(3)} B free")


# --------------------------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("mode, message", [
    ("first-forward", r"rank [01]: first hpczeco call on this communicator \(MPI_Comm_idup\) exceeded the "
                      r"collective timeout of 2 s; still waiting for a rank that did not arrive"),
    ("before-forward", r"ZeCOGLA\.forward \(arrival/validation\) exceeded the collective timeout of 2 s; still "
                       r"waiting for rank\(s\) \[2\], which did not call ZeCOGLA\.forward"),
    ("in-forward", r"rank 2: scan\(ring\) wait exceeded the collective timeout of 2 s; still waiting for rank 1 "
                   r"\(the previous rank in scan order"),
    ("before-backward", r"ZeCOGLA\.backward \(arrival/validation\) exceeded the collective timeout of 2 s; still "
                        r"waiting for rank\(s\) \[2\], which did not call ZeCOGLA\.backward"),
])  # fmt: skip
def test_stall_around_the_layer_ends_the_job(mode, message):
    """3 ranks, HPCZECO_COLLECTIVE_TIMEOUT=2: a rank stalls before the first call, before forward, inside
    forward, or before backward; the others end the job within the timeout, naming it."""
    out, took, t_end = _run([PY, str(HERE / "reliability" / "zeco_stall.py"), mode], 3,
                            HPCZECO_COLLECTIVE_TIMEOUT="2")
    text = _text(out)
    assert out.returncode != 0, text
    assert "finished (unexpected)" not in text, text
    assert re.search(message, text), text
    exit_s = _exit_after_fault(out, t_end)
    print(f"stall[{mode}]: job ended {exit_s:.2f} s after the stall (timeout 2 s, rc {out.returncode})")
    assert exit_s < 60


def test_sigstopped_rank_in_training_ends_the_job(text_file):
    """3 ranks, timeout 3 s: rank 2 SIGSTOPs itself in step 3 (after its forward/backward); the others, in the
    gradient sum, end the job naming rank 2."""
    out, took, t_end = _run(_train(text_file, "--steps", "8"), 3, HPCZECO_COLLECTIVE_TIMEOUT="3",
                            HPCZECO_FAULT_STOP="2:3")
    text = _text(out)
    assert out.returncode != 0, text
    assert re.search(r"rank [01]: gradient sum exceeded the collective timeout of 3 s; still waiting for "
                     r"rank\(s\) \[2\], which did not reach gradient sum", text), text
    exit_s = _exit_after_fault(out, t_end, r"rank 2 SIGSTOPs itself in step 3 at t=([\d.]+)")
    print(f"SIGSTOP in training: job ended {exit_s:.2f} s after the stop (timeout 3 s, rc {out.returncode})")
    assert exit_s < 60


def test_timeout_set_on_one_rank_is_a_configuration_mismatch():
    """Only rank 0 has HPCZECO_COLLECTIVE_TIMEOUT: every rank raises the same configuration-mismatch error at
    the first call (not 'rank(s) ... did not call'), and the job ends normally."""
    out, took, _ = _run([PY, str(HERE / "reliability" / "zeco_stall.py"), "mismatch"], 3)
    text = _text(out)
    assert out.returncode == 0, text
    lines = sorted(ln for ln in out.stdout.splitlines() if "raised" in ln)
    assert len(lines) == 3, text
    msgs = {ln.split(": ", 1)[1] for ln in lines}
    assert len(msgs) == 1, lines
    assert ("configuration mismatch: $HPCZECO_COLLECTIVE_TIMEOUT differs between the ranks (2 s on rank(s) [0]; "
            "unset (the default, 600 s) on rank(s) [1, 2])") in msgs.pop(), lines
    assert "did not call" not in text


# --------------------------------------------------------------------------------------------- prefill limits


def test_prefill_refuses_a_text_above_the_token_limit(tmp_path):
    """2 MB of random printable characters, byte tokens, default limits, 2 ranks: refused at once with the
    estimate (it used to plan 2M tokens, nearly all global: hours), exit status 2. (Random bytes that are not
    UTF-8 are refused earlier, as a binary file: tests/test_daaf_drivers.py.)"""
    f = tmp_path / "random.txt"
    f.write_bytes(np.random.default_rng(0).integers(32, 127, 2 << 20, dtype=np.uint8).tobytes())
    out, took, _ = _run([PY, "-m", "hpczeco", "prefill", str(f), "--tokenizer", "byte"], 2)
    text = _text(out)
    assert out.returncode == 2, text
    assert re.search(r"hpczeco prefill: refusing to start: the text has [\d,]+ byte tokens, more than 131,072 "
                     r"\(--max-tokens 131,072\); at that many tokens alone the prefill needs ~[\d,]+ MiB per rank "
                     r"and up to 8\.59e\+09 attention pairs; raise --max-tokens", text), text
    print(f"prefill token limit: refused after {took:.1f} s")


def test_prefill_refuses_a_run_above_the_memory_limit(tmp_path):
    """A 20k-token text with --max-memory 8M: refused after planning, naming the estimate."""
    from hpczeco.drivers.daaf_demo import mixed_tokens

    f = tmp_path / "mix.txt"
    f.write_text(mixed_tokens(20000, 0.3, 10000, seed=1)[2])
    out, took, _ = _run([PY, "-m", "hpczeco", "prefill", str(f), "--max-memory", "8M"], 2)
    text = _text(out)
    assert out.returncode == 2, text
    assert re.search(r"hpczeco prefill: refusing to start: estimated memory [\d,]+ MiB per rank exceeds "
                     r"--max-memory 8 MiB \([\d,]+ tokens, [\d.]+% global, .* attention pairs .* per rank on 2 "
                     r"rank\(s\) \(sequence\)\); raise --max-memory", text), text
