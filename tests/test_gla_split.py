"""hpczeco.gla.split: the phase-split forward/backward equal chunk_gla / chunk_gla_bwd (which test_gla.py checks
against the float64 recurrent reference) on fresh random inputs; poll is called; edge cases and input checks.
Serial tests (no MPI)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import log_gates, rel

import hpczeco.gla.chunk as geometry_mod
from hpczeco.gla import chunk_gla, chunk_gla_bwd
from hpczeco.gla.split import BackwardSplit, ForwardSplit

pytestmark = pytest.mark.filterwarnings("error")  # no overflow/invalid RuntimeWarnings, even for strong decays

TOL = {np.float64: 1e-10, np.float32: 1e-4}


def make(rng, B, T, H, K, V, kind, dt):
    """Inputs in dtype ``dt``: q, k, v, g, do and two states (S_in / initial_state, dht)."""
    d = dict(
        q=rng.standard_normal((B, T, H, K)),
        k=rng.standard_normal((B, T, H, K)),
        v=rng.standard_normal((B, T, H, V)),
        g=log_gates(rng, (B, T, H, K), kind),
        do=rng.standard_normal((B, T, H, V)),
        s0=rng.standard_normal((B, H, K, V)),
        dht=rng.standard_normal((B, H, K, V)),
    )
    return {n: x.astype(dt) for n, x in d.items()}


CASES = [
    # B, T, H, K, V, chunk_size
    (2, 100, 3, 16, 8, 16),  # T not a multiple of the chunk, K != V
    (1, 257, 2, 32, 24, 64),  # partial last chunk, several groups of chunks
    (2, 75, 1, 5, 3, 7),  # odd sizes, chunk not a multiple of the sub-chunk
    (1, 40, 2, 4, 6, 100),  # chunk longer than T
    (2, 130, 2, 16, 16, 40),
    (1, 1, 2, 4, 3, 64),  # T = 1
]
KINDS = ["strong", "weak", "mixed", "logsigmoid"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_forward_split_matches_chunk_gla(rng, case, dt, kind):
    B, T, H, K, V, cs = case
    d = make(rng, B, T, H, K, V, kind, dt)
    scale = None if rng.random() < 0.5 else float(rng.uniform(0.1, 2.0))
    S_in = d["s0"] if rng.random() < 0.7 else None
    o_ref, f_ref = chunk_gla(d["q"], d["k"], d["v"], d["g"], scale=scale, initial_state=S_in, output_final_state=True,
                             chunk_size=cs)  # fmt: skip
    _, s_loc = chunk_gla(d["q"], d["k"], d["v"], d["g"], scale=scale, output_final_state=True, chunk_size=cs)
    fs = ForwardSplit(d["q"], d["k"], d["v"], d["g"], scale=scale, chunk_size=cs)
    assert fs.S_local.shape == (B, H, K, V) and fs.S_local.dtype == dt and fs.a.shape == (B, H, K) and fs.a.dtype == dt
    assert rel(fs.S_local, s_loc) < TOL[dt]
    a_ref = np.exp(d["g"].astype(np.float64).sum(axis=1)).astype(dt)  # underflows like a
    assert rel(fs.a, a_ref) < TOL[dt]
    calls = []
    fs.intra(poll=lambda: calls.append(1))
    assert calls, "poll was never called"
    o, f = fs.finish(S_in)
    assert o.shape == (B, T, H, V) and o.dtype == dt and f.shape == (B, H, K, V) and f.dtype == dt
    assert rel(o, o_ref) < TOL[dt], rel(o, o_ref)
    assert rel(f, f_ref) < TOL[dt], rel(f, f_ref)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_backward_split_matches_chunk_gla_bwd(rng, case, dt, kind):
    B, T, H, K, V, cs = case
    d = make(rng, B, T, H, K, V, kind, dt)
    scale = None if rng.random() < 0.5 else float(rng.uniform(0.1, 2.0))
    h0 = d["s0"] if rng.random() < 0.7 else None
    dht = d["dht"] if rng.random() < 0.7 else None
    args = (d["q"], d["k"], d["v"], d["g"], d["do"])
    ref = chunk_gla_bwd(*args, scale=scale, initial_state=h0, dht=dht, chunk_size=cs)
    u_ref = chunk_gla_bwd(*args, scale=scale, initial_state=h0, chunk_size=cs)[4]
    bs = BackwardSplit(*args, scale=scale, initial_state=h0, chunk_size=cs)
    assert bs.U.shape == (B, H, K, V) and bs.U.dtype == dt
    assert rel(bs.U, u_ref) < TOL[dt], rel(bs.U, u_ref)
    calls = []
    bs.local(poll=lambda: calls.append(1))
    assert calls, "poll was never called"
    got = bs.finish(dht)
    for name, x, r in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref):
        assert x.shape == r.shape and x.dtype == r.dtype, name
        assert rel(x, r) < TOL[dt], (name, rel(x, r))


def test_phases_optional_and_finish_once(rng):
    """finish() without intra()/local() runs them; a second finish() (they work in place) raises."""
    d = make(rng, 2, 90, 2, 8, 5, "mixed", np.float64)
    args = (d["q"], d["k"], d["v"], d["g"])
    for S_in, dht in ((d["s0"], d["dht"]), (None, None)):
        fs = ForwardSplit(*args, chunk_size=32)
        o, f = fs.finish(S_in)
        o_ref, f_ref = chunk_gla(*args, initial_state=S_in, output_final_state=True, chunk_size=32)
        assert rel(o, o_ref) < 1e-10 and rel(f, f_ref) < 1e-10
        with pytest.raises(RuntimeError, match="finish"):
            fs.finish(S_in)
        bs = BackwardSplit(*args, d["do"], initial_state=d["s0"], chunk_size=32)
        got = bs.finish(dht)
        ref = chunk_gla_bwd(*args, d["do"], initial_state=d["s0"], dht=dht, chunk_size=32)
        for x, r in zip(got, ref):
            assert rel(x, r) < 1e-10
        with pytest.raises(RuntimeError, match="finish"):
            bs.finish(dht)


@pytest.mark.parametrize("group_tokens", [1, 40, 10_000])
def test_groups_threads_and_poll_thread(rng, monkeypatch, group_tokens):
    """Groups of 1 chunk, a few, or all; 1 or 3 worker threads: equal to chunk_gla(_bwd), bit-for-bit across
    thread counts, and poll runs in the calling thread."""
    monkeypatch.setattr(geometry_mod, "GROUP_TOKENS", group_tokens)
    monkeypatch.setattr(geometry_mod, "GROUP_TOKENS_LIGHT", group_tokens)
    d = make(rng, 2, 203, 3, 8, 6, "mixed", np.float64)
    args = (d["q"], d["k"], d["v"], d["g"])
    o_ref, f_ref = chunk_gla(*args, initial_state=d["s0"], output_final_state=True, chunk_size=16)
    ref = chunk_gla_bwd(*args, d["do"], initial_state=d["s0"], dht=d["dht"], chunk_size=16)
    me = threading.get_ident()
    runs = []
    for threads in ("1", "3"):
        monkeypatch.setenv("HPCZECO_GLA_THREADS", threads)
        idents = set()
        fs = ForwardSplit(*args, chunk_size=16)
        fs.intra(poll=lambda s=idents: s.add(threading.get_ident()))
        o, f = fs.finish(d["s0"])
        bs = BackwardSplit(*args, d["do"], initial_state=d["s0"], chunk_size=16)
        bs.local(poll=lambda s=idents: s.add(threading.get_ident()))
        grads = bs.finish(d["dht"])
        assert idents == {me}
        assert rel(o, o_ref) < 1e-10 and rel(f, f_ref) < 1e-10
        for x, r in zip(grads, ref):
            assert rel(x, r) < 1e-10
        runs.append((o, f, *grads))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_poll_called_during_work(rng, monkeypatch, threads):
    """Over many milliseconds of work, poll is called repeatedly (not only at the start)."""
    monkeypatch.setenv("HPCZECO_GLA_THREADS", threads)
    d = make(rng, 1, 8192, 2, 32, 32, "logsigmoid", np.float32)
    fs = ForwardSplit(d["q"], d["k"], d["v"], d["g"])
    bs = BackwardSplit(d["q"], d["k"], d["v"], d["g"], d["do"])
    for phase in (fs.intra, bs.local):
        stamps = []
        phase(poll=lambda s=stamps: s.append(1))
        assert len(stamps) >= 2, len(stamps)


def test_all_pairwise_and_very_strong_decays(rng, monkeypatch):
    """Every diagonal block in the exact pairwise form (span limit 0), and gates down to -1000 per token."""
    monkeypatch.setitem(geometry_mod.SPAN_LIMIT, np.dtype(np.float64), 0.0)
    monkeypatch.setitem(geometry_mod.SPAN_LIMIT, np.dtype(np.float32), 0.0)
    for dt in (np.float64, np.float32):
        for scale_g in (1.0, 125.0):
            d = make(rng, 1, 150, 2, 16, 8, "strong", dt)
            d["g"] = (d["g"] * scale_g).astype(dt)
            args = (d["q"], d["k"], d["v"], d["g"])
            o_ref, f_ref = chunk_gla(*args, initial_state=d["s0"], output_final_state=True, chunk_size=48)
            o, f = ForwardSplit(*args, chunk_size=48).finish(d["s0"])
            assert np.isfinite(o).all() and rel(o, o_ref) < TOL[dt] and rel(f, f_ref) < TOL[dt]
            ref = chunk_gla_bwd(*args, d["do"], initial_state=d["s0"], dht=d["dht"], chunk_size=48)
            got = BackwardSplit(*args, d["do"], initial_state=d["s0"], chunk_size=48).finish(d["dht"])
            for x, r in zip(got, ref):
                assert np.isfinite(x).all() and rel(x, r) < TOL[dt]


@pytest.mark.parametrize("T,B,H", [(0, 2, 3), (5, 0, 2), (5, 2, 0)])
def test_empty(rng, T, B, H):
    """T = 0 or B * H = 0: zero outputs, the final state / dh0 pass S_in / dht through."""
    for dt in (np.float64, np.float32):
        d = make(rng, B, T, H, 4, 3, "mixed", dt)
        args = (d["q"], d["k"], d["v"], d["g"])
        fs = ForwardSplit(*args)
        assert np.array_equal(fs.S_local, np.zeros((B, H, 4, 3))) and np.array_equal(fs.a, np.ones((B, H, 4)))
        calls = []
        fs.intra(poll=lambda c=calls: c.append(1))
        o, f = fs.finish(d["s0"])
        o_ref, f_ref = chunk_gla(*args, initial_state=d["s0"], output_final_state=True)
        assert o.shape == o_ref.shape and o.dtype == dt and np.array_equal(f, f_ref) and f.dtype == dt
        bs = BackwardSplit(*args, d["do"], initial_state=d["s0"])
        assert np.array_equal(bs.U, np.zeros((B, H, 4, 3)))
        bs.local(poll=lambda c=calls: c.append(1))
        assert len(calls) == 2
        got = bs.finish(d["dht"])
        ref = chunk_gla_bwd(*args, d["do"], initial_state=d["s0"], dht=d["dht"])
        for x, r in zip(got, ref):
            assert x.shape == r.shape and x.dtype == r.dtype and np.array_equal(x, r)


def test_float16_inputs(rng):
    """Half inputs run in float32: o and gradients in float16, states float32 (a float32 S_in / dht allowed)."""
    d = make(rng, 2, 70, 2, 16, 8, "logsigmoid", np.float64)
    h = {n: d[n].astype(np.float16) for n in ("q", "k", "v", "g", "do")}
    args = (h["q"], h["k"], h["v"], h["g"])
    s0, dht = d["s0"].astype(np.float32), d["dht"].astype(np.float32)
    o_ref, f_ref = chunk_gla(*args, initial_state=s0, output_final_state=True, chunk_size=32)
    fs = ForwardSplit(*args, chunk_size=32)
    assert fs.S_local.dtype == np.float32
    o, f = fs.finish(s0)
    assert o.dtype == np.float16 and f.dtype == np.float32
    assert rel(o, o_ref) < 2e-3 and rel(f, f_ref) < 1e-5
    ref = chunk_gla_bwd(*args, h["do"], initial_state=s0, dht=dht, chunk_size=32)
    got = BackwardSplit(*args, h["do"], initial_state=s0, chunk_size=32).finish(dht)
    for x, r in zip(got, ref):
        assert x.dtype == r.dtype and rel(x, r) < 2e-3


def test_input_errors(rng):
    d = make(rng, 1, 10, 2, 4, 3, "mixed", np.float32)
    args = (d["q"], d["k"], d["v"], d["g"])
    with pytest.raises(ValueError, match="k has shape"):
        ForwardSplit(d["q"], d["k"][:, :5], d["v"], d["g"])
    with pytest.raises(ValueError, match="g"):
        ForwardSplit(d["q"], d["k"], d["v"], np.abs(d["g"]) + 1)
    with pytest.raises(TypeError, match="chunk_size"):
        ForwardSplit(*args, chunk_size=1.5)
    with pytest.raises(ValueError, match="do has shape"):
        BackwardSplit(*args, d["do"][:, :3])
    with pytest.raises(TypeError, match="initial_state"):
        BackwardSplit(*args, d["do"], initial_state=d["s0"].astype(np.float64))
    fs, bs = ForwardSplit(*args), BackwardSplit(*args, d["do"])
    with pytest.raises(ValueError, match="S_in has shape"):
        fs.finish(d["s0"][:, :1])
    with pytest.raises(TypeError, match="S_in has dtype"):
        fs.finish(d["s0"].astype(np.float64))
    bad = d["s0"].copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="S_in"):
        fs.finish(bad)
    with pytest.raises(TypeError, match="dht"):
        bs.finish([[1.0]])
    with pytest.raises(ValueError, match="dht"):
        bs.finish(bad)


@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize(
    "case", [(2, 100, 3, 16, 8, 16), (1, 75, 2, 5, 3, 7), (1, 1, 1, 4, 3, 64), (2, 0, 2, 4, 3, 64)]
)
def test_backward_reuses_forward_states(rng, case, dt):
    """BackwardSplit(states=ForwardSplit.states) equals chunk_gla_bwd; the states end with the final state;
    check_values=False gives the same results."""
    B, T, H, K, V, cs = case
    d = make(rng, B, T, H, K, V, "mixed", dt)
    args = (d["q"], d["k"], d["v"], d["g"])
    for S_in in (d["s0"], None):
        fs = ForwardSplit(*args, chunk_size=cs, check_values=False)
        with pytest.raises(RuntimeError, match="finish"):
            fs.states  # noqa: B018
        o, f = fs.finish(S_in)
        N = -(-T // max(1, min(cs, T))) if T else 0
        assert fs.states.shape == (B, H, N + 1, K, V) and fs.states.dtype == dt
        assert np.array_equal(fs.states[:, :, -1], f)
        ref = chunk_gla_bwd(*args, d["do"], initial_state=S_in, dht=d["dht"], chunk_size=cs)
        bs = BackwardSplit(*args, d["do"], initial_state=S_in, chunk_size=cs, states=fs.states, check_values=False)
        kept = fs.states.copy()
        got = bs.finish(d["dht"])
        assert np.array_equal(fs.states, kept)  # read only
        for x, r in zip(got, ref):
            assert x.dtype == r.dtype and rel(x, r) < TOL[dt]


def test_states_checked(rng):
    d = make(rng, 1, 50, 2, 4, 3, "mixed", np.float64)
    args = (d["q"], d["k"], d["v"], d["g"])
    fs = ForwardSplit(*args, chunk_size=16)
    fs.finish(d["s0"])
    with pytest.raises(ValueError, match="states has shape"):
        BackwardSplit(*args, d["do"], initial_state=d["s0"], chunk_size=32, states=fs.states)
    with pytest.raises(TypeError, match="states has dtype"):
        BackwardSplit(*args, d["do"], initial_state=d["s0"], chunk_size=16, states=fs.states.astype(np.float32))
    with pytest.raises(ValueError, match="initial_state"):
        BackwardSplit(*args, d["do"], initial_state=None, chunk_size=16, states=fs.states)


def _poison(ws) -> None:
    """Fill every array the workspace holds with NaN: a split that reads what it did not write then fails."""
    for name in ws.names():
        x = ws._arrays[name]
        x.fill(np.nan)


@pytest.mark.parametrize("dt", [np.float64, np.float32])
def test_workspace_reused_across_calls(rng, dt):
    """A SplitWorkspace handed to one split after another (changing inputs, shapes, chunk sizes, S_in and
    initial_state; its arrays poisoned with NaN in between) gives the results of fresh splits: chunk_gla /
    chunk_gla_bwd. Same-shape calls reuse its arrays (no new allocation)."""
    from hpczeco.gla.split import SplitWorkspace

    ws = SplitWorkspace()
    calls = [(2, 100, 3, 16, 8, 16), (2, 100, 3, 16, 8, 16), (1, 75, 2, 5, 3, 7), (2, 100, 3, 16, 8, 16),
             (1, 130, 2, 16, 16, 40)]
    held: dict[str, int] = {}
    for i, (B, T, H, K, V, cs) in enumerate(calls):
        d = make(rng, B, T, H, K, V, "mixed", dt)
        args = (d["q"], d["k"], d["v"], d["g"])
        S_in = d["s0"] if i % 2 == 0 else None
        _poison(ws)
        fs = ForwardSplit(*args, chunk_size=cs, check_values=False, workspace=ws)
        fs.intra()
        o, f = fs.finish(S_in)
        o_ref, f_ref = chunk_gla(*args, initial_state=S_in, output_final_state=True, chunk_size=cs)
        assert rel(o, o_ref) < TOL[dt] and rel(f, f_ref) < TOL[dt]
        for states in (fs.states, None):  # the backward with the forward's states, and recomputing them
            bs = BackwardSplit(*args, d["do"], initial_state=S_in, chunk_size=cs, states=states,
                               check_values=False, workspace=ws)
            got = bs.finish(d["dht"])
            ref = chunk_gla_bwd(*args, d["do"], initial_state=S_in, dht=d["dht"], chunk_size=cs)
            for x, r in zip(got, ref):
                assert x.dtype == r.dtype and rel(x, r) < TOL[dt]
        assert set(ws.names()) == {"fwd.states", "fwd.Qs", "bwd.dHl", "bwd.E", "bwd.states"}
        ids = {n: id(ws._arrays[n]) for n in ws.names()}
        if i == 1:  # the second call has the first one's shapes: nothing was allocated anew
            assert ids == held
        held = ids
    nbytes = ws.nbytes
    assert nbytes > 0
    ws.clear()
    assert ws.nbytes == 0 and ws.names() == []


def test_workspace_take():
    from hpczeco.gla.split import SplitWorkspace

    ws = SplitWorkspace()
    a = ws.take("x", (3, 4), np.float32)
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.flags.c_contiguous
    assert ws.take("x", (3, 4), np.float32) is a
    b = ws.take("x", (3, 4), np.float64)  # another dtype replaces it
    assert b is not a and b.dtype == np.float64 and ws.nbytes == b.nbytes
    c = ws.take("x", [4, 3], "float64")  # another shape too
    assert c is not b and c.shape == (4, 3)
    assert ws.take("y", (2,), np.float32) is not c and ws.names() == ["x", "y"]
