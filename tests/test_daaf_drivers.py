"""Smoke tests of the DAAF drivers (`hpczeco prefill`, `hpczeco bench daaf`) at tiny sizes."""

from __future__ import annotations

import json

from hpczeco.drivers.daaf_demo import mixed_tokens


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


def test_prefill_refuses_binary_input_and_labels_the_logits(tmp_path, capsys):
    from hpczeco.drivers.prefill import main

    small = ["--layers", "1", "--d-model", "16", "--heads", "2", "--head-dim", "8"]
    binary = tmp_path / "a.out"
    binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 4)
    assert main([str(binary), *small]) == 2
    err = capsys.readouterr().err
    assert f"hpczeco prefill: refusing to start: {binary} is not UTF-8 text (byte 0x80 at offset 135 is invalid " \
           "UTF-8): a binary file? prefill reads text files only" in err, err
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"valid UTF-8 text\x00with a NUL byte")
    assert main([str(nul), *small]) == 2
    assert "is not text: it holds a NUL byte (at character 16" in capsys.readouterr().err
    text = tmp_path / "t.txt"
    text.write_text(mixed_tokens(600, 0.3, 300, seed=2)[2])
    assert main([str(text), *small]) == 0
    out = capsys.readouterr().out
    assert "first token id" not in out and "last-position logits checksum sum " in out and "not a prediction" in out
    assert main([str(text), *small, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["logits_checksum"].startswith("sum ") and ", norm " in rec["logits_checksum"]


def test_bench_daaf_verdict_needs_separate_ranges():
    from hpczeco.drivers.bench_daaf import verdict

    assert verdict([1.0, 1.1, 1.2], [0.5, 0.6, 0.7]) == "DAAF faster"
    assert verdict([0.5, 0.6], [1.0, 0.9]) == "dense faster"
    assert verdict([1.0, 0.6, 0.8], [0.7, 0.9, 0.65]) == "no clear winner (ranges overlap)"
    assert verdict([1.0], [0.5]) == "DAAF faster (1 run each: no spread)"


def test_bench_daaf_tiny(tmp_path, capsys):
    from hpczeco.drivers.bench_daaf import main

    out = tmp_path / "bench"
    assert main(["--lengths", "1024", "--repeats", "1", "--requests", "4", "--request-lengths", "256,512",
                 "--rows", "8", "--layers", "1", "--d-model", "16", "--heads", "2", "--head-dim", "8",
                 "--window", "128", "--local-window", "16", "--segment", "512", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "priority" in text and "fcfs" in text
    assert "legend:" in text and "needles in key regions" in text and "err L0" not in text and "tok=" not in text
    r0 = json.loads((out / "daaf.json").read_text())["lengths"][0]
    lo, hi = r0["ttft_daaf_range_s"]
    assert lo <= r0["ttft_daaf_s"] <= hi and f"[{lo:.3f}-{hi:.3f}]" in text and r0["verdict"] in text
    res = json.loads((out / "daaf.json").read_text())
    r = res["lengths"][0]
    assert r["T"] > 1000 and 0 <= r["work_saved"] < 1 and r["ttft_daaf_s"] > 0 and r["ttft_dense_s"] > 0
    assert r["needles"]["key_region_exact_rate"] == 1.0
    assert (out / "daaf.png").stat().st_size > 1000
    assert set(res["serve"]["results"]) == {"daaf/priority", "daaf/fcfs", "dense/priority", "dense/fcfs"}
