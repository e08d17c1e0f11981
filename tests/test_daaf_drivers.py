"""Smoke tests of the DAAF drivers (`hpczeco prefill`, `hpczeco bench daaf`) at tiny sizes."""

from __future__ import annotations

import json

from hpczeco.daaf.texts import mixed_tokens


def test_prefill_driver_prints_plan_and_ttft(tmp_path, capsys):
    from hpczeco.drivers.prefill import main

    f = tmp_path / "mix.txt"
    f.write_text(mixed_tokens(1500, 0.3, 750, seed=1)[2])
    args = [str(f), "--window", "128", "--local-window", "16", "--threshold", "0.6", "--layers", "1",
            "--d-model", "16", "--heads", "2", "--head-dim", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "policy=" in out and "work saved" in out and "TTFT" in out and "key regions" in out
    assert main(args + ["--dense"]) == 0
    assert "dense causal attention" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["plan"]["policy"] in ("threshold", "fallback-dense") and rec["ttft_s"] > 0
    assert main([str(tmp_path / "missing.txt")]) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main([str(empty)]) == 2
    assert "text is empty" in capsys.readouterr().err


def test_bench_daaf_tiny(tmp_path, capsys):
    from hpczeco.drivers.bench_daaf import main

    out = tmp_path / "bench"
    assert main(["--lengths", "1024", "--repeats", "1", "--requests", "4", "--request-lengths", "256,512",
                 "--rows", "8", "--layers", "1", "--d-model", "16", "--heads", "2", "--head-dim", "8",
                 "--window", "128", "--local-window", "16", "--segment", "512", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "priority" in text and "fcfs" in text
    res = json.loads((out / "daaf.json").read_text())
    r = res["lengths"][0]
    assert r["T"] > 1000 and 0 <= r["work_saved"] < 1 and r["ttft_daaf_s"] > 0 and r["ttft_dense_s"] > 0
    assert r["needles"]["key_region_exact_rate"] == 1.0
    assert (out / "daaf.png").stat().st_size > 1000
    assert set(res["serve"]["results"]) == {"daaf/priority", "daaf/fcfs", "dense/priority", "dense/fcfs"}
