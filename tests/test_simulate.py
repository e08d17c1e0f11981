"""`hpczeco simulate` on a tiny platform (SimGrid): the schedules run, ring and ptree carry real pieces that equal
the float64 fold on every simulated rank, the simulator follows the two-level model, and the outputs are written.
Skipped, with the reason, where SimGrid's Python bindings are missing (Debian: ``apt-get install
python3-simgrid``; PyPI: ``pip install simgrid``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hpczeco.collectives import schedule
from hpczeco.drivers import simulate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def simgrid_ok():
    why = simulate.simgrid_available()
    if why is not None:
        pytest.skip(f"SimGrid not available: {why}")


def test_tiny_platform(tmp_path, simgrid_ok):
    out = tmp_path / "sim"
    cmd = [sys.executable, "-m", "hpczeco", "simulate", "--P", "4,9", "--topologies", "ring,ptree,tree,allgather",
           "--state-bytes", "64K", "--gpus-per-node", "4", "--nodes-per-leaf", "2", "--software", "fixed",
           "--verify", "--jobs", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "simulate.json").read_text())
    rows = [r for r in data["results"] if not r["topology"].startswith("verify:")]
    assert {(r["topology"], r["P"]) for r in rows} == {(t, P) for t in ("ring", "ptree", "tree", "allgather")
                                                       for P in (4, 9)}
    for r in rows:
        assert "error" not in r, r
        assert 0.7 < r["time_s"] / r["model_s"] < 1.4, r  # the simulator follows the model it shares numbers with
        want = sum(len(p.sends()) for p in schedule.programs(r["topology"], r["P"], r["k"]))
        assert r["messages"] == want, r  # every message of the schedule, no more
    verify = [r for r in data["results"] if r["topology"].startswith("verify:")]
    assert {r["P"] for r in verify} == {2, 3, 4, 5, 9}
    assert all(r["max_error"] < 1e-12 for r in verify), verify
    assert (out / "simulate.png").stat().st_size > 0 and (out / "simulate.csv").read_text().startswith("topology,")
    assert "simulator / model" in proc.stdout


def test_one_engine_per_process(simgrid_ok):
    code = ("from hpczeco.drivers import simulate as s\n"
            "j = s.Job('ring', 3, 2, 8, 4, 8, s.Platform())\n"
            "print(s.run_job(j)['time_s'] > 0)\n"
            "try:\n    s.run_job(j)\nexcept RuntimeError as e:\n    print('refused', 'one SimGrid' in str(e))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "refused", "True"]


def test_fit_software_reproduces_the_papers_all_scan():
    from hpczeco.collectives import costmodel as cm
    from hpczeco.drivers.costfit import PAPER_TABLE2

    plat, rms = simulate.fit_software(simulate.Platform(), 1 << 20, 128, 128)
    assert rms < 0.1 and 1e-7 < plat.send < 1e-4 and 1e-6 < plat.call < 1e-3
    intra, inter = plat.link_params()
    for P, row in PAPER_TABLE2.items():
        t, _ = cm.predict_hier("ring", P, 1 << 20, intra, inter, 8)
        assert abs(math.log(t / (row["ring"] * 1e-3))) < 0.25, P

