"""Property tests (hypothesis) of the collectives, the GLA kernels, ZeCO and DAAF over random shapes,
dtypes, options and extreme gates, plus invalid inputs.

MPI-marked properties draw the SAME examples on every rank: ``derandomize=True``, no example database,
no health checks (their timing could differ between ranks), and every example ends with a collective
agreement on its outcome (an error on any rank is raised on every rank), so shrinking stays in step."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import agree_on_error, rel_max
from hpczeco.collectives.scan import TOPOLOGIES, fold_reference, scan
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from hpczeco.gla import chunk_gla, chunk_gla_bwd, recurrent_gla, recurrent_gla_bwd


def lockstep(max_examples: int) -> settings:
    """Settings under which every rank draws the same examples in the same order (see the module docstring)."""
    return settings(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                    print_blob=False, report_multiple_bugs=False, max_examples=max_examples,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink))


def _world() -> MPI.Comm:
    return MPI.COMM_WORLD


# --------------------------------------------------------------------------------------------- scan

scan_cases = st.fixed_dictionaries({
    "lead": st.lists(st.integers(1, 3), min_size=0, max_size=2),
    "K": st.integers(1, 6),
    "V": st.integers(1, 5),
    "dtype": st.sampled_from(["float32", "float64"]),
    "blocks": st.one_of(st.none(), st.integers(1, 6)),
    "topology": st.sampled_from(TOPOLOGIES),
    "reverse": st.booleans(),
    "initial": st.booleans(),
    "decay": st.sampled_from(["uniform", "zero", "one"]),
    "seed": st.integers(0, 2**31 - 1),
})  # fmt: skip


@pytest.mark.mpi
@lockstep(15)
@given(case=scan_cases)
def test_fuzz_scan_matches_fold_reference(case):
    comm = _world()
    P, rank = comm.Get_size(), comm.Get_rank()
    K, V, dt = case["K"], case["V"], np.dtype(case["dtype"])
    blocks = None if case["blocks"] is None else min(case["blocks"], K)
    shape_a = (*case["lead"], K)
    rng = np.random.default_rng(case["seed"])  # same pairs on every rank
    if case["decay"] == "uniform":
        a_all = rng.random((P, *shape_a))
    else:
        a_all = np.full((P, *shape_a), 0.0 if case["decay"] == "zero" else 1.0)
    a_all = a_all.astype(dt)
    S_all = rng.standard_normal((P, *shape_a, V)).astype(dt)
    init = rng.standard_normal((*shape_a, V)).astype(dt) if case["initial"] else None
    order = list(range(P))[::-1] if case["reverse"] else list(range(P))
    first = order[0]
    err = None
    try:
        got = scan(a_all[rank], S_all[rank], comm, topology=case["topology"], blocks=blocks,
                   reverse=case["reverse"], initial=init if rank == first else None)
        pairs = [(a_all[r].astype(np.float64), S_all[r].astype(np.float64)) for r in order]
        ref = fold_reference(pairs, None if init is None else init.astype(np.float64))[order.index(rank)]
        assert got.shape == S_all[rank].shape and got.dtype == dt, (got.shape, got.dtype)
        tol = 1e-12 if dt == np.float64 else 2e-5
        assert rel_max(got, ref) <= tol * P, f"{case}: error {rel_max(got, ref):.3g}"
    except Exception as exc:  # noqa: BLE001 - agreed below
        err = exc
    agree_on_error(comm, err)


@pytest.mark.mpi
@lockstep(12)
@given(kind=st.sampled_from(["nan-a", "inf-S", "a>1", "a<0", "shape", "dtype", "blocks>K", "blocks=0", "topology",
                             "initial-elsewhere"]),
       bad_rank=st.integers(0, 7), topology=st.sampled_from(["ring", "tree", "allgather"]))
def test_fuzz_scan_bad_input_raises_on_every_rank(kind, bad_rank, topology):
    comm = _world()
    P, rank = comm.Get_size(), comm.Get_rank()
    bad_rank %= P
    a, S = np.full((2, 3), 0.5), np.ones((2, 3, 2))
    kw: dict = {"topology": topology}
    mine = rank == bad_rank
    if kind == "nan-a" and mine:
        a[0, 1] = np.nan
    elif kind == "inf-S" and mine:
        S[1, 2, 0] = np.inf
    elif kind == "a>1" and mine:
        a[1, 1] = 1.5
    elif kind == "a<0" and mine:
        a[0, 0] = -0.1
    elif kind == "shape" and mine:
        S = np.ones((2, 3, 3)) if P > 1 else np.ones((2, 4, 2))
    elif kind == "dtype" and mine:
        a, S = a.astype(np.float32), S.astype(np.float32)
        if P == 1:
            S = S.astype(np.float64)
    elif kind == "blocks>K":
        kw = {"topology": "ring", "blocks": 4}
    elif kind == "blocks=0":
        kw = {"topology": "ring", "blocks": 0}
    elif kind == "topology":
        kw = {"topology": "hypercube"}
    elif kind == "initial-elsewhere":
        if P == 1:
            kw["initial"] = np.ones((2, 2))  # wrong shape
        elif rank == P - 1:
            kw["initial"] = np.ones_like(S)
    err = None
    try:
        with pytest.raises((ValueError, TypeError)):
            scan(a, S, comm, **kw)
    except BaseException as exc:  # noqa: BLE001 - pytest's Failed is a BaseException
        err = exc
    agree_on_error(comm, err)


# --------------------------------------------------------------------------------------------- GLA kernels


def _gates(rng, shape, kind: str) -> np.ndarray:
    if kind == "normal":
        return np.log(1 / (1 + np.exp(-rng.standard_normal(shape) - 2)))  # logsigmoid, ~(-0.5, 0)
    if kind == "near0":
        return -rng.uniform(0, 1e-6, shape)
    if kind == "zero":
        return np.zeros(shape)
    if kind == "very-negative":
        return -rng.uniform(5, 20, shape)
    # mixed: every regime, token by token
    out = -rng.uniform(0, 1e-6, shape)
    pick = rng.integers(0, 3, shape)
    out[pick == 1] = -rng.uniform(5, 20, shape)[pick == 1]
    out[pick == 2] = np.log(1 / (1 + np.exp(-rng.standard_normal(shape))))[pick == 2]
    return out


gla_cases = st.fixed_dictionaries({
    "B": st.integers(1, 2), "T": st.integers(1, 40), "H": st.integers(1, 2), "K": st.integers(1, 8),
    "V": st.integers(1, 8), "chunk": st.sampled_from([4, 8, 16, 64]), "dtype": st.sampled_from(["float32", "float64"]),
    "gates": st.sampled_from(["normal", "near0", "zero", "very-negative", "mixed"]), "h0": st.booleans(),
    "dht": st.booleans(), "seed": st.integers(0, 2**31 - 1),
})  # fmt: skip


@settings(max_examples=25, deadline=None, database=None)
@given(case=gla_cases)
def test_fuzz_chunk_gla_matches_recurrent_reference(case):
    rng = np.random.default_rng(case["seed"])
    B, T, H, K, V, dt = case["B"], case["T"], case["H"], case["K"], case["V"], np.dtype(case["dtype"])
    q, k = rng.standard_normal((B, T, H, K)).astype(dt), rng.standard_normal((B, T, H, K)).astype(dt)
    v = rng.standard_normal((B, T, H, V)).astype(dt)
    g = _gates(rng, (B, T, H, K), case["gates"]).astype(dt)
    h0 = rng.standard_normal((B, H, K, V)).astype(dt) if case["h0"] else None
    do = rng.standard_normal((B, T, H, V)).astype(dt)
    dht = rng.standard_normal((B, H, K, V)).astype(dt) if case["dht"] else None
    f64 = (lambda x: None if x is None else x.astype(np.float64))
    o_ref, s_ref = recurrent_gla(f64(q), f64(k), f64(v), f64(g), initial_state=f64(h0), output_final_state=True)
    o, s = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=case["chunk"])
    assert o.shape == (B, T, H, V) and o.dtype == dt and s.shape == (B, H, K, V)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    tol = 1e-10 if dt == np.float64 else 3e-4
    assert rel_max(o, o_ref) <= tol, f"o: {rel_max(o, o_ref):.3g}"
    assert rel_max(s, s_ref) <= tol, f"final state: {rel_max(s, s_ref):.3g}"
    ref = recurrent_gla_bwd(f64(q), f64(k), f64(v), f64(g), f64(do), initial_state=f64(h0), dht=f64(dht))
    got = chunk_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht, chunk_size=case["chunk"])
    for name, x, r in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref):
        assert x.shape == r.shape and np.all(np.isfinite(x)), name
        assert rel_max(x, r) <= 10 * tol, f"{name}: {rel_max(x, r):.3g}"


@settings(max_examples=15, deadline=None, database=None)
@given(kind=st.sampled_from(["nan-q", "inf-v", "positive-g", "nan-g", "shape-k", "shape-v", "chunk0", "h0-shape",
                             "int-dtype"]), seed=st.integers(0, 1000))
def test_fuzz_chunk_gla_bad_inputs(kind, seed):
    rng = np.random.default_rng(seed)
    q, k, g = (rng.standard_normal((1, 6, 1, 3)) for _ in range(3))
    g = -np.abs(g)
    v = rng.standard_normal((1, 6, 1, 2))
    kw: dict = {}
    if kind == "nan-q":
        q[0, 2, 0, 1] = np.nan
    elif kind == "inf-v":
        v[0, 1, 0, 0] = np.inf
    elif kind == "positive-g":
        g[0, 3, 0, 0] = 0.5
    elif kind == "nan-g":
        g[0, 0, 0, 2] = np.nan
    elif kind == "shape-k":
        k = k[:, :5]
    elif kind == "shape-v":
        v = v[:, :, :, None]
    elif kind == "chunk0":
        kw["chunk_size"] = 0
    elif kind == "h0-shape":
        kw["initial_state"] = np.zeros((1, 1, 2, 3))
    else:
        q = q.astype(np.int64)
    with pytest.raises((ValueError, TypeError)):
        chunk_gla(q, k, v, g, **kw)
    with pytest.raises((ValueError, TypeError)):
        chunk_gla_bwd(q, k, v, g, np.ones_like(v, dtype=np.float64), **kw)


# --------------------------------------------------------------------------------------------- ZeCO


zeco_cases = st.fixed_dictionaries({
    "T": st.integers(1, 48), "K": st.integers(1, 6), "V": st.integers(1, 6), "H": st.integers(1, 2),
    "chunk": st.sampled_from([4, 8, 16]), "topology": st.sampled_from(["ring", "tree", "allgather", "serial"]),
    "gates": st.sampled_from(["normal", "mixed", "very-negative"]), "h0": st.booleans(),
    "seed": st.integers(0, 2**31 - 1),
})  # fmt: skip


@pytest.mark.mpi
@lockstep(10)
@given(case=zeco_cases)
def test_fuzz_zeco_random_slices_match_one_process(case):
    from hpczeco.zeco import ZeCOGLA

    comm = _world()
    P, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(case["seed"])
    B, T, H, K, V = 1, case["T"], case["H"], case["K"], case["V"]
    cuts = np.sort(rng.integers(0, T + 1, P - 1))  # random slice lengths (some may be empty)
    bounds = np.concatenate([[0], cuts, [T]])
    q, k = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K))
    v, do = rng.standard_normal((B, T, H, V)), rng.standard_normal((B, T, H, V))
    g = _gates(rng, (B, T, H, K), case["gates"])
    h0 = rng.standard_normal((B, H, K, V)) if case["h0"] else None
    o_ref, s_ref = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=case["chunk"])
    grads_ref = chunk_gla_bwd(q, k, v, g, do, initial_state=h0, chunk_size=case["chunk"])
    sl = slice(int(bounds[rank]), int(bounds[rank + 1]))
    err = None
    try:
        layer = ZeCOGLA(comm, topology=case["topology"], chunk_size=case["chunk"])
        o = layer.forward(q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=h0 if rank == 0 else None)
        dq, dk, dv, dg, dh0 = layer.backward(do[:, sl])
        for name, x, r in zip(("o", "dq", "dk", "dv", "dg"), (o, dq, dk, dv, dg), (o_ref, *grads_ref[:4])):
            full = np.concatenate(comm.allgather(np.asarray(x)), axis=1)  # the slices assembled over ranks
            assert full.shape == r.shape, (name, full.shape, r.shape)
            assert rel_max(full, r) <= 1e-9, f"{name}: {rel_max(full, r):.3g} (bounds {bounds.tolist()})"
        if rank == P - 1:
            assert rel_max(layer.final_state, s_ref) <= 1e-9, "final state"
        if rank == 0:
            assert rel_max(dh0, grads_ref[4]) <= 1e-9, "dh0"
    except Exception as exc:  # noqa: BLE001 - agreed below
        err = exc
    agree_on_error(comm, err)


# --------------------------------------------------------------------------------------------- DAAF


def _tokens(rng, T: int, pattern: str) -> np.ndarray:
    if pattern == "uniform":
        return rng.integers(0, 300, T)
    if pattern == "constant":
        return np.full(T, 7)
    if pattern == "periodic":
        return np.arange(T) % 5
    # segments of low and high entropy
    out = np.empty(T, dtype=np.int64)
    pos = 0
    while pos < T:
        n = int(rng.integers(8, 64))
        out[pos:pos + n] = rng.integers(0, 3 if rng.random() < 0.5 else 500, min(n, T - pos))
        pos += n
    return out


daaf_cases = st.fixed_dictionaries({
    "T": st.integers(1, 400), "pattern": st.sampled_from(["uniform", "constant", "periodic", "segments"]),
    "window": st.integers(4, 80), "stride": st.one_of(st.none(), st.integers(1, 40)),
    "threshold": st.floats(0.0, 1.0), "local_window": st.integers(0, 40),
    "rule": st.sampled_from(["threshold", "budget", "work_budget"]), "fraction": st.floats(0.0, 1.0),
    "policy": st.sampled_from(["dense", "budget"]), "seed": st.integers(0, 2**31 - 1),
})  # fmt: skip


@settings(max_examples=25, deadline=None, database=None)
@given(case=daaf_cases)
def test_fuzz_daaf_plan_invariants_and_attention(case):
    from hpczeco.daaf import attention, attention_pairs, dense_pairs, plan
    from hpczeco.daaf.reference import attention_reference

    rng = np.random.default_rng(case["seed"])
    T = case["T"]
    tok = _tokens(rng, T, case["pattern"])
    kw = {"budget": case["fraction"]} if case["rule"] == "budget" else (
        {"work_budget": case["fraction"]} if case["rule"] == "work_budget" else {})
    p = plan(tok, window=case["window"], threshold=case["threshold"], local_window=case["local_window"],
             policy=case["policy"], stride=case["stride"], **kw)
    m = p.global_mask
    assert p.T == T and m.shape == (T,) and m.dtype == bool
    # regions: sorted, disjoint, non-empty half-open spans whose union is exactly the mask
    cover = np.zeros(T, dtype=bool)
    last_end = -1
    for a, b in p.regions:
        assert 0 <= a < b <= T and a > last_end, p.regions
        cover[a:b] = True
        last_end = b
    assert np.array_equal(cover, m)
    assert isinstance(p.policy, str) and p.policy and isinstance(p.reason, str) and p.reason
    assert p.local_window == case["local_window"]
    assert p.pairs == attention_pairs(m, p.local_window) and p.dense == dense_pairs(T)
    assert 0.0 <= p.work_saved <= 1.0 and 0.0 <= p.global_fraction <= 1.0
    assert len(p.weights) == len(p.window_starts) == len(p.selected)
    assert np.all((p.weights >= -1e-12) & (p.weights <= 1 + 1e-12))
    # attention under the plan equals the float64 reference (small T only: the reference is O(T^2))
    if T <= 96:
        D, Dv, H = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(1, 3))
        q, k = rng.standard_normal((1, T, H, D)), rng.standard_normal((1, T, H, D))
        v = rng.standard_normal((1, T, H, Dv))
        o = attention(q, k, v, p)
        ref = attention_reference(q, k, v, p)
        assert o.shape == ref.shape and rel_max(o, ref) <= 1e-10, rel_max(o, ref)
        o32 = attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), p)
        assert o32.dtype == np.float32 and rel_max(o32, ref) <= 1e-4


@settings(max_examples=12, deadline=None, database=None)
@given(kind=st.sampled_from(["empty", "negative", "float-tokens", "2d", "window0", "threshold>1", "policy",
                             "local<0", "nan-q", "shape-qk", "plan-T"]))
def test_fuzz_daaf_bad_inputs(kind):
    from hpczeco.daaf import attention, plan

    tok = np.arange(64) % 9
    q = k = v = np.ones((1, 64, 1, 4))
    if kind in ("nan-q", "shape-qk", "plan-T"):
        p = plan(tok, window=16)
        if kind == "nan-q":
            q = q.copy()
            q[0, 3, 0, 0] = np.nan
        elif kind == "shape-qk":
            k = np.ones((1, 64, 1, 5))
        else:
            q = k = v = np.ones((1, 32, 1, 4))
        with pytest.raises((ValueError, TypeError)):
            attention(q, k, v, p)
        return
    bad = {
        "empty": ((np.array([], dtype=np.int64),), {}), "negative": ((tok - 5,), {}),
        "float-tokens": ((tok.astype(float),), {}), "2d": ((tok.reshape(8, 8),), {}),
        "window0": ((tok,), {"window": 0}), "threshold>1": ((tok,), {"threshold": 1.5}),
        "policy": ((tok,), {"policy": "random"}), "local<0": ((tok,), {"local_window": -1}),
    }[kind]
    with pytest.raises((ValueError, TypeError)):
        plan(*bad[0], **bad[1])
