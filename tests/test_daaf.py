"""DAAF: planner, attention kernels vs the float64 reference, needle retrieval, bad inputs (serial)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hpczeco.drivers.daaf_demo import tokenize

from hpczeco.daaf import (
    Plan,
    attention,
    attention_pairs,
    exact_attention,
    plan,
    plan_arrays,
    plan_from_mask,
    window_entropy,
    window_starts,
)
from hpczeco.daaf.reference import allowed_mask, attention_reference, exact_attention_reference

# --------------------------------------------------------------------------- planner


def _entropy_bits(x: np.ndarray) -> float:
    _, c = np.unique(x, return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def test_window_entropy_matches_direct_count(rng):
    T, window, stride = 1000, 64, 24
    tok = rng.integers(0, 40, size=T)
    starts = window_starts(T, window, stride)
    assert starts[0] == 0 and starts[-1] == T - window and np.all(np.diff(starts) > 0)
    got = window_entropy(tok, window, stride, vocab_size=40)
    want = [_entropy_bits(tok[s : s + window]) / math.log2(40) for s in starts]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # Miller-Madow adds (m - 1) / (2 N ln 2) bits before normalising
    mm = window_entropy(tok, window, stride, vocab_size=40, bias_correction="miller-madow")
    m = np.array([len(np.unique(tok[s : s + window])) for s in starts])
    want_mm = np.clip((np.array(want) * math.log2(40) + (m - 1) / (2 * window * math.log(2))) / math.log2(40), 0, 1)
    np.testing.assert_allclose(mm, want_mm, atol=1e-12)
    # unbounded vocabulary normalises by log2(window)
    np.testing.assert_allclose(window_entropy(tok, window, stride), np.array(want) * math.log2(40) / 6, atol=1e-12)


def test_window_entropy_extremes():
    assert np.all(window_entropy(np.zeros(100, int), 10) == 0)
    assert np.allclose(window_entropy(np.arange(100), 10), 1.0)


def test_plan_dense_region_in_the_middle(rng):
    window, T = 64, 64 * 12
    tok = np.tile(np.arange(4), T // 4)  # low entropy: 2 bits of log2(64) = 6
    tok[5 * 64 : 7 * 64] = rng.permutation(1000)[: 2 * 64]  # a high-entropy block
    p = plan(tok, window=window, threshold=0.8, local_window=16)
    assert p.policy == "threshold"
    assert p.regions == [(5 * 64, 7 * 64)]
    assert p.n_global == 128 and np.array_equal(np.flatnonzero(p.global_mask), np.arange(320, 448))
    assert p.pairs == int(allowed_mask(p.global_mask, 16).sum())
    assert 0 < p.work_saved < 1 and math.isclose(p.work_saved, 1 - p.pairs / (T * (T + 1) / 2))
    assert p.weights.shape == p.window_starts.shape == p.selected.shape == (12,)
    assert list(np.flatnonzero(p.selected)) == [5, 6]
    # a budget picks the top windows by percentile instead
    pb = plan(tok, window=window, budget=1 / 12, local_window=16)
    assert pb.policy == "budget" and pb.n_global == 64 and pb.regions[0][0] in (320, 384)
    pw = plan(tok, window=window, work_budget=0.5, local_window=16)
    assert pw.policy == "work-budget" and pw.work_fraction <= 0.5
    assert pw.selected[5] and pw.selected[6] and pw.global_mask[320:448].all()  # ranked first
    assert pw.n_global > 128  # then lower-entropy windows (ties: earlier first) while the work fits
    assert plan(tok, window=window, work_budget=0.0, local_window=16).n_global == 0


def test_plan_uniform_stream_falls_back_and_says_why(rng):
    tok = np.tile(np.arange(8), 400)  # like repeated log records: every window scores the same
    p = plan(tok, window=64, local_window=8)
    assert p.policy == "fallback-dense" and "uniform" in p.reason
    assert p.global_mask.all() and p.work_saved == 0
    pb = plan(tok, window=64, local_window=8, policy="budget", fallback_budget=0.25)
    assert pb.policy == "fallback-budget" and "uniform" in pb.reason
    assert 0 < pb.n_global <= 0.25 * len(tok) + 64 and pb.work_saved > 0
    # separable, but below the threshold: never a silent all-local plan
    low = np.tile(np.arange(8), 400)
    low[:64] = 0
    p2 = plan(low, window=64, local_window=8, threshold=0.9)
    assert p2.policy == "fallback-dense" and "threshold" in p2.reason and p2.global_mask.all()


def test_plan_short_text_is_dense():
    p = plan(np.arange(100), window=512)
    assert p.policy == "dense" and "shorter" in p.reason and p.global_mask.all()
    assert p.weights.shape == (1,) and 0 < p.density <= 1


def test_plan_arrays_interface(rng):
    g = rng.random(300) < 0.1
    p = plan_from_mask(g, 7)
    a = plan_arrays(p)
    assert a["global_idx"].dtype == np.int32 and np.array_equal(a["global_idx"], np.flatnonzero(g))
    assert a["is_global_query_mask"].dtype == bool and np.array_equal(a["is_global_query_mask"], g)
    assert a["n_global_before"].dtype == np.int32 and a["n_global_before"].shape == (301,)
    assert a["local_window"] == 7 and a["T"] == 300
    # the documented rule reproduces the allowed mask
    allowed = allowed_mask(g, 7)
    for t in range(300):
        if g[t]:
            keys = set(range(t + 1))
        else:
            lo = max(0, t - 7)
            keys = set(range(lo, t + 1)) | set(a["global_idx"][: a["n_global_before"][lo]].tolist())
        assert keys == set(np.flatnonzero(allowed[t]).tolist())
    assert [tuple(s) for s in a["spans"]] == p.regions


def test_tokenizer_is_stable_and_offline():
    a = tokenize("def f(x):\n    return x + 1  # ok")
    b = tokenize("def f(x):\n    return x + 1  # ok")
    assert a.dtype == np.int32 and np.array_equal(a, b) and a.max() < 32768 and len(a) > 5
    assert np.array_equal(tokenize("hé", mode="byte"), np.array([104, 195, 169]))


# --------------------------------------------------------------------------- attention vs the float64 reference


def _qkv(rng, B, T, H, D, Dv, dtype=np.float64):
    return (rng.standard_normal((B, T, H, D)).astype(dtype), rng.standard_normal((B, T, H, D)).astype(dtype),
            rng.standard_normal((B, T, H, Dv)).astype(dtype))


@pytest.mark.parametrize("T,W", [(1, 0), (7, 3), (130, 16), (300, 0), (333, 64), (257, 400)])
@pytest.mark.parametrize("kind", ["empty", "full", "random", "regions"])
def test_attention_matches_reference(rng, T, W, kind):
    B, H, D, Dv = 2, 3, 8, 5
    g = {"empty": np.zeros(T, bool), "full": np.ones(T, bool), "random": rng.random(T) < 0.15,
         "regions": (np.arange(T) // 40) % 3 == 1}[kind]
    p = plan_from_mask(g, W)
    q, k, v = _qkv(rng, B, T, H, D, Dv)
    scale = float(rng.uniform(0.1, 0.6))
    ref = attention_reference(q, k, v, p, scale)
    np.testing.assert_allclose(attention(q, k, v, p, scale), ref, rtol=0, atol=1e-12)
    o32 = attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), p, scale)
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, ref, rtol=0, atol=2e-5)
    assert p.pairs == attention_pairs(g, W) == int(allowed_mask(g, W).sum())


def test_exact_attention_matches_reference(rng):
    q, k, v = _qkv(rng, 2, 300, 2, 6, 4)
    np.testing.assert_allclose(exact_attention(q, k, v), exact_attention_reference(q, k, v), atol=1e-12)
    full = plan_from_mask(np.ones(300, bool), 5)
    np.testing.assert_allclose(attention(q, k, v, full), exact_attention_reference(q, k, v), atol=1e-12)


def test_attention_on_a_planned_text(rng):
    tok = np.tile(np.arange(4), 150)
    tok[200:300] = rng.permutation(5000)[:100]
    p = plan(tok, window=50, local_window=20)
    assert p.policy == "threshold" and 0 < p.n_global < 600
    q, k, v = _qkv(rng, 1, 600, 2, 8, 8)
    np.testing.assert_allclose(attention(q, k, v, p), attention_reference(q, k, v, p), atol=1e-12)


def test_needle_in_a_key_region_is_retrieved(rng):
    """A key planted deep inside a key region is found by the matching query far outside the window."""
    T, W, H, D = 1200, 32, 2, 16
    g = np.zeros(T, bool)
    g[100:300] = True
    g[600:700] = True
    p = plan_from_mask(g, W)
    q, k, v = _qkv(rng, 1, T, H, D, D)
    q *= 0.3
    k *= 0.3
    for pos in (120, 250, 650):
        u = rng.standard_normal(D)
        u /= np.linalg.norm(u)
        kk, qq, vv = k.copy(), q.copy(), v.copy()
        kk[0, pos, :] = 12 * u
        vv[0, pos, :] = rng.standard_normal((H, D)) * 5
        qq[0, T - 1, :] = 12 * u
        o = attention(qq, kk, vv, p)
        a, b = o[0, T - 1], vv[0, pos]
        cos = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        assert np.all(cos > 0.99), (pos, cos)
    # the same needle outside any key region (and outside the window) is not seen
    kk, qq, vv = k.copy(), q.copy(), v.copy()
    kk[0, 450, :] = 12 * u
    vv[0, 450, :] = rng.standard_normal((H, D)) * 5
    qq[0, T - 1, :] = 12 * u
    o = attention(qq, kk, vv, p)
    assert np.all(np.abs(np.sum(o[0, T - 1] * vv[0, 450], -1)) / np.linalg.norm(vv[0, 450], axis=-1) ** 2 < 0.5)


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_are_named(rng):
    q, k, v = _qkv(rng, 1, 20, 2, 4, 4)
    p = plan_from_mask(np.zeros(20, bool), 4)
    with pytest.raises(ValueError, match="plan covers T=21"):
        attention(q, k, v, plan_from_mask(np.zeros(21, bool), 4))
    with pytest.raises(ValueError, match="^k has shape"):
        attention(q, k[:, :10], v, p)
    with pytest.raises(ValueError, match="^v has shape"):
        attention(q, k, v[:, :, :1], p)
    bad = q.copy()
    bad[0, 3, 1, 2] = np.nan
    with pytest.raises(ValueError, match="q contains NaN"):
        attention(bad, k, v, p)
    with pytest.raises(ValueError, match="v contains NaN"):
        exact_attention(q, k, np.full_like(v, np.inf))
    with pytest.raises(TypeError, match="one dtype"):
        attention(q, k.astype(np.float32), v, p)
    with pytest.raises(TypeError, match="plan must be"):
        attention(q, k, v, np.zeros(20, bool))
    with pytest.raises(ValueError, match="scale"):
        attention(q, k, v, p, scale=-1.0)
    with pytest.raises(TypeError, match="q must have a floating dtype"):
        attention(q.astype(np.int64), k, v, p)
    with pytest.raises(TypeError, match="tokens must hold int"):
        plan([1.5, 2.0, 3.0], window=2)
    with pytest.raises(TypeError, match="tokens must be a sequence of int"):
        plan("some text")
    with pytest.raises(ValueError, match="tokens is empty"):
        plan([])
    with pytest.raises(ValueError, match="text is empty"):
        tokenize("")
    with pytest.raises(ValueError, match="window .* is larger than the text"):
        window_entropy(np.arange(10), 11)
    with pytest.raises(ValueError, match="tokens must be non-negative"):
        plan([1, -2, 3], window=2)
    with pytest.raises(ValueError, match="threshold"):
        plan(np.arange(10), window=2, threshold=1.5)
    with pytest.raises(ValueError, match="policy"):
        plan(np.arange(10), window=2, policy="local")
    with pytest.raises(ValueError, match="vocab_size"):
        window_entropy(np.arange(10), 5, vocab_size=5)
    assert isinstance(p, Plan)


# --------------------------------------------------------------------------- GPU dispatch


@pytest.mark.gpu
def test_gpu_dispatch_matches_the_reference(rng):
    from hpczeco.base.backend import cupy_available

    if not cupy_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    import cupy as cp

    T, W, B, H, D = 300, 16, 2, 3, 64
    g = (np.arange(T) // 40) % 3 == 1
    p = plan_from_mask(g, W)
    q, k, v = _qkv(rng, B, T, H, D, D, np.float32)
    o = attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), p, 0.2)
    assert isinstance(o, cp.ndarray) and o.shape == (B, T, H, D)
    np.testing.assert_allclose(cp.asnumpy(o), attention_reference(q, k, v, p, 0.2), rtol=0, atol=1e-4)
    e = exact_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v))
    np.testing.assert_allclose(cp.asnumpy(e), exact_attention_reference(q, k, v), rtol=0, atol=1e-4)
    bad = cp.asarray(q)
    bad[0, 5, 1, 2] = cp.nan
    with pytest.raises(ValueError, match="q contains NaN"):
        attention(bad, cp.asarray(k), cp.asarray(v), p)
    with pytest.raises(TypeError, match="all be numpy or all CuPy"):
        attention(cp.asarray(q), k, v, p)
