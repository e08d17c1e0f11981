"""What the command line prints (issue 17, "output a newcomer understands"): help texts (defaults shown, no
internal remarks, nothing printed twice), the training output (no progress bar in a pipe, the checkpoint
line, the first-run compile notice), the oversubscription warning and what it changes in `bench scan`,
`report` and the demo's drivers, and the weak-scaling plot's tokens-per-rank curves."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hpczeco.drivers import bench_scan, bench_zeco, cli, console, helpfmt, mpienv, report, train
from hpczeco.drivers.data import read_corpus
from mpi4py import MPI

REPO = Path(__file__).resolve().parent.parent
SUBCOMMANDS = [[name] for name in cli.COMMANDS] + [["bench", name] for name in cli.BENCHES]


def _help(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        cli.dispatch([*argv, "--help"])
    assert exc.value.code == 0, argv
    return buf.getvalue()


def _mpiexec() -> str | None:
    if os.environ.get("MPIEXEC"):
        return os.environ["MPIEXEC"]
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def _on_one_core(exe: str, taskset: str) -> list[str]:
    """``taskset -c C mpiexec``, so that every rank inherits one core. Open MPI's mpiexec binds each rank
    to a core of its own by default (2 ranks: cores 0 and 1 whatever the launcher's mask), so it gets
    ``--bind-to none`` to keep the mask; MPICH's hydra keeps it as it is."""
    probe = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    ompi = "open mpi" in (probe.stdout + probe.stderr).lower() or "open-mpi" in (probe.stdout + probe.stderr).lower()
    return [taskset, "-c", str(min(os.sched_getaffinity(0))), exe, *(["--bind-to", "none"] if ompi else [])]


def _env(**extra: str) -> dict[str, str]:
    env = mpienv.launch_env(dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


# --------------------------------------------------------------------------------------------- help texts


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_help_has_no_junk(argv):
    text = _help(argv)
    assert not re.search(r"\bissues?\b", text, re.I), text  # no remarks about the project's issues
    for junk in ("(default: None)", "(default: False)", "(default: )", "default: True) (default"):
        assert junk not in text, (junk, text)
    # the description's first paragraph is printed once (not again as the epilog)
    first = text.split("\n\n")[1].strip()
    assert first and text.count(first) == 1, first


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_every_option_says_what_it_is(argv):
    module = importlib.import_module((cli.BENCHES[argv[1]] if argv[0] == "bench" else cli.COMMANDS[argv[0]])[0])
    build = getattr(module, "build_parser", None) or getattr(module, "_parser", None)
    if build is None:  # info builds its one-option parser in main()
        assert "--json      print one JSON object" in _help(argv)
        return
    assert helpfmt.check_parser(build(" ".join(["hpczeco", *argv]))) == []


def test_train_help_shows_every_default():
    blocks, current = {}, None  # option -> its help text (argparse wraps it over indented lines)
    for line in _help(["train"]).splitlines():
        if re.match(r"  -", line):
            current = line.strip()
            blocks[current] = ""
        elif current and line.startswith("     "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    for option, default in (("--config {tiny,125m,340m,1.3b}", "tiny"), ("--seq SEQ", "1024"),
                            ("--steps STEPS", "20"), ("--lr LR", "0.003"), ("--beta1 BETA1", "0.9"),
                            ("--beta2 BETA2", "0.99"),
                            ("--eps EPS", "1e-08"), ("--weight-decay WEIGHT_DECAY", "0.0"), ("--seed SEED", "0"),
                            ("--chunk-size CHUNK_SIZE", "64"), ("--ckpt-every CKPT_EVERY", "0")):
        help_ = " ".join(v if k == option else k[len(option):] + v for k, v in blocks.items() if k.startswith(option))
        assert re.search(rf"\(default:? {re.escape(default)}\b", help_), (option, help_)


def test_scan_calibrate_flag_and_zeco_tokens_help():
    scan = _help(["bench", "scan"])
    assert "--calibrate, --no-calibrate" in scan and scan.count("(default: True)") == 1
    zeco = " ".join(_help(["bench", "zeco"]).split())
    assert "tokens per rank (fixed as P grows: weak scaling; the paper's runs use 16384) (default: 4096)" in zeco
    assert _help(["model"]).count("predicted All-Scan (ring) vs tree vs allgather") == 1


@pytest.mark.parametrize("bench", ["bench_scan", "bench_zeco"])
def test_topologies_are_checked_by_the_one_rule(bench, capsys):
    """--topologies (a list; --topology where one is taken) is checked by collectives.names.check_topology: a bad
    name is a usage error naming the accepted ones, before any MPI work."""
    import importlib

    from hpczeco.collectives.names import TOPOLOGIES

    mod = importlib.import_module(f"hpczeco.drivers.{bench}")
    parser = mod.build_parser("x") if hasattr(mod, "build_parser") else mod._parser("x")
    assert parser.parse_args(["--topologies", "ring, tree,serial"]).topologies == ["ring", "tree", "serial"]
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--topologies", "ring,rign"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "topology must be one of" in err and "'rign'" in err and str(TOPOLOGIES) in err


# --------------------------------------------------------------------------------------------- training output


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    data, _ = read_corpus(None, 32 << 10)
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_bytes(data)
    return str(path)


TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--seq", "64", "--chunk-size", "16"]


def test_train_output_in_a_pipe(text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(console, "kernels_cached", lambda modules=console.KERNEL_MODULES: False)  # a first run
    res = train.run(["--text", text_file, *TINY, "--steps", "3", "--ckpt-dir", str(tmp_path / "a")], MPI.COMM_SELF)
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert "\r" not in out.out + out.err and "train:" not in out.err  # no bar redraws in a pipe
    assert f"  checkpoints: {tmp_path / 'a'} (at the end)" in lines and "every -" not in out.out
    notice = lines.index(console.COMPILE_NOTICE)
    first_step = next(i for i, ln in enumerate(lines) if ln.startswith("  step"))
    assert notice < first_step and lines[first_step].split()[1] == "1/3"
    assert lines[-1].startswith("hpczeco train: steps 1..3 on 1 rank(s)") and res.step == 3
    train.run(["--text", text_file, *TINY, "--steps", "2", "--ckpt-dir", str(tmp_path / "b"), "--ckpt-every", "1"],
              MPI.COMM_SELF)
    assert "(every 1 steps and at the end)" in capsys.readouterr().out


def test_compile_notice_only_without_cache(monkeypatch, capsys):
    said: list[str] = []
    monkeypatch.setattr(console, "kernels_cached", lambda modules=console.KERNEL_MODULES: True)
    assert console.compile_notice(0, said.append) is False and said == []
    monkeypatch.setattr(console, "kernels_cached", lambda modules=console.KERNEL_MODULES: False)
    assert console.compile_notice(1, said.append) is False and said == []  # rank 0 only
    assert console.compile_notice(0, said.append) is True and said == [console.COMPILE_NOTICE]


def test_kernels_cached_sees_an_empty_numba_cache(tmp_path):
    code = "from hpczeco.drivers.console import kernels_cached; print(kernels_cached())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=_env(NUMBA_CACHE_DIR=str(tmp_path / "numba")))
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# --------------------------------------------------------------------------------------------- oversubscription


def test_warning_printed_once_per_process(monkeypatch):
    over = mpienv.CoreOversubscription("nodeA", 4, 2, 1)
    monkeypatch.setattr(mpienv, "core_oversubscription", lambda comm: over)
    monkeypatch.setattr(console, "_warned", set())
    said: list[str] = []
    assert console.warn_oversubscribed(MPI.COMM_SELF, "hpczeco demo", said.append) is over
    assert console.warn_oversubscribed(MPI.COMM_SELF, "hpczeco bench scan", said.append) is over
    assert said == ["hpczeco demo: warning: 4 ranks share 2 usable core(s) on nodeA: the ranks are oversubscribed, "
                    "so they wait for a core and timings measure that scheduling more than the code"]


def test_one_rank_is_never_oversubscribed():
    assert mpienv.core_oversubscription(MPI.COMM_SELF) is None


@pytest.mark.mpi
def test_core_oversubscription_agrees_with_the_affinities(comm):
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    cores = len(set().union(*node.allgather(set(os.sched_getaffinity(0)))))
    ranks = node.Get_size()
    node.Free()
    got = mpienv.core_oversubscription(comm)
    answers = comm.allgather(got)
    assert all(a == answers[0] for a in answers)  # the same verdict on every rank
    if ranks > cores:
        assert got is not None and (got.ranks, got.cores) == (ranks, cores)
    else:
        assert got is None or got.host != socket.gethostname()  # (another node may be oversubscribed)


# ------------------------------------------------------------------------------------------- core sharing


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_core_sharing_sees_a_busy_process_on_this_core():
    """A busy process pinned to this process's one core takes about half of a spin, in the kernel's slices."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    import select

    hog = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                           stdout=subprocess.PIPE, text=True)
    try:
        try:
            os.sched_setaffinity(hog.pid, {cpu})
            os.sched_setaffinity(0, {cpu})
        except PermissionError as exc:
            pytest.skip(f"CPU affinity cannot be set here: {exc}")
        assert hog.stdout is not None and select.select([hog.stdout], [], [], 60)[0], "the busy process did not start"
        assert hog.stdout.readline().strip() == "spinning"  # it runs from here on
        time.sleep(0.01)
        got = mpienv.core_sharing(MPI.COMM_SELF, seconds=0.2)
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
    assert got is not None and got.ranks == (0,) and 0.2 < got.lost <= 1.0, got
    assert 0.5 <= got.gap_ms <= 100.0 and got.probe_s == 0.2
    assert "rank(s) 0 lost up to" in got.describe() and "--bind-to core" in got.describe()


def test_core_sharing_checks_its_arguments():
    for bad in ({"seconds": 0}, {"floor": 0}, {"threshold": 0}, {"threshold": 1.5}):
        with pytest.raises(ValueError, match="core_sharing needs"):
            mpienv.core_sharing(MPI.COMM_SELF, **bad)


def test_core_sharing_warning_and_record(monkeypatch, capsys):
    monkeypatch.setattr(mpienv, "spin_gaps", lambda seconds, floor: [])
    said: list[str] = []
    assert console.warn_core_sharing(MPI.COMM_SELF, "hpczeco bench scan", said.append) is None and said == []
    monkeypatch.setattr(mpienv, "spin_gaps", lambda seconds, floor: [4e-3] * 5)  # 20 ms of a 50 ms spin
    got = console.warn_core_sharing(MPI.COMM_SELF, "hpczeco bench scan", said.append)
    assert got is not None and got.ranks == (0,) and got.probe_s == 0.05
    assert (got.lost, got.gap_ms) == (pytest.approx(0.4), pytest.approx(4.0))
    assert said == [f"hpczeco bench scan: warning: {got.describe()}"] and "lost up to 40%" in said[0]
    assert "in gaps of 4.0 ms" in said[0]
    data = _scan_result(2, False)
    data["core_sharing"] = {"describe": got.describe()}
    bench_scan.print_table(data)
    assert "CORES SHARED" in capsys.readouterr().out


@pytest.mark.mpi
def test_core_sharing_names_the_same_ranks_on_every_rank(comm, monkeypatch):
    lost_rank = comm.Get_size() - 1
    monkeypatch.setattr(mpienv, "spin_gaps",
                        lambda seconds, floor: [8e-3] * 3 if comm.Get_rank() == lost_rank else [])
    got = mpienv.core_sharing(comm, seconds=0.05)
    answers = comm.allgather(got)
    assert all(a == answers[0] for a in answers)
    assert got is not None and got.ranks == (lost_rank,) and got.gap_ms == pytest.approx(8.0)
    assert got.lost == pytest.approx(0.48)
    assert f"rank(s) {lost_rank} lost up to 48%" in got.describe()


def _scan_result(P: int, oversubscribed: bool, calibrated: bool = True) -> dict:
    row = {"P": P, "label": "ring", "topology": "ring", "blocks": 1, "nbytes": 4096, "shape": [1, 8, 128],
           "median_s": 1e-4, "model_s": 1e-4}
    return {"P": P, "oversubscribed": oversubscribed, "calibrated": calibrated, "dtype": "float32", "results": [row],
            "oversubscription": {"describe": f"{P} ranks share 1 usable core(s) on x"} if oversubscribed else None,
            "params": {"alpha": 1e-6, "beta": 1e-10}}


def test_scan_table_and_report_reference_mind_oversubscription(capsys):
    bench_scan.print_table(_scan_result(4, True))
    text = capsys.readouterr().out
    assert "OVERSUBSCRIBED" in text and "NOT a ranking of the algorithms" in text and "4 ranks share" in text
    assert "\nfastest per size:" not in text
    bench_scan.print_table(_scan_result(2, False))
    assert "\nfastest per size: 4 KiB: ring" in capsys.readouterr().out
    runs = [_scan_result(2, False), _scan_result(4, True)]
    ref, max_p, caveat = report.model_reference(runs, 256)
    assert ref["P"] == 2 and max_p == 256 and "P = 4 are not used" in caveat
    ref, max_p, caveat = report.model_reference([_scan_result(2, True), _scan_result(4, True)], 256)
    assert max_p == 4 and "no extrapolation past P = 4" in caveat
    ref, max_p, caveat = report.model_reference([_scan_result(4, True, calibrated=False)], 256)
    assert max_p == 256 and caveat is None  # a --link preset is no oversubscribed measurement


def test_oversubscribed_scan_warns_and_report_refuses_to_extrapolate(tmp_path):
    exe, taskset = _mpiexec(), shutil.which("taskset")
    if exe is None or taskset is None:
        pytest.skip("needs mpiexec and taskset")
    out = tmp_path / "scan"
    cmd = [*_on_one_core(exe, taskset), "-n", "2", sys.executable, "-m", "hpczeco", "bench",
           "scan", "--sizes", "4K", "--repeats", "3", "--warmup", "1", "--time-limit", "0.5", "--blocks", "2",
           "--topologies", "ring,serial", "--no-plot", "--out", str(out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warning = "hpczeco bench scan: warning: 2 ranks share 1 usable core(s) on "
    assert proc.stdout.count(warning) == 1, proc.stdout  # rank 0, once
    assert "NOT a ranking of the algorithms; fastest per size here (oversubscribed): 4 KiB:" in proc.stdout
    data = json.loads((out / "scan_P2.json").read_text())
    assert data["oversubscribed"] is True and data["oversubscription"]["ranks"] == 2
    assert data["oversubscription"]["cores"] == 1
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert report.main(["--in", str(out), "--out", str(tmp_path / "rep")]) == 0
    assert "hpczeco report: warning: every run was oversubscribed" in buf.getvalue()
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "no extrapolation past P = 2" in md and "## P = 2 (oversubscribed)" in md
    assert "fastest (oversubscribed: not a ranking)" in md


def test_oversubscribed_train_warns_once_and_fair_run_does_not(text_file, tmp_path):
    exe, taskset = _mpiexec(), shutil.which("taskset")
    if exe is None or taskset is None:
        pytest.skip("needs mpiexec and taskset")
    base = [exe, "-n", "2", sys.executable, "-m", "hpczeco", "train", "--text", text_file, *TINY, "--steps", "2"]
    one_core = subprocess.run([*_on_one_core(exe, taskset), *base[1:]], env=_env(),
                              capture_output=True, text=True, timeout=300)
    assert one_core.returncode == 0, one_core.stdout + one_core.stderr
    assert one_core.stdout.count("hpczeco train: warning: 2 ranks share 1 usable core(s)") == 1, one_core.stdout
    if len(os.sched_getaffinity(0)) >= 2:
        fair = subprocess.run(base, env=_env(), capture_output=True, text=True, timeout=300)
        assert fair.returncode == 0, fair.stdout + fair.stderr
        assert "warning" not in fair.stdout, fair.stdout


# --------------------------------------------------------------------------------------------- weak-scaling plot


def _zeco_rows(P: int, tokens: int, ratio: float) -> list[dict]:
    return [{"variant": v, "P": P, "tokens_per_rank": tokens, "ratio_vs_ideal": r}
            for v, r in (("ideal", 1.0), ("ring", ratio))]


def test_zeco_plot_one_curve_per_tokens_per_rank(tmp_path):
    rows = _zeco_rows(1, 4096, 1.02) + _zeco_rows(2, 2048, 1.3) + _zeco_rows(4, 4096, 1.05)
    groups = bench_zeco.plot_groups(rows)
    assert list(groups) == [2048, 4096]
    assert groups[4096]["ring"] == [(1, 1.02, False), (4, 1.05, False)]  # 2048 never joins the 4096 curve
    assert groups[2048]["ring"] == [(2, 1.3, False)]
    for P, tokens, ratio in ((1, 4096, 1.02), (2, 2048, 1.3)):
        (tmp_path / f"zeco_P{P}.json").write_text(json.dumps({"rows": _zeco_rows(P, tokens, ratio)}))
    assert bench_zeco._plot(tmp_path) == [2048, 4096]
    assert (tmp_path / "zeco.png").stat().st_size > 1000
