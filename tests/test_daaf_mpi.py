"""DAAF over MPI: halo exchange / allgather-v / reduce-scatter-v, and distributed attention equal to one rank.

Run under ``mpiexec -n N python -m pytest -m mpi tests/test_daaf_mpi.py`` (N = 1..5). Every assertion
holds on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from hpczeco.collectives.agree import CollectiveInputError
from hpczeco.collectives.halo import allgather_v, allreduce, halo_exchange, reduce_scatter_v

from hpczeco.daaf import attention, plan, plan_from_mask
from hpczeco.daaf.distributed import distributed_attention, head_range, sequence_range


def _shared(rng, comm) -> np.random.Generator:
    """A generator identical on every rank (rank 0's draw, broadcast)."""
    return np.random.default_rng(comm.bcast(int(rng.integers(2**62)), root=0))


def _lengths(kind: str, T: int, P: int, gen) -> list[int]:
    if kind == "even":
        return [sequence_range_len(T, P, p) for p in range(P)]
    if kind == "short":  # several ranks shorter than the halo, one of them empty
        cuts = np.sort(gen.integers(0, T + 1, size=P - 1))
        if P > 1:
            cuts[0] = cuts[1] if P > 2 else cuts[0]
        return np.diff(np.concatenate([[0], cuts, [T]])).astype(int).tolist()
    lens = [0] * P  # "all-on-last": every rank but the last is empty
    lens[-1] = T
    return lens


def sequence_range_len(T: int, P: int, p: int) -> int:
    base, extra = divmod(T, P)
    return base + (1 if p < extra else 0)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["even", "short", "all-on-last"])
def test_halo_exchange_and_allgather_v(comm, rng, kind):
    gen = _shared(rng, comm)
    P, me = comm.Get_size(), comm.Get_rank()
    T = 23
    full = gen.standard_normal((2, T, 3))
    lens = _lengths(kind, T, P, gen)
    s = sum(lens[:me])
    mine = full[:, s : s + lens[me]]
    for width in (0, 3, 17, 1000):
        halo = halo_exchange(mine, width, comm, axis=1)
        np.testing.assert_array_equal(halo, full[:, max(0, s - width) : s])
    np.testing.assert_array_equal(allgather_v(mine, comm, axis=1), full)
    np.testing.assert_array_equal(allgather_v(np.ascontiguousarray(mine.transpose(1, 0, 2)), comm, axis=0),
                                  full.transpose(1, 0, 2))


@pytest.mark.mpi
def test_reduce_scatter_v_and_allreduce(comm, rng):
    gen = _shared(rng, comm)
    P, me = comm.Get_size(), comm.Get_rank()
    parts = gen.standard_normal((P, 4, 11))
    counts = _lengths("short", 11, P, gen)
    got = reduce_scatter_v(parts[me], counts, comm, axis=1)
    s = sum(counts[:me])
    np.testing.assert_allclose(got, parts.sum(0)[:, s : s + counts[me]], atol=1e-13)
    np.testing.assert_array_equal(allreduce(parts[me], comm, "max"), parts.max(0))


@pytest.mark.mpi
def test_halo_bad_input_raises_on_every_rank(comm):
    P, me = comm.Get_size(), comm.Get_rank()
    last = me == P - 1
    x = np.zeros((2, 5, 3))
    with pytest.raises(CollectiveInputError, match=f"rank {P - 1}: width must be >= 0"):
        halo_exchange(x, -1 if last else 2, comm)
    with pytest.raises(CollectiveInputError, match="axis 3 is out of range"):
        allgather_v(x, comm, axis=3 if last else 1)
    with pytest.raises(CollectiveInputError, match="counts sum to"):
        reduce_scatter_v(x, [5] + [0] * (P - 1) if not last else [4] + [0] * (P - 1), comm, axis=1)
    if P > 1:
        with pytest.raises(CollectiveInputError, match="disagree on dtype"):
            allgather_v(x.astype(np.float32) if last else x, comm)
        with pytest.raises(CollectiveInputError, match="disagree on width"):
            halo_exchange(x, 3 if last else 2, comm)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["even", "short", "all-on-last"])
@pytest.mark.parametrize("W,gkind", [(5, "regions"), (16, "random"), (0, "empty"), (7, "full")])
def test_distributed_attention_equals_one_rank(comm, rng, kind, W, gkind):
    gen = _shared(rng, comm)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        _check_distributed(comm, gen, kind, dtype, tol, W, gkind)


def _check_distributed(comm, gen, kind, dtype, tol, W, gkind):
    P, me = comm.Get_size(), comm.Get_rank()
    T, B, H, D, Dv = 61, 2, 2, 6, 5
    g = {"regions": (np.arange(T) // 9) % 3 == 1, "random": gen.random(T) < 0.2,
         "empty": np.zeros(T, bool), "full": np.ones(T, bool)}[gkind]
    p = plan_from_mask(g, W)
    q, k, v = (gen.standard_normal((B, T, H, d)).astype(dtype) for d in (D, D, Dv))
    want = attention(q, k, v, p)
    lens = _lengths(kind, T, P, gen)
    s = sum(lens[:me])
    sl = slice(s, s + lens[me])
    got = distributed_attention(q[:, sl], k[:, sl], v[:, sl], p, comm)
    assert got.dtype == dtype and got.shape == (B, lens[me], H, Dv)
    np.testing.assert_allclose(got, want[:, sl], rtol=0, atol=tol)
    # heads split: every rank the whole sequence for its own heads (possibly none)
    h0, h1 = head_range(H, comm)
    got_h = distributed_attention(q[:, :, h0:h1], k[:, :, h0:h1], v[:, :, h0:h1], p, comm, mode="heads")
    np.testing.assert_allclose(got_h, want[:, :, h0:h1], rtol=0, atol=tol)


@pytest.mark.mpi
def test_distributed_attention_planned_text(comm, rng):
    gen = _shared(rng, comm)
    tok = np.tile(np.arange(4), 100)
    tok[120:220] = gen.permutation(5000)[:100]
    p = plan(tok, window=50, local_window=12)
    assert p.policy == "threshold" and 0 < p.n_global < 400
    q, k, v = (gen.standard_normal((1, 400, 2, 8)) for _ in range(3))
    a, b = sequence_range(400, comm)
    got = distributed_attention(q[:, a:b], k[:, a:b], v[:, a:b], p, comm, scale=0.3)
    np.testing.assert_allclose(got, attention(q, k, v, p, 0.3)[:, a:b], rtol=0, atol=1e-12)


@pytest.mark.mpi
def test_distributed_bad_inputs_raise_everywhere(comm, rng):
    gen = _shared(rng, comm)
    P, me = comm.Get_size(), comm.Get_rank()
    last = me == P - 1
    T = 20  # every rank holds >= 4 rows for P <= 5
    p = plan_from_mask(np.zeros(T, bool), 4)
    q, k, v = (gen.standard_normal((1, T, 2, 4)) for _ in range(3))
    a, b = sequence_range(T, comm)
    ql, kl, vl = q[:, a:b], k[:, a:b], v[:, a:b]
    bad = ql.copy()
    if last:
        bad[0, 1, 0, 0] = np.nan
    with pytest.raises(CollectiveInputError, match=f"rank {P - 1}: q contains NaN"):
        distributed_attention(bad, kl, vl, p, comm)
    with pytest.raises(CollectiveInputError, match="k has shape"):
        distributed_attention(ql, kl[:, :-1] if last else kl, vl, p, comm)
    short = slice(0, b - a - 1) if last else slice(0, b - a)
    with pytest.raises(ValueError, match="plan covers T=20"):
        distributed_attention(ql[:, short], kl[:, short], vl[:, short], p, comm)
    with pytest.raises(CollectiveInputError, match="mode must be one of"):
        distributed_attention(ql, kl, vl, p, comm, mode="bogus" if last else "sequence")
    with pytest.raises(CollectiveInputError, match="plan must be"):
        distributed_attention(ql, kl, vl, None if last else p, comm)
    if P > 1:
        other = plan_from_mask(np.ones(T, bool), 4)
        with pytest.raises(CollectiveInputError, match="disagree on plan"):
            distributed_attention(ql, kl, vl, other if last else p, comm)
