"""drivers/benchkit.py (the benchmark drivers' recorder, timers and environment capture) and the GPU bench
subcommands' behaviour on a machine without a GPU. Serial tests."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

import pytest
from hpczeco.base.backend import cupy_available
from hpczeco.drivers import benchkit


def test_recorder_rewrites_json_and_csv_after_every_row(tmp_path, capsys):
    rec = benchkit.Recorder(tmp_path, "demo", info={"seed": 7})
    rec.timing("first", 1.5, GBps=3.0)
    data = json.loads((tmp_path / "demo.json").read_text())  # already on disk before finish()
    assert data["info"] == {"seed": 7}
    assert data["timings"] == [{"name": "first", "median_ms": 1.5, "GBps": 3.0}]
    rec.record({"T": 8, "speedup": 2.0, "positions": [1, 2]}, table="ttft")
    rec.failed("second", RuntimeError("no device"))
    data = json.loads((tmp_path / "demo.json").read_text())
    assert [r["name"] for r in data["timings"]] == ["first", "second"]
    assert data["timings"][1]["median_ms"] is None and data["timings"][1]["error"] == "RuntimeError: no device"
    assert data["ttft"] == [{"T": 8, "speedup": 2.0, "positions": [1, 2]}]
    rows = list(csv.DictReader(open(tmp_path / "demo_timings.csv")))
    assert [r["name"] for r in rows] == ["first", "second"] and rows[0]["GBps"] == "3.0" and rows[1]["GBps"] == ""
    assert list(csv.DictReader(open(tmp_path / "demo_ttft.csv")))[0]["positions"] == "[1, 2]"
    out = capsys.readouterr().out
    assert "TIME  first" in out and "1.500 ms" in out and "ttft: T=8  speedup=2" in out


def test_recorder_finish_prints_table_and_writes_plot(tmp_path, capsys):
    rec = benchkit.Recorder(tmp_path, "demo")
    rec.timing("a", 2.0, ratio=1.25)
    rec.record({"T": 1, "method": "x", "median_ms": 3.0}, table="rows")

    def plot(tables, out):
        assert set(tables) == {"timings", "rows"}
        path = out / "demo.png"
        path.write_bytes(b"png")
        return path

    rec.finish(plot=plot)
    out = capsys.readouterr().out
    assert "-- timings" in out and "2.000 ms" in out and "ratio=1.25" in out
    assert "-- rows" in out and "method" in out
    assert json.loads((tmp_path / "demo.json").read_text())["info"]["plot"] == str(tmp_path / "demo.png")
    rec.finish(plot=lambda tables, out: 1 / 0)  # a failing plot is recorded, the results stay
    assert json.loads((tmp_path / "demo.json").read_text())["info"]["plot"].startswith("failed: ZeroDivisionError")


def test_recorder_on_other_ranks_writes_nothing(tmp_path, capsys):
    rec = benchkit.Recorder(tmp_path / "sub", "demo", rank=1)
    rec.timing("a", 1.0)
    rec.finish()
    assert not (tmp_path / "sub").exists() and capsys.readouterr().out == ""


def test_host_time_excludes_warmup_and_takes_the_median():
    calls = []
    durations = iter([0.05, 0.0, 0.02, 0.0])  # the first call is the warm-up: slow, and not counted

    def fn():
        calls.append(1)
        time.sleep(next(durations))

    t = benchkit.host_time(fn, repeats=3, warmup=1, sync=lambda: calls.append(0))
    assert len([c for c in calls if c == 1]) == 4 and t["reps"] == 3
    assert t["min_ms"] < 15 <= t["max_ms"] and t["min_ms"] <= t["median_ms"] <= t["max_ms"]
    assert t["median_ms"] < 15  # two of the three timed calls were instant
    with pytest.raises(ValueError, match="repeats"):
        benchkit.host_time(fn, repeats=0)


@pytest.mark.mpi
def test_host_time_counts_the_slowest_rank(comm):
    rank = comm.Get_rank()
    t = benchkit.host_time(lambda: time.sleep(0.02 if rank == comm.Get_size() - 1 else 0.0), repeats=3, warmup=0,
                           comm=comm)
    everyone = comm.allgather(t["median_ms"])
    assert all(m == everyone[0] for m in everyone) and everyone[0] >= 20


def test_stopwatch_measures_wall_and_cpu():
    with benchkit.Stopwatch() as sw:
        t0 = time.process_time()
        while time.process_time() - t0 < 0.02:
            pass
        time.sleep(0.03)
    assert sw.wall >= 0.05 and 0.015 <= sw.cpu < sw.wall


def test_cuda_event_time_rejects_bad_arguments():
    with pytest.raises(ValueError, match="events"):
        benchkit.cuda_event_time(lambda i: None, 2, events="opencl")
    with pytest.raises(ValueError, match="repeats"):
        benchkit.cuda_event_time(lambda i: None, 0)


def test_environment_describes_the_machine():
    env = benchkit.environment(("numpy", "no_such_module_here"))
    for key in ("host", "platform", "cpu", "cpus", "python", "date_utc", "numpy"):
        assert env[key], key
    assert env["cpu"] == benchkit.cpu_model()
    assert env["no_such_module_here"].startswith("unavailable (ModuleNotFoundError")
    if not cupy_available():
        assert benchkit.environment(gpu=True)["gpu"].startswith("unavailable")


@pytest.mark.skipif(cupy_available(), reason="checks the message shown where CuPy is missing")
@pytest.mark.parametrize("bench", ["gpu-gla", "gpu-daaf", "gpu-multi"])
def test_gpu_benches_fail_with_one_line_without_cupy(tmp_path, bench):
    res = subprocess.run([sys.executable, "-m", "hpczeco", "bench", bench, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == f"hpczeco bench {bench}: needs CuPy and a CUDA GPU " \
                                 "(ModuleNotFoundError: No module named 'cupy')", res.stderr
    assert not list(tmp_path.iterdir())  # nothing written
    helped = subprocess.run([sys.executable, "-m", "hpczeco", "bench", bench, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--out" in helped.stdout
