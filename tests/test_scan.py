"""Exclusive scans over ranks (hpczeco.collectives.scan): every topology against a float64 fold.

Every rank regenerates every rank's inputs from the shared ``rng`` seed, computes the sequential
float64 fold of all of them, and checks its own result. Runs under mpiexec at n = 1..5.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import agreed_error
from hpczeco.collectives import scan, scan_start
from hpczeco.collectives.ring import relay_recv, relay_send
from hpczeco.collectives.scan import TOPOLOGIES, combine, fold_reference

pytestmark = pytest.mark.mpi

CONCRETE = ("ring", "tree", "allgather", "serial", "exscan", "ptree", "auto")


def make_inputs(rng, P, lead, K, V):
    """Everyone's (a, S) in float64, decays in (0, 1], and an initial state."""
    A = [rng.uniform(0.0, 1.0, lead + (K,)) for _ in range(P)]
    for x in A:  # (0, 1]: no zeros, some exact ones
        x[x == 0.0] = 0.5
        x.flat[0] = 1.0
    S = [rng.standard_normal(lead + (K, V)) for _ in range(P)]
    init = rng.standard_normal(lead + (K, V))
    return A, S, init


def expected(A, S, init, rank, reverse):
    order = list(range(len(A)))[::-1] if reverse else list(range(len(A)))
    ref = fold_reference([(A[q], S[q]) for q in order], init)
    return ref[order.index(rank)], order[0] == rank


def tol(dtype, P):
    return 1e-12 if dtype == np.float64 else 2e-5 * P


def test_combine_is_associative_not_commutative(rng):
    x, y, z = ((rng.uniform(0, 1, (3,)), rng.standard_normal((3, 2))) for _ in range(3))
    left = combine(combine(x, y), z)
    right = combine(x, combine(y, z))
    for u, v in zip(left, right):
        np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)
    assert not np.allclose(combine(x, y)[1], combine(y, x)[1])


def test_every_topology_matches_fold(comm, rng):
    P, rank = comm.Get_size(), comm.Get_rank()
    K, V = 6, 3
    full = [(dt, rev, ini) for dt in (np.float64, np.float32) for rev in (False, True) for ini in (False, True)]
    for lead, combos in (((2, 3), full), ((), [(np.float32, False, True), (np.float64, True, False)])):
        A, S, init = make_inputs(rng, P, lead, K, V)
        for dtype, reverse, use_init in combos:
            ref, first = expected(A, S, init if use_init else None, rank, reverse)
            cases = [("ring", 1), ("ring", 4), ("ring", K), ("ring", None), ("ptree", 1), ("ptree", 4), ("ptree", K)]
            cases += [(t, None) for t in CONCRETE if t != "ring"]
            for topo, blocks in cases:
                out = scan(
                    A[rank].astype(dtype),
                    S[rank].astype(dtype),
                    comm,
                    topology=topo,
                    blocks=blocks,
                    reverse=reverse,
                    initial=init.astype(dtype) if (use_init and first) else None,
                )
                what = f"{topo} blocks={blocks} lead={lead} {dtype.__name__} reverse={reverse} init={use_init}"
                assert out.shape == S[rank].shape and out.dtype == dtype, what
                np.testing.assert_allclose(out, ref, rtol=tol(dtype, P), atol=tol(dtype, P), err_msg=what)


def test_ring_any_blocks_and_one_row(comm, rng):
    """Every blocks value 1..K for a small K, and K = 1 (one row)."""
    P, rank = comm.Get_size(), comm.Get_rank()
    for K in (5, 1):
        A, S, _ = make_inputs(rng, P, (), K, 2)
        ref, _ = expected(A, S, None, rank, False)
        for blocks in range(1, K + 1):
            out = scan(A[rank], S[rank], comm, topology="ring", blocks=blocks)
            np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12, err_msg=f"K={K} blocks={blocks}")


def test_inputs_unchanged_and_noncontiguous(comm, rng):
    P, rank = comm.Get_size(), comm.Get_rank()
    A, S, _ = make_inputs(rng, P, (4,), 3, 5)
    ref, _ = expected(A, S, None, rank, False)
    a = np.asfortranarray(A[rank])
    s = np.asfortranarray(S[rank])
    a0, s0 = a.copy(), s.copy()
    for topo in CONCRETE:
        out = scan(a, s, comm, topology=topo)
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12, err_msg=topo)
        np.testing.assert_array_equal(a, a0)
        np.testing.assert_array_equal(s, s0)


def test_out_buffer_and_reuse(comm, rng):
    """``out=`` is filled and returned; pooled scratch buffers never leak old data into new results."""
    P, rank = comm.Get_size(), comm.Get_rank()
    for trial in range(2):
        A, S, init = make_inputs(rng, P, (3,), 4, 5)
        for reverse in (False, True):
            ref, first = expected(A, S, init, rank, reverse)
            for topo in CONCRETE:
                out = np.full_like(S[rank], np.nan)
                got = scan(A[rank], S[rank], comm, topology=topo, blocks=3, reverse=reverse,
                           initial=init if first else None, out=out)
                assert got is out, topo
                np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12, err_msg=f"{topo} trial {trial}")
    s = S[rank]
    with pytest.raises(ValueError, match="out must not overlap S"):
        scan(A[rank], s, comm, out=s)
    with pytest.raises(ValueError, match="out has shape"):
        scan(A[rank], s, comm, out=np.empty((1,) + s.shape))
    with pytest.raises(TypeError, match="out must be"):
        scan(A[rank], s, comm, out=s.astype(np.float32))


def test_scan_start_test_wait(comm, rng):
    P, rank = comm.Get_size(), comm.Get_rank()
    A, S, init = make_inputs(rng, P, (2,), 8, 4)
    for reverse in (False, True):
        ref, first = expected(A, S, init, rank, reverse)
        for topo in CONCRETE:
            for progress in ("poll", "thread"):
                h = scan_start(A[rank], S[rank], comm, topology=topo, blocks=None, reverse=reverse,
                               initial=init if first else None, progress=progress)
                polls = 0
                while not h.test():  # other work would go here
                    polls += 1
                    assert polls < 10_000_000
                assert h.done
                out = h.wait()
                assert h.wait() is out  # idempotent
                np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12, err_msg=f"{topo} {progress}")
                assert h.topology in TOPOLOGIES


def test_two_scans_in_flight(comm, rng):
    """Forward and backward (and a second layer) in flight at once, completed in another order."""
    P, rank = comm.Get_size(), comm.Get_rank()
    A, S, init = make_inputs(rng, P, (2,), 6, 3)
    B, T, _ = make_inputs(rng, P, (2,), 6, 3)
    for topo_f, topo_b in (("ring", "ring"), ("tree", "ring"), ("ring", "exscan"), ("allgather", "tree"),
                           ("ptree", "ring"), ("ring", "ptree")):
        ref_f, first_f = expected(A, S, init, rank, False)
        ref_b, _ = expected(B, T, None, rank, True)
        ref_2, _ = expected(B, T, None, rank, False)
        hf = scan_start(A[rank], S[rank], comm, topology=topo_f, blocks=2, initial=init if first_f else None)
        hb = scan_start(B[rank], T[rank], comm, topology=topo_b, blocks=3, reverse=True)
        h2 = scan_start(B[rank], T[rank], comm, topology=topo_f, blocks=6)
        hb.test()
        out_2 = h2.wait()
        out_b = hb.wait()
        out_f = hf.wait()
        what = f"{topo_f}/{topo_b}"
        np.testing.assert_allclose(out_f, ref_f, rtol=1e-12, atol=1e-12, err_msg=what)
        np.testing.assert_allclose(out_b, ref_b, rtol=1e-12, atol=1e-12, err_msg=what)
        np.testing.assert_allclose(out_2, ref_2, rtol=1e-12, atol=1e-12, err_msg=what)


def test_relay_chain(comm, rng):
    """LASP-1 style: receive whole, combine, send whole -- in both directions."""
    P, rank = comm.Get_size(), comm.Get_rank()
    A, S, _ = make_inputs(rng, P, (2,), 4, 3)
    for reverse in (False, True):
        ref, first = expected(A, S, None, rank, reverse)
        buf = np.empty_like(S[rank])
        got = relay_recv(buf, comm, reverse=reverse)
        assert got == (not first)
        if not got:
            buf[...] = 0.0
        np.testing.assert_allclose(buf, ref, rtol=1e-12, atol=1e-12)
        out = A[rank][..., None] * buf + S[rank]
        relay_send(out, comm, reverse=reverse)


# --------------------------------------------------------------------------- validation


def test_mismatches_raise_everywhere(comm, rng):
    P, rank = comm.Get_size(), comm.Get_rank()
    last = P - 1
    K, V = 4, 3
    A, S, init = make_inputs(rng, P, (2,), K, V)
    a, s = A[rank], S[rank]

    def bad(cond, x, y):
        return x if cond else y

    cases = [
        # (name, needs >1 rank, kwargs builder, expected fragment)
        ("K differs", True, lambda: dict(a=bad(rank == last, a[..., :3], a), S=bad(rank == last, s[..., :3, :], s)),
         "disagree on S.shape"),
        ("dtype differs", True, lambda: dict(a=bad(rank == last, a.astype(np.float32), a),
                                             S=bad(rank == last, s.astype(np.float32), s)), "disagree on dtype"),
        ("blocks differ", True, lambda: dict(blocks=bad(rank == last, 2, 3)), "disagree on blocks"),
        ("topology differs", True, lambda: dict(topology=bad(rank == last, "tree", "ring")), "disagree on topology"),
        ("reverse differs", True, lambda: dict(reverse=(rank == last)), ""),
        ("initial on wrong rank", True, lambda: dict(initial=bad(rank == last, init, None)), "initial must be None"),
        ("initial on every rank", True, lambda: dict(initial=init), "initial must be None"),
        ("blocks 0", False, lambda: dict(blocks=0), "blocks must be in 1..K=4"),
        ("blocks K+1", False, lambda: dict(blocks=K + 1), "blocks must be in 1..K=4"),
        ("blocks float", False, lambda: dict(blocks=2.0), "blocks must be an int"),
        ("bad topology", False, lambda: dict(topology="butterfly"), "topology must be one of"),
        ("a/S shapes", False, lambda: dict(a=bad(rank == last, a[:1], a)), "expected [1, 4, 'V']"),
        ("NaN in S", False, lambda: dict(S=bad(rank == last, np.where(s > 1e9, s, np.nan), s)), "S contains NaN"),
        ("Inf in S", False, lambda: dict(S=bad(rank == 0, s + np.inf, s)), "S contains NaN or Inf"),
        ("NaN in a", False, lambda: dict(a=bad(rank == last, a * np.nan, a)), "a contains NaN"),
        ("decay > 1", False, lambda: dict(a=bad(rank == last, a + 1.5, a)), "outside [0, 1]"),
        ("decay < 0", False, lambda: dict(a=bad(rank == 0, -a, a)), "outside [0, 1]"),
        ("not an array", False, lambda: dict(S=bad(rank == last, s.tolist(), s)), "S must be a numpy or cupy array"),
        ("float16", False, lambda: dict(a=a.astype(np.float16), S=s.astype(np.float16)), "float32 or float64"),
        ("bad initial shape", False, lambda: dict(initial=bad(rank == 0, init[:, :2], None)), "initial has shape"),
        ("NaN initial", False, lambda: dict(initial=bad(rank == 0, init * np.nan, None)), "initial contains NaN"),
    ]
    ref, _ = expected(A, S, None, rank, False)
    for topo in ("ring", "tree", "exscan", "ptree"):
        for name, multi, build, frag in cases:
            if multi and P == 1:
                continue
            kw = dict(a=a, S=s, topology=topo)
            kw.update(build())
            msg = agreed_error(comm, lambda kw=kw: scan(kw.pop("a"), kw.pop("S"), comm, **kw))
            assert msg is not None, f"{name}: no error"
            assert msg.startswith("scan: ") and frag in msg, f"{name}: {msg}"
        # nothing was half-sent: a valid scan on the same communicator is still right
        out = scan(a, s, comm, topology=topo, blocks=2)
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_transport_argument(comm, rng):
    """None, a name, or a Transport object; a device transport name with host arrays is refused everywhere."""
    from hpczeco.collectives.transport import HostTransport

    P, rank = comm.Get_size(), comm.Get_rank()
    A, S, _ = make_inputs(rng, P, (2,), 4, 3)
    ref, _ = expected(A, S, None, rank, False)
    for tr in (None, "host", "auto", HostTransport(comm)):
        for topo in ("ring", "tree", "allgather"):
            out = scan(A[rank], S[rank], comm, topology=topo, blocks=2, transport=tr)
            np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12, err_msg=f"{topo} {tr}")
    msg = agreed_error(comm, lambda: scan(A[rank], S[rank], comm, transport="nccl"))
    assert msg is not None and "needs device (CuPy) arrays" in msg
    msg = agreed_error(comm, lambda: scan(A[rank], S[rank], comm, transport="pigeon" if rank == P - 1 else None))
    assert msg is not None and "transport must be one of" in msg
    buf = np.empty_like(S[rank])
    got = relay_recv(buf, comm, transport="host")
    relay_send(S[rank], comm, transport="host")
    assert got == (rank > 0)
    if got:
        np.testing.assert_array_equal(buf, S[rank - 1])


def test_auto_device_transport_skips_nccl_where_ranks_share_a_gpu(comm, monkeypatch):
    """NCCL refuses two ranks of one communicator on one GPU: "auto" then picks host staging, and an
    explicit "nccl" is the same clear error on every rank (the GPU ids are stood in for: no GPU here)."""
    from hpczeco.collectives import device as D

    P, rank = comm.Get_size(), comm.Get_rank()
    monkeypatch.setattr(D, "cuda_aware_known", lambda: False)
    monkeypatch.setattr(D, "nccl_available", lambda: True)
    monkeypatch.setattr(D, "gpu_id", lambda: f"node/0000:{rank:02x}:00.0")  # one GPU each
    assert D.shared_gpus(comm) == {}
    assert D.resolve_kind(comm, "auto") == "nccl"
    monkeypatch.setattr(D, "gpu_id", lambda: f"node/0000:{min(rank, 1):02x}:00.0")  # ranks 1.. share one
    assert D.shared_gpus(comm) == ({"node/0000:01:00.0": list(range(1, P))} if P > 2 else {})
    assert D.resolve_kind(comm, "auto") == ("staged" if P > 2 else "nccl")
    if P > 2:
        msg = agreed_error(comm, lambda: D.NcclTransport(comm), ValueError)
        assert msg is not None and msg.startswith("transport 'nccl' needs one GPU per rank: ranks [1, 2")


def test_transport_env_is_read_once_and_agreed(comm, monkeypatch):
    """$HPCZECO_TRANSPORT is read once, where a communicator's context is made, and agreed over its ranks: the
    kind named alike everywhere is the default device kind (unset: "auto"); a value that differs between the ranks,
    or is not a kind, is the same error on every rank when the context is made (before any other message)."""
    from hpczeco.collectives.context import get_context
    from hpczeco.collectives.names import TRANSPORT_ENV
    from hpczeco.collectives.selection import transport_for

    P, r = comm.Get_size(), comm.Get_rank()
    last = r == P - 1
    cases = [("staged", "staged", "staged", None), (None, None, "auto", None), ("auto", None, "auto", None),
             ("nccl", None, None, "configuration mismatch: $HPCZECO_TRANSPORT differs between the ranks"),
             ("nccl", "pigeon", None, "must be one of auto, cuda-aware, staged, nccl (or unset), got 'pigeon' on "
                                      "rank(s)")]
    for value, on_last, want_kind, want_error in cases:
        if want_error == "configuration mismatch: $HPCZECO_TRANSPORT differs between the ranks" and P == 1:
            continue  # one rank cannot disagree with itself
        mine = on_last if last else value
        if mine is None:
            monkeypatch.delenv(TRANSPORT_ENV, raising=False)
        else:
            monkeypatch.setenv(TRANSPORT_ENV, mine)
        dup = comm.Dup()
        try:
            msg = agreed_error(comm, lambda d=dup: get_context(d))
            if want_error is None:
                assert msg is None
                ctx = get_context(dup)
                monkeypatch.setenv(TRANSPORT_ENV, "cuda-aware")  # read once: a later change does not count
                assert ctx.device_kind == want_kind
                assert transport_for(ctx, None, np.zeros(3)).name == "host"
            else:
                assert msg is not None and want_error in msg, msg
                if "pigeon" in want_error:
                    assert msg.endswith(f"[{P - 1}]"), msg
        finally:
            dup.Free()


def test_error_types(comm, rng):
    P, rank = comm.Get_size(), comm.Get_rank()
    a = rng.uniform(0.1, 1, (3,))
    s = rng.standard_normal((3, 2))
    with pytest.raises(TypeError, match="float32 or float64"):
        scan(a.astype(np.int64), s, comm)
    with pytest.raises(ValueError, match="blocks must be in"):
        scan(a, s, comm, blocks=9)
    with pytest.raises(TypeError, match="intra-communicator"):
        scan(a, s, None)
    with pytest.raises(TypeError, match="reverse must be a bool"):
        scan(a, s, comm, reverse="yes")
    with pytest.raises(ValueError, match="progress must be"):
        scan_start(a, s, comm, progress="magic")
    assert rank < P


def test_check_values_switch(comm, rng):
    """By default a NaN in S is refused on every rank; check_values=False skips the data scans (the
    caller validated the data) and the scan still folds finite inputs exactly."""
    P, r = comm.Get_size(), comm.Get_rank()
    a_all = rng.uniform(0.1, 1.0, size=(P, 2, 5))
    S_all = rng.standard_normal((P, 2, 5, 3))
    want = fold_reference([(a_all[p], S_all[p]) for p in range(P)])[r]
    got = scan(a_all[r].copy(), S_all[r].copy(), comm, topology="ring", check_values=False)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    bad = S_all[r].copy()
    if r == P - 1:
        bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        scan(a_all[r].copy(), bad, comm, topology="ring")
