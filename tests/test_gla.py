"""hpczeco.gla: chunked forward/backward against the float64 references, finite differences, edge cases,
input validation and the device dispatch seam. Serial tests (no MPI); fresh random inputs (``rng``)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from helpers import log_gates, rel

import hpczeco.gla.chunk as chunk_mod
from hpczeco.gla import chunk_gla, chunk_gla_bwd, recurrent_gla, recurrent_gla_bwd, validate_gla_inputs

pytestmark = pytest.mark.filterwarnings("error")  # no overflow/invalid RuntimeWarnings, even for strong decays

TOL = {np.float64: 1e-10, np.float32: 1e-4}


def make(rng, B, T, H, K, V, kind="logsigmoid", h0=True, grads=False):
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    v = rng.standard_normal((B, T, H, V))
    g = log_gates(rng, (B, T, H, K), kind)
    out = dict(q=q, k=k, v=v, g=g, h0=rng.standard_normal((B, H, K, V)) if h0 else None)
    if grads:
        out["do"] = rng.standard_normal((B, T, H, V))
        out["dht"] = rng.standard_normal((B, H, K, V)) if h0 else None
    return out


def cast(x, dt):
    return None if x is None else x.astype(dt)


# ------------------------------------------------------------------------------------------- forward

FWD_CASES = [
    # B, T, H, K, V, chunk_size
    (2, 100, 3, 16, 8, 16),
    (1, 257, 2, 32, 32, 64),
    (3, 64, 2, 8, 12, 64),
    (2, 75, 1, 5, 3, 7),
    (1, 40, 2, 4, 6, 100),
    (2, 130, 2, 16, 16, 40),
]


@pytest.mark.parametrize("kind", ["strong", "weak", "mixed", "logsigmoid"])
@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: "x".join(map(str, c)))
def test_forward_matches_recurrent(rng, case, dt, kind):
    B, T, H, K, V, cs = case
    use_h0 = bool(rng.integers(2)) if kind != "strong" else True
    d = make(rng, B, T, H, K, V, kind, h0=use_h0)
    scale = None if rng.random() < 0.5 else float(rng.uniform(0.1, 2.0))
    o_ref, s_ref = recurrent_gla(d["q"], d["k"], d["v"], d["g"], scale=scale, initial_state=d["h0"],
                                 output_final_state=True)  # fmt: skip
    c = [cast(d[n], dt) for n in ("q", "k", "v", "g", "h0")]
    o, s = chunk_gla(*c[:4], scale=scale, initial_state=c[4], output_final_state=True, chunk_size=cs)
    assert o.dtype == dt and o.shape == (B, T, H, V)
    assert s.dtype == dt and s.shape == (B, H, K, V)
    assert rel(o, o_ref) < TOL[dt], rel(o, o_ref)
    assert rel(s, s_ref) < TOL[dt], rel(s, s_ref)
    o2, none = chunk_gla(*c[:4], scale=scale, initial_state=c[4], chunk_size=cs)
    assert none is None and np.array_equal(o, o2)


@pytest.mark.parametrize("limit", [0.0, "default", 1e30])
def test_forward_both_diagonal_paths(rng, monkeypatch, limit):
    """Every diagonal block exact-pairwise (limit 0), factored (huge limit, weak gates only), or the default."""
    if limit != "default":
        monkeypatch.setitem(chunk_mod.SPAN_LIMIT, np.dtype(np.float64), limit)
        monkeypatch.setitem(chunk_mod.SPAN_LIMIT, np.dtype(np.float32), limit)
    kind = "weak" if limit == 1e30 else "mixed"
    d = make(rng, 2, 150, 2, 16, 8, kind)
    o_ref, s_ref = recurrent_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True)
    for dt in (np.float64, np.float32):
        c = [cast(d[n], dt) for n in ("q", "k", "v", "g", "h0")]
        o, s = chunk_gla(*c[:4], initial_state=c[4], output_final_state=True, chunk_size=48)
        assert rel(o, o_ref) < TOL[dt] and rel(s, s_ref) < TOL[dt]


@pytest.mark.parametrize("group_tokens", [1, 40, 10_000])
def test_streaming_groups_and_threads(rng, monkeypatch, group_tokens):
    """Several chunk groups (1 chunk each, a few, or one), partial last group, 1 or 3 threads: results agree
    with the reference, and bit-for-bit across thread counts."""
    monkeypatch.setattr(chunk_mod, "GROUP_TOKENS", group_tokens)
    d = make(rng, 2, 203, 3, 8, 6, "mixed", grads=True)
    ref_o, ref_s = recurrent_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True)
    ref_b = recurrent_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"])
    runs = []
    for threads in ("1", "3"):
        monkeypatch.setenv("HPCZECO_GLA_THREADS", threads)
        o, s = chunk_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True,
                         chunk_size=16)  # fmt: skip
        grads = chunk_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"],
                              chunk_size=16)  # fmt: skip
        assert rel(o, ref_o) < 1e-10 and rel(s, ref_s) < 1e-10
        for x, r in zip(grads, ref_b):
            assert rel(x, r) < 1e-10
        runs.append((o, s, *grads))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_noncontiguous_inputs(rng):
    """Views (transposed/strided inputs) give the same result as contiguous copies."""
    d = make(rng, 2, 50, 2, 4, 3, grads=True)
    big = {n: np.repeat(x, 2, axis=-1)[..., ::2] for n, x in d.items() if x is not None}  # strided views
    o1, s1 = chunk_gla(big["q"], big["k"], big["v"], big["g"], initial_state=big["h0"], output_final_state=True)
    o2, s2 = chunk_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True)
    assert np.array_equal(o1, o2) and np.array_equal(s1, s2)


def test_forward_very_strong_decay_is_safe(rng):
    """Gates far beyond -8 (up to -1000 per token): finite, no warnings, still equal to the reference."""
    d = make(rng, 1, 200, 2, 8, 8, "weak")
    d["g"] = -1000.0 * rng.random(d["g"].shape)
    o_ref, s_ref = recurrent_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True)
    for dt in (np.float64, np.float32):
        c = [cast(d[n], dt) for n in ("q", "k", "v", "g", "h0")]
        o, s = chunk_gla(*c[:4], initial_state=c[4], output_final_state=True)
        assert np.isfinite(o).all() and np.isfinite(s).all()
        assert rel(o, o_ref) < TOL[dt] and rel(s, s_ref) < TOL[dt]


def test_forward_float16(rng):
    d = make(rng, 2, 90, 2, 16, 16)
    c = [cast(d[n], np.float16) for n in ("q", "k", "v", "g")]
    h0 = cast(d["h0"], np.float32)  # half inputs accept a float32 state
    o_ref, s_ref = recurrent_gla(*[x.astype(np.float64) for x in c], initial_state=h0.astype(np.float64),
                                 output_final_state=True)  # fmt: skip
    o, s = chunk_gla(*c, initial_state=h0, output_final_state=True, chunk_size=32)
    assert o.dtype == np.float16 and s.dtype == np.float32
    assert rel(o, o_ref) < 2e-3 and rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("shape,cs", [((1, 9, 2, 1, 1), 1), ((2, 13, 1, 3, 2), 1), ((1, 5, 1, 2, 3), 1000)])
def test_tiny_dims_and_chunks(rng, shape, cs):
    """K = V = 1, chunk_size 1 (one token per chunk) and a chunk far longer than T."""
    d = make(rng, *shape, "mixed", grads=True)
    o_ref, s_ref = recurrent_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True)
    o, s = chunk_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True, chunk_size=cs)
    assert rel(o, o_ref) < 1e-12 and rel(s, s_ref) < 1e-12
    refs = recurrent_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"])
    grads = chunk_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"], chunk_size=cs)
    for x, r in zip(grads, refs):
        assert rel(x, r) < 1e-12


def test_empty_batch_or_heads(rng):
    for B, H in ((0, 2), (2, 0)):
        d = make(rng, B, 4, H, 3, 2, grads=True)
        o, s = chunk_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True)
        assert o.shape == (B, 4, H, 2) and s.shape == (B, H, 3, 2)
        grads = chunk_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"])
        assert [x.shape for x in grads] == [(B, 4, H, 3)] * 2 + [(B, 4, H, 2), (B, 4, H, 3), (B, H, 3, 2)]


def test_recurrent_returns_input_dtype(rng):
    d = make(rng, 1, 5, 1, 3, 2)
    o, s = recurrent_gla(*[cast(d[n], np.float32) for n in ("q", "k", "v", "g")], output_final_state=True)
    assert o.dtype == np.float32 and s.dtype == np.float32


@pytest.mark.parametrize("h0", [True, False])
def test_T0_and_T1(rng, h0):
    for T in (0, 1):
        d = make(rng, 2, T, 3, 4, 5, h0=h0, grads=True)
        for dt in (np.float64, np.float32):
            c = {n: cast(x, dt) for n, x in d.items()}
            o, s = chunk_gla(c["q"], c["k"], c["v"], c["g"], initial_state=c["h0"], output_final_state=True)
            o_ref, s_ref = recurrent_gla(d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"],
                                         output_final_state=True)  # fmt: skip
            assert o.shape == (2, T, 3, 5) and o.dtype == dt and s.shape == (2, 3, 4, 5) and s.dtype == dt
            assert rel(o, o_ref) < TOL[dt] and rel(s, s_ref) < TOL[dt]
            if T == 0:
                assert np.array_equal(s, c["h0"] if h0 else np.zeros((2, 3, 4, 5)))
            grads = chunk_gla_bwd(c["q"], c["k"], c["v"], c["g"], c["do"], initial_state=c["h0"], dht=c["dht"])
            refs = recurrent_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"])
            for name, x, r in zip(("dq", "dk", "dv", "dg", "dh0"), grads, refs):
                assert x.shape == r.shape, name
                assert rel(x, r) < TOL[dt], (T, name, rel(x, r))
            if T == 0:
                assert np.array_equal(grads[4], c["dht"] if h0 else np.zeros((2, 3, 4, 5)))


# ------------------------------------------------------------------------------------------- backward


def _loss_chunk(q, k, v, g, h0, do, dht, scale, cs):
    o, s = chunk_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, chunk_size=cs)
    return float((o * do).sum() + (s * dht).sum())


@pytest.mark.parametrize("kind,cs", [("logsigmoid", 4), ("mixed", 5), ("pairwise", 16)])
def test_backward_finite_differences(rng, monkeypatch, kind, cs):
    """All five gradients of sum(o * do) + sum(S_T * dht) against central differences of chunk_gla (float64)."""
    if kind == "pairwise":  # force the exact pairwise diagonal blocks in both passes
        monkeypatch.setitem(chunk_mod.SPAN_LIMIT, np.dtype(np.float64), 0.0)
        kind = "mixed"
    B, T, H, K, V = 1, 11, 2, 3, 2
    d = make(rng, B, T, H, K, V, kind, grads=True)
    d["g"] = np.minimum(d["g"], -1e-2)  # keep g - eps <= g + eps <= 0
    scale = float(rng.uniform(0.3, 1.5))
    args = [d[n] for n in ("q", "k", "v", "g", "h0")]
    grads = chunk_gla_bwd(*args[:4], d["do"], scale=scale, initial_state=args[4], dht=d["dht"], chunk_size=cs)
    eps = 1e-6
    for idx, name in enumerate(("dq", "dk", "dv", "dg", "dh0")):
        x = args[idx]
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[i] += eps
            xm[i] -= eps
            lp = _loss_chunk(*[xp if j == idx else a for j, a in enumerate(args)], d["do"], d["dht"], scale, cs)
            lm = _loss_chunk(*[xm if j == idx else a for j, a in enumerate(args)], d["do"], d["dht"], scale, cs)
            num[i] = (lp - lm) / (2 * eps)
        assert rel(grads[idx], num) < 1e-6, (name, rel(grads[idx], num))


def test_reference_backward_finite_differences(rng):
    """The float64 reference backward is itself checked against central differences of recurrent_gla."""
    d = make(rng, 1, 6, 1, 2, 3, "logsigmoid", grads=True)
    d["g"] = np.minimum(d["g"], -1e-2)
    args = [d[n] for n in ("q", "k", "v", "g", "h0")]
    grads = recurrent_gla_bwd(*args[:4], d["do"], initial_state=args[4], dht=d["dht"])

    def loss(a):
        o, s = recurrent_gla(*a[:4], initial_state=a[4], output_final_state=True)
        return float((o * d["do"]).sum() + (s * d["dht"]).sum())

    for idx in range(5):
        x = args[idx]
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[i] += 1e-6
            xm[i] -= 1e-6
            num[i] = (loss([xp if j == idx else a for j, a in enumerate(args)])
                      - loss([xm if j == idx else a for j, a in enumerate(args)])) / 2e-6  # fmt: skip
        assert rel(grads[idx], num) < 1e-6


BWD_CASES = [
    (2, 200, 2, 16, 8, 64),
    (1, 150, 3, 8, 16, 32),
    (2, 97, 1, 12, 5, 16),
]


@pytest.mark.parametrize("kind", ["strong", "weak", "mixed", "logsigmoid"])
@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: "x".join(map(str, c)))
def test_backward_matches_reference(rng, case, dt, kind):
    B, T, H, K, V, cs = case
    use_h0 = bool(rng.integers(2))
    d = make(rng, B, T, H, K, V, kind, h0=use_h0, grads=True)
    refs = recurrent_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"])
    c = {n: cast(x, dt) for n, x in d.items()}
    grads = chunk_gla_bwd(c["q"], c["k"], c["v"], c["g"], c["do"], initial_state=c["h0"], dht=c["dht"],
                          chunk_size=cs)  # fmt: skip
    for name, x, r in zip(("dq", "dk", "dv", "dg", "dh0"), grads, refs):
        assert x.shape == r.shape and x.dtype == dt, name
        assert rel(x, r) < TOL[dt], (name, rel(x, r))


def test_backward_without_initial_state_returns_dh0(rng):
    d = make(rng, 2, 70, 2, 8, 4, h0=False, grads=True)
    dq, dk, dv, dg, dh0 = chunk_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], chunk_size=16)
    ref = recurrent_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"])
    assert dh0.shape == (2, 2, 8, 4) and rel(dh0, ref[4]) < 1e-10
    # dh0 is the gradient at a zero initial state: equal to the one with an explicit zero state
    dh0_zero = chunk_gla_bwd(d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=np.zeros((2, 2, 8, 4)))[4]
    assert rel(dh0, dh0_zero) < 1e-12


# ------------------------------------------------------------------------------------------- validation


def _valid(rng, dt=np.float32):
    d = make(rng, 2, 9, 3, 4, 5, grads=True)
    return {n: cast(x, dt) for n, x in d.items()}


def _call_all(d, **over):
    """Run validate_gla_inputs, chunk_gla (or chunk_gla_bwd when do/dht are involved) and recurrent_gla."""
    a = {**d, **over}
    yield lambda: validate_gla_inputs(a["q"], a["k"], a["v"], a["g"], initial_state=a["h0"], do=a["do"],
                                      dht=a["dht"])  # fmt: skip
    yield lambda: chunk_gla_bwd(a["q"], a["k"], a["v"], a["g"], a["do"], initial_state=a["h0"], dht=a["dht"])
    if "do" not in over and "dht" not in over:
        yield lambda: chunk_gla(a["q"], a["k"], a["v"], a["g"], initial_state=a["h0"])
        yield lambda: recurrent_gla(a["q"], a["k"], a["v"], a["g"], initial_state=a["h0"])


BAD_SHAPES = [
    ("q", lambda d: d["q"][0], "q must have 4 dimensions"),
    ("k", lambda d: d["k"][:, :-1], "k has shape"),
    ("g", lambda d: d["g"][..., :-1], "g has shape"),
    ("v", lambda d: d["v"][:, :, :-1], "v has shape"),
    ("v", lambda d: d["v"][..., :0], "V must be >= 1"),
    ("do", lambda d: d["do"][..., :-1], "do has shape"),
    ("do", lambda d: d["do"][None], "do must have 4 dimensions"),
    ("h0", lambda d: d["h0"][:, :, :-1], "initial_state has shape"),
    ("dht", lambda d: d["dht"][:1], "dht has shape"),
]


@pytest.mark.parametrize("arg,mutate,msg", BAD_SHAPES, ids=[f"{a}-{m}" for a, _, m in BAD_SHAPES])
def test_bad_shapes(rng, arg, mutate, msg):
    d = _valid(rng)
    for call in _call_all(d, **{arg: mutate(d)}):
        with pytest.raises(ValueError, match=msg):
            call()


BAD_TYPES = [
    ("q", lambda d: d["q"].astype(np.int32), "q must have a floating dtype"),
    ("v", lambda d: d["v"].tolist(), "v must be a numpy or cupy array"),
    ("k", lambda d: d["k"].astype(np.float64), "k=float64"),
    ("g", lambda d: d["g"].astype(np.float16), "g=float16"),
    ("do", lambda d: d["do"].astype(np.float64), "do=float64"),
    ("h0", lambda d: d["h0"].astype(np.float64), "initial_state has dtype float64"),
    ("dht", lambda d: d["dht"].astype(np.float16), "dht has dtype float16"),
    ("h0", lambda d: d["h0"].astype(np.complex64), "initial_state must have a floating dtype"),
]


@pytest.mark.parametrize("arg,mutate,msg", BAD_TYPES, ids=[f"{a}-{m}" for a, _, m in BAD_TYPES])
def test_bad_types(rng, arg, mutate, msg):
    d = _valid(rng)
    for call in _call_all(d, **{arg: mutate(d)}):
        with pytest.raises(TypeError, match=msg):
            call()


@pytest.mark.parametrize("arg", ["q", "k", "v", "g", "do", "h0", "dht"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf(rng, arg, bad):
    d = _valid(rng)
    x = d[arg].copy()
    x[tuple(int(rng.integers(s)) for s in x.shape)] = bad
    name = {"h0": "initial_state"}.get(arg, arg)
    for call in _call_all(d, **{arg: x}):
        with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
            call()


@pytest.mark.parametrize("dt", [np.float32, np.float16])
def test_positive_gate(rng, dt):
    d = _valid(rng, dt)
    g = d["g"].copy()
    g[1, 3, 2, 0] = 0.25
    for call in _call_all(d, g=g):
        with pytest.raises(ValueError, match="g is a log forget gate and must be <= 0"):
            call()


def test_chunk_size_and_scale(rng):
    d = _valid(rng)
    args = (d["q"], d["k"], d["v"], d["g"])
    for bad in (0, -3):
        with pytest.raises(ValueError, match="chunk_size must be >= 1"):
            chunk_gla(*args, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size must be >= 1"):
            chunk_gla_bwd(*args, d["do"], chunk_size=bad)
    for bad in (2.0, True, "64"):
        with pytest.raises(TypeError, match="chunk_size must be an int"):
            chunk_gla(*args, chunk_size=bad)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        chunk_gla(*args, scale=float("nan"))
    with pytest.raises(TypeError, match="scale must be a positive number or None"):
        chunk_gla_bwd(*args, d["do"], scale="0.5")
    # one rule with ZeCOGLA (hpczeco.base.checks.check_scale): zero and negative scales are refused too
    for bad in (-1.0, 0.0, -0.5):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            chunk_gla(*args, scale=bad)
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            chunk_gla_bwd(*args, d["do"], scale=bad)
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            recurrent_gla(*args, scale=bad)


def test_validate_returns_dims_and_skips_values(rng):
    d = _valid(rng)
    assert validate_gla_inputs(d["q"], d["k"], d["v"], d["g"]) == (2, 9, 3, 4, 5)
    g = d["g"].copy()
    g[0, 0, 0, 0] = np.nan
    assert validate_gla_inputs(d["q"], d["k"], d["v"], g, check_values=False) == (2, 9, 3, 4, 5)


# ------------------------------------------------------------------------------------------- device seam


def test_device_dispatch(rng, monkeypatch):
    """Device arrays go to hpczeco.gpu.gla with the same arguments; a missing module is a clear error."""
    d = _valid(rng)
    calls = []
    fake = types.ModuleType("hpczeco.gpu.gla")
    fake.chunk_gla = lambda *a, **kw: calls.append(("fwd", a, kw)) or "fwd-result"
    fake.chunk_gla_bwd = lambda *a, **kw: calls.append(("bwd", a, kw)) or "bwd-result"
    monkeypatch.setattr(chunk_mod, "_any_device", lambda *arrays: True)
    monkeypatch.setitem(sys.modules, "hpczeco.gpu.gla", fake)
    import hpczeco.gpu as gpu_pkg

    monkeypatch.setattr(gpu_pkg, "gla", fake, raising=False)
    args = (d["q"], d["k"], d["v"], d["g"])
    assert chunk_gla(*args, scale=0.5, initial_state=d["h0"], output_final_state=True, chunk_size=8) == "fwd-result"
    assert chunk_gla_bwd(*args, d["do"], scale=0.5, initial_state=d["h0"], dht=d["dht"], chunk_size=8) == "bwd-result"
    (k1, a1, kw1), (k2, a2, kw2) = calls
    assert k1 == "fwd" and a1[0] is d["q"] and kw1 == dict(scale=0.5, initial_state=d["h0"], output_final_state=True,
                                                           chunk_size=8)  # fmt: skip
    assert k2 == "bwd" and a2[4] is d["do"] and kw2["dht"] is d["dht"] and kw2["chunk_size"] == 8
    # inputs are validated before dispatch
    with pytest.raises(ValueError, match="g is a log forget gate"):
        chunk_gla(d["q"], d["k"], d["v"], -d["g"])
    monkeypatch.setitem(sys.modules, "hpczeco.gpu.gla", None)  # import fails
    monkeypatch.delattr(gpu_pkg, "gla", raising=False)
    with pytest.raises(ImportError, match="hpczeco.gpu.gla could not be imported"):
        chunk_gla(*args)
