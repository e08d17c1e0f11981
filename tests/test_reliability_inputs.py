"""Reliability, round three (issue 30), in process: every option checked where it enters, file inputs read with a
bound, outputs checked before the work, `report`'s inputs checked whole and never written, the library's
``HPCZECO_*`` settings agreed on every rank (the timeout on by default), one writing job per checkpoint folder.
The ``mpi`` tests run at every rank count of the suite. The same faults in whole launched jobs:
test_reliability_exits.py. (``hpczeco train``'s text, outputs, folder lock and memory estimate: test_train.py.)"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import agreed_error
from hpczeco.collectives import costmodel as cm
from hpczeco.collectives import settings
from hpczeco.collectives.context import get_context
from hpczeco.collectives.names import ALGORITHMS
from hpczeco.collectives.watchdog import describe_timeout, resolve_timeout
from hpczeco.drivers import cli, files, options, report
from hpczeco.drivers.checkpoint import LOCK_NAME, CheckpointError, CheckpointWriter
from hpczeco.drivers.checkpoint.write import _lock_fd

SUBCOMMANDS = [[name] for name in cli.COMMANDS] + [["bench", name] for name in cli.BENCHES]


def _parser(argv: list[str]):
    import importlib

    module = importlib.import_module((cli.BENCHES[argv[1]] if argv[0] == "bench" else cli.COMMANDS[argv[0]])[0])
    build = getattr(module, "build_parser", None) or getattr(module, "_parser", None)
    return None if build is None else build(" ".join(["hpczeco", *argv]))


# --------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_no_option_takes_an_unchecked_number(argv):
    """Every number an option takes is checked where it enters (drivers/options.py): no bare int/float type, which
    lets nan, inf, -1 and 0 through to fail later, or not at all."""
    ap = _parser(argv)
    if ap is None:  # info: --json only
        return
    bare = [a.option_strings[0] for a in ap._actions if a.option_strings and a.type in options.BARE_TYPES]
    assert bare == [], bare


NONSENSE = [
    (["bench", "scan"], "--time-limit", "nan"), (["bench", "scan"], "--time-limit", "-1"),
    (["bench", "scan"], "--overlap-ms", "nan"), (["bench", "scan"], "--max-gather-mib", "-1"),
    (["bench", "scan"], "--sizes", "0"), (["bench", "scan"], "--sizes", "nan"),
    (["bench", "scan"], "--sizes", "4K,inf"),
    (["bench", "scan"], "--K", "0"), (["bench", "scan"], "--V", "-3"), (["bench", "scan"], "--blocks", "4,0"),
    (["bench", "scan"], "--repeats", "0"), (["bench", "scan"], "--link", "bogus"),
    (["bench", "scan"], "--ring-big", "inf"), (["bench", "scan"], "--overlap-size", "0"),
    (["bench", "zeco"], "--tokens", "0"), (["bench", "zeco"], "--chunk-size", "0"),
    (["bench", "zeco"], "--blocks", "0"),
    (["report"], "--model-max-p", "-5"), (["report"], "--np", "0,-1"), (["report"], "--np", "1"),
    (["report"], "--sizes", "4K,nan"),
    (["model"], "--P", "0,4"), (["model"], "--alpha", "nan"), (["model"], "--state-bytes", "-1"),
    (["model"], "--link", "1,2,x"),
    (["prefill"], "--threshold", "nan"), (["prefill"], "--budget", "0"), (["prefill"], "--max-tokens", "-1"),
    (["bench", "gla"], "--T", "0"), (["bench", "daaf"], "--threshold", "2"), (["demo"], "--steps", "0"),
    (["train"], "--blas-threads", "-4"), (["train"], "--blas-threads", "100000"), (["train"], "--print-every", "-1"),
    (["train"], "--seq", "0"), (["train"], "--seq", "1e400"), (["train"], "--lr", "nan"), (["train"], "--lr", "0"),
    (["train"], "--min-lr", "2"), (["train"], "--beta2", "1"), (["train"], "--eps", "-1e-8"),
    (["train"], "--clip", "inf"),
    (["train"], "--weight-decay", "-0.1"), (["train"], "--peak-tflops", "0"), (["train"], "--corpus-bytes", "0"),
    (["train"], "--corpus-bytes", "nan"), (["train"], "--d-model", "0"), (["train"], "--d-model", "1e200"),
    (["train"], "--layers", "-2"), (["train"], "--keep", "0"), (["train"], "--seed", "-1"),
    (["train"], "--chunk-size", "0"), (["train"], "--bucket-mb", "0"), (["train"], "--steps", "-1"),
    (["train"], "--ckpt-every", "-3"), (["train"], "--warmup-steps", "-1"), (["train"], "--sp", "-2"),
]  # fmt: skip


@pytest.mark.parametrize("argv, opt, value", NONSENSE, ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_nonsense_options_are_usage_errors(capsys, argv, opt, value):
    """The accepted nonsense of the issue (and its neighbours): a usage error naming the option, status 2, before
    any work -- never a traceback, a division by zero after a calibration, or a table of a zero-token run."""
    ap = _parser(argv)
    extra = ["FILE"] if argv == ["prefill"] else []
    with pytest.raises(SystemExit) as exc:
        if argv == ["train"]:  # its front door: parsed on every rank, a bad option on one ends them all
            from hpczeco.drivers.train.options import parse
            from mpi4py import MPI

            parse([opt, value], MPI.COMM_SELF, ap.prog)
        else:
            ap.parse_args([*extra, opt, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {opt}: " in err and "Traceback" not in err, err


def test_option_types_accept_what_they_should():
    assert options.int_range(1)("3") == 3 and options.float_range(0, 1)("0.25") == 0.25
    assert options.size_bytes()("1.5K") == 1536 and options.size_bytes(allow_zero=True)("0M") == 0
    assert options.size_list()("4K,1M") == [4096, 1 << 20] and options.int_list(2)("2,4") == [2, 4]
    assert options.as_text(options.size_list())("4K,64K") == "4K,64K"
    for bad in ("inf", "-inf", "nan", "1e400"):
        with pytest.raises(Exception, match="finite"):
            options.float_range()(bad)


# --------------------------------------------------------------------------------------------- bounded inputs


def test_file_inputs_are_regular_files_read_with_a_bound(tmp_path):
    """``/dev/zero`` (st_size 0, endless) and a FIFO with no writer (opening it blocks) are refused by what they
    are, without being opened; a directory likewise; a file larger than the limit is refused unread."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, what in (("/dev/zero", "a character device"), (str(fifo), "a FIFO"), (str(tmp_path), "a directory")):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=f"the text: {path} is {what}"):
            files.read_bounded(path, 1 << 20, "the text")
        assert time.monotonic() - t0 < 5
    big = tmp_path / "big"
    with open(big, "wb") as fh:
        fh.truncate(3 << 30)  # sparse: 3 GiB declared
    with pytest.raises(ValueError, match=r"has 3,221,225,472 bytes, more than 1,048,576; raise it"):
        files.read_bounded(str(big), 1 << 20, "the text", too_large="; raise it")
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    assert files.read_bounded(str(small), 100, "t") == b"x" * 100
    assert files.read_bounded(str(small), 0, "t") == b"x" * 100
    with pytest.raises(ValueError, match="more than 99"):
        files.read_bounded(str(small), 99, "t")


def test_outputs_are_checked_before_the_work(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--out .*afile: it exists and is not a folder"):
        files.check_output_dir(tmp_path / "afile", "--out")
    with pytest.raises(ValueError, match=r"--out /proc/version/x: cannot create the folder"):
        files.check_output_dir("/proc/version/x", "--out")
    made = files.check_output_dir(tmp_path / "a" / "b", "--out")
    assert made.is_dir() and list(made.iterdir()) == []  # the probe is removed
    with pytest.raises(ValueError, match="is a folder"):
        files.check_output_file(tmp_path, "--json")
    with pytest.raises(ValueError, match="does not exist"):
        files.check_output_file(tmp_path / "missing" / "x.json", "--json")


# --------------------------------------------------------------------------------------------- report


def _fake_run(P: int, seed: int = 0) -> dict:
    """A bench scan result of P ranks (times: the shm preset's model with noise), as bench scan writes it."""
    rng = np.random.default_rng(seed + P)
    params = cm.PRESETS["shm"]
    rows = []
    for nbytes in (4096, 65536, 1 << 20):
        rws = nbytes // (128 * 4)
        K = min(128, rws)
        H, V = max(1, rws // K), 128
        nb = H * K * V * 4
        for t in ALGORITHMS:
            blocks = cm.best_blocks(P, nb, K, params) if t == "ring" else None
            m = cm.predict(t, P, nb, params, blocks=blocks, K=K, V=V)
            rows.append({"P": P, "label": t, "topology": t, "blocks": blocks, "nbytes": nb, "shape": [H, K, V],
                         "median_s": m * float(rng.uniform(0.8, 1.3)), "model_s": m})
    return {"bench": "scan", "P": P, "dtype": "float32", "oversubscribed": False, "calibrated": False,
            "machine": {"host": "test", "date": "today"}, "params": params.as_dict(),
            "exscan_algorithm": "recursive_doubling", "results": rows}


def _results(folder: Path, *Ps: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for P in Ps:
        (folder / f"scan_P{P}.json").write_text(json.dumps(_fake_run(P)))
    return folder


def _snapshot(folder: Path) -> list[tuple]:
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


def _damage(folder: Path, case: str) -> str:
    f2, f4 = folder / "scan_P2.json", folder / "scan_P4.json"
    d = json.loads(f2.read_text())
    if case == "unreadable":
        f2.unlink()
        f2.mkdir()  # as root every file is readable: a directory is what cannot be read as one
        return r"--in: .*scan_P2\.json is a directory, not a regular file"
    if case == "huge":
        with open(f2, "wb") as fh:
            fh.truncate(2 << 30)
        return r"scan_P2\.json has 2,147,483,648 bytes, more than 67,108,864 .*not a bench scan result"
    if case == "not-json":
        f2.write_text("{ half")
        return r"scan_P2\.json: not a bench scan result \(not JSON"
    if case == "wrong-shape":
        d4 = json.loads(f4.read_text())
        d4["results"] = d4["results"][0]
        f4.write_text(json.dumps(d4))
        return r"scan_P4\.json: holds no results"
    if case == "misnamed":
        d["P"] = 4
        f2.write_text(json.dumps(d))
        return r"scan_P2\.json: holds a run of P = 4 ranks but is named for P = 2"
    if case == "one-rank":
        d["P"] = 1
        (folder / "scan_P1.json").write_text(json.dumps(d))
        return r"scan_P1\.json: a one-rank run \(P = 1\)"
    if case in ("nan", "inf", "negative"):
        d["results"][3]["median_s"] = {"nan": math.nan, "inf": math.inf, "negative": -1e-3}[case]
        f2.write_text(json.dumps(d))
        return r"scan_P2\.json: result 3 \(.*\): median_s is .*, not a finite positive time"
    if case == "topology":
        d["results"][0]["topology"] = "carrier-pigeon"
        f2.write_text(json.dumps(d))
        return r"scan_P2\.json: result 0 .* is not one of"
    if case == "params":
        d["params"]["alpha"] = -1
        f2.write_text(json.dumps(d))
        return r"scan_P2\.json: its link parameters are not usable"
    raise ValueError(case)


@pytest.mark.parametrize("case", ["unreadable", "huge", "not-json", "wrong-shape", "misnamed", "one-rank", "nan", "inf",
                                  "negative", "topology", "params"])
def test_report_refuses_a_bad_input_and_writes_nothing(tmp_path, case):
    """A scan_P*.json that cannot be read, is too large, not a result, wrongly shaped, of one rank, or holds a
    NaN/inf/negative time: the report stops naming it (no skipping, no bench run, nothing written anywhere), where
    it used to skip it, run a bench and overwrite the file, crash in the fit, or rank NaN fastest."""
    inp = _results(tmp_path / "in", 2, 4)
    want = _damage(inp, case)
    before = _snapshot(inp)
    with pytest.raises(ValueError, match=want):
        report.main(["--in", str(inp), "--out", str(tmp_path / "out"), "--mpiexec", "/nonexistent/mpiexec"])
    assert _snapshot(inp) == before
    assert not (tmp_path / "out" / "report.md").exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # --out was checked (made), nothing else


def test_report_writes_only_into_out(tmp_path, capsys):
    inp = _results(tmp_path / "in", 2, 4)
    before = _snapshot(inp)
    # --sim: not the default runs/simulate, which a `hpczeco simulate` in the cwd would fill
    assert report.main(["--in", str(inp), "--out", str(tmp_path / "out"), "--sim", str(tmp_path / "no-sim")]) == 0
    assert _snapshot(inp) == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "report.md", "scan_over_p.png", "scan_presets.png", "scan_sizes.png"]
    assert "P = 2, 4 (from scan_P2.json, scan_P4.json)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="is the --in folder"):
        report.main(["--in", str(inp), "--out", str(inp)])


def test_report_bench_goes_to_a_new_folder_and_its_launcher_is_checked_first(tmp_path, monkeypatch):
    """With no results in --in, the short bench writes into a new folder under --out (never --in, never an earlier
    bench's folder); a launcher that is not there, or not an mpiexec, is refused before anything is launched."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    for bad, why in (("/nonexistent/mpiexec", "not found"), ("/bin/false", "ended with status 1: not an mpiexec")):
        with pytest.raises(ValueError, match=why):
            report.main(["--in", str(inp), "--out", str(out), "--mpiexec", bad])
    assert list(inp.iterdir()) == [] and not list(out.glob("bench_scan-*"))
    launched: list[Path] = []

    def fake_bench(folder, nps, sizes, mpiexec):
        assert nps == [2, 3] and sizes == "4K,64K" and mpiexec == "/fake/mpiexec"
        launched.append(folder)
        _results(folder, *nps)

    monkeypatch.setattr(report, "check_mpiexec", lambda explicit: "/fake/mpiexec")
    monkeypatch.setattr(report, "run_short_bench", fake_bench)
    monkeypatch.setattr(report, "write_report", lambda runs, out, max_p, sim: out / "report.md")  # the plots: elsewhere
    for _ in range(2):
        assert report.main(["--in", str(inp), "--out", str(out), "--np", "2,3", "--sizes", "4K,64K"]) == 0
    assert len(launched) == 2 and launched[0] != launched[1]
    assert all(f.parent == out and f.name.startswith("bench_scan-") for f in launched)
    assert list(inp.iterdir()) == []
    monkeypatch.setenv("PMI_SIZE", "2")  # launched on several ranks: no nested mpiexec
    with pytest.raises(ValueError, match="the short bench launches its own mpiexec"):
        report.main(["--in", str(inp), "--out", str(out)])


# --------------------------------------------------------------------------------------------- settings


def test_settings_parse_or_name_the_variable():
    assert settings.parse_timeout("") == settings.DEFAULT_TIMEOUT_S == 600.0
    assert settings.parse_timeout("off") is None and settings.parse_timeout("0") is None
    assert settings.parse_timeout(" 2.5 ") == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=r"\$HPCZECO_COLLECTIVE_TIMEOUT must be"):
            settings.parse_timeout(bad)
    env = {"HPCZECO_TRANSPORT": "bogus", "HPCZECO_CUDA_AWARE": "maybe", "HPCZECO_LINK": "warp", "HPCZECO_POOL_MB": "-5",
           "HPCZECO_GLA_THREADS": "0", "HPCZECO_TRACEBACK": "sometimes"}
    got = settings.read_all(env)
    for name in env:
        assert got[name][2] is not None and f"${name}" in got[name][2], got[name]
    assert settings.read_all({})["HPCZECO_COLLECTIVE_TIMEOUT"] == ("", 600.0, None)
    assert resolve_timeout(None) in (600.0, None) or os.environ.get(settings.TIMEOUT_ENV)
    assert "(the default;" in describe_timeout(600.0) or os.environ.get(settings.TIMEOUT_ENV)


@pytest.mark.mpi
def test_the_collective_timeout_is_on_by_default(comm, monkeypatch):
    """Unset, every communicator's waits are bounded by 600 s (the issue: unset used to mean forever)."""
    monkeypatch.delenv(settings.TIMEOUT_ENV, raising=False)
    dup = comm.Dup()
    try:
        assert get_context(dup).timeout == 600.0
    finally:
        dup.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("name, value, on_last, want", [
    ("HPCZECO_CUDA_AWARE", "maybe", "maybe", "$HPCZECO_CUDA_AWARE must be one of"),
    ("HPCZECO_CUDA_AWARE", None, "maybe", "$HPCZECO_CUDA_AWARE must be one of"),
    ("HPCZECO_CUDA_AWARE", "1", "0", "configuration mismatch: $HPCZECO_CUDA_AWARE differs"),
    ("HPCZECO_TRANSPORT", "bogus", "bogus", "$HPCZECO_TRANSPORT must be one of"),
    ("HPCZECO_LINK", "shm", "tcp", "configuration mismatch: $HPCZECO_LINK differs"),
    ("HPCZECO_GLA_THREADS", None, "0", "$HPCZECO_GLA_THREADS must be an int >= 1"),
    ("HPCZECO_POOL_MB", None, "lots", "$HPCZECO_POOL_MB must be a number"),
])  # fmt: skip
def test_bad_or_differing_settings_are_one_error_on_every_rank(comm, monkeypatch, name, value, on_last, want):
    """A library variable that is not valid on some rank, or one that must agree and differs, is the same error on
    every rank where the library first meets the communicator (HPCZECO_TRANSPORT=bogus and HPCZECO_CUDA_AWARE=maybe
    used to be ignored on the CPU)."""
    if "mismatch" in want and comm.Get_size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    mine = on_last if comm.Get_rank() == comm.Get_size() - 1 else value
    if mine is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, mine)
    dup = comm.Dup()
    try:
        msg = agreed_error(comm, lambda: get_context(dup))
    finally:
        dup.Free()
    assert msg is not None and want in msg, msg
    if "mismatch" not in want:
        last = comm.Get_size() - 1
        assert msg.endswith(f"on rank(s) {list(range(comm.Get_size())) if value == on_last else [last]}"), msg


# --------------------------------------------------------------------------------------------- checkpoints


_HOLDER = """
import sys, time
from hpczeco.drivers.checkpoint import CheckpointWriter
w = CheckpointWriter(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def test_two_jobs_cannot_share_a_checkpoint_folder(tmp_path):
    """A second live job's writer on the same folder is refused, naming the holder, before it writes (two jobs used
    to delete each other's temporaries); once the holder is gone, the folder is free."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        line = [None]
        reader = threading.Thread(target=lambda: line.__setitem__(0, holder.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert line[0] == "held\n", line
        with pytest.raises(CheckpointError, match=rf"checkpoint folder {tmp_path} is in use by another live job "
                                                  rf"\(process {holder.pid} on "):
            CheckpointWriter(tmp_path)
    finally:
        holder.kill()
        holder.wait(30)
    w = CheckpointWriter(tmp_path)
    w.save(1, {"w": np.ones(3)})
    w2 = CheckpointWriter(tmp_path)  # this process's writers share its lock (a demo runs train twice)
    w2.save(2, {"w": np.ones(3)})
    assert (tmp_path / LOCK_NAME).exists()


def test_cleanup_removes_only_temporaries_nobody_holds(tmp_path):
    live = tmp_path / ".ckpt_00000007.h5.tmp-local-otherhost-99-1"
    stale = tmp_path / ".ckpt_00000006.h5.tmp-12345.batch-node1-98-2"
    old_style = tmp_path / ".ckpt_00000005.h5.tmp-97-3"
    for p in (live, stale, old_style):
        p.write_bytes(b"half a file")
    fd = _lock_fd(live)  # as its writer holds it (this test holds it through its own descriptor)
    try:
        CheckpointWriter(tmp_path).save(8, {"w": np.zeros(2)})
        names = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME)
        assert names == [live.name, "ckpt_00000008.h5"], names
    finally:
        if fd is not None:
            os.close(fd)


def test_temporaries_carry_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(Path(src).name)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    CheckpointWriter(tmp_path).save(3, {"w": np.zeros(2)})
    assert len(seen) == 1 and seen[0].startswith(".ckpt_00000003.h5.tmp-4242-"), seen


# --------------------------------------------------------------------------------------------- one process


def test_cli_reports_a_collective_error_once(monkeypatch, capsys):
    """A bad setting on a one-process command: one line, status 2, no traceback."""
    monkeypatch.setenv("HPCZECO_TRANSPORT", "bogus")
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["info"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.count("$HPCZECO_TRANSPORT must be one of auto, cuda-aware, staged, nccl (or unset), got 'bogus'") == 1
