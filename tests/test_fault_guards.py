"""The guards against single-rank faults, in process: agreement on the backward's ``do``, options equal in value
but not in type, option checks, the agreed collective timeout and the timed collectives, the prefill's agreement
and limits, the checkpoint loader's bounds and the writer's clean-up (the same faults in whole launched jobs:
test_job_faults.py). The ``mpi`` ones run at every rank count of the suite (a disagreement is raised on one rank,
checked on all)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import agreed_error, gla_inputs
from hpczeco.collectives import timed
from hpczeco.collectives.agree import agree_fast, canonical, collective_check
from hpczeco.collectives.context import get_context
from hpczeco.collectives.watchdog import TIMEOUT_ENV
from hpczeco.drivers.checkpoint import (
    LOCK_NAME,
    CheckpointError,
    CheckpointWriter,
    array_sha256,
    load_checkpoint,
    load_latest,
)
from hpczeco.drivers.checkpoint import guarded_file as ck_guarded
from mpi4py import MPI

from hpczeco import ZeCOGLA

# --------------------------------------------------------------------------------------------- the backward's do


def _layer_and_inputs(comm, rng, dtype=np.float32):
    q, k, v, g, do, _, _ = gla_inputs(rng, 1, 12, 2, 8, 4)
    layer = ZeCOGLA(comm, chunk_size=16)
    layer.forward(*(x.astype(dtype) for x in (q, k, v, g)))
    return layer, do.astype(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("bad", ["dtype", "shape", "nan", "ndim"])
def test_backward_do_disagreement_raises_on_every_rank(comm, rng, bad):
    """``do`` of another dtype, shape or with a NaN on the last rank only: every rank raises the same error
    before any message of the backward (it used to: one rank TypeError, one returned, one hung); the next
    backward with a good ``do`` then works on every rank."""
    layer, do = _layer_and_inputs(comm, rng)
    last = comm.Get_size() - 1
    with_nan = do.copy()
    with_nan[0, -1, 0, 0] = np.nan
    wrong = {"dtype": do.astype(np.float64), "shape": do[:, :, :1], "nan": with_nan, "ndim": do[0]}[bad]
    mine = wrong if comm.Get_rank() == last else do
    msg = agreed_error(comm, lambda: layer.backward(mine))
    want = {"dtype": "do must have the forward's dtype float32, got float64", "shape": "do has shape",
            "nan": "do contains NaN", "ndim": "do must have 4 dimensions"}[bad]  # fmt: skip
    assert msg is not None and msg.startswith(f"ZeCOGLA.backward: rank {last}: ") and want in msg, msg
    grads = layer.backward(do)
    assert all(np.isfinite(x).all() for x in grads[:4])


# --------------------------------------------------------------------------------------------- values and types


@pytest.mark.mpi
def test_equal_values_of_other_types_agree(comm):
    """0.5 and np.float32(0.5) agree (they used to end in an AssertionError on every rank); 0.1 and
    np.float32(0.1) do not, nor True and 1: the same named disagreement on every rank."""
    r, last = comm.Get_rank(), comm.Get_size() - 1
    same = {"scale": np.float32(0.5) if r == last else 0.5, "n": np.int64(3) if r == last else 3,
            "shape": [2, 3] if r == last else (2, 3), "flag": True}  # fmt: skip
    agree_fast(comm, "op", None, same)
    collective_check(comm, "op", None, same)
    if comm.Get_size() == 1:
        return
    msg = agreed_error(comm, lambda: agree_fast(comm, "op", None, {"scale": np.float32(0.1) if r == last else 0.1}))
    assert msg == f"op: ranks disagree on scale: rank 0 has 0.1, rank {last} has {np.float32(0.1)!r}", msg
    msg = agreed_error(comm, lambda: agree_fast(comm, "op", None, {"flag": 1 if r == last else True}))
    assert msg == f"op: ranks disagree on flag: rank 0 has True, rank {last} has 1", msg


def test_canonical_forms():
    assert canonical(0.5) == canonical(np.float32(0.5)) and canonical(2) == canonical(2.0) == canonical(np.int8(2))
    assert canonical(0.1) != canonical(np.float32(0.1)) and canonical(True) != canonical(1)
    assert canonical((1, [2.0])) == canonical([1, (2,)]) and canonical({"b": 1, "a": 2}) == canonical({"a": 2, "b": 1})
    from hpczeco.collectives.agree import _digest

    # the digest cache must not confuse values that Python calls equal (True == 1 == 1.0, same hash)
    for a, b in ((True, 1), ((True, 2), (1, 2)), (0.1, np.float32(0.1))):
        assert _digest({"x": a}) != _digest({"x": b}) and _digest({"x": b}) != _digest({"x": a})
    for a, b in ((0.5, np.float32(0.5)), (2, 2.0), ([1, 2], (1, 2))):
        assert _digest({"x": a}) == _digest({"x": b})


@pytest.mark.mpi
def test_zeco_scale_of_other_types_runs_alike(comm, rng):
    """ZeCOGLA with scale 0.375 on some ranks and np.float32(0.375) on others runs and gives the all-0.375
    result (the mixed layer runs first: the agreement's digest cache must not hide a difference)."""
    q, k, v, g, _, _, _ = gla_inputs(rng, 1, 10, 2, 4, 4)
    mixed = ZeCOGLA(comm, scale=np.float32(0.375) if comm.Get_rank() % 2 else 0.375).forward(q, k, v, g)
    ref = ZeCOGLA(comm, scale=0.375).forward(q, k, v, g)
    assert np.array_equal(ref, mixed)


@pytest.mark.parametrize("scale, err", [("0.5", TypeError), (True, TypeError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), (-1.0, ValueError), (0, ValueError)])
def test_zeco_rejects_bad_scale(scale, err):
    with pytest.raises(err, match="scale must be"):
        ZeCOGLA(MPI.COMM_SELF, scale=scale)


@pytest.mark.mpi
def test_agree_fast_flags_are_the_maximum(comm):
    r, P = comm.Get_rank(), comm.Get_size()
    got = agree_fast(comm, "flags", None, {"x": 1}, flags=(int(r == P - 1), r, 0))
    assert got == (1, P - 1, 0)


# --------------------------------------------------------------------------------------------- the agreed timeout


@pytest.mark.mpi
def test_timeout_agreed_per_communicator(comm):
    """The context agrees on $HPCZECO_COLLECTIVE_TIMEOUT when it is made: set alike it is used; set on one
    rank only, or invalid on one rank, every rank raises the same configuration error."""
    old = os.environ.get(TIMEOUT_ENV)
    r, last = comm.Get_rank(), comm.Get_size() - 1
    cases = [("7", "7", None), ("7", None, "configuration mismatch"), ("7", "soon", "must be a number of seconds"),
             ("7", "-1", "must be a positive finite number"), ("off", "0", None)]
    try:
        for value, on_last, want in cases:
            os.environ[TIMEOUT_ENV] = value
            if r == last:
                if on_last is None:
                    os.environ.pop(TIMEOUT_ENV)
                else:
                    os.environ[TIMEOUT_ENV] = on_last
            if comm.Get_size() == 1 and want == "configuration mismatch":
                continue  # one rank cannot disagree with itself
            dup = comm.Dup()
            try:
                msg = agreed_error(comm, lambda d=dup: get_context(d))
                if want is None:
                    assert msg is None and get_context(dup).timeout == (7.0 if value == "7" else None)
                else:
                    assert msg is not None and want in msg, msg
            finally:
                dup.Free()
    finally:
        os.environ.pop(TIMEOUT_ENV, None)
        if old is not None:
            os.environ[TIMEOUT_ENV] = old


@pytest.mark.mpi
@pytest.mark.parametrize("with_timeout", [False, True])
def test_timed_collectives_equal_mpi(comm, rng, with_timeout):
    """Every timed collective gives what the plain MPI call gives, with and without a timeout (off: the blocking
    calls)."""
    old = os.environ.pop(TIMEOUT_ENV, None)
    os.environ[TIMEOUT_ENV] = "30" if with_timeout else "off"
    dup = comm.Dup()
    try:
        assert get_context(dup).timeout == (30.0 if with_timeout else None)
        r, P = comm.Get_rank(), comm.Get_size()
        obj = {"rank": r, "blob": list(range(r * 3))}
        assert timed.allgather(dup, obj, "t") == comm.allgather(obj)
        assert timed.bcast(dup, obj if r == P - 1 else None, P - 1, "t") == comm.bcast(obj, root=P - 1)
        x = rng.standard_normal(257) + r
        got = np.empty((P, x.size))
        timed.Allgather(dup, x, got, "t")
        want = np.empty((P, x.size))
        comm.Allgather(x, want)
        assert np.array_equal(got, want)
        s = x.copy()
        timed.Allreduce(dup, s, MPI.MAX, "t")
        m = np.empty_like(x)
        comm.Allreduce(x, m, op=MPI.MAX)
        assert np.array_equal(s, m)
        b = x.copy()
        timed.Bcast(dup, b, 0, "t")
        c = x.copy()
        comm.Bcast(c, root=0)
        assert np.array_equal(b, c)
        assert timed.gather(dup, obj, P - 1, "t") == comm.gather(obj, root=P - 1)
        timed.Barrier(dup, "t")
        counts = [r + 1 for r in range(P)]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        mine = np.full(r + 1, float(r))
        got_v = np.empty(sum(counts))
        timed.Allgatherv(dup, mine, got_v, counts, displs, "t")
        assert np.array_equal(got_v, np.repeat(np.arange(P, dtype=float), counts))
        y = rng.standard_normal(2 * P) * (r + 1)
        rs = np.empty(2)
        timed.Reduce_scatter(dup, y, rs, [2] * P, MPI.SUM, "t")
        want_rs = np.empty(2 * P)
        comm.Allreduce(y, want_rs, op=MPI.SUM)
        assert np.allclose(rs, want_rs[2 * r:2 * r + 2])
    finally:
        dup.Free()
        os.environ.pop(TIMEOUT_ENV, None)
        if old is not None:
            os.environ[TIMEOUT_ENV] = old


# --------------------------------------------------------------------------------------------- prefill


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["seed", "swapped-tokens"])
def test_prefill_heads_detects_a_different_model_or_tokens(comm, rng, what):
    """Heads mode: a model of another seed, or two tokens swapped, on the last rank only is a collective error
    (the token check used to be a plain sum, and the model was not compared)."""
    from hpczeco.drivers.daaf_demo import ModelConfig, PrefillModel

    if comm.Get_size() == 1:
        pytest.skip("needs two ranks to disagree")
    last = comm.Get_rank() == comm.Get_size() - 1
    tokens = rng.integers(0, 64, 40).astype(np.int64)
    cfg = {"vocab_size": 64, "d_model": 16, "n_heads": 2, "head_dim": 8, "n_layers": 1}
    seed = 1 if (what == "seed" and last) else 0
    model = PrefillModel(ModelConfig(**cfg, seed=seed))
    mine = tokens.copy()
    if what == "swapped-tokens" and last:
        mine[[3, 17]] = mine[[17, 3]] if mine[3] != mine[17] else (mine[17] + 1, mine[3])
    msg = agreed_error(comm, lambda: model.prefill(mine, "dense", comm=comm, mode="heads"))
    assert msg is not None and f"ranks disagree on {'model' if what == 'seed' else 'tokens'}" in msg, msg


@pytest.mark.parametrize("bad", [{"n_heads": 0}, {"head_dim": 0}, {"d_model": 0}, {"vocab_size": 1},
                                 {"n_layers": -1}, {"head_dim": 2.0}, {"rope_base": float("nan")}])
def test_model_config_checked(bad):
    from hpczeco.drivers.daaf_demo import ModelConfig

    with pytest.raises((ValueError, TypeError), match="ModelConfig"):
        ModelConfig(**bad)


@pytest.mark.parametrize("opt", ["--heads", "--head-dim", "--d-model", "--layers", "--window"])
def test_prefill_rejects_zero_sizes(tmp_path, capsys, opt):
    from hpczeco.drivers.prefill import main

    f = tmp_path / "t.txt"
    f.write_text("a few words of text " * 20)
    with pytest.raises(SystemExit) as exc:
        main([str(f), opt, "0"])
    assert exc.value.code == 2 and f"argument {opt}: must be an integer >= 1, got '0'" in capsys.readouterr().err


def test_word_pieces_equal_one_findall(rng):
    """The chunked tokenizer finds the same pieces as one findall over the text, whatever the chunk size
    (long words and whitespace runs crossing chunks included), and stops at max_tokens."""
    from hpczeco.drivers.daaf_demo.tokenizer import WORD_PATTERN, TokenLimitError, tokenize, word_pieces

    alphabet = list("ab  \n\t.,;é€_") + ["x" * 40, " " * 30]
    for _ in range(200):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 300))))
        got = [p for chunk in word_pieces(text, chunk=int(rng.integers(1, 25))) for p in chunk]
        assert got == WORD_PATTERN.findall(text), repr(text)
    text = "".join(rng.choice(alphabet, size=5000))
    n = len(WORD_PATTERN.findall(text))
    assert len(tokenize(text)) == n and len(tokenize(text, max_tokens=n)) == n
    with pytest.raises(TokenLimitError, match=f"more than {n - 1:,} tokens"):
        tokenize(text, max_tokens=n - 1)
    with pytest.raises(TokenLimitError, match="byte tokens"):
        tokenize(text, mode="byte", max_tokens=10)


def test_prefill_estimate_grows_with_tokens_and_global_share():
    from hpczeco.drivers.daaf_demo import ModelConfig, PrefillModel

    m = PrefillModel(ModelConfig(vocab_size=256, d_model=32, n_heads=2, head_dim=16, n_layers=2))
    a = m.estimate(10_000, 0, 10_000 * 65, 1)
    b = m.estimate(20_000, 0, 20_000 * 65, 1)
    c = m.estimate(20_000, 20_000, 20_000 * 20_001 // 2, 4, "sequence", 64)
    assert b.bytes_per_rank > a.bytes_per_rank > m.weight_bytes() and b.flops > a.flops
    assert c.flops > b.flops and c.global_fraction == 1.0 and c.ranks == 4
    assert m.estimate(20_000, 0, 0, 4, "heads").bytes_per_rank < b.bytes_per_rank


# --------------------------------------------------------------------------------------------- train options


@pytest.mark.parametrize("opt", ["--lr", "--weight-decay", "--clip", "--eps"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_train_rejects_non_finite_options(capsys, opt, value):
    from hpczeco.drivers.train import run

    with pytest.raises(SystemExit) as exc:
        run([opt, value, "--steps", "1"], MPI.COMM_SELF)
    assert exc.value.code == 2 and f"argument {opt}: must be a finite number" in capsys.readouterr().err


def test_cli_one_rank_reports_errors(tmp_path, capsys, monkeypatch):
    """One rank: a user error is one line and exit status 2; an internal error shows its traceback, status 1."""
    from hpczeco.drivers.cli import main

    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 40)
    base = ["train", "--text", str(text), "--d-model", "8", "--layers", "1", "--heads", "1", "--seq", "32",
            "--steps", "2", "--no-progress", "--quiet"]  # fmt: skip
    assert main([*base, "--log", str(tmp_path / "missing" / "log.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "hpczeco train: error: --log" in err and "does not exist" in err and "Traceback" not in err
    monkeypatch.setenv("HPCZECO_FAULT_RAISE", "0:2")
    assert main(base) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "hpczeco train: error: RuntimeError: fault injection: rank 0 raises in step 2 (internal error" in err


# --------------------------------------------------------------------------------------------- checkpoints


def _good(tmp_path: Path, step: int = 1) -> Path:
    return CheckpointWriter(tmp_path, keep=None).save(step, {"params/w": np.arange(6.0), "params/b": np.ones(2)},
                                                      {"config": {"a": 1}})


def test_declared_storage_is_bounded_before_reading(tmp_path):
    """A chunked never-written (10**12,) dataset, and a 64 MB sparse one with a valid checksum, in small files:
    refused before anything is read (no MemoryError, no 64 MB allocation), and the previous one is used."""
    _good(tmp_path, 1)
    for step, shape in ((2, (10**12,)), (3, (8 << 20,))):
        path = _good(tmp_path, step)
        with h5py.File(path, "a") as f:
            f.create_dataset("params/big", shape=shape, dtype="f8", chunks=(1 << 16,))
            manifest = __import__("json").loads(f.attrs["_manifest"])
            digest = "0" * 64 if shape[0] > 1 << 30 else array_sha256(np.zeros(shape))
            manifest["params/big"] = {"shape": list(shape), "dtype": "<f8", "sha256": digest}
            f.attrs["_manifest"] = __import__("json").dumps(manifest, sort_keys=True)
        assert path.stat().st_size < 1 << 20
        with pytest.raises(CheckpointError, match="'params/big' is chunked"):
            load_checkpoint(path)
    msgs: list[str] = []
    step, arrays, _ = load_latest(tmp_path, report=msgs.append)
    assert step == 1 and np.array_equal(arrays["params/w"], np.arange(6.0))
    assert len([m for m in msgs if m.startswith("rejected")]) == 2, msgs


def test_expected_arrays_checked_before_reading(tmp_path):
    _good(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"array 'params/w' is <f8\[6\], this run expects <f4\[6\]"):
        load_checkpoint(tmp_path / "ckpt_00000001.h5", expect_arrays={"params/w": ((6,), np.float32),
                                                                      "params/b": ((2,), np.float64)})
    with pytest.raises(CheckpointError, match=r"missing \['params/c'\], unexpected \['params/b'\]"):
        load_checkpoint(tmp_path / "ckpt_00000001.h5", expect_arrays={"params/w": ((6,), np.float64),
                                                                      "params/c": ((2,), np.float64)})


@pytest.mark.parametrize("error", [KeyError, MemoryError, ValueError])
def test_any_failure_of_the_callers_checks_rejects_the_candidate(tmp_path, error):
    _good(tmp_path, 1)
    _good(tmp_path, 2)

    def validate(step, arrays, attrs):
        if step == 2:
            raise error("planted")

    msgs: list[str] = []
    step, _, _ = load_latest(tmp_path, validate=validate, report=msgs.append)
    assert step == 1
    assert any(f"ckpt_00000002.h5 ({error.__name__}: " in m and "falls back to ckpt_00000001.h5" in m for m in msgs)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_entries_named_like_a_checkpoint_are_reported(tmp_path, kind):
    _good(tmp_path, 1)
    odd = tmp_path / "ckpt_00000009.h5"
    if kind == "directory":
        odd.mkdir()
    elif kind == "fifo":
        os.mkfifo(odd)
    else:
        odd.symlink_to(tmp_path / "ckpt_00000001.h5")
    msgs: list[str] = []
    step, _, _ = load_latest(tmp_path, report=msgs.append)
    assert step == 1
    what = {"directory": "a directory", "fifo": "a FIFO", "symlink": "a symbolic link"}[kind]
    assert msgs == [f"skipped {odd}: {what}{' (not followed)' if kind == 'symlink' else ''}, not a checkpoint file"]


def test_leftover_temporaries_removed_by_the_next_write(tmp_path):
    _good(tmp_path, 1)
    stale = [tmp_path / ".ckpt_00000003.h5.tmp-123-456", tmp_path / ".ckpt_00000002.h5.tmp-9-10"]
    for p in stale:
        p.write_bytes(b"half a file")
    keep = tmp_path / ".notes.tmp-1-2"
    keep.write_text("not ours")
    _good(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == [".notes.tmp-1-2", "ckpt_00000001.h5",
                                                                                "ckpt_00000004.h5"]


def test_disk_full_write_is_a_clean_error(tmp_path, monkeypatch):
    """os.pwrite failing with ENOSPC half-way (simulated: the tmpfs test in test_job_faults.py does it for
    real): a CheckpointError naming the folder and the bytes needed, the temporary removed."""
    _good(tmp_path, 1)
    real = os.pwrite
    calls = {"n": 0}

    def full(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data[: max(1, len(data) // 2)], offset)

    monkeypatch.setattr(ck_guarded.os, "pwrite", full)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint ckpt_00000002\.h5 into .*: no space left on "
                                              r"the device \(No space left on device\): it needs [\d,]+ bytes"):
        _good(tmp_path, 2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == ["ckpt_00000001.h5"]
