"""Scans and the ZeCO layer on device arrays under mpiexec (one GPU per rank by local rank): every topology,
forward and reverse, with an initial state, over every device transport, against a float64 host fold;
the ZeCO layer (``hpczeco.ZeCOGLA``) on P GPUs against the single-GPU kernels on the whole sequence.

Marked ``gpu`` and ``mpi``; skipped without CuPy and a GPU. The transports themselves (exchange,
allgather, cache) are checked in tests/test_gpu_transport.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import device_transport_kinds, rel, use_local_gpu
from hpczeco.base.backend import cupy_available

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA GPU")]

SCAN_CASES = [(topo, reverse, blocks) for topo in ("ring", "tree", "allgather", "serial", "exscan", "ptree", "auto")
              for reverse in (False, True) for blocks in ((None, 5) if topo in ("ring", "ptree") else (None,))]


@pytest.mark.parametrize("topology,reverse,blocks", SCAN_CASES,
                         ids=[f"{t}-{'reverse' if r else 'forward'}-blocks{b}" for t, r, b in SCAN_CASES])
def test_scan_over_every_device_transport(comm, rng, topology, reverse, blocks):
    cp = use_local_gpu(comm)
    from hpczeco.collectives import device as D
    from hpczeco.collectives.scan import fold_reference, scan

    P, rank = comm.Get_size(), comm.Get_rank()
    B, H, K, V = 2, 3, 16, 24
    order = list(range(P))[::-1] if reverse else list(range(P))
    for kind in device_transport_kinds(comm):
        a_all = rng.uniform(0.3, 1.0, (P, B, H, K)).astype(np.float32)
        S_all = rng.standard_normal((P, B, H, K, V)).astype(np.float32)
        init = rng.standard_normal((B, H, K, V)).astype(np.float32)
        got = scan(cp.asarray(a_all[rank]), cp.asarray(S_all[rank]), comm, topology=topology, blocks=blocks,
                   reverse=reverse, initial=cp.asarray(init) if rank == order[0] else None,
                   transport=D.get_device_transport(comm, kind))
        assert isinstance(got, cp.ndarray), f"{kind}: result is a {type(got)}"
        ref = fold_reference([(a_all[r].astype(np.float64), S_all[r].astype(np.float64)) for r in order],
                             initial=init.astype(np.float64))
        err = rel(got.get(), ref[order.index(rank)])
        assert err <= 1e-5, f"{kind}: rel err {err:.2e}"


@pytest.mark.parametrize("L", [1000, 32768])
def test_zeco_layer_on_gpus_matches_one_gpu(comm, rng, L):
    """Output and gradients of ZeCO on P GPUs (ring scan, bf16, H=16, K=V=128) equal the single-GPU kernels
    on the whole P*L-token sequence, over every device transport."""
    cp = use_local_gpu(comm)
    from hpczeco.gpu import gla as G

    import hpczeco

    P, rank = comm.Get_size(), comm.Get_rank()
    H, K, V = 16, 128, 128
    try:
        cp.zeros(2, dtype="bfloat16")
        zdt = "bfloat16"
    except Exception:  # CuPy without ml_dtypes has no bfloat16 dtype
        zdt = "float16"
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    g = np.log(1.0 / (1.0 + np.exp(-rng.standard_normal((1, P * L, H, K)) - 2.0))).astype(np.float32)
    full = {n: cp.asarray(a).astype(zdt) for n, a in dict(q=f(1, P * L, H, K), k=f(1, P * L, H, K),
                                                             v=f(1, P * L, H, V), g=g, do=f(1, P * L, H, V)).items()}
    sl = slice(rank * L, (rank + 1) * L)
    mine = {n: cp.ascontiguousarray(a[:, sl]) for n, a in full.items()}
    o_full, _ = G.chunk_gla(full["q"], full["k"], full["v"], full["g"])
    g_full = G.chunk_gla_bwd(full["q"], full["k"], full["v"], full["g"], full["do"])
    f32 = lambda x: cp.asnumpy(x.astype(cp.float32))
    for kind in device_transport_kinds(comm):
        layer = hpczeco.ZeCOGLA(comm, topology="ring", chunk_size=64, transport=kind)
        o = layer.forward(mine["q"], mine["k"], mine["v"], mine["g"])
        grads = layer.backward(mine["do"])
        errs = {"o": rel(f32(o), f32(o_full[:, sl]))}
        errs.update({n: rel(f32(a), f32(b[:, sl])) for n, a, b in zip(("dq", "dk", "dv", "dg"), grads[:4], g_full)})
        assert max(errs.values()) <= 2e-2, f"{kind} ({zdt}): " + " ".join(f"{n} {e:.2e}" for n, e in errs.items())


@pytest.mark.parametrize("scan", ["ring", "tree", "serial"])
def test_zeco_layer_in_float64_on_gpus(comm, rng, scan):
    """ZeCO on float64 device arrays (the Numba CUDA kernels of hpczeco.gpu.gla_numba, launches counted), with an
    initial state and dht, over every device transport: equal to the float64 recurrence of the whole sequence
    to 1e-12 (slices of different lengths)."""
    cp = use_local_gpu(comm)
    from hpczeco.gpu import gla_numba

    import hpczeco
    from hpczeco.gla import recurrent_gla, recurrent_gla_bwd

    P, rank = comm.Get_size(), comm.Get_rank()
    H, K, V = 2, 32, 48
    lengths = [150 + 37 * r for r in range(P)]
    T = sum(lengths)
    q, k, v, do = (rng.standard_normal(s) for s in ((1, T, H, K), (1, T, H, K), (1, T, H, V), (1, T, H, V)))
    g = -np.logaddexp(0.0, -(rng.standard_normal((1, T, H, K)) + 2.0))
    h0, dht = rng.standard_normal((1, H, K, V)), rng.standard_normal((1, H, K, V))
    ro, rht = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    ref = recurrent_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht)
    lo = sum(lengths[:rank])
    sl = slice(lo, lo + lengths[rank])
    mine = [cp.asarray(np.ascontiguousarray(x[:, sl])) for x in (q, k, v, g, do)]
    for kind in device_transport_kinds(comm):
        layer = hpczeco.ZeCOGLA(comm, topology=scan, chunk_size=64, transport=kind)
        before = gla_numba.LAUNCHES.copy()
        o = layer.forward(*mine[:4], initial_state=cp.asarray(h0) if rank == 0 else None)
        grads = layer.backward(mine[4], dht=cp.asarray(dht) if rank == P - 1 else None)
        ran = gla_numba.LAUNCHES - before
        assert ran["fwd_output"] == 1 and ran["bwd_dqdk"] == 1 and ran["bwd_dv"] == 1, f"{kind}: {dict(ran)}"
        errs = {"o": rel(o.get(), ro[:, sl])}
        errs.update({n: rel(a.get(), b[:, sl]) for n, a, b in zip(("dq", "dk", "dv", "dg"), grads[:4], ref)})
        if rank == 0:
            errs["dh0"] = rel(grads[4].get(), ref[4])
        if rank == P - 1:
            errs["final_state"] = rel(layer.final_state.get(), rht)
        assert max(errs.values()) <= 1e-12, f"{kind}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items())
