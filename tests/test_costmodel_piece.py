"""The cost model's per-piece term of the ring (``LinkParams.piece`` above ``eager`` bytes): formula, the
choice of k, its estimate from measured times, old results without the keys, and its calibration."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hpczeco.collectives import costmodel as cm
from hpczeco.drivers import costfit

BASE = cm.LinkParams(alpha=4e-6, beta=3.2e-10, gamma=1.4e-10, delta=2.8e-6, overhead=80e-6)
COSTLY = replace(BASE, piece=40e-6)


def test_piece_term_by_hand():
    P, m, eager = 12, 1 << 20, COSTLY.eager
    for k in (1, 8, 16, 31, 32, 33, 64):
        pi = 40e-6 if m / k > eager else 0.0
        expect = 80e-6 + (P + k - 2) * (4e-6 + pi + m * 3.2e-10 / k) + (P + k - 3) * (2.8e-6 + m * 1.4e-10 / k)
        assert cm.ring_time(P, m, k, COSTLY) == pytest.approx(expect, rel=1e-12), k
    assert cm.piece_cost(eager, COSTLY) == 0.0 and cm.piece_cost(eager + 1, COSTLY) == 40e-6
    # no term without the key, whatever the piece size; the serial relay pays it once per hop
    assert cm.ring_time(P, m, 16, BASE) < cm.ring_time(P, m, 16, COSTLY)
    assert cm.serial_time(P, m, COSTLY) - cm.serial_time(P, m, BASE) == pytest.approx((P - 1) * 40e-6)
    # the other topologies have no such term
    for t in ("tree", "allgather", "exscan"):
        assert cm.predict(t, P, m, COSTLY) == cm.predict(t, P, m, BASE)


def test_more_pieces_cost_more_when_pieces_are_costly():
    P, m = 12, 1 << 20
    # above eager, the time grows with k by the term per extra stage beyond what the base model says
    for k1, k2 in ((8, 16), (16, 26), (4, 30)):
        d_base = cm.ring_time(P, m, k2, BASE) - cm.ring_time(P, m, k1, BASE)
        d_costly = cm.ring_time(P, m, k2, COSTLY) - cm.ring_time(P, m, k1, COSTLY)
        assert d_costly - d_base == pytest.approx((k2 - k1) * 40e-6)
    assert cm.ring_time(P, m, 26, COSTLY) > cm.ring_time(P, m, 16, COSTLY)  # the measured signature
    assert cm.ring_time(P, m, 26, BASE) < cm.ring_time(P, m, 16, BASE)  # which the base model inverts


@pytest.mark.parametrize("P", [2, 3, 5, 12, 64])
@pytest.mark.parametrize("m", [1 << 14, 1 << 18, 1 << 20, 1 << 23])
@pytest.mark.parametrize("piece", [0.0, 5e-6, 40e-6, 400e-6])
@pytest.mark.parametrize("eager", [4096.0, 32768.0])
@pytest.mark.parametrize("ring_beta", [0.0, 2e-10, 1.5e-9])  # the ring's own stage cost (test_costmodel_ring.py)
def test_best_blocks_is_the_exact_optimum_with_the_term(P, m, piece, eager, ring_beta):
    p = replace(BASE, piece=piece, eager=eager, ring_beta=ring_beta)
    K = 128
    k = cm.best_blocks(P, m, K, p)
    times = [cm.ring_time(P, m, j, p) for j in range(1, K + 1)]
    assert cm.ring_time(P, m, k, p) == pytest.approx(min(times), rel=1e-12)
    assert cm.predict("ring", P, m, p, K=K) == cm.ring_time(P, m, k, p)


def test_costly_pieces_make_the_ring_choose_fewer_or_eager_sized_pieces():
    P, m, K = 12, 1 << 20, 128
    k0 = cm.best_blocks(P, m, K, BASE)
    # with the term, no piece count above eager that is larger than the base choice can win
    k1 = cm.best_blocks(P, m, K, COSTLY)
    assert m / k1 <= COSTLY.eager or k1 < k0
    # with a threshold far below the pieces, it must take fewer pieces, and fewer still as the term grows
    low = replace(COSTLY, eager=1024.0)
    k_low = cm.best_blocks(P, m, K, low)
    assert k_low < k0
    assert cm.best_blocks(P, m, K, replace(low, piece=400e-6)) < k_low
    # auto's ring prediction uses the same k
    topo, blocks = cm.choose(P, m, K, low)
    if topo == "ring":
        assert blocks == k_low


def test_piece_from_times_recovers_the_term_and_checks_its_inputs():
    P, m = 12, 1 << 20
    for true in (0.0, 7e-6, 40e-6):
        p = replace(BASE, piece=true)
        t1, t2 = cm.ring_time(P, m, 16, p), cm.ring_time(P, m, 26, p)
        assert cm.piece_from_times(P, m, 16, t1, 26, t2, BASE) == pytest.approx(true, abs=1e-15)
    # a measured growth smaller than the base model's clamps at 0
    assert cm.piece_from_times(P, m, 16, 1e-3, 26, 0.5e-3, BASE) == 0.0
    with pytest.raises(ValueError):
        cm.piece_from_times(P, m, 26, 1e-3, 16, 1e-3, BASE)
    with pytest.raises(ValueError):  # pieces at or below eager carry no term
        cm.piece_from_times(P, m, 16, 1e-3, 64, 1e-3, BASE)


def test_estimate_piece_from_points(rng):
    P, m = 12, float(1 << 20)
    true = float(rng.uniform(10e-6, 80e-6))
    p = replace(BASE, piece=true)
    pts = [(f"ring/k={k}", P, m, cm.ring_time(P, m, k, p)) for k in (8, 16, 26)]
    pts += [("tree", P, m, 1e-3), ("ring/k=64", P, m, 1e-3)]  # not ring, and pieces of 16 KiB: ignored
    est, used = costfit.estimate_piece(pts, BASE)
    assert est == pytest.approx(true, rel=1e-9)
    assert sorted((k1, k2) for *_, k1, k2 in used) == [(8, 16), (8, 26), (16, 26)]
    assert costfit.estimate_piece([("ring/k=16", P, m, 1e-3)], BASE) is None


def test_old_results_without_the_keys_load_with_the_defaults():
    old = {"alpha": 4e-6, "beta": 3.2e-10, "gamma": 1.4e-10, "delta": 2.8e-6, "overhead": 8e-5,
           "name": "calibrated (shift)"}
    p = cm.LinkParams(**json.loads(json.dumps(old)))
    assert p.piece == 0.0 and p.eager == cm.EAGER_DEFAULT
    assert cm.ring_time(12, 1 << 20, 26, p) == cm.ring_time(12, 1 << 20, 26, replace(BASE, overhead=8e-5))
    new = cm.LinkParams(**json.loads(json.dumps(COSTLY.as_dict())))
    assert new == COSTLY
    assert "piece=40.0 us above 32 KiB" in COSTLY.describe() and "piece" not in p.describe()
    q = cm.parse_link("4e-6,3.2e-10,1.4e-10,2.8e-6,8e-5,piece=4e-5,eager=16384")
    assert (q.piece, q.eager, q.overhead) == (4e-5, 16384.0, 8e-5)
    assert cm.parse_link("4e-6,3.2e-10,piece=1e-5").piece == 1e-5
    for bad in ("1,2,3,4,5,6", "1,2,piece=1,3", "1,2,speed=3", "1,2,piece=1,piece=2", "1,piece=2"):
        with pytest.raises(ValueError):
            cm.parse_link(bad)
    with pytest.raises(ValueError):
        cm.LinkParams(alpha=1e-6, beta=1e-9, piece=-1.0)


def test_report_shows_the_term_for_old_runs(tmp_path):
    from hpczeco.drivers import report

    P, m, K, V = 12, 1 << 20, 2048, 128
    truth = replace(BASE, piece=40e-6)
    rows = [{"P": P, "label": lab, "topology": "ring", "blocks": k, "nbytes": m, "shape": [1, K, V],
             "median_s": cm.ring_time(P, m, k, truth), "model_s": 0.0} for lab, k in (("ring", 26), ("ring/k=16", 16))]
    run = {"P": P, "params": {k: v for k, v in BASE.as_dict().items() if k not in ("piece", "eager")},
           "results": rows}
    report.remodel(run)
    text = "\n".join(report.piece_md([run]))
    assert "40.0 above 32 KiB" in text and "estimated from this run's ring (k=16/26 at 1 MiB)" in text
    assert "1.00" in text.split("|")[-3]  # measured/model with the term, exact on these synthetic points


@pytest.mark.mpi
def test_measure_piece_is_collective_and_identical(comm):
    from hpczeco.collectives.calibrate import calibrate, eager_bytes, measure_piece

    pc = measure_piece(comm, BASE, repeats=3)
    assert all(x == pc for x in comm.allgather(pc))
    assert pc >= 0.0 and pc < 1.0
    if comm.Get_size() == 1:
        assert pc == 0.0
    p = calibrate(comm, sizes=(8, 65536), repeats=3)
    assert all(q == p for q in comm.allgather(p))
    assert p.piece >= 0.0 and p.eager == eager_bytes(comm) in (4096.0, cm.EAGER_DEFAULT)
    assert calibrate(comm, sizes=(8, 65536), repeats=2, piece=False).piece == 0.0
