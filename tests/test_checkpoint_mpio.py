"""Checkpoints through parallel HDF5 (``driver="mpio"``): only with an h5py built against parallel HDF5
(``make phdf5``; ``make test-phdf5`` runs this file and tests/test_checkpoint.py at n = 1..4, where the
writers of tests/test_checkpoint.py take the mpio path by themselves). Skipped with the reason elsewhere.

A checkpoint written through mpio must load through the serial reader (rank 0, default driver, as
``load_latest`` always reads) and one written serially must read through mpio on every rank; both
paths must store the same datasets and attributes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hpczeco.drivers.checkpoint import (
    LOCK_NAME,
    CheckpointWriter,
    array_sha256,
    load_checkpoint,
    load_latest,
    parallel_hdf5,
)

pytestmark = pytest.mark.skipif(not parallel_hdf5(), reason="h5py without parallel HDF5 (h5py.get_config().mpi is "
                                "False): `make phdf5` builds one against libhdf5-openmpi-dev")


def _arrays(rng) -> dict[str, np.ndarray]:
    return {
        "params/layer0/wq": rng.standard_normal((8, 6)),
        "params/layer0/norm": rng.standard_normal(6).astype(np.float32),
        "params/embed": rng.standard_normal((33, 4)).astype(np.float32),
        "adam/t": np.array(7, dtype=np.int64),
        "mask": rng.random(5) > 0.5,
        "empty": np.zeros((0, 3), np.float32),
    }


def _attrs(rng) -> dict:
    return {"config": {"d_model": 64, "dims": [1, 2]}, "data_pos": int(rng.integers(1 << 40)), "loss": 2.5,
            "note": "mpio", "hist": rng.standard_normal(4)}


@pytest.fixture
def shared_dir(comm):
    """One temporary folder seen by every rank (rank 0 makes it and removes it)."""
    path = tempfile.mkdtemp(prefix="hpczeco-mpio-") if comm.Get_rank() == 0 else None
    path = Path(comm.bcast(path, root=0))
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _contents(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Every dataset and root attribute of a file (read serially), ``created`` left out."""
    arrays: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: arrays.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        attrs = {k: f.attrs[k] for k in f.attrs if k != "created"}
    return arrays, attrs


@pytest.mark.mpi
def test_default_writer_takes_the_mpio_path(comm, shared_dir, rng):
    w = CheckpointWriter(shared_dir, comm=comm)
    assert w.mode == "mpio"
    arrays = comm.bcast(_arrays(rng), root=0)
    w.save(1, arrays, {"config": {"a": 1}})
    step, got, attrs = load_latest(shared_dir, comm=comm)
    assert step == 1 and attrs["nranks"] == comm.Get_size()
    for name, a in arrays.items():
        np.testing.assert_array_equal(got[name], a)


@pytest.mark.mpi
@pytest.mark.parametrize("writer", ["mpio", "serial"])
def test_written_by_one_path_reads_through_the_other(comm, shared_dir, rng, writer):
    arrays = comm.bcast(_arrays(rng), root=0)
    attrs = comm.bcast(_attrs(rng), root=0)
    path = CheckpointWriter(shared_dir, comm=comm, parallel=writer == "mpio").save(3, arrays, attrs)
    # serial reader: rank 0 opens it with the default driver and verifies every checksum, then broadcasts
    step, got, got_attrs = load_latest(shared_dir, comm=comm, expect_config=attrs["config"])
    assert step == 3 and got_attrs["data_pos"] == attrs["data_pos"] and got_attrs["note"] == "mpio"
    np.testing.assert_array_equal(got_attrs["hist"], attrs["hist"])
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        np.testing.assert_array_equal(got[name], a)
    if comm.Get_rank() == 0:
        assert load_checkpoint(path)[0] == 3
    # parallel reader: every rank opens it collectively with driver="mpio" and checks every dataset
    with h5py.File(path, "r", driver="mpio", comm=comm) as f:
        manifest = json.loads(f.attrs["_manifest"])
        assert sorted(manifest) == sorted(arrays)
        for name, a in arrays.items():
            data = np.asarray(f[name][()], dtype=f[name].dtype)
            assert array_sha256(data) == manifest[name]["sha256"] == array_sha256(a), name
        assert int(f.attrs["nranks"]) == comm.Get_size() and int(f.attrs["step"]) == 3


@pytest.mark.mpi
def test_both_paths_store_the_same_file_contents(comm, shared_dir, rng):
    arrays = comm.bcast(_arrays(rng), root=0)
    attrs = comm.bcast(_attrs(rng), root=0)
    mpio = CheckpointWriter(shared_dir / "mpio", comm=comm, parallel=True).save(5, arrays, attrs)
    serial = CheckpointWriter(shared_dir / "serial", comm=comm, parallel=False).save(5, arrays, attrs)
    comm.Barrier()
    a_arrays, a_attrs = _contents(mpio)
    b_arrays, b_attrs = _contents(serial)
    assert sorted(a_arrays) == sorted(b_arrays) == sorted(arrays)
    for name in a_arrays:
        np.testing.assert_array_equal(a_arrays[name], b_arrays[name])
    assert sorted(a_attrs) == sorted(b_attrs)
    for key in a_attrs:
        np.testing.assert_array_equal(np.asarray(a_attrs[key]), np.asarray(b_attrs[key]), err_msg=key)


@pytest.mark.mpi
@pytest.mark.parametrize("writer", ["mpio", "serial"])
def test_size_estimate_bounds_the_written_file(comm, shared_dir, rng, writer):
    """checkpoint.estimated_bytes (the mpio path's free-space check) is at least the size of the file written,
    on both paths, for small and larger arrays."""
    from hpczeco.drivers import checkpoint as ck

    arrays = comm.bcast({**_arrays(rng), "big": rng.standard_normal((300, 257))}, root=0)
    attrs = comm.bcast(_attrs(rng), root=0)
    w = CheckpointWriter(shared_dir / writer, comm=comm, parallel=writer == "mpio")
    path = w.save(2, arrays, attrs)
    _, host, _, stored, _ = w._prepare(2, arrays, attrs)
    est = ck.estimated_bytes(host, stored, {"_manifest": "x" * 2048, "created": "2026-12-01T00:00:00Z"})
    size = path.stat().st_size
    assert size <= est <= 2 * size + 200_000, (size, est)


@pytest.mark.mpi
def test_mpio_refuses_before_writing_when_the_space_is_short(comm, shared_dir, rng, monkeypatch):
    """Parallel HDF5 can crash in H5Fclose after a failed MPI-IO write, so the mpio path checks the free
    space first: every rank gets the same CheckpointError, no temporary is left, the previous checkpoint
    stays."""
    from hpczeco.drivers import checkpoint as ck
    from hpczeco.drivers.checkpoint import write as ck_write

    arrays = comm.bcast(_arrays(rng), root=0)
    w = CheckpointWriter(shared_dir, comm=comm, parallel=True)
    w.save(1, arrays, {})
    monkeypatch.setattr(ck_write, "_free_bytes", lambda folder: 1000)  # rank 0 decides; the others take its answer
    with pytest.raises(ck.CheckpointError, match=r"cannot write checkpoint ckpt_00000002\.h5 into .*: no space "
                       r"left on the device \(checked before writing, parallel HDF5\): it needs [\d,]+ bytes, "
                       r"1,000 bytes are free there; the previous checkpoints are kept"):
        w.save(2, arrays, {})
    comm.Barrier()
    assert sorted(p.name for p in shared_dir.iterdir() if p.name != LOCK_NAME) == ["ckpt_00000001.h5"]
