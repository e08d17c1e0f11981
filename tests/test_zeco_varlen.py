"""ZeCOGLA with packed documents (``cu_seqlens``) under mpiexec: documents that start, end or cross inside any rank's
slice (including empty slices and empty documents) equal each document run alone by the float64 recurrence, in every
scan topology, forward and backward; the per-rank document bookkeeping; collective errors for bad offsets."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import agreed_error, rel
from hpczeco.collectives import CollectiveInputError

from hpczeco import ZeCOGLA
from hpczeco.gla import recurrent_gla, recurrent_gla_bwd
from hpczeco.zeco_varlen import rank_documents

TOPOLOGIES = ["ring", "tree", "allgather", "serial", "exscan", "auto"]


def document_lengths(rng, P: int, bounds: np.ndarray, variant: str) -> list[int]:
    """Document lengths summing to ``bounds[-1]``: random cuts, one document of a single token, empty ones (a
    repeated cut; at 0 or T at times), a boundary exactly on a rank boundary and, with three or more ranks, a
    non-empty middle slice ``m`` shaped by ``variant``: "cross" (one document covers it and crosses both ends),
    "start" (a document starts at its first token and goes on into the next slice) or "end" (a document from the
    slice before ends at its last token, the next one starts on the next rank)."""
    T = int(bounds[-1])
    cuts = [int(x) for x in rng.integers(0, T + 1, size=max(2, T // 12))]
    x = int(rng.integers(0, T))
    cuts += [x, x + 1]  # a document of one token
    if P >= 2:
        cuts.append(int(bounds[int(rng.integers(1, P))]))  # a document boundary on a rank boundary
    cuts.append(cuts[int(rng.integers(len(cuts)))])  # a cut twice: a document of length 0
    middle = [m for m in range(1, P - 1) if bounds[m + 1] > bounds[m]]
    if middle:
        m = middle[int(rng.integers(len(middle)))]
        lo, hi = int(bounds[m]), int(bounds[m + 1])
        keep = {"cross": lambda c: not lo - 1 <= c <= hi + 1, "start": lambda c: not lo <= c <= hi + 1,
                "end": lambda c: not lo - 1 <= c <= hi}[variant]
        cuts = [c for c in cuts if keep(c)] + {"cross": [], "start": [lo], "end": [hi]}[variant]
    cu = np.concatenate([[0], np.sort(cuts), [T]])
    return [int(d) for d in np.diff(cu)]


def slice_bounds(rng, T: int, P: int) -> np.ndarray:
    """Uneven contiguous slices; with three or more ranks one middle rank gets none."""
    cuts = np.sort(rng.integers(0, T + 1, size=P - 1))
    bounds = np.concatenate([[0], cuts, [T]])
    if P >= 4:
        bounds[P // 2] = bounds[P // 2 + 1]
        bounds = np.maximum.accumulate(bounds)
    return bounds


def gather_rows(comm, rows: np.ndarray, docs: np.ndarray, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's per-document rows assembled into ``[N, ...]`` (float64) and how many ranks gave each row."""
    everyone = comm.allgather((np.asarray(docs), np.asarray(rows, dtype=np.float64)))
    shape = next((r.shape[1:] for _, r in everyone if len(r)), None)
    full = np.zeros((N,) + (shape or ()))
    count = np.zeros(N, int)
    for d, r in everyone:
        if len(d):
            full[d] = r
            count[d] += 1
    return full, count


@pytest.mark.mpi
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("with_states", [False, True])
def test_packed_documents_across_ranks_equal_each_document_alone(comm, rng, topology, dtype, with_states):
    P, r = comm.Get_size(), comm.Get_rank()
    H, K, V = 2, 5, 3
    T = int(rng.integers(25, 45)) * P
    bounds = slice_bounds(rng, T, P)
    variant = ["cross", "start", "end"][(2 * (dtype == np.float32) + with_states + TOPOLOGIES.index(topology)) % 3]
    lengths = document_lengths(rng, P, bounds, variant)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    N = len(lengths)
    f = lambda *s: rng.standard_normal(s)  # noqa: E731
    q, k, v, do = f(1, T, H, K), f(1, T, H, K), f(1, T, H, V), f(1, T, H, V)
    g = rng.uniform(-8.0 if rng.integers(2) else -0.6, 0.0, (1, T, H, K))
    g[:, :, 0] *= 0.005  # head 0: weak decays, so that a state leaking across a document start would show
    h0 = f(N, H, K, V) if with_states else None
    dht = f(N, H, K, V) if with_states else None
    o_ref, fin_ref = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    grads_ref = recurrent_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht, cu_seqlens=cu)

    lo, hi = int(bounds[r]), int(bounds[r + 1])
    sl = slice(lo, hi)
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    layer = ZeCOGLA(comm, topology=topology, blocks=int(rng.integers(1, K + 1)), chunk_size=8)
    o = layer.forward(*(cast(x[:, sl]) for x in (q, k, v, g)), initial_state=cast(h0),
                      cu_seqlens=cu.astype(rng.choice([np.int32, np.int64])))
    docs = layer.documents
    assert (docs.lo, docs.hi) == (lo, hi)
    fin = layer.final_state
    dq, dk, dv, dg, dh0 = layer.backward(cast(do[:, sl]), dht=cast(dht))

    # every collective first (an assertion failing on one rank must not leave the others in a collective)
    fulls = {name: np.concatenate(comm.allgather(np.asarray(x, dtype=np.float64)), axis=1)
             for name, x in zip("o dq dk dv dg".split(), (o, dq, dk, dv, dg))}
    full_fin, count_fin = gather_rows(comm, fin, docs.ends, N)
    full_dh0, count_dh0 = gather_rows(comm, dh0, docs.starts, N)

    tol = 1e-10 if dtype == np.float64 else 2e-4
    assert o.dtype == dtype and o.shape == (1, hi - lo, H, V)
    for (name, full), got, ref in zip(fulls.items(), (o, dq, dk, dv, dg), (o_ref, *grads_ref[:4])):
        assert got.shape == ref[:, sl].shape, name
        assert rel(full, ref) < tol, (name, rel(full, ref))
    # every document's final state and dh0 come from exactly one rank
    assert fin.shape == (len(docs.ends), H, K, V) and dh0.shape == (len(docs.starts), H, K, V)
    assert (count_fin == 1).all() and (count_dh0 == 1).all(), (count_fin, count_dh0)
    assert rel(full_fin, fin_ref) < tol, rel(full_fin, fin_ref)
    assert rel(full_dh0, grads_ref[4]) < tol, rel(full_dh0, grads_ref[4])
    # which documents end here: those whose last token (an empty one: whose position) is in this slice
    for i in docs.ends:
        if lengths[i]:
            assert lo <= cu[i + 1] - 1 < hi, (i, lo, hi)
        else:
            assert lo <= cu[i] < hi or (cu[i] == T and r == P - 1), (i, lo, hi)


@pytest.mark.mpi
def test_the_layer_runs_plain_after_packed_and_packed_after_plain(comm, rng):
    """The same layer object: a packed call, a plain call, a packed call; each equals its reference."""
    P, r = comm.Get_size(), comm.Get_rank()
    H, K, V, L = 1, 4, 3, 12
    T = L * P
    q, k, v, g = (rng.standard_normal((1, T, H, d)) for d in (K, K, V, K))
    g = -np.abs(g) * 0.3
    cu = np.array([0, T // 3, T // 3, T])
    sl = slice(L * r, L * (r + 1))
    layer = ZeCOGLA(comm, chunk_size=4)
    o_ref = recurrent_gla(q, k, v, g, cu_seqlens=cu)[0]
    o_plain = recurrent_gla(q, k, v, g)[0]
    results = []  # asserted after the loop: a failure on one rank must not leave the others in a collective
    for packed in (True, False, True):
        o = layer.forward(q[:, sl], k[:, sl], v[:, sl], g[:, sl], cu_seqlens=cu if packed else None)
        docs = layer.documents
        grads = layer.backward(np.ones_like(o))
        results.append((packed, o, docs, grads[4]))
    for packed, o, docs, dh0 in results:
        assert rel(o, (o_ref if packed else o_plain)[:, sl]) < 1e-10
        assert (docs is not None) == packed
        if packed:
            assert dh0.shape == (len(docs.starts), H, K, V)
        else:
            assert (dh0 is None) == (r != 0)


def test_rank_documents_partition_the_documents(rng):
    """Serial: for random offsets and slices (empty ones included), the pieces tile each slice, every document
    starts on exactly one rank and ends on exactly one, and an empty document lives where its position does."""
    for _ in range(200):
        P = int(rng.integers(1, 7))
        T = int(rng.integers(0, 40))
        bounds = np.concatenate([[0], np.sort(rng.integers(0, T + 1, size=P - 1)), [T]])
        cu = np.concatenate([[0], np.sort(rng.integers(0, T + 1, size=int(rng.integers(0, 8)))), [T]])
        N = len(cu) - 1
        starts, ends = np.zeros(N, int), np.zeros(N, int)
        for p in range(P):
            d = rank_documents(cu, bounds, p)
            lo, hi = int(bounds[p]), int(bounds[p + 1])
            if hi > lo:
                assert d.cu_local[0] == 0 and d.cu_local[-1] == hi - lo and (np.diff(d.cu_local) > 0).all()
                assert d.continues == (cu[d.pieces[0]] < lo) and d.continues_after == (cu[d.pieces[-1] + 1] > hi)
            else:
                assert len(d.pieces) == 0 and not d.continues and not d.continues_after
            starts[d.starts] += 1
            ends[d.ends] += 1
            for i in d.empty:
                x = cu[i]
                assert (lo <= x < hi) or (x == T and p == P - 1)
        assert (starts == 1).all() and (ends == 1).all(), (cu, bounds, starts, ends)


@pytest.mark.mpi
def test_bad_cu_seqlens_fail_on_every_rank(comm, rng):
    P, r = comm.Get_size(), comm.Get_rank()
    H, K, V, L = 2, 4, 3, 6
    T = L * P
    q, k, v = (rng.standard_normal((1, L, H, d)) for d in (K, K, V))
    g = -np.abs(rng.standard_normal((1, L, H, K)))
    layer = ZeCOGLA(comm)
    bad = P - 1
    good = np.array([0, T // 2, T])

    def fails(cu, match, h0=None, x=(q, k, v, g)):
        msg = agreed_error(comm, lambda: layer.forward(*x, initial_state=h0, cu_seqlens=cu), error=(
            CollectiveInputError, ValueError, TypeError))
        assert msg is not None and any(m in msg for m in match.split("|")), msg

    mine = lambda x: x if r == bad else good  # noqa: E731 - the bad value on one rank only
    fails(mine(np.array([0, T, T // 2, T])), "non-decreasing")
    fails(mine(np.array([1, T])), "start at 0")
    fails(np.array([0, T + 1]), "ends at")  # the same on every rank: checked against the slices collectively
    fails(mine(np.array([0.0, T])), "integer dtype")
    fails(mine(np.array([[0, T]])), "1-D")
    fails(mine(np.array([True, True])), "integer dtype")
    if P > 1:
        fails(mine(np.array([0, 1, T])), "disagree on cu_seqlens")
    fails(good, "batch size must be 1", x=tuple(np.concatenate([a] * 2) if r == bad else a for a in (q, k, v, g)))
    h0 = rng.standard_normal((2, H, K, V))
    fails(good, "initial_state has shape", h0=h0[:1] if r == bad else h0)
    if P > 1:
        fails(good, "disagree on initial_state per document", h0=h0 if r == bad else None)
    hn = h0.copy()
    if r == bad:
        hn[1, 0, 0, 0] = np.nan
    fails(good, "NaN", h0=hn)
    # backward: dht of the wrong number of documents on one rank
    layer.forward(q, k, v, g, initial_state=h0, cu_seqlens=good)
    dht = rng.standard_normal((2, H, K, V))
    msg = agreed_error(comm, lambda: layer.backward(np.ones((1, L, H, V)), dht=dht[:1] if r == bad else dht))
    assert msg is not None and "dht has shape" in msg
    if P > 1:
        msg = agreed_error(comm, lambda: layer.backward(np.ones((1, L, H, V)), dht=dht if r == bad else None))
        assert msg is not None and "dht per document" in msg
    # the layer still works after all those errors
    o = layer.forward(q, k, v, g, initial_state=h0, cu_seqlens=good)
    grads = layer.backward(np.ones((1, L, H, V)), dht=dht)
    assert np.isfinite(o).all() and all(np.isfinite(x).all() for x in grads)


@pytest.mark.mpi
def test_packed_check_values_false_propagates_a_nan(comm, rng):
    """check_values=False with packed documents: a NaN on one rank raises nowhere (no rank is left waiting in the
    scan) and stays inside its own document."""
    r = comm.Get_rank()
    H, K, V, L = 1, 3, 2, 10
    T = L * comm.Get_size()
    q, k, v, g = (rng.standard_normal((1, L, H, d)) for d in (K, K, V, K))
    g = -np.abs(g)
    cu = np.array([0, 3, T])  # document 0: tokens 0 .. 2 on rank 0; document 1: the rest
    if r == 0:
        k[0, 1] = np.nan  # k enters the state: the rest of document 0 turns NaN
    layer = ZeCOGLA(comm, check_values=False, chunk_size=4)
    with np.errstate(invalid="ignore"):
        o = layer.forward(q, k, v, g, cu_seqlens=cu)
        grads = layer.backward(np.ones((1, L, H, V)))
    assert len(grads) == 5
    if r == 0:
        assert np.isnan(o[0, 1:3]).all() and np.isfinite(o[0, 3:]).all()
    else:
        assert np.isfinite(o).all()
