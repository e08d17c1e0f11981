"""The cost model's ring stage cost (``LinkParams.ring_beta``): formula, the choice of k, its fit to measured ring
times with the per-piece term, old results without the key, and its calibration (``measure_ring``). That
``best_blocks`` is the exact optimum with it: test_costmodel_piece.py."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hpczeco.collectives import costmodel as cm

BASE = cm.LinkParams(alpha=4e-6, beta=3.2e-10, gamma=1.4e-10, delta=2.8e-6, overhead=80e-6)
SLOW = replace(BASE, piece=12e-6, ring_beta=1.5e-9)  # what the GPU machine's host cores fit (docs: network.md)


def test_ring_stage_term_by_hand():
    P, m, eager = 12, 1 << 20, SLOW.eager
    for k in (2, 8, 16, 31, 32, 33, 64):
        pi = 12e-6 if m / k > eager else 0.0
        expect = 80e-6 + (P + k - 2) * (4e-6 + pi + m * 1.5e-9 / k) + (P + k - 3) * 2.8e-6
        assert cm.ring_time(P, m, k, SLOW) == pytest.approx(expect, rel=1e-12), k
    assert cm.ring_time(2, m, 8, SLOW) == pytest.approx(80e-6 + 8 * (4e-6 + 12e-6 + m * 1.5e-9 / 8), rel=1e-12)
    # one piece (the serial relay) and the other topologies keep beta and gamma
    no_stage = replace(SLOW, ring_beta=0.0)
    assert cm.ring_time(P, m, 1, SLOW) == cm.ring_time(P, m, 1, no_stage)
    assert cm.serial_time(P, m, SLOW) == cm.serial_time(P, m, no_stage)
    for t in ("tree", "allgather", "exscan"):
        assert cm.predict(t, P, m, SLOW) == cm.predict(t, P, m, no_stage)


def test_a_costlier_byte_per_stage_takes_more_pieces():
    P, m, K = 12, 1 << 20, 128
    cheap, costly = replace(BASE, ring_beta=1e-11), replace(BASE, ring_beta=1e-9)
    assert cm.best_blocks(P, m, K, costly) > cm.best_blocks(P, m, K, cheap)


@pytest.mark.parametrize("P", [2, 5, 12])
@pytest.mark.parametrize("truth", [SLOW, replace(BASE, piece=0.0, ring_beta=4e-10), replace(BASE, piece=60e-6,
                                                                                               ring_beta=3e-9)])
def test_ring_from_times_recovers_both_terms(P, truth):
    m, ks = 2 << 20, [8, 16, 48]
    times = [cm.ring_time(P, m, k, truth) for k in ks]
    piece, ring_beta = cm.ring_from_times(P, m, ks, times, replace(truth, piece=0.0, ring_beta=0.0))
    assert piece == pytest.approx(truth.piece, abs=1e-12) and ring_beta == pytest.approx(truth.ring_beta, rel=1e-9)


def test_ring_from_times_least_squares_and_checks(rng):
    P, m, ks = 12, 2 << 20, [8, 16, 32, 48]
    exact = [cm.ring_time(P, m, k, SLOW) for k in ks]
    noisy = [t * (1 + 0.01 * e) for t, e in zip(exact, rng.standard_normal(len(ks)))]
    piece, ring_beta = cm.ring_from_times(P, m, ks, noisy, BASE)
    assert ring_beta == pytest.approx(SLOW.ring_beta, rel=0.1)
    assert cm.ring_time(P, 1 << 20, 27, replace(BASE, piece=piece, ring_beta=ring_beta)) == pytest.approx(
        cm.ring_time(P, 1 << 20, 27, SLOW), rel=0.1)
    # faster than the model's fixed terms allow: clamped at 0, not negative
    assert cm.ring_from_times(P, m, [8, 16], [1e-6, 1e-6], BASE) == (0.0, 0.0)
    for ks_bad, ts in (([8], [1e-3]), ([8, 8], [1e-3, 2e-3]), ([8, 16], [1e-3]), ([8, 128], [1e-3, 2e-3]),
                       ([1, 8], [1e-3, 2e-3])):
        with pytest.raises(ValueError):  # one point, repeated k, missing time, pieces <= eager, one piece
            cm.ring_from_times(P, m, ks_bad, ts, BASE)
    # a point set whose free fit has a negative per-piece cost: piece 0, ring_beta fitted alone
    cheap = replace(BASE, ring_beta=1.5e-9)
    ts = [cm.ring_time(P, m, k, cheap) - 2e-6 * (P + k - 2) for k in ks]  # stages 2 us cheaper than alpha allows
    piece, ring_beta = cm.ring_from_times(P, m, ks, ts, BASE)
    assert piece == 0.0 and 0 < ring_beta < 1.5e-9
    y = [t - BASE.overhead - (P + k - 3) * BASE.delta - (P + k - 2) * BASE.alpha for k, t in zip(ks, ts)]
    c = [(P + k - 2) * m / k for k in ks]
    assert ring_beta == pytest.approx(sum(a * b for a, b in zip(c, y)) / sum(a * a for a in c), rel=1e-12)
    with pytest.raises(ValueError):
        cm.ring_from_times(1, m, [8, 16], [1e-3, 2e-3], BASE)


def test_two_level_ring_follows_the_one_level_formula_with_the_stage_term():
    m, K = 1 << 20, 128
    for P in (8, 9, 16, 24):
        for k in (1, 4, 16, 64):
            flat = cm.ring_time(P, m, k, SLOW)
            hier, _ = cm.predict_hier("ring", P, m, SLOW, SLOW, 8, blocks=k, K=K)
            assert hier == pytest.approx(flat, rel=1e-12), (P, k)


def test_old_results_without_the_key_and_the_text_form():
    old = {k: v for k, v in BASE.as_dict().items() if k != "ring_beta"}
    p = cm.LinkParams(**json.loads(json.dumps(old)))
    assert p.ring_beta == 0.0 and cm.ring_time(12, 1 << 20, 26, p) == cm.ring_time(12, 1 << 20, 26, BASE)
    assert cm.LinkParams(**json.loads(json.dumps(SLOW.as_dict()))) == SLOW
    assert "ring stage 1.500 ns/B" in SLOW.describe() and "ring stage" not in BASE.describe()
    q = cm.parse_link("4e-6,3.2e-10,1.4e-10,2.8e-6,8e-5,piece=1.2e-5,ring_beta=1.5e-9")
    assert (q.piece, q.ring_beta) == (1.2e-5, 1.5e-9)
    for bad in ("1,2,ring_beta=1,ring_beta=2", "1,2,ring_beta=-1"):
        with pytest.raises(ValueError):
            cm.parse_link(bad)


@pytest.mark.mpi
def test_measure_ring_is_collective_and_identical(comm):
    from hpczeco.collectives.calibrate import calibrate, measure_ring

    pc, rb = measure_ring(comm, BASE, repeats=3)
    assert all(x == (pc, rb) for x in comm.allgather((pc, rb)))
    assert 0.0 <= pc < 1.0 and 0.0 <= rb < 1e-6 and np.isfinite(rb)
    if comm.Get_size() == 1:
        assert (pc, rb) == (0.0, 0.0)
    p = calibrate(comm, sizes=(8, 65536), repeats=3)
    assert all(q == p for q in comm.allgather(p))
    assert p.ring_beta >= 0.0
    assert calibrate(comm, sizes=(8, 65536), repeats=2, piece=False).ring_beta == 0.0
