"""Command-line smoke tests: `hpczeco bench scan` under mpiexec (2 ranks), `hpczeco model`, `hpczeco report`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hpczeco.drivers import bench_scan, model, report


def _mpiexec() -> str | None:
    if os.environ.get("MPIEXEC"):
        return os.environ["MPIEXEC"]
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.parametrize("mod", [bench_scan, model, report])
def test_help(mod, capsys):
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_parse_size_and_shape():
    assert bench_scan.parse_size("4K") == 4096 and bench_scan.parse_size("64MiB") == 64 << 20
    assert bench_scan.parse_size("1536") == 1536
    assert bench_scan.state_shape(1 << 20, 4) == (16, 128, 128)  # the design card's 1 MiB state
    assert bench_scan.state_shape(4096, 4) == (1, 8, 128)


def test_model_prints_paper_rows(tmp_path, capsys):
    assert model.main(["--P", "2,8,256", "--gpus-per-node", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0.226 / 0.375" in out and "2.165 / 8.514" in out
    assert "residual: RMS of log(model/paper)" in out and "tree: NOT measured by the paper" in out
    data = json.loads((tmp_path / "model.json").read_text())
    assert [r["P"] for r in data["rows"]] == [2, 8, 256]
    assert all(r["ring"] > 0 and r["tree"] > 0 and r["allgather"] > 0 for r in data["rows"])
    assert (tmp_path / "model.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        model.main(["--link", "warp-drive"])


def test_model_fit_paper_prints_fit_and_residuals(capsys):
    assert model.main(["--P", "8,256,1024", "--fit-paper"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"fit to Table 2 \(RMS log residual ([\d.]+)\)", out)
    assert m and float(m.group(1)) < 0.1, out
    for P in (8, 16, 32, 64, 128, 256):  # every row of the paper's table beside the model
        assert re.search(rf"^\s+{P}\s+[\d.]+\s+[\d.]+\s+[\d.]+", out, re.M), P
    assert "rows past P=256 extrapolate" in out


def test_bench_scan_two_ranks_then_report(tmp_path):
    exe = _mpiexec()
    if exe is None:
        pytest.skip("no mpiexec")
    env = dict(os.environ, HYDRA_LAUNCHER="fork", MPIR_CVAR_CH4_PROGRESS_THROTTLE="true",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    out = tmp_path / "scan"
    cmd = [exe, "-n", "2", sys.executable, "-m", "hpczeco", "bench", "scan", "--sizes", "4K,16K",
           "--repeats", "3", "--warmup", "1", "--blocks", "2", "--no-calibrate", "--out", str(out),
           "--overlap-ms", "0.5", "--overlap-size", "16K"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fastest per size" in proc.stdout
    data = json.loads((out / "scan_P2.json").read_text())
    assert data["P"] == 2
    labels = {r["label"] for r in data["results"]}
    assert labels == {"ring", "ring/k=2", "tree", "allgather", "serial", "exscan", "ptree", "ptree/k=2"}
    assert all(r["median_s"] > 0 and r["model_s"] > 0 for r in data["results"])
    assert {"scan only", "poll", "thread"} <= set(data["overlap"])
    assert (out / "scan_P2.csv").read_text().startswith("P,label,")
    assert (out / "scan_P2.png").stat().st_size > 0
    rep = tmp_path / "report"
    assert report.main(["--in", str(out), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "## P = 2" in md and "scan_over_p.png" in md
    assert "## Measured / model" in md and "states <= 64 KiB: worst measured/model" in md and "## Refit" in md
    assert all(r["times_s"] and len(r["times_s"]) == r["repeats"] and r["start_median_s"] > 0 for r in data["results"])
    assert (rep / "scan_sizes.png").stat().st_size > 0 and (rep / "scan_over_p.png").stat().st_size > 0
