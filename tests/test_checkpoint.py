"""HDF5 checkpoints: contents, checksums, atomic writes, keep-last-N, corruption fallback, unsafe files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hpczeco.drivers import checkpoint as ck
from hpczeco.drivers.checkpoint import LOCK_NAME, CheckpointError, CheckpointWriter, list_checkpoints, load_latest
from hpczeco.drivers.checkpoint import write as ck_write


def _arrays(rng, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "params/layer0/wq": scale * rng.standard_normal((8, 6)),
        "params/layer0/norm": rng.standard_normal(6).astype(np.float32),
        "params/embed": rng.standard_normal((16, 4)).astype(np.float32),
        "adam/m/layer0/wq": rng.standard_normal((8, 6)),
        "adam/t": np.array(7, dtype=np.int64),
        "mask": rng.random(5) > 0.5,
        "empty": np.zeros((0, 3), np.float32),
    }


def _attrs(step: int) -> dict:
    rng_state = np.random.default_rng(step).bit_generator.state  # 128-bit ints inside
    return {
        "config": {"d_model": 64, "layers": 2, "lr": 1e-3, "dims": [1, 2]},
        "rng": rng_state,
        "data_pos": 1234 * step,
        "loss": 2.5,
        "resumed": False,
        "note": "hello",
        "hist": np.arange(4, dtype=np.float64),
    }


class Collect:
    def __init__(self):
        self.msgs: list[str] = []

    def __call__(self, msg: str) -> None:
        self.msgs.append(msg)


def test_roundtrip_contents_and_checksums(tmp_path, rng):
    arrays = _arrays(rng)
    w = CheckpointWriter(tmp_path, comm=None, keep=3)
    path = w.save(5, arrays, _attrs(5))
    assert path == tmp_path / "ckpt_00000005.h5" and path.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME] == ["ckpt_00000005.h5"]  # no temporary left
    step, got, attrs = load_latest(tmp_path)
    assert step == 5 and sorted(got) == sorted(arrays)
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        np.testing.assert_array_equal(got[name], a)
    want = _attrs(5)
    assert attrs["config"] == want["config"] and attrs["rng"] == want["rng"]
    assert attrs["data_pos"] == want["data_pos"] and attrs["note"] == "hello" and attrs["resumed"] is False
    assert attrs["loss"] == 2.5 and attrs["step"] == 5 and attrs["nranks"] == 1
    np.testing.assert_array_equal(attrs["hist"], want["hist"])
    # the file itself: plain datasets with a checksum each, config as a JSON string, no pickles
    with h5py.File(path, "r") as f:
        assert f["params/layer0/wq"].attrs["sha256"] == ck.array_sha256(arrays["params/layer0/wq"])
        assert json.loads(f.attrs["config"]) == want["config"]
        assert int(f.attrs["step"]) == 5 and f.attrs["format"] == ck.FORMAT
        manifest = json.loads(f.attrs["_manifest"])
        assert set(manifest) == set(arrays)


def _sha256_v1(a: np.ndarray) -> str:
    """The format's array checksum, computed here without the checkpoint code: dtype, shape, C-order bytes."""
    return hashlib.sha256(a.dtype.str.encode() + repr(tuple(a.shape)).encode() + a.tobytes()).hexdigest()


#: attributes of each kind of the format, with their kinds
_V1_ATTRS = {"config": ({"d_model": 8, "dims": [1, 2]}, "json"), "note": ("hello", "str"), "lr": (0.5, "float"),
             "n": (3, "int"), "flag": (True, "bool"), "hist": (np.arange(3.0), "array")}


def _v1_manifest(arrays: dict[str, np.ndarray]) -> dict:
    return {n: {"shape": list(a.shape), "dtype": a.dtype.str, "sha256": _sha256_v1(a)} for n, a in arrays.items()}


def _v1_attrs_digest() -> str:
    items = [[k, kind, _sha256_v1(v) if kind == "array" else v] for k, (v, kind) in sorted(_V1_ATTRS.items())]
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def test_the_format_on_disk_is_version_1(tmp_path, rng):
    """The writer's file is the documented format, checked with h5py, json and hashlib alone (not the checkpoint
    code): the root attributes, one sha256 per dataset, the manifest, the attribute kinds and their checksum."""
    arrays = {"params/w": rng.standard_normal((3, 4)), "t": np.array(7, np.int64), "m": rng.random(5) > 0.5}
    path = CheckpointWriter(tmp_path).save(4, arrays, {k: v for k, (v, _) in _V1_ATTRS.items()})
    with h5py.File(path, "r") as f:
        assert set(f.attrs) == {"format", "format_version", "step", "nranks", "created", "_manifest", "_attr_kinds",
                                "_attrs_sha256", *_V1_ATTRS}
        assert f.attrs["format"] == "hpczeco-checkpoint" and int(f.attrs["format_version"]) == 1
        assert int(f.attrs["step"]) == 4 and int(f.attrs["nranks"]) == 1
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", f.attrs["created"])
        assert json.loads(f.attrs["_manifest"]) == _v1_manifest(arrays)
        assert json.loads(f.attrs["_attr_kinds"]) == {k: kind for k, (_, kind) in _V1_ATTRS.items()}
        assert f.attrs["_attrs_sha256"] == _v1_attrs_digest()
        assert json.loads(f.attrs["config"]) == _V1_ATTRS["config"][0] and f.attrs["note"] == "hello"
        np.testing.assert_array_equal(f.attrs["hist"], _V1_ATTRS["hist"][0])
        for name, a in arrays.items():
            ds = f[name]
            assert dict(ds.attrs) == {"sha256": _sha256_v1(a)} and ds.dtype == a.dtype
            np.testing.assert_array_equal(ds[()], a)


def test_a_version_1_file_built_by_hand_loads(tmp_path, rng):
    """A checkpoint made by other code that follows the format (here: h5py, json, hashlib) loads: the files
    of earlier versions of this code load as long as the format is version 1."""
    arrays = {"params/w": rng.standard_normal((3, 4)).astype(np.float32), "t": np.array(7, np.int64)}
    with h5py.File(tmp_path / "ckpt_00000006.h5", "w") as f:
        for name, a in arrays.items():
            f.create_dataset(name, data=a).attrs["sha256"] = _sha256_v1(a)
        f.attrs.update({"format": "hpczeco-checkpoint", "format_version": np.int64(1), "step": np.int64(6),
                        "nranks": np.int64(3), "created": "2026-01-01T00:00:00Z",
                        "_manifest": json.dumps(_v1_manifest(arrays)),
                        "_attr_kinds": json.dumps({k: kind for k, (_, kind) in _V1_ATTRS.items()}),
                        "_attrs_sha256": _v1_attrs_digest()})
        for k, (v, kind) in _V1_ATTRS.items():
            f.attrs[k] = json.dumps(v) if kind == "json" else v
    step, got, attrs = load_latest(tmp_path, expect_config=_V1_ATTRS["config"][0])
    assert step == 6 and attrs["step"] == 6 and attrs["nranks"] == 3 and sorted(got) == sorted(arrays)
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype
        np.testing.assert_array_equal(got[name], a)
    np.testing.assert_array_equal(attrs["hist"], _V1_ATTRS["hist"][0])
    for k, (v, kind) in _V1_ATTRS.items():
        assert kind == "array" or (attrs[k] == v and type(attrs[k]) is type(v)), k


def test_keep_last_n_and_list(tmp_path, rng):
    w = CheckpointWriter(tmp_path, keep=2)
    for step in (1, 2, 10, 3):
        w.save(step, {"w": rng.standard_normal(3)}, {"config": {"a": 1}})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 10]
    assert load_latest(tmp_path)[0] == 10
    with pytest.raises(ValueError, match="keep"):
        CheckpointWriter(tmp_path, keep=0)
    assert load_latest(tmp_path / "nothing-here") is None


def test_atomic_write_failure_leaves_previous_newest(tmp_path, rng, monkeypatch):
    w = CheckpointWriter(tmp_path, keep=3)
    w.save(1, {"w": np.ones(3)}, {"config": {"a": 1}})

    def broken_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ck_write.os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="disk full"):
        w.save(2, {"w": np.full(3, 2.0)}, {"config": {"a": 1}})
    monkeypatch.undo()
    # temporary removed (the writer's folder lock stays)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == ["ckpt_00000001.h5"]
    # a crashed writer's hidden temporary (never renamed) is never taken as a checkpoint
    (tmp_path / ".ckpt_00000009.h5.tmp-123-456").write_bytes(b"half a file")
    step, arrays, _ = load_latest(tmp_path)
    assert step == 1 and np.array_equal(arrays["w"], np.ones(3))


def _flip_byte_in(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    assert offset is not None
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        b = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["truncate", "flip", "config", "attr"])
def test_corrupt_checkpoint_falls_back_with_message(tmp_path, rng, damage):
    w = CheckpointWriter(tmp_path, keep=5)
    good = rng.standard_normal((4, 4))
    w.save(1, {"params/w": good}, {"config": {"d": 4}, "data_pos": 10})
    newest = w.save(2, {"params/w": good + 1}, {"config": {"d": 4 if damage != "config" else 8}, "data_pos": 20})
    if damage == "truncate":
        size = newest.stat().st_size
        with open(newest, "r+b") as fh:
            fh.truncate(size // 2)
        expect = "cannot be read"
    elif damage == "flip":
        _flip_byte_in(newest, "params/w")
        expect = "checksum mismatch in dataset 'params/w'"
    elif damage == "config":
        expect = "config mismatch \\(d: stored 8 vs expected 4\\)"
    else:
        with h5py.File(newest, "r+") as f:
            f.attrs["data_pos"] = np.int64(99)
        expect = "checksum mismatch in the attributes"
    msgs = Collect()
    step, arrays, attrs = load_latest(tmp_path, expect_config={"d": 4}, report=msgs)
    assert step == 1 and attrs["data_pos"] == 10
    np.testing.assert_array_equal(arrays["params/w"], good)
    assert len(msgs.msgs) == 2, msgs.msgs
    assert "rejected" in msgs.msgs[0] and "ckpt_00000002.h5" in msgs.msgs[0]
    assert "falls back to ckpt_00000001.h5" in msgs.msgs[0]


    assert re.search(expect, msgs.msgs[0]), msgs.msgs[0]
    # when every checkpoint is bad: a clear error, not a silent fresh start
    _flip_byte_in(tmp_path / "ckpt_00000001.h5", "params/w")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        load_latest(tmp_path, expect_config={"d": 4}, report=Collect())


@pytest.mark.parametrize("bad", ["/abs", "../up", "a/../b", "a//b", "./a", "a/.hidden", "", "a b"])
def test_unsafe_names_refused(tmp_path, bad):
    w = CheckpointWriter(tmp_path)
    with pytest.raises(ValueError, match="plain relative name"):
        w.save(1, {bad: np.ones(2)})
    assert list_checkpoints(tmp_path) == []


def test_bad_inputs(tmp_path):
    w = CheckpointWriter(tmp_path)
    with pytest.raises(TypeError, match="object"):
        w.save(1, {"w": np.array([object()])})
    with pytest.raises(ValueError, match="reserved"):
        w.save(1, {"w": np.ones(2)}, {"step": 3})
    with pytest.raises(TypeError, match="JSON"):
        w.save(1, {"w": np.ones(2)}, {"x": {"a": object()}})
    with pytest.raises(ValueError, match="also used as a group"):
        w.save(1, {"a": np.ones(2), "a/b": np.ones(2)})
    with pytest.raises(ValueError, match="step"):
        w.save(-1, {"w": np.ones(2)})


@pytest.mark.parametrize("kind", ["soft", "external", "extra"])
def test_links_out_of_the_file_refused(tmp_path, kind):
    w = CheckpointWriter(tmp_path, keep=5)
    w.save(1, {"w": np.ones(2)})
    newest = w.save(2, {"w": np.zeros(2)})
    outside = tmp_path.parent / f"outside_{kind}.h5"
    with h5py.File(outside, "w") as f:
        f["secret"] = np.arange(3.0)
    with h5py.File(newest, "r+") as f:
        if kind == "soft":
            f["sneaky"] = h5py.SoftLink("/w")
        elif kind == "external":
            f["sneaky"] = h5py.ExternalLink(str(outside), "/secret")
        else:
            f["sneaky"] = np.ones(1)
    msgs = Collect()
    step, arrays, _ = load_latest(tmp_path, report=msgs)
    assert step == 1 and np.array_equal(arrays["w"], np.ones(2))
    assert "sneaky" in msgs.msgs[0]


# --------------------------------------------------------------------------------------------- MPI


@pytest.fixture
def shared_dir(comm):
    """One temporary folder seen by every rank (rank 0 makes it and removes it)."""
    path = tempfile.mkdtemp(prefix="hpczeco-ckpt-") if comm.Get_rank() == 0 else None
    path = Path(comm.bcast(path, root=0))
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.mpi
def test_mpi_save_load_fallback(comm, rng, shared_dir):
    arrays = comm.bcast(_arrays(rng), root=0)  # replicated (the rng fixture may differ between ranks)
    w = CheckpointWriter(shared_dir, comm=comm, keep=2)
    assert w.save(1, arrays, _attrs(1)) == shared_dir / "ckpt_00000001.h5"
    w.save(2, {k: v + 1 if v.dtype.kind == "f" else v for k, v in arrays.items()}, _attrs(2))
    step, got, attrs = load_latest(shared_dir, comm=comm, expect_config=_attrs(2)["config"])
    assert step == 2 and attrs["nranks"] == comm.Get_size() and attrs["rng"] == _attrs(2)["rng"]
    np.testing.assert_array_equal(got["params/layer0/wq"], arrays["params/layer0/wq"] + 1)
    np.testing.assert_array_equal(attrs["hist"], np.arange(4.0))
    # corrupt the newest on rank 0: every rank falls back to step 1
    comm.Barrier()
    if comm.Get_rank() == 0:
        _flip_byte_in(shared_dir / "ckpt_00000002.h5", "params/layer0/wq")
    comm.Barrier()
    msgs = Collect()
    step, got, attrs = load_latest(shared_dir, comm=comm, report=msgs)
    assert step == 1 and attrs["data_pos"] == 1234
    np.testing.assert_array_equal(got["params/layer0/wq"], arrays["params/layer0/wq"])
    assert (len(msgs.msgs) > 0) == (comm.Get_rank() == 0)


@pytest.mark.mpi
def test_mpi_non_replicated_refused_everywhere(comm, shared_dir):
    w = CheckpointWriter(shared_dir, comm=comm)
    mine = np.full(3, float(comm.Get_rank() > 0))
    if comm.Get_size() > 1:
        with pytest.raises(ValueError, match="rank 1 differs from rank 0 in array 'w'"):
            w.save(1, {"w": mine})
    bad = {"/abs": np.ones(2)} if comm.Get_rank() == comm.Get_size() - 1 else {"ok": np.ones(2)}
    with pytest.raises(ValueError, match=f"rank {comm.Get_size() - 1}: array name '/abs'"):
        w.save(1, bad)
    comm.Barrier()
    assert list_checkpoints(shared_dir) == []
    assert [n for n in os.listdir(shared_dir) if n != LOCK_NAME] == []
