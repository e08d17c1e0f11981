"""ZeCOGLA under mpiexec equals single-process chunked GLA on the concatenated sequence."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import rel
from hpczeco.collectives import CollectiveInputError

from hpczeco import ZeCOGLA, zeco_gla
from hpczeco.gla import chunk_gla, chunk_gla_bwd

pytestmark = pytest.mark.mpi

TOPOLOGIES = ["ring", "tree", "allgather", "serial", "exscan", "ptree", "auto"]


def slice_bounds(rng, T: int, P: int, force_empty: bool) -> np.ndarray:
    """Uneven contiguous slices covering [0, T); with force_empty one middle rank gets none."""
    cuts = np.sort(rng.integers(0, T + 1, size=P - 1))
    bounds = np.concatenate([[0], cuts, [T]])
    if force_empty and P >= 3:
        bounds[P // 2] = bounds[P // 2 + 1]
        bounds = np.maximum.accumulate(bounds)
    return bounds


def make_inputs(rng, B, T, H, K, V, dtype, strong: bool):
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    v = rng.standard_normal((B, T, H, V))
    lo = -8.0 if strong else -0.5
    g = rng.uniform(lo, 0.0, size=(B, T, H, K))
    do = rng.standard_normal((B, T, H, V))
    h0 = rng.standard_normal((B, H, K, V))
    dht = rng.standard_normal((B, H, K, V))
    return [x.astype(dtype) for x in (q, k, v, g, do, h0, dht)]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("with_states", [False, True])
def test_zeco_matches_single_process(comm, rng, topology, dtype, with_states):
    P, r = comm.Get_size(), comm.Get_rank()
    B, H, K, V = 2, 3, 8, 5
    T = int(rng.integers(20, 40)) * P
    strong = bool(rng.integers(0, 2))
    q, k, v, g, do, h0, dht = make_inputs(rng, B, T, H, K, V, dtype, strong)
    bounds = slice_bounds(rng, T, P, force_empty=with_states)
    lo, hi = bounds[r], bounds[r + 1]
    h0 = h0 if with_states else None
    dht = dht if with_states else None

    # single-process float64 reference on the whole sequence
    f64 = lambda x: None if x is None else x.astype(np.float64)
    o_ref, fin_ref = chunk_gla(f64(q), f64(k), f64(v), f64(g), initial_state=f64(h0), output_final_state=True,
                               chunk_size=16)
    grads_ref = chunk_gla_bwd(f64(q), f64(k), f64(v), f64(g), f64(do), initial_state=f64(h0), dht=f64(dht),
                              chunk_size=16)
    _, prefix_state = chunk_gla(f64(q[:, :hi]), f64(k[:, :hi]), f64(v[:, :hi]), f64(g[:, :hi]),
                                initial_state=f64(h0), output_final_state=True, chunk_size=16)

    layer = ZeCOGLA(comm, topology=topology, blocks=int(rng.integers(1, K + 1)), chunk_size=16)
    sl = slice(lo, hi)
    o = layer.forward(q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=h0 if r == 0 else None)
    dq, dk, dv, dg, dh0 = layer.backward(do[:, sl], dht=dht if r == P - 1 else None)

    tol = 1e-9 if dtype == np.float64 else 1e-4
    assert o.shape == (B, hi - lo, H, V) and o.dtype == dtype
    # the slices assembled from every rank equal the one-device result (a slice alone can be ~0, e.g. dg of
    # a first token with no initial state, so the comparison is of the whole sequence)
    for name, got, ref in zip("o dq dk dv dg".split(), (o, dq, dk, dv, dg), (o_ref, *grads_ref[:4])):
        assert got.shape == ref[:, sl].shape, name
        full = np.concatenate(comm.allgather(np.asarray(got, dtype=np.float64)), axis=1)
        assert rel(full, ref) < tol, (name, rel(full, ref))
    assert rel(layer.final_state, prefix_state) < tol
    if r == P - 1:
        assert rel(layer.final_state, fin_ref) < tol
    if r == 0:
        assert dh0 is not None and rel(dh0, grads_ref[4]) < tol
    else:
        assert dh0 is None


def test_layer_reuses_its_workspace_across_calls(comm, rng):
    """One layer, several steps with fresh inputs (its split arrays reused from step to step, poisoned with NaN
    in between): every step equals the one-process float64 reference; a second forward before the backward
    makes the backward that of the second forward; a slice length change reallocates."""
    P, r = comm.Get_size(), comm.Get_rank()
    B, H, K, V = 1, 2, 8, 4
    layer = ZeCOGLA(comm, topology="ring", chunk_size=16)
    f64 = lambda x: None if x is None else x.astype(np.float64)  # noqa: E731
    for step, (per_rank, extra_forward) in enumerate([(40, False), (40, True), (40, False), (23, False)]):
        T = per_rank * P
        q, k, v, g, do, h0, dht = make_inputs(rng, B, T, H, K, V, np.float32, strong=False)
        sl = slice(per_rank * r, per_rank * (r + 1))
        for x in layer._workspace._arrays.values():
            x.fill(np.nan)
        if extra_forward:  # a forward of other inputs whose backward never comes
            other = make_inputs(rng, B, T, H, K, V, np.float32, strong=True)
            layer.forward(*(x[:, sl] for x in other[:4]))
        o = layer.forward(q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=h0 if r == 0 else None)
        grads = layer.backward(do[:, sl], dht=dht if r == P - 1 else None)
        o_ref, _ = chunk_gla(f64(q), f64(k), f64(v), f64(g), initial_state=f64(h0), output_final_state=True,
                             chunk_size=16)
        refs = chunk_gla_bwd(f64(q), f64(k), f64(v), f64(g), f64(do), initial_state=f64(h0), dht=f64(dht),
                             chunk_size=16)
        for name, got, ref in zip("o dq dk dv dg".split(), (o, *grads[:4]), (o_ref, *refs[:4])):
            full = np.concatenate(comm.allgather(np.asarray(got, dtype=np.float64)), axis=1)
            assert rel(full, ref) < 1e-4, (step, name, rel(full, ref))
        if r == 0:
            assert rel(grads[4], refs[4]) < 1e-4
        assert layer._workspace.nbytes > 0


def test_functional_form(comm, rng):
    P, r = comm.Get_size(), comm.Get_rank()
    q, k, v, g, *_ = make_inputs(rng, 1, 24 * P, 2, 4, 4, np.float64, strong=False)
    o_ref, fin_ref = chunk_gla(q, k, v, g, output_final_state=True)
    sl = slice(24 * r, 24 * (r + 1))
    o, fin = zeco_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], comm, output_final_state=True)
    assert rel(o, o_ref[:, sl]) < 1e-10
    if r == P - 1:
        assert rel(fin, fin_ref) < 1e-10
    # without output_final_state only the output (as hpczeco.torch.zeco_gla and fla's chunk_gla)
    o2, none = zeco_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], comm, topology="tree", blocks=1, chunk_size=8)
    assert none is None and rel(o2, o_ref[:, sl]) < 1e-10


def _expect_collective_error(comm, fn, match: str):
    with pytest.raises((CollectiveInputError, ValueError, TypeError), match=match):
        fn()


def test_bad_inputs_fail_on_every_rank(comm, rng):
    P, r = comm.Get_size(), comm.Get_rank()
    q, k, v, g, *_ = make_inputs(rng, 1, 8, 2, 4, 3, np.float64, strong=False)
    layer = ZeCOGLA(comm)
    bad_rank = P - 1

    if P > 1:  # disagreements need two ranks
        # a rank with a different K
        kk = 5 if r == bad_rank else 4
        qq = rng.standard_normal((1, 8, 2, kk))
        _expect_collective_error(comm, lambda: layer.forward(qq, qq, v, -np.abs(qq)), "disagree on B,H,K,V|rank")
        # a rank with a different H
        hh = 3 if r == bad_rank else 2
        x = rng.standard_normal((1, 8, hh, 4))
        vv = rng.standard_normal((1, 8, hh, 3))
        _expect_collective_error(comm, lambda: layer.forward(x, x, vv, -np.abs(x)), "B,H,K,V|rank")
        # a rank with another dtype
        dt = np.float32 if r == bad_rank else np.float64
        _expect_collective_error(comm, lambda: layer.forward(q.astype(dt), k.astype(dt), v.astype(dt), g.astype(dt)),
                                 "dtype")
    # NaN on one rank
    qn = q.copy()
    if r == bad_rank:
        qn[0, 3, 1, 2] = np.nan
    _expect_collective_error(comm, lambda: layer.forward(qn, k, v, g), "NaN")
    # mismatched scan topology
    other = ZeCOGLA(comm, topology="tree" if r == bad_rank else "ring")
    if P > 1:
        _expect_collective_error(comm, lambda: other.forward(q, k, v, g), "topology")
    # initial_state on a rank other than 0
    if P > 1:
        h0 = rng.standard_normal((1, 2, 4, 3))
        _expect_collective_error(comm, lambda: layer.forward(q, k, v, g, initial_state=h0 if r == 1 else None),
                                 "rank 0 only")
    # the layer still works after all those errors (nothing half-sent)
    o = layer.forward(q, k, v, g)
    assert np.isfinite(o).all()
    assert comm.allreduce(1) == P


def test_check_values_false_skips_only_the_value_scans(comm, rng):
    """check_values=False: a NaN propagates into the output (no error, no hang); shapes are still agreed."""
    P, r = comm.Get_size(), comm.Get_rank()
    q, k, v, g, do, *_ = make_inputs(rng, 1, 9, 2, 4, 3, np.float64, strong=False)
    layer = ZeCOGLA(comm, check_values=False)
    qn = q.copy()
    qn[0, 4, 1, 2] = np.nan
    o = layer.forward(qn, k, v, g)
    assert np.isnan(o).any()  # rank 0 at t >= 4; later ranks through the NaN state they receive
    if r == 0:
        assert np.isfinite(o[0, :4]).all()
    grads = layer.backward(do)
    assert len(grads) == 5
    if P > 1:  # options and shapes are still checked collectively
        picky = ZeCOGLA(comm, check_values=(r != P - 1))
        _expect_collective_error(comm, lambda: picky.forward(q, k, v, g), "check_values")
    assert comm.allreduce(1) == P


def test_constructor_rejects_bad_options(comm):
    with pytest.raises(ValueError, match="topology must be one of"):
        ZeCOGLA(comm, topology="ringg")
    with pytest.raises(ValueError, match="blocks"):
        ZeCOGLA(comm, blocks=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ZeCOGLA(comm, chunk_size=0)
