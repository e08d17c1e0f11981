"""DAAF controller, scheduler and prefill model: fixed traces, sampled measurements, MPI modes."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hpczeco.collectives.agree import CollectiveInputError
from hpczeco.drivers.daaf_demo import ModelConfig, PrefillModel, run_rounds, run_trace, simulate

from hpczeco.daaf import (
    Request,
    WeightController,
    attention,
    exact_attention,
    mass_recall,
    metrics,
    plan,
    plan_from_mask,
    sampled_error,
    serve_mpi,
    utilization,
)
from hpczeco.daaf.controller import daaf_rows, exact_rows, sample_rows
from hpczeco.daaf.reference import allowed_mask

# --------------------------------------------------------------------------- controller


def test_controller_fixed_trace():
    trace = [(0.10, 0.2), (0.10, 0.5), (0.01, 0.9), (0.01, 1.0), (0.01, 1.0), (0.01, 1.0), (0.2, 0.0),
             (0.2, 0.0), (0.2, 0.0), (0.2, 0.0), (0.2, 0.0)]
    want, w = [], 0.5
    for e, u in trace:  # the seed's rule, written out
        w = w + 0.1 * (1 - u) if e > 0.05 else w - 0.05 * u
        w = min(0.8, max(0.3, w))
        want.append(w)
    got = run_trace(trace, error_threshold=0.05)
    np.testing.assert_allclose(got, want, atol=1e-15)
    np.testing.assert_allclose(got[:4], [0.58, 0.63, 0.585, 0.535], atol=1e-12)
    assert got[-1] == 0.8 and min(got) >= 0.3
    assert run_trace([(0.0, 1.0)] * 10) == pytest.approx([0.45, 0.4, 0.35, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3])
    assert run_trace(trace) == run_trace(trace)  # deterministic


def test_controller_bad_input():
    c = WeightController()
    with pytest.raises(ValueError, match="utilization"):
        c.update(0.1, 1.5)
    with pytest.raises(ValueError, match="error"):
        c.update(float("nan"), 0.5)
    with pytest.raises(ValueError, match="w0"):
        WeightController(w0=0.9)
    assert utilization(3.0, 2.0) == 1.0 and utilization(0.5, 2.0) == 0.25
    with pytest.raises(ValueError, match="budget_seconds"):
        utilization(1.0, 0.0)


def test_controller_closed_loop_on_a_text(rng):
    tok = np.tile(np.arange(6), 600)
    tok[1000:1600] = rng.permutation(10_000)[:600]
    tok[2500:2800] = rng.permutation(10_000)[:300]
    H, D = 2, 8
    q, k, v = (rng.standard_normal((1, len(tok), H, D)) for _ in range(3))
    rows = sample_rows(len(tok), 24, seed=1)

    def measure(p):  # deterministic: error of the sampled rows, utilization from the work fraction
        return sampled_error(q, k, v, p, rows), min(1.0, p.work_fraction)

    c = WeightController(error_threshold=1e-3)
    log = run_rounds(c, tok, 4, measure, window=100, local_window=16)
    assert [r["w"] for r in log][0] == 0.5
    for r in log:
        assert r["policy"] == "work-budget" and r["work_fraction"] <= r["w"] + 1e-12
        w_next = r["w"] + 0.1 * (1 - r["utilization"]) if r["error"] > 1e-3 else r["w"] - 0.05 * r["utilization"]
        assert r["w_next"] == pytest.approx(min(0.8, max(0.3, w_next)))
    again = run_rounds(WeightController(error_threshold=1e-3), tok, 4, measure, window=100, local_window=16)
    assert [r["w"] for r in again] == [r["w"] for r in log]


def test_sampled_rows_and_recall(rng):
    T, W = 200, 9
    g = rng.random(T) < 0.1
    p = plan_from_mask(g, W)
    q, k, v = (rng.standard_normal((2, T, 2, 5)) for _ in range(3))
    rows = sample_rows(T, 30, seed=3)
    np.testing.assert_allclose(exact_rows(q, k, v, rows), exact_attention(q, k, v)[:, rows], atol=1e-12)
    np.testing.assert_allclose(daaf_rows(q, k, v, p, rows), attention(q, k, v, p)[:, rows], atol=1e-12)
    assert sampled_error(q, k, v, plan_from_mask(np.ones(T, bool), W), rows) < 1e-12
    err = sampled_error(q, k, v, p, rows)
    o = attention(q, k, v, p)
    assert err > 0 and err == pytest.approx(sampled_error(q, k, v, p, rows, o_daaf=o))
    # recall against a direct computation from the allowed mask
    allowed = allowed_mask(g, W)
    s = np.einsum("bthd,bjhd->bhtj", q, k) * 5**-0.5
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.mean([w[:, :, t, allowed[t]].sum(-1).mean() for t in rows])
    assert mass_recall(q, k, v, p, rows) == pytest.approx(want, abs=1e-12)
    assert mass_recall(q, k, v, plan_from_mask(np.ones(T, bool), W), rows) == pytest.approx(1.0)


# --------------------------------------------------------------------------- scheduler


def test_scheduler_fixed_trace_priority_beats_fcfs():
    reqs = [Request(0, 0.0, 10.0, 0.5, 2.0), Request(1, 0.0, 2.0, 0.5, 1.0), Request(2, 0.0, 3.0, 0.9, 1.0)]
    f = simulate(reqs, 1, "fcfs")
    assert [(s.rid, s.start, s.finish) for s in f.served] == [(0, 0, 2), (1, 2, 3), (2, 3, 4)]
    p = simulate(reqs, 1, "priority")  # t=0: C 0.3 > B 0.25 > A 0.05; t=1: B 0.5 > A 0.056
    assert [(s.rid, s.start, s.finish) for s in p.served] == [(0, 2, 4), (1, 1, 2), (2, 0, 1)]
    mf, mp = metrics(f), metrics(p)
    assert mf["deadlines_met"] == pytest.approx(1 / 3) and mp["deadlines_met"] == 1.0
    assert mp["ttft_p50"] == 2.0 and mf["ttft_p50"] == 3.0 and mp["busy_fraction"] == 1.0


def test_scheduler_invariants(rng):
    reqs = [Request(i, float(a), float(a + d), float(rng.random()), float(c))
            for i, (a, d, c) in enumerate(zip(np.sort(rng.uniform(0, 5, 40)), rng.uniform(1, 8, 40),
                                              rng.uniform(0.1, 1.0, 40)))]
    for pol in ("priority", "fcfs"):
        res = simulate(reqs, 3, pol)
        assert sorted(s.rid for s in res.served) == list(range(40))
        for s in res.served:
            r = reqs[s.rid]
            assert s.start >= r.arrival - 1e-12 and s.finish == pytest.approx(s.start + r.cost)
        for w in range(3):  # a worker serves one request at a time
            mine = sorted((s.start, s.finish) for s in res.served if s.worker == w)
            assert all(b[0] >= a[1] - 1e-12 for a, b in zip(mine, mine[1:]))
        m = metrics(res)
        assert 0 < m["busy_fraction"] <= 1 and m["ttft_p50"] <= m["ttft_p99"]
    with pytest.raises(ValueError, match="deadline"):
        Request(0, 1.0, 0.5, 0.1, 1.0)
    with pytest.raises(ValueError, match="policy"):
        simulate(reqs, 2, "lifo")


@pytest.mark.mpi
def test_serve_mpi_serves_every_request_once(comm):
    reqs = [Request(i, 0.002 * (i % 3), 0.05 + 0.01 * i, 0.1 * (i % 5), 0.003) for i in range(9)]
    ran = []

    def run(r):
        ran.append(r.rid)
        time.sleep(r.cost)

    for pol in ("priority", "fcfs"):
        ran.clear()
        res = serve_mpi(reqs, comm, run, pol)
        assert sorted(s.rid for s in res.served) == list(range(9))
        everyone = comm.allgather(list(ran))
        assert sorted(sum(everyone, [])) == list(range(9))  # each request ran on exactly one rank
        for s in res.served:
            assert s.finish >= s.start >= s.arrival - 1e-9
        m = metrics(res)
        assert m["n"] == 9 and 0 < m["busy_fraction"] <= 1.0 + 1e-9
        assert comm.allgather(m["n"]) == [9] * comm.Get_size()


# --------------------------------------------------------------------------- model


def _small_model() -> PrefillModel:
    return PrefillModel(ModelConfig(vocab_size=500, d_model=24, n_heads=3, head_dim=8, n_layers=2, seed=5))


def test_model_dense_equals_all_global_daaf(rng):
    m = _small_model()
    tok = rng.integers(0, 500, 150)
    a = m.prefill(tok, "dense")
    b = m.prefill(tok, "daaf", plan_from_mask(np.ones(150, bool), 8))
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-6, atol=1e-6)
    assert a.first_token == b.first_token and a.seconds > 0
    with pytest.raises(TypeError, match="plan must be"):
        m.prefill(tok, "daaf")
    with pytest.raises(ValueError, match="vocab_size"):
        m.prefill(np.array([1, 2, 600]), "dense")
    with pytest.raises(ValueError, match="plan covers"):
        m.prefill(tok[:100], "daaf", plan_from_mask(np.ones(150, bool), 8))


@pytest.mark.mpi
def test_model_distributed_equals_one_rank(comm, rng):
    gen = np.random.default_rng(comm.bcast(int(rng.integers(2**62))))
    m = _small_model()
    tok = np.tile(np.arange(5), 40)
    tok[60:110] = gen.integers(0, 500, 50)
    p = plan(tok, window=25, local_window=7)
    for attn in ("daaf", "dense"):
        ref = m.prefill(tok, attn, p)
        for mode in ("sequence", "heads"):
            got = m.prefill(tok, attn, p, comm=comm, mode=mode)
            np.testing.assert_allclose(got.logits, ref.logits, rtol=0, atol=1e-5 * np.abs(ref.logits).max())
            assert got.first_token == ref.first_token


@pytest.mark.mpi
def test_model_bad_tokens_raise_everywhere(comm):
    m = _small_model()
    last = comm.Get_rank() == comm.Get_size() - 1
    tok = np.arange(50) if not last else np.arange(50).astype(float)
    with pytest.raises((CollectiveInputError, TypeError), match="tokens must hold int"):
        m.prefill(tok, "dense", comm=comm)
