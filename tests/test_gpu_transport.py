"""Device transports (CuPy buffers) and the scans over them, under mpiexec; skipped without CuPy and a GPU.

Every rank uses GPU ``local rank % device count``. NCCL needs one GPU per rank (skipped otherwise);
CUDA-aware MPI only where the MPI is known to be CUDA-aware (``HPCZECO_CUDA_AWARE=1`` or the MPIX query).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hpczeco.base.backend import cupy_available
from hpczeco.collectives.names import ALGORITHMS

needs_gpu = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA GPU")


def _kinds(comm):
    import cupy as cp
    from hpczeco.collectives import device as D

    kinds = ["staged"]
    if D.nccl_available() and comm.Get_size() <= cp.cuda.runtime.getDeviceCount():
        kinds.append("nccl")
    if D.cuda_aware_known():
        kinds.append("cuda-aware")
    return kinds


@pytest.fixture
def gpu(comm):
    import cupy as cp

    lr = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.Get_rank()))
    cp.cuda.Device(lr % cp.cuda.runtime.getDeviceCount()).use()
    return cp


@pytest.mark.gpu
@needs_gpu
@pytest.mark.mpi
def test_exchange_and_allgather(comm, gpu):
    from hpczeco.collectives import device as D

    cp = gpu
    P, r = comm.Get_size(), comm.Get_rank()
    for kind in _kinds(comm):
        tr = D.get_device_transport(comm, kind)
        assert D.get_device_transport(comm, kind) is tr  # cached
        mine = cp.arange(1000, dtype=cp.float32) + 10000 * r
        got = cp.full(1000, -1, dtype=cp.float32)
        reqs = [tr.irecv(got, (r - 1) % P, 3), tr.isend(mine, (r + 1) % P, 3)]
        for q in reqs:
            q.wait()
        np.testing.assert_array_equal(got.get(), np.arange(1000, dtype=np.float32) + 10000 * ((r - 1) % P))
        allg = cp.empty((P, 1000), dtype=cp.float32)
        tr.allgather(mine, allg)
        exp = np.arange(1000, dtype=np.float32)[None] + 10000 * np.arange(P, dtype=np.float32)[:, None]
        np.testing.assert_array_equal(allg.get(), exp)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("topology", ALGORITHMS)
def test_scan_on_device_arrays(comm, gpu, rng, topology):
    from hpczeco.collectives import device as D
    from hpczeco.collectives.scan import fold_reference, scan

    cp = gpu
    P, r = comm.Get_size(), comm.Get_rank()
    a_all = rng.uniform(0.3, 1.0, (P, 2, 8)).astype(np.float32)
    S_all = rng.standard_normal((P, 2, 8, 6)).astype(np.float32)
    for kind in _kinds(comm):
        for reverse in (False, True):
            tr = D.get_device_transport(comm, kind)
            got = scan(
                cp.asarray(a_all[r]),
                cp.asarray(S_all[r]),
                comm,
                topology=topology,
                blocks=3 if topology in ("ring", "ptree") else None,
                reverse=reverse,
                transport=tr,
            )
            order = list(range(P))[::-1] if reverse else list(range(P))
            ref = fold_reference([(a_all[i].astype(np.float64), S_all[i].astype(np.float64)) for i in order])
            np.testing.assert_allclose(got.get(), ref[order.index(r)], rtol=1e-5, atol=1e-5)


def test_kind_checks_without_gpu(comm):
    from hpczeco.collectives import device as D

    with pytest.raises(ValueError, match="transport kind"):
        D.get_device_transport(comm, "carrier-pigeon")
    assert D.resolve_kind(comm, "staged") == "staged"
    if not D.cuda_aware_known():  # never a device pointer into an MPI not known to be CUDA-aware
        with pytest.raises(RuntimeError, match="CUDA-aware"):
            D.CudaAwareTransport(comm)


def test_transport_cache_dies_with_its_communicator(comm):
    """A freed communicator's cached transports never reach a later Dup that reuses its handle."""
    from hpczeco.collectives import device as D

    c1 = comm.Dup()
    D._cache_for(c1)["staged"] = "transport of c1"
    assert D._cache_for(c1)["staged"] == "transport of c1"
    c1.Free()
    for _ in range(4):  # MPI implementations reuse freed handles
        c2 = comm.Dup()
        assert "staged" not in D._cache_for(c2)
        c2.Free()
