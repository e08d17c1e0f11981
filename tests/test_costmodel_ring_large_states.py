"""The ring's stage cost on states too large for the caches (``LinkParams.ring_beta_big``): the interpolation in
``log(m)``, its place in ``ring_time``/``predict_hier``/``best_blocks``, the fit to measured ring times
(``ring_beta_from_times``), the checks, old results, the text form, its calibration (``measure_ring_big``) and
the benchmark's ``--ring-big``; and the floor below the fewest pieces the fits measured (``ring_k_min``)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest
from hpczeco.collectives import costmodel as cm

MIB = 1 << 20
SMALL = cm.LinkParams(alpha=4e-6, beta=4e-10, gamma=1.5e-10, delta=3e-6, overhead=90e-6, piece=30e-6, eager=4096.0,
                      ring_beta=0.5e-9)
BIG = replace(SMALL, ring_beta_big=1.1e-9)  # what the GPU machine's host cores give under CMA (network.md §5)


def test_interpolation_in_log_size_and_clamped_outside():
    lo, hi = BIG.ring_bytes, BIG.ring_big
    assert (lo, hi) == (2 * MIB, 16 * MIB)
    for m in (1.0, 64 * 1024, MIB, lo):
        assert cm.ring_beta_at(m, BIG) == BIG.ring_beta
    for m in (hi, 64 * MIB, 1e12):
        assert cm.ring_beta_at(m, BIG) == BIG.ring_beta_big
    for m in (3 * MIB, 4 * MIB, 8 * MIB, 11 * MIB):
        w = math.log(m / lo) / math.log(hi / lo)
        expect = BIG.ring_beta + w * (BIG.ring_beta_big - BIG.ring_beta)
        assert cm.ring_beta_at(m, BIG) == pytest.approx(expect, rel=1e-14), m
    # the geometric midpoint is the arithmetic mean; monotone between
    assert cm.ring_beta_at(math.sqrt(lo * hi), BIG) == pytest.approx(0.8e-9, rel=1e-12)
    xs = [cm.ring_beta_at(m, BIG) for m in np.geomspace(MIB, 32 * MIB, 40)]
    assert all(a <= b for a, b in zip(xs, xs[1:]))
    for m in (MIB, 4 * MIB, 64 * MIB):  # without the big term: ring_beta everywhere
        assert cm.ring_beta_at(m, SMALL) == SMALL.ring_beta
        assert cm.ring_beta_at(m, replace(SMALL, ring_beta=0.0)) == 0.0


def test_ring_time_and_the_two_level_ring_use_the_size_s_stage_cost():
    for P in (3, 8, 12):
        for m in (MIB, 4 * MIB, 16 * MIB, 64 * MIB):
            for k in (2, 16, 53, 128):
                fixed = replace(SMALL, ring_beta=cm.ring_beta_at(m, BIG))
                assert cm.ring_time(P, m, k, BIG) == pytest.approx(cm.ring_time(P, m, k, fixed), rel=1e-13)
                hier, _ = cm.predict_hier("ring", P + 8, m, BIG, BIG, 8, blocks=k)
                flat = cm.ring_time(P + 8, m, k, BIG)
                assert hier == pytest.approx(flat, rel=1e-12), (P, m, k)
    # one piece, the tree, allgather and exscan keep beta and gamma
    for t in ("serial", "tree", "allgather", "exscan"):
        assert cm.predict(t, 12, 16 * MIB, BIG) == cm.predict(t, 12, 16 * MIB, SMALL)
    assert cm.ring_time(12, 16 * MIB, 1, BIG) == cm.ring_time(12, 16 * MIB, 1, SMALL)
    assert cm.ring_time(12, 16 * MIB, 32, BIG) > cm.ring_time(12, 16 * MIB, 32, SMALL)
    assert cm.ring_time(12, MIB, 32, BIG) == cm.ring_time(12, MIB, 32, SMALL)


@pytest.mark.parametrize("P", [2, 5, 12])
def test_best_blocks_is_the_exact_optimum_with_the_big_term(P, rng):
    for _ in range(6):
        p = replace(BIG, ring_beta=float(rng.uniform(0.1, 2)) * 1e-9, piece=float(rng.uniform(0, 60)) * 1e-6)
        p = replace(p, ring_beta_big=p.ring_beta * float(rng.uniform(1, 4)))
        for m in (MIB, 5 * MIB, 16 * MIB, 40 * MIB):
            k = cm.best_blocks(P, m, 128, p)
            brute = min(range(1, 129), key=lambda j: cm.ring_time(P, m, j, p))
            assert cm.ring_time(P, m, k, p) == pytest.approx(cm.ring_time(P, m, brute, p), rel=1e-12), (p, m)


@pytest.mark.parametrize("P", [2, 5, 12, 16])
def test_ring_beta_from_times_recovers_the_stage_cost(P, rng):
    for _ in range(5):
        truth = float(rng.uniform(0.2, 3.0)) * 1e-9
        p = replace(SMALL, piece=float(rng.uniform(0, 50)) * 1e-6, ring_beta=truth)
        m = float(rng.integers(3, 64)) * MIB
        ks = sorted({int(x) for x in rng.integers(2, 129, size=3)})
        times = [cm.ring_time(P, m, k, p) for k in ks]
        assert cm.ring_beta_from_times(P, m, ks, times, p) == pytest.approx(truth, rel=1e-9)
    # least squares over noisy points lies between the per-point fits; never negative
    ks = [16, 48]
    times = [cm.ring_time(P, 16 * MIB, k, replace(SMALL, ring_beta=b)) for k, b in zip(ks, (1e-9, 2e-9))]
    got = cm.ring_beta_from_times(P, 16 * MIB, ks, times, SMALL)
    assert 1e-9 < got < 2e-9
    assert cm.ring_beta_from_times(P, 16 * MIB, [16], [1e-9], SMALL) == 0.0  # faster than its fixed terms
    for bad in (([], []), ([16, 48], [1.0]), ([1, 16], [1.0, 1.0])):
        with pytest.raises(ValueError):
            cm.ring_beta_from_times(P, 16 * MIB, *bad, SMALL)
    with pytest.raises(ValueError):
        cm.ring_beta_from_times(1, 16 * MIB, [16], [1.0], SMALL)
    with pytest.raises(ValueError, match="nbytes"):
        cm.ring_beta_from_times(P, 0, [16], [1.0], SMALL)
    with pytest.raises(ValueError, match="finite"):
        cm.ring_beta_from_times(P, 16 * MIB, [16, 48], [1e-3, float("nan")], SMALL)
    with pytest.raises(ValueError, match="ring_k_min"):  # such points pay the floor, not the fitted cost
        cm.ring_beta_from_times(P, 16 * MIB, [4, 16], [1e-3, 1e-3], replace(SMALL, ring_k_min=8.0))


def test_checks_old_results_and_the_text_form():
    with pytest.raises(ValueError, match="ring_beta_big needs"):
        replace(SMALL, ring_beta=0.0, ring_beta_big=1e-9)
    with pytest.raises(ValueError, match="ring_beta_big needs"):
        replace(BIG, ring_bytes=16 * MIB)
    with pytest.raises(ValueError):
        replace(BIG, ring_big=-1.0)
    old = {k: v for k, v in SMALL.as_dict().items() if k not in ("ring_beta_big", "ring_bytes", "ring_big")}
    p = cm.LinkParams(**json.loads(json.dumps(old)))
    assert p == SMALL and cm.ring_time(12, 16 * MIB, 40, p) == cm.ring_time(12, 16 * MIB, 40, SMALL)
    assert cm.LinkParams(**json.loads(json.dumps(BIG.as_dict()))) == BIG
    assert "0.500 ns/B (2 MiB), 1.100 ns/B (16 MiB)" in BIG.describe()
    assert "(16 MiB)" not in SMALL.describe()
    q = cm.parse_link("4e-6,4e-10,1.5e-10,3e-6,9e-5,piece=3e-5,eager=4096,ring_beta=5e-10,ring_beta_big=1.1e-9")
    assert q == replace(BIG, name="custom")
    q = cm.parse_link("1e-6,1e-9,ring_beta=1e-9,ring_beta_big=2e-9,ring_bytes=1048576,ring_big=8388608")
    assert (q.ring_bytes, q.ring_big) == (MIB, 8 * MIB)
    for bad in ("1,2,ring_beta_big=1e-9", "1,2,ring_beta=1e-9,ring_beta_big=2e-9,ring_big=1024",
                "1,2,ring_big=1,ring_big=2"):
        with pytest.raises(ValueError):
            cm.parse_link(bad)


def test_report_shows_both_stage_costs():
    from hpczeco.drivers import report

    P, rows = 12, []
    for m in (MIB, 4 * MIB, 16 * MIB):
        K = 128
        for label, k in (("ring", cm.best_blocks(P, m, K, BIG)), ("ring/k=16", 16), ("ring/k=48", 48)):
            t = cm.ring_time(P, m, k, BIG)
            rows.append({"P": P, "label": label, "topology": "ring", "blocks": k, "nbytes": m,
                         "shape": [m // (K * 128 * 4), K, 128], "median_s": t, "min_s": t, "mean_s": t,
                         "repeats": 3, "model_s": t})
    run = {"bench": "scan", "P": P, "dtype": "float32", "params": BIG.as_dict(), "calibrated": True,
           "exscan_algorithm": "linear", "results": rows, "machine": {}}
    text = "\n".join(report.piece_md([run]))
    assert "ring stage 0.500 ns/B at 2 MiB, 1.100 at 16 MiB" in text, text


# what the CPU box's veths between two namespaces calibrate (network.md §5): whole messages 0.8 ns/B, the fitted
# pieces of 43-256 KiB 0.36 ns/B
TCP2 = cm.LinkParams(alpha=6.6e-6, beta=0.8e-9, gamma=1.1e-10, delta=1.2e-6, overhead=50e-6, ring_beta=0.36e-9,
                     ring_k_min=8.0)


def test_fewer_pieces_than_the_fit_measured_pay_at_least_a_whole_message():
    for P in (2, 3, 12):
        for p in (TCP2, replace(TCP2, ring_beta=2e-9), replace(BIG, ring_k_min=8.0)):
            for m in (MIB, 4 * MIB, 32 * MIB):
                whole = p.beta + (p.gamma if P > 2 else 0.0)
                for k in range(2, 8):
                    assert cm.ring_stage_beta(P, m, k, p) == max(cm.ring_beta_at(m, p), whole), (P, k)
                for k in (8, 9, 64):
                    assert cm.ring_stage_beta(P, m, k, p) == cm.ring_beta_at(m, p)
                    assert cm.ring_time(P, m, k, p) == cm.ring_time(P, m, k, replace(p, ring_k_min=0.0))
                for k in (2, 5):  # the formula with the floored per-byte cost; one piece keeps beta and gamma
                    fixed = replace(p, ring_k_min=0.0, ring_beta_big=0.0, ring_beta=cm.ring_stage_beta(P, m, k, p))
                    assert cm.ring_time(P, m, k, p) == pytest.approx(cm.ring_time(P, m, k, fixed), rel=1e-13)
                assert cm.ring_time(P, m, 1, p) == cm.ring_time(P, m, 1, replace(p, ring_k_min=0.0))
                hier, _ = cm.predict_hier("ring", P + 8, m, p, p, 8, blocks=4)
                assert hier == pytest.approx(cm.ring_time(P + 8, m, 4, p), rel=1e-12)
    # where the fit is the dearer cost (shared memory) the floor changes nothing
    shm = replace(BIG, ring_k_min=8.0)
    for k in range(2, 8):
        assert cm.ring_time(12, 4 * MIB, k, shm) == cm.ring_time(12, 4 * MIB, k, BIG)


def test_the_floor_keeps_the_model_off_large_pieces_it_never_measured():
    # without the floor the model takes k = 2 at P = 2 (the fitted per-byte cost is below a whole message's);
    # measured over TCP that is 2-3x slower than k >= 8 (network.md §5)
    assert cm.best_blocks(2, MIB, 128, replace(TCP2, ring_k_min=0.0)) == 2
    for m in (MIB, 2 * MIB, 4 * MIB):
        k = cm.best_blocks(2, m, 128, TCP2)
        assert k >= 8
        assert cm.ring_time(2, m, k, TCP2) == min(cm.ring_time(2, m, j, TCP2) for j in range(1, 129))
    assert "at least beta below k = 8" in TCP2.describe() and "below k" not in SMALL.describe()
    q = cm.parse_link("6.6e-6,8e-10,1.1e-10,1.2e-6,5e-5,ring_beta=3.6e-10,ring_k_min=8")
    assert q == replace(TCP2, name="custom")


@pytest.mark.mpi
def test_measure_ring_big_is_collective_and_calibrate_records_it(comm):
    from hpczeco.collectives.calibrate import calibrate, measure_ring_big

    rbb, m = measure_ring_big(comm, SMALL, nbytes=3 * MIB, repeats=2)
    assert all(x == (rbb, m) for x in comm.allgather((rbb, m)))
    assert 0.0 <= rbb < 1e-6 and np.isfinite(rbb)
    P = comm.Get_size()
    if P == 1:
        assert rbb == 0.0
    else:
        assert m == 3 * MIB  # [1, 6144, 128] float32
    p = calibrate(comm, sizes=(8, 65536), repeats=2, ring_big=3 * MIB)
    assert all(q == p for q in comm.allgather(p))
    if p.ring_beta_big > 0:
        assert p.ring_beta > 0 and (p.ring_bytes, p.ring_big) == (2 * MIB, 3 * MIB)
    assert p.ring_k_min == (8.0 if p.ring_beta > 0 else 0.0)
    assert calibrate(comm, sizes=(8, 65536), repeats=2, ring_big=0).ring_beta_big == 0.0
    with pytest.raises(ValueError, match="ring_big"):
        calibrate(comm, sizes=(8, 65536), repeats=2, ring_big=MIB)  # checked before any message: every rank


def test_bench_ring_big_option(capsys):
    from hpczeco.collectives.calibrate import check_ring_big
    from hpczeco.drivers import bench_scan

    check_ring_big(0)
    check_ring_big(3 * MIB)
    check_ring_big(2 * MIB + 512)  # one float32 row more
    for bad in (MIB, 2 * MIB, 2 * MIB + 100):  # 2 MiB + 100 B rounds down to the 2 MiB state
        with pytest.raises(ValueError, match="ring_big must be 0 or more than"):
            check_ring_big(bad)
    with pytest.raises(ValueError):
        check_ring_big(2 * MIB + 512, "float64")  # a float64 row is 1 KiB
    assert bench_scan.parse_size_or_zero("0M") == 0 and bench_scan.parse_size_or_zero("0") == 0

    ap = bench_scan.build_parser("hpczeco bench scan")
    assert ap.parse_args([]).ring_big == 16 * MIB
    assert ap.parse_args(["--ring-big", "0"]).ring_big == 0
    assert ap.parse_args(["--ring-big", "32M"]).ring_big == 32 * MIB
    with pytest.raises(SystemExit) as exc:  # a usage error (status 2), before any MPI work
        bench_scan.main(["--ring-big", "1M"])
    assert exc.value.code == 2 and "--ring-big must be 0 or more than 2 MiB" in capsys.readouterr().err


def test_bench_records_the_mpi_settings_and_says_when_single_copy_is_off(monkeypatch):
    from hpczeco.drivers import bench_scan

    for var in list(os.environ):
        if var.startswith(("OMPI_MCA_", "MPIR_CVAR_")):
            monkeypatch.delenv(var)
    assert bench_scan.transport_note() is None and "mpi_env" not in bench_scan.machine_info()
    monkeypatch.setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1.0;tcp://192.0.2.2:1")  # the launcher's own: not recorded
    monkeypatch.setenv("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    assert bench_scan.machine_info()["mpi_env"] == {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
                                                    "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    assert "btl_vader_single_copy_mechanism cma" in bench_scan.transport_note()
    monkeypatch.setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "cma")
    assert bench_scan.transport_note() is None
    monkeypatch.setenv("OMPI_MCA_btl_sm_single_copy_mechanism", "none")  # Open MPI 5's name
    assert "--mca btl_sm_single_copy_mechanism cma" in bench_scan.transport_note()
