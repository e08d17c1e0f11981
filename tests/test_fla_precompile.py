"""The parallel precompile of fla's kernels (hpczeco.drivers.fla_precompile): its cases, the process pool (jobs at
once, timeouts, failures, the children's environment) with stand-in children, and its command line. The children's
real work (fla on a GPU) runs on the GPU machine through `hpczeco bench gpu-gla`."""

from __future__ import annotations

import sys

import pytest
from hpczeco.drivers import bench_gpu_gla as bench
from hpczeco.drivers import fla_precompile as fp


def test_cases_one_per_shape_and_per_grid_pair_each_once():
    shapes = [(1, 32768, 4, 256, 512), (1, 32768, 8, 128, 256), (1, 32768, 4, 256, 512)]
    got = fp.cases(shapes, [(256, 512), (128, 256)], (1, 63, 2048))
    assert got == ["shape:1,32768,4,256,512", "shape:1,32768,8,128,256", "grid:256,512:1,63,2048",
                   "grid:128,256:1,63,2048"]  # fmt: skip
    assert fp.cases(shapes[:1], [(256, 512)], ()) == ["shape:1,32768,4,256,512"]  # no lengths, no grid cases
    for case in got:
        kind, dims, lengths = fp.parse_case(case)
        assert kind in ("shape", "grid") and len(dims) == (5 if kind == "shape" else 2)


@pytest.mark.parametrize("bad", ["", "shape:1,2,3", "shape:1,2,3,4,0", "grid:256,512", "grid:256:1", "cube:1,2",
                                 "shape:a,b,c,d,e", "grid:256,512:1,x"])  # fmt: skip
def test_a_bad_case_is_refused_with_the_expected_forms(bad, capsys):
    with pytest.raises(ValueError, match="expected 'shape:B,T,H,K,V' or 'grid:K,V:T1,T2,...'"):
        fp.parse_case(bad)
    assert fp.main([bad]) == 2
    assert "not a precompile case" in capsys.readouterr().err


def _child(tmp_path, body: str):
    """argv_of for stand-in children: python -c BODY with the case as argv[1] and a shared log file as argv[2]."""
    log = tmp_path / "events.log"
    return log, (lambda case: [sys.executable, "-c", body, case, str(log)])


def test_pool_runs_jobs_at_once_and_gives_results_in_the_given_order(tmp_path):
    # each child logs its start and waits (up to 30 s) until two children have started; the first case also until
    # two others have ended. One at a time, the peak would be 1; results in completion order would not be in order
    body = ("import os, sys, time\n"
            "log = sys.argv[2]\n"
            "def n(word):\n"
            "    return open(log).read().split().count(word)\n"
            "open(log, 'a').write('start\\n')\n"
            "t = time.time()\n"
            "while n('start') < 2 and time.time() - t < 30: time.sleep(0.02)\n"
            "while sys.argv[1].endswith(',64,2,64,64') and n('end') < 2 and time.time() - t < 30: time.sleep(0.02)\n"
            "open(log, 'a').write('end\\n')\n"
            "e = os.environ.get\n"
            "print('FLA_CACHE_RESULTS=' + e('FLA_CACHE_RESULTS', 'unset'),\n"
            "      'TRITON_CACHE_AUTOTUNING=' + e('TRITON_CACHE_AUTOTUNING', 'unset'), sys.argv[1])")  # fmt: skip
    log, argv_of = _child(tmp_path, body)
    log.write_text("")
    todo = [f"shape:1,{64 * (i + 1)},2,64,64" for i in range(5)]
    said = []
    res = fp.precompile(todo + todo[:1], jobs=2, timeout_s=60, say=said.append, argv_of=argv_of, poll_s=0.05)
    assert [r.case for r in res] == todo and all(r.ok for r in res)  # the repeated case ran once
    for r in res:  # the children compile but keep (and read) no autotune choices
        assert f"FLA_CACHE_RESULTS=0 TRITON_CACHE_AUTOTUNING=0 {r.case}" in r.tail
    live = peak = 0
    events = log.read_text().split()
    assert events.count("start") == events.count("end") == 5
    for e in events:
        live += 1 if e == "start" else -1
        peak = max(peak, live)
    assert peak == 2
    assert len(said) == 5 and all(": ok in " in s for s in said)
    assert said[0].startswith(f"fla precompile {todo[1]}:")  # finished first, yet the results are in order


def test_an_exception_in_the_pool_kills_the_running_children(tmp_path, monkeypatch):
    body = "import time, sys\nopen(sys.argv[2], 'a').write('up\\n')\ntime.sleep(60)"
    log, argv_of = _child(tmp_path, body)
    seen = []

    def say(line):  # the first report raises: the other child is still running then
        seen.append(line)
        raise KeyboardInterrupt

    body_fast = "print('done')"
    argv = lambda case: argv_of(case) if case.endswith("1") else [sys.executable, "-c", body_fast]  # noqa: E731
    started = []
    real_popen = fp.subprocess.Popen

    def popen(*a, **kw):
        started.append(real_popen(*a, **kw))
        return started[-1]

    monkeypatch.setattr(fp.subprocess, "Popen", popen)
    with pytest.raises(KeyboardInterrupt):
        fp.precompile(["grid:64,64:1", "grid:64,64:2"], jobs=2, timeout_s=60, say=say, argv_of=argv, poll_s=0.05)
    assert len(started) == 2 and all(p.poll() is not None for p in started)  # none left running
    assert len(seen) == 1 and seen[0].startswith("fla precompile grid:64,64:2: ok in ")


def test_a_failing_and_a_hanging_child_are_reported_and_the_rest_still_run(tmp_path):
    body = ("import sys, time\n"
            "case = sys.argv[1]\n"
            "sys.stdout.write('x' * 200000 + '\\n')\n"  # more than a pipe holds: the child must not block on it
            "if case.endswith('9'):\n"
            "    print('boom: no GPU here'); sys.exit(3)\n"
            "if case.endswith('7'):\n"
            "    time.sleep(60)\n"
            "print('fine')")  # fmt: skip
    _, argv_of = _child(tmp_path, body)
    todo = ["grid:64,64:9", "grid:64,64:7", "grid:64,64:1"]
    res = {r.case: r for r in fp.precompile(todo, jobs=3, timeout_s=2, say=lambda s: None, argv_of=argv_of,
                                            poll_s=0.05)}  # fmt: skip
    assert res["grid:64,64:9"].status == "exit 3" and "boom: no GPU here" in res["grid:64,64:9"].tail
    assert res["grid:64,64:7"].status == "timed out" and res["grid:64,64:7"].seconds < 30
    assert res["grid:64,64:1"].ok and "fine" in res["grid:64,64:1"].tail


def test_jobs_must_be_positive():
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        fp.precompile(["shape:1,64,1,16,16"], jobs=0, timeout_s=1)


def test_bench_options_for_the_precompile():
    p = bench.build_parser("hpczeco bench gpu-gla")
    a = p.parse_args([])
    assert a.fla_jobs == 0 and a.fla_jobs_timeout == 420  # off unless asked for
    assert p.parse_args(["--fla-jobs", "0"]).fla_jobs == 0
    with pytest.raises(SystemExit):
        p.parse_args(["--fla-jobs", "-1"])
    with pytest.raises(SystemExit):
        p.parse_args(["--fla-jobs-timeout", "0"])


@pytest.mark.parametrize("jobs, grid, want_jobs", [(8, False, 2), (8, True, 4), (1, True, None), (0, True, None)])
def test_bench_runs_the_precompile_over_its_cases(tmp_path, monkeypatch, jobs, grid, want_jobs):
    from hpczeco.drivers import benchkit

    args = bench.build_parser("x").parse_args(["--fla-jobs", str(jobs), "--out", str(tmp_path)]
                                              + (["--grid", "--grid-kv", "256x512,128x256", "--grid-t", "63,777"]
                                                 if grid else []))  # fmt: skip
    calls = []

    def fake(todo, jobs, timeout_s, say):
        calls.append((list(todo), jobs, timeout_s))
        return [fp.Result(c, 1.0, "ok" if i else "exit 1", "no GPU") for i, c in enumerate(todo)]

    monkeypatch.setattr(fp, "precompile", fake)
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: set(range(16)))
    rec = benchkit.Recorder(tmp_path, "t")
    b = bench.Bench(args, rec, None, 1)
    b.fla_precompile([bench.SHAPES["3"], bench.SHAPES["4"]])
    if want_jobs is None:
        assert calls == []
        return
    todo, got_jobs, timeout = calls[0]
    assert got_jobs == want_jobs and timeout == 420
    assert todo[:2] == ["shape:1,32768,4,256,512", "shape:1,32768,8,128,256"]
    assert todo[2:] == (["grid:256,512:63,777", "grid:128,256:63,777"] if grid else [])
    rows = rec.tables["fla_precompile"]
    assert [r["case"] for r in rows] == todo and rows[0]["status"] == "exit 1" and rows[0]["tail"] == "no GPU"
