"""``hpczeco bench daaf-quality`` on the CPU: the tiny model trains deterministically, the retrieval task is what
it claims, every method's plan is the rule it names (same budget across baselines, the oracle's top-attended
keys, DAAF's planner mask), attention through a plan equals the float64 reference, and the evaluation runs end
to end at tiny lengths with finite perplexities."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hpczeco.drivers import daaf_lm as lm  # noqa: E402
from hpczeco.drivers import daaf_quality as dq  # noqa: E402

from hpczeco.daaf.planner import attention_pairs, plan, plan_from_mask  # noqa: E402
from hpczeco.daaf.reference import attention_reference  # noqa: E402

TINY = lm.PRESETS["tiny"]
S = dq.DaafSettings(window=64, threshold=0.8, local_window=16, fallback_budget=0.25, global_layers=1,
                    continuation=64)


@pytest.fixture(scope="module")
def corpus():
    return lm.load_corpus_split(400_000, 4)


def _ctx_tokens(rng, C: int) -> np.ndarray:
    """Low-entropy bytes with a few high-entropy stretches, so the windows' entropies differ."""
    tok = rng.integers(97, 101, C)
    for a in rng.choice(np.arange(0, C - 40, 40), 3, replace=False):
        tok[a : a + 40] = rng.integers(0, 256, 40)
    return tok.astype(np.int64)


def test_tiny_training_is_deterministic(corpus):
    cfg = replace(TINY.train, seq=64, long_seq=128, batch_tokens=128, steps=4, seconds=None)
    runs = []
    for _ in range(2):
        model = lm.build_model(TINY.model, 5)
        before = model.head.weight.detach().clone()
        info = lm.train(model, corpus.train, cfg, log=lambda s: None)
        runs.append((info, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        assert not torch.equal(before, model.head.weight)  # it trained
    (a, wa), (b, wb) = runs
    assert a["steps"] == b["steps"] == 4 and a["bound_by"] == "steps"
    assert [c["loss"] for c in a["curve"]] == [c["loss"] for c in b["curve"]]
    assert math.isfinite(a["final_loss"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["tokens_by_phase"]["long"] > 0 and a["tokens_by_phase"]["short"] > 0  # both phases ran


def test_corpus_split_by_file_and_fallback_to_site_packages(tmp_path, monkeypatch):
    full = lm.load_corpus_split(300_000, 4)
    assert full.info["roots"] == ["stdlib"] and full.heldout.size > 0 and full.train.size > 3 * full.heldout.size
    # an image without the stdlib's sources: the *.py files of site-packages follow
    for name in ("a.py", "b.py", "c.py", "d.py"):
        (tmp_path / name).write_bytes(name.encode() * 50)
    real = lm.iter_corpus_files
    monkeypatch.setattr(lm, "iter_corpus_files", lambda root=None: iter(()) if root is None else real(root))
    monkeypatch.setattr(lm.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    c = lm.load_corpus_split(None, 4, min_bytes=1)
    assert c.info["roots"] == ["stdlib", str(tmp_path)] and c.info["files"] == 4
    assert c.heldout.tobytes() == b"c.py" * 50  # file index 2 of every 4
    assert c.train.tobytes() == b"a.py" * 50 + b"b.py" * 50 + b"d.py" * 50
    monkeypatch.setattr(lm.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="no corpus"):
        lm.load_corpus_split(None, 4)


def test_save_and_load_round_trip(tmp_path):
    model = lm.build_model(TINY.model, 3)
    path = lm.save_weights(model, tmp_path / "m", {"train": {"steps": 0}})
    back, meta = lm.load_weights(path)
    assert meta["train"]["steps"] == 0
    tok = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        assert torch.equal(model(tok), back(tok))
    with pytest.raises(ValueError, match="no saved model"):
        lm.load_weights(tmp_path / "missing")


def test_retrieval_task_is_what_it_claims(corpus, rng):
    fmt = lm.KV
    doc = lm.retrieval_doc(corpus.heldout, 100, 1024, rng, 3, 4, fmt)
    b = doc.tokens.astype(np.uint8).tobytes()
    assert doc.tokens.size == 1024 and doc.context == 1024 - 7 * fmt.line_len
    assert b[doc.context - 1 : doc.context] == b"\n"
    assert sorted(q["kind"] for q in doc.queries) == ["block"] * 3 + ["scatter"] * 4
    for q in doc.queries:
        d, a = q["def_value"], q["ask_value"]
        assert b[d - fmt.value_offset : d + fmt.val_len + 1] == fmt.define(q["key"].encode(), q["value"].encode())
        assert b[a - fmt.value_offset : a + fmt.val_len + 1] == fmt.ask(q["key"].encode(), q["value"].encode())
        assert d + fmt.val_len <= doc.context <= a
    seq = lm.kv_training_sequence(corpus.train, 2049, rng, fmt)
    text = seq.tobytes()
    assert seq.size == 2049
    for line in [x for x in text.split(b"\n") if x.startswith(b"#ask ")]:
        key = line[5 : 5 + fmt.key_len]
        at = text.index(line)
        assert b"#def " + key + b"=" + line[fmt.value_offset :] in text[:at]  # defined earlier, same value
    batch = lm.training_batch(corpus.train, 128, 3, rng, 0.5)
    assert batch.shape == (3, 129) and batch.dtype == np.int64 and batch.max() < 256


def test_method_plans_are_the_rules_they_name(rng):
    C, T = 600, 700
    ctx = _ctx_tokens(rng, C)
    scores = rng.random(C) ** 4
    plans = dq.method_plans(ctx, T, S, scores, rng)
    assert set(plans) == set(dq.METHODS)
    src = plan(ctx, S.window, S.threshold, S.local_window, policy="budget", fallback_budget=S.fallback_budget,
               vocab_size=256)
    d = plans["daaf"]
    assert np.array_equal(d.plan.global_mask[:C], src.global_mask) and not d.plan.global_mask[C:].any()
    assert d.source.policy == src.policy and np.array_equal(d.source.global_mask, src.global_mask)
    assert plans["daaf-gl"].exact_layers == S.global_layers and plans["daaf"].exact_layers == 0
    G = int(src.global_mask.sum())
    assert G > 0
    for name in ("sinks", "random", "oracle", "oracle-tok", "daaf", "daaf-gl"):  # the same budget
        g = plans[name].plan.global_mask
        assert g.size == T and int(g.sum()) == G and not g[C:].any(), name
    for name, mp in plans.items():
        if mp.plan is None:
            assert name == "exact"
            continue
        W = mp.plan.local_window
        assert W == (S.local_window if name != "window-wide" else mp.info["window"])
        assert mp.plan.pairs == attention_pairs(mp.plan.global_mask, W)
    assert plans["exact-lib"].plan.global_mask.all() and not plans["window"].plan.global_mask.any()
    g = plans["sinks"].plan.global_mask
    assert g[:G].all() and not g[G:].any()
    # random: whole blocks of the grid, but the last one taken
    blocks = dq.block_grid(C, S.window)
    part = [int(plans["random"].plan.global_mask[a:b].sum()) for a, b in blocks]
    assert sum(1 for n, (a, b) in zip(part, blocks) if 0 < n < b - a) <= 1
    # the oracles: the highest-scoring blocks / tokens
    g = plans["oracle-tok"].plan.global_mask[:C]
    assert scores[g].min() >= scores[~g].max()
    g = plans["oracle"].plan.global_mask[:C]
    sums = np.array([scores[a:b].sum() for a, b in blocks])
    full = np.array([g[a:b].all() for a, b in blocks])
    touched = np.array([g[a:b].any() for a, b in blocks])
    assert sums[full].min() >= sums[~touched].max()
    # window-wide: the window whose pairs are closest to DAAF's
    Ww = plans["window-wide"].info["window"]
    zero = np.zeros(T, bool)
    best = abs(attention_pairs(zero, Ww) - d.plan.pairs)
    assert best <= abs(attention_pairs(zero, Ww + 1) - d.plan.pairs)
    assert Ww == 0 or best <= abs(attention_pairs(zero, Ww - 1) - d.plan.pairs)
    # the budget curve: DAAF's percentile plan, and the baselines at its number of global tokens
    curve = dq.method_plans(ctx, T, S, scores, rng, dq.CURVE_METHODS, budget=0.5)
    src = plan(ctx, S.window, S.threshold, S.local_window, budget=0.5, vocab_size=256)
    assert np.array_equal(curve["daaf"].plan.global_mask[:C], src.global_mask)
    assert {int(curve[m].plan.global_mask.sum()) for m in ("sinks", "random", "oracle", "oracle-tok")} == \
        {int(src.global_mask.sum())}
    with pytest.raises(ValueError, match="oracle_scores"):
        dq.method_plans(ctx, T, S, None, rng, ("oracle",))


@pytest.mark.parametrize("backend", ["cpu", "dense"])
def test_attention_through_the_plan_equals_the_float64_reference(rng, backend):
    C, T, H, D = 250, 300, 3, 16
    plans = dq.method_plans(_ctx_tokens(rng, C), T, S, rng.random(C), rng)
    q, k, v = (rng.standard_normal((1, T, H, D)) for _ in range(3))
    runner = dq.Runner(None, "cpu", backend)
    for name, mp in plans.items():
        if mp.plan is None:
            continue
        ref = attention_reference(q, k, v, mp.plan)
        got = runner.planned(mp.plan)(*(torch.from_numpy(x).float() for x in (q, k, v)))
        err = float(np.abs(got.double().numpy() - ref).max() / np.abs(ref).max())
        assert err < 1e-5, (name, err)
    assert runner.calls[backend] == len(plans) - 1 and runner.fallback is None
    # in float64 the dense masked attention is the reference itself
    g = plans["daaf"].plan.global_mask
    got = dq.dense_masked_attention(*(torch.from_numpy(x) for x in (q, k, v)), g, S.local_window, block=64)
    ref = attention_reference(q, k, v, g, local_window=S.local_window)
    assert np.abs(got.numpy() - ref).max() < 1e-12


def test_oracle_mass_is_the_exact_attention_beyond_the_window(rng):
    T, H, D, C, W = 90, 2, 8, 70, 10
    q, k = rng.standard_normal((1, T, H, D)), rng.standard_normal((1, T, H, D))
    rows = np.arange(C - 1, T - 1)
    got = dq.oracle_mass(torch.from_numpy(q), torch.from_numpy(k), rows, C, W, chunk=7)
    want = np.zeros(C)
    for t in rows:
        for h in range(H):
            s = k[0, : t + 1, h] @ q[0, t, h] / math.sqrt(D)
            p = np.exp(s - s.max())
            p /= p.sum()
            for j in range(min(C, t + 1)):
                if t - j > W:
                    want[j] += p[j]
    assert np.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_runner_falls_back_to_dense_and_says_why(rng):
    notes = []
    runner = dq.Runner(None, "cpu", "gpu", log=notes.append)  # no CUDA tensors here: the GPU kernel refuses
    p = plan_from_mask(rng.random(40) < 0.2, 4)
    q, k, v = (torch.randn(1, 40, 2, 8) for _ in range(3))
    out = runner.planned(p)(q, k, v)
    ref = attention_reference(q.double().numpy(), k.double().numpy(), v.double().numpy(), p)
    assert np.abs(out.double().numpy() - ref).max() < 1e-5
    assert runner.backend == "dense" and runner.fallback and "failed" in notes[0]


def test_evaluation_records_have_equal_budgets_and_finite_metrics(corpus):
    model = lm.build_model(TINY.model, 1).eval()
    docs = dq.make_docs(corpus.heldout, 320, S, 1, 1, seed=3, n_block=1, n_scatter=1)
    assert [d.kind for d in docs] == ["text", "retrieval"] and docs[0].C == 320 - S.continuation
    runner = dq.Runner(model, "cpu", "cpu")
    recs = dq.evaluate(runner, docs, S, dq.METHODS, (None, 0.5), seed=3)
    for di in range(len(docs)):
        for budget in (None, 0.5):
            n = {r["method"]: r["n_global"] for r in recs if r["doc"] == di and r["budget"] == budget}
            same = {n[m] for m in ("sinks", "random", "oracle", "oracle-tok", "daaf") if m in n}
            assert len(same) == 1 and same.pop() > 0, (di, budget, n)
    rows = dq.aggregate(recs)
    main = {r["method"]: r for r in rows if r["budget"] is None}
    assert set(main) == set(dq.METHODS)
    for r in rows:
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and 0 <= r["retrieval_acc"] <= 1
        assert 0 <= r["first_token_agree"] <= 1 and r["n_in"] + r["n_out"] == 2
    assert main["exact"]["ppl_increase_pct"] == 0 and main["exact"]["top1_agree"] == 1
    assert abs(main["exact-lib"]["ppl_increase_pct"]) < 1e-3  # the library's all-global plan is exact attention
    assert main["exact-lib"]["top1_agree"] > 0.99 and main["window"]["global_frac"] == 0


def test_bench_command_end_to_end(tmp_path, capsys):
    from hpczeco.drivers.bench_daaf_quality import main

    out = tmp_path / "dq"
    assert main(["--preset", "tiny", "--device", "cpu", "--steps", "2", "--seq", "64", "--long-seq", "128",
                 "--batch-tokens", "128", "--max-bytes", "400000", "--lengths", "320", "--docs", "1",
                 "--retrieval-docs", "1", "--pairs", "1,1", "--continuation", "64", "--curve-length", "320",
                 "--budgets", "0.25,0.5", "--save", str(tmp_path / "w"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1].startswith("wall ")
    assert "quality (held-out" in text and "budget curve" in text and "verdicts:" in text
    res = json.loads((out / "daaf_quality.json").read_text())
    assert {r["method"] for r in res["quality"]} == set(dq.METHODS)
    assert {r["method"] for r in res["curve"]} == {"exact", *dq.CURVE_METHODS}
    assert all(math.isfinite(r["ppl"]) for r in res["quality"] + res["curve"])
    assert res["train"][0]["steps"] == 2 and res["info"]["backend"] == "cpu"
    assert (out / "daaf_quality.png").is_file() and "failed" not in str(res["info"].get("plot"))
    # the saved weights evaluate again without training
    assert main(["--preset", "tiny", "--device", "cpu", "--load", str(tmp_path / "w"), "--max-bytes", "400000",
                 "--lengths", "320", "--docs", "1", "--retrieval-docs", "0", "--continuation", "64",
                 "--curve-length", "0", "--methods", "daaf", "--out", str(out / "again")]) == 0
    again = json.loads((out / "again" / "daaf_quality.json").read_text())
    first = {r["method"]: r["ppl"] for r in res["quality"]}
    assert {r["method"] for r in again["quality"]} == {"exact", "daaf"}
    assert abs(again["quality"][0]["ppl"] - first["exact"]) / first["exact"] < 1e-9


def test_bench_refuses_options_that_cannot_work(capsys):
    from hpczeco.drivers import bench_daaf_quality as bq

    assert bq._methods() == dq.METHODS  # the parser's list (no torch import for --help) is the evaluation's
    for argv, msg in ((["--pairs", "3"], "--pairs must be two counts"), (["--lengths", "100"], "must exceed"),
                      (["--budgets", "0,0.5"], "--budgets must lie")):
        with pytest.raises(ValueError, match=msg):
            bq.main(["--device", "cpu", *argv])
    with pytest.raises(SystemExit) as exc:  # a number out of range is a usage error where it enters
        bq.main(["--device", "cpu", "--threshold", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --threshold: must be a finite number >= 0 and <= 1" in err


def test_gpu_kernel_choice_falls_back_with_reasons(monkeypatch):
    import threading

    from hpczeco.drivers import bench_daaf_quality as bq

    class Rec:
        info: dict = {}

    notes = []
    done = threading.Thread(target=lambda: None)
    done.start()
    # no CUDA here: the check in this process records why, and the dense masked attention takes over
    records, ok = bq.probe_kernels(["auto", "tc2"], 2, 16)
    assert ok is None and records[0]["error"]
    state = {"done": True, "thread": done, "probe": {"error": "probe process exited 1: boom"}}
    assert bq._choose_kernel(state, "auto", notes.append, Rec(), 2, 16) == ("dense", "auto")
    assert any("boom" in n for n in notes) and Rec.info["gpu_probe"] == records
    # the child's verdict: nothing passed -> dense without another check; a kernel passed -> checked here once
    state = {"done": True, "thread": done, "probe": {"records": [{"impl": "auto", "ok": False}], "ok": None}}
    assert bq._choose_kernel(state, "auto", notes.append, Rec(), 2, 16) == ("dense", "auto")
    asked = []
    monkeypatch.setattr(bq, "probe_kernels", lambda impls, H, D: (asked.append(list(impls)) or [], impls[0]))
    state = {"done": True, "thread": done, "probe": {"records": [], "ok": "tc2"},
             "prebuild": {"error": "no nvcc"}}
    assert bq._choose_kernel(state, "auto", notes.append, Rec(), 2, 16) == ("gpu", "tc2") and asked == [["tc2"]]
    state = {"done": True, "thread": done, "probe": {"records": [{"impl": None, "error": "no device"}], "ok": None}}
    assert bq._choose_kernel(state, "auto", notes.append, Rec(), 2, 16) == ("gpu", "auto")  # set-up failed there
    assert asked[-1] == ["auto", "tc2"]
    state = {"done": False, "thread": done}  # the child never answered: both kernels checked here
    assert bq._choose_kernel(state, "auto", notes.append, Rec(), 2, 16, wait=0.01) == ("gpu", "auto")
    assert asked[-1] == ["auto", "tc2"]
