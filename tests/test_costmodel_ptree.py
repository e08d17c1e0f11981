"""The cost model of the pipelined tree (``ptree_time``, ``best_blocks_ptree``, ``ptree_from_times``,
``ptree_time_hier``), ``choose`` among all four candidates, and the big-state shift and combine terms
(``beta_at`` / ``gamma_at``) that the tree, allgather, exscan and serial relay pay; their calibration pieces
(``measure_big``, ``measure_ptree``) under MPI."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hpczeco.collectives import costmodel as cm

MIB = 1 << 20
HOST = cm.LinkParams(alpha=5e-6, beta=4e-10, gamma=1.5e-10, delta=2e-6, overhead=80e-6)
BIG = replace(HOST, beta_big=9e-10, gamma_big=4e-10)


def test_ptree_at_two_ranks_is_the_rings_hop():
    for m in (4096.0, MIB, 16 * MIB):
        for k in (1, 2, 7, 32):
            assert cm.ptree_time(2, m, k, HOST) == pytest.approx(cm.ring_time(2, m, k, HOST), rel=1e-12)
    assert cm.ptree_time(1, MIB, 4, HOST) == 0.0
    with pytest.raises(ValueError):
        cm.ptree_time(4, MIB, 0, HOST)


def test_ptree_first_piece_counts_the_sweeps():
    # unit hops, free combines and launches: the longest chain of messages through both sweeps
    assert cm._ptree_first_piece(2, lambda u, v: 1.0, 0.0, lambda u, v: 0.0) == 1.0  # 0 -> 1
    assert cm._ptree_first_piece(3, lambda u, v: 1.0, 0.0, lambda u, v: 0.0) == 2.0  # 0 -> 1 -> 2
    for P in (7, 8, 15, 16, 100, 1024):  # up and down through the depth: about 2 log2 P hops
        hops = cm._ptree_first_piece(P, lambda u, v: 1.0, 0.0, lambda u, v: 0.0)
        d = P.bit_length() - 1
        assert d <= hops <= 2 * d + 1, (P, hops)
    # the ring's chain is P - 1 hops: the tree's is logarithmic
    assert cm._ptree_first_piece(1024, lambda u, v: 1.0, 0.0, lambda u, v: 0.0) < 25


def test_ptree_beats_ring_at_scale_and_loses_on_bandwidth():
    # many ranks, small states: the tree's log P depth wins; few ranks, big states: three pieces each way lose
    assert cm.predict("ptree", 1024, MIB, HOST) < cm.predict("ring", 1024, MIB, HOST)
    assert cm.predict("ptree", 8, 16 * MIB, HOST) > 1.5 * cm.predict("ring", 8, 16 * MIB, HOST)
    k = cm.best_blocks_ptree(64, 16 * MIB, 128, HOST)
    assert 1 < k <= 128 and k in cm.PTREE_K_LADDER
    assert cm.best_blocks_ptree(64, 1024, 128, HOST) == 1  # a tiny state: one piece
    assert cm.best_blocks_ptree(64, 16 * MIB, 5, HOST) <= 5


def test_choose_is_the_argmin_of_predict():
    for params in (HOST, BIG, cm.PRESETS["nvlink4"], cm.PRESETS["tcp"]):
        for P in (2, 3, 8, 16, 64, 512):
            for m in (16 << 10, MIB, 16 * MIB):
                topo, k = cm.choose(P, m, 128, params)
                got = cm.predict(topo, P, m, params, blocks=k)
                for t in ("ring", "tree", "allgather", "ptree"):
                    assert got <= cm.predict(t, P, m, params) * (1 + 1e-12), (params.name, P, m, topo, t)
                assert (k is None) == (topo not in ("ring", "ptree"))


def test_ptree_beta_from_times_recovers_the_term():
    for P in (3, 8, 12, 16):
        truth = replace(HOST, ptree_beta=2.3e-9)
        ks = [8, 32]
        times = [cm.ptree_time(P, 2 * MIB, k, truth) for k in ks]
        assert cm.ptree_from_times(P, 2 * MIB, ks, times, HOST) == pytest.approx(2.3e-9, rel=1e-9)
    with pytest.raises(ValueError):
        cm.ptree_from_times(4, 2 * MIB, [1, 8], [1.0, 2.0], HOST)
    with pytest.raises(ValueError):
        cm.ptree_from_times(4, 2 * MIB, [8], [float("nan")], HOST)


def test_beta_and_gamma_at_interpolate_in_log_size():
    lo, hi = BIG.shift_bytes, BIG.big_bytes
    assert (lo, hi) == (4 * MIB, 16 * MIB)
    for m in (1.0, MIB, lo):
        assert cm.beta_at(m, BIG) == BIG.beta and cm.gamma_at(m, BIG) == BIG.gamma
    for m in (hi, 1e12):
        assert cm.beta_at(m, BIG) == BIG.beta_big and cm.gamma_at(m, BIG) == BIG.gamma_big
    assert cm.beta_at(8 * MIB, BIG) == pytest.approx((BIG.beta + BIG.beta_big) / 2, rel=1e-12)
    for m in (MIB, 64 * MIB):  # without the big terms: the small ones everywhere
        assert cm.beta_at(m, HOST) == HOST.beta and cm.gamma_at(m, HOST) == HOST.gamma
    # the tree, allgather and exscan pay them on big states, not on small ones
    for t in ("tree", "allgather", "exscan", "serial", "ptree"):
        assert cm.predict(t, 12, 16 * MIB, BIG) > 1.3 * cm.predict(t, 12, 16 * MIB, HOST), t
        assert cm.predict(t, 12, 64 << 10, BIG) == pytest.approx(cm.predict(t, 12, 64 << 10, HOST), rel=1e-12), t
    # the allgather's working set is all P pairs: big already at 1 MiB per rank on 16 ranks
    assert cm.predict("allgather", 16, MIB, BIG) > cm.predict("allgather", 16, MIB, HOST)


def test_big_terms_checked_parsed_and_old_results_load():
    with pytest.raises(ValueError, match="shift_bytes < big_bytes"):
        replace(BIG, shift_bytes=32 * MIB)
    with pytest.raises(ValueError, match="ptree_beta"):
        replace(HOST, ptree_beta=-1.0)
    p = cm.parse_link("5e-6,4e-10,1.5e-10,2e-6,8e-5,beta_big=9e-10,gamma_big=4e-10,ptree_beta=2e-9")
    assert (p.beta_big, p.gamma_big, p.ptree_beta) == (9e-10, 4e-10, 2e-9)
    old = {k: v for k, v in BIG.as_dict().items() if k not in ("beta_big", "gamma_big", "shift_bytes", "big_bytes",
                                                                "ptree_beta")}
    assert cm.LinkParams(**old).beta_big == 0.0
    assert "shift" in BIG.describe() and "ptree stage" in replace(HOST, ptree_beta=1e-9).describe()


def test_ptree_two_level_model():
    nv, ib = cm.PRESETS["nvlink4"], cm.PRESETS["ib-ndr"]
    for P in (2, 5, 8):  # one node: the flat model with the intra link
        t, k = cm.predict_hier("ptree", P, MIB, nv, ib, 8)
        assert t == pytest.approx(cm.predict("ptree", P, MIB, nv, blocks=k), rel=1e-12)
    prev = 0.0
    for P in (16, 64, 256, 1024):
        t, k = cm.predict_hier("ptree", P, MIB, nv, ib, 8)
        assert k in cm.PTREE_K_LADDER and t > prev
        prev = t
        assert t < cm.predict_hier("ring", P, MIB, nv, ib, 8)[0] or P < 32
    # slower links between nodes cost more
    slow = replace(ib, beta=ib.beta * 10)
    assert cm.predict_hier("ptree", 256, MIB, nv, slow, 8)[0] > cm.predict_hier("ptree", 256, MIB, nv, ib, 8)[0]


@pytest.mark.mpi
def test_measure_big_and_ptree(comm):
    from hpczeco.collectives import calibrate

    P = comm.Get_size()
    bb, gb = calibrate.measure_big(comm, 1 << 20, 1e-6, 1e-6, repeats=2)
    assert bb >= 0 and gb >= 0 and math.isfinite(bb) and math.isfinite(gb)
    assert comm.allgather((bb, gb)) == [(bb, gb)] * P  # the same everywhere
    if P == 1:
        assert bb == 0.0
    pb = calibrate.measure_ptree(comm, HOST, repeats=2, blocks=(4, 8))
    assert pb >= 0 and comm.allgather(pb) == [pb] * P
    if P < 3:
        assert pb == 0.0
    m, t = calibrate.ptree_times(comm, 1 << 16, (2, 4), repeats=2)
    assert m >= 1 << 16 and len(t) == 2 and all(np.isfinite(t)) and min(t) > 0
