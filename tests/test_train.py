"""The GLA language model and `hpczeco train`: gradients by finite differences, loss falls, P ranks vs 1,
resume equals an uninterrupted run (bitwise on the same rank count, within tolerance on another)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hpczeco.drivers import train
from hpczeco.drivers.checkpoint import CheckpointError, list_checkpoints
from hpczeco.drivers.data import Sampler, read_corpus, slice_bounds
from hpczeco.drivers.lm import GLALM, LMConfig, init_params, make_mixers
from mpi4py import MPI

SMALL = ["--d-model", "16", "--layers", "2", "--heads", "2", "--seq", "60", "--chunk-size", "16",
         "--no-progress", "--quiet", "--lr", "1e-2"]  # fmt: skip


def _have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


# --------------------------------------------------------------------------------------------- model


def _fd_check(mixer_kind: str, rng, comm=None) -> float:
    cfg = LMConfig(vocab=13, d_model=8, n_layers=2, n_heads=2, d_ff=12)
    params = init_params(cfg, 1, np.float64)
    for k in params:
        params[k] = params[k] + 0.1 * rng.standard_normal(params[k].shape)
    tok, tgt = rng.integers(0, 13, (2, 9)), rng.integers(0, 13, (2, 9))
    model = GLALM(cfg, make_mixers(mixer_kind, cfg.n_layers, comm, chunk_size=4))
    _, grads = model.loss_and_grads(params, tok, tgt, tok.size)
    worst = 0.0
    h = 1e-6
    for name in params:
        for _ in range(2):
            idx = tuple(int(rng.integers(0, s)) for s in params[name].shape)
            plus = {k: v.copy() for k, v in params.items()}
            plus[name][idx] += h
            minus = {k: v.copy() for k, v in params.items()}
            minus[name][idx] -= h
            fd = model.loss_and_grads(plus, tok, tgt, tok.size)[0] - model.loss_and_grads(minus, tok, tgt, tok.size)[0]
            fd /= 2 * h
            # central differences in float64: truncation ~h^2, rounding ~1e-16 * loss / h ~ 1e-9 absolute
            err = abs(fd - grads[name][idx])
            assert err <= 1e-5 * abs(fd) + 1e-8, (
                f"{mixer_kind}: dloss/d{name}{idx}: finite difference {fd}, backward {grads[name][idx]}"
            )
            worst = max(worst, err / max(abs(fd), 1e-8))
    return worst


def test_backward_matches_finite_differences_recurrent(rng):
    """The model's own layers, with the self-contained float64 recurrent GLA mixer."""
    _fd_check("recurrent", rng)


@pytest.mark.skipif(not _have("hpczeco.gla"), reason="hpczeco.gla (chunk_gla) not available in this build")
def test_backward_matches_finite_differences_chunk(rng):
    _fd_check("chunk", rng)


@pytest.mark.skipif(not _have("hpczeco.zeco"), reason="hpczeco.zeco not available in this build")
def test_backward_matches_finite_differences_zeco_one_rank(rng):
    _fd_check("zeco", rng, MPI.COMM_SELF)


def test_slices_and_sampler():
    for T, P in [(10, 3), (60, 4), (7, 7), (5, 1)]:
        b = [slice_bounds(T, P, p) for p in range(P)]
        assert b[0][0] == 0 and b[-1][1] == T and all(b[i][1] == b[i + 1][0] for i in range(P - 1))
        assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1
    s1 = Sampler(1000, 50, 2, seed=3)
    s1.next_offsets()
    state = json.loads(json.dumps(s1.state()))  # JSON round trip, as in a checkpoint
    s2 = Sampler(1000, 50, 2, seed=99)
    s2.set_state(state)
    np.testing.assert_array_equal(s1.next_offsets(), s2.next_offsets())
    assert s1.drawn == s2.drawn == 4
    with pytest.raises(ValueError, match="fewer than seq"):
        Sampler(10, 50, 1, seed=0)


# --------------------------------------------------------------------------------------------- driver


@pytest.fixture(scope="module")
def text_file():
    """A small text (the first 48 KiB of the default stdlib corpus), one path for every rank."""
    comm = MPI.COMM_WORLD
    path = None
    if comm.Get_rank() == 0:
        data, _ = read_corpus(None, 48 << 10)
        fd, path = tempfile.mkstemp(prefix="hpczeco-text-", suffix=".txt")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        os.unlink(path)


@pytest.fixture
def shared_dir():
    comm = MPI.COMM_WORLD
    path = tempfile.mkdtemp(prefix="hpczeco-train-") if comm.Get_rank() == 0 else None
    path = Path(comm.bcast(path, root=0))
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_help():
    out = subprocess.run([sys.executable, "-m", "hpczeco", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--text", "--ckpt-every", "--resume", "--dtype", "--log", "--scan"):
        assert flag in out.stdout


def test_loss_falls_and_log(text_file, tmp_path, capsys):
    log = tmp_path / "train.jsonl"
    res = train.run(["--text", text_file, *SMALL, "--steps", "12", "--log", str(log), "--seq", "128"], MPI.COMM_SELF)
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses
    assert losses[0] == pytest.approx(np.log(256), rel=0.15)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13)) and recs[-1]["event"] == "end"
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == 128 for r in steps)
    assert [r["loss"] for r in steps] == losses
    assert "loss" in capsys.readouterr().out


def test_resume_bitwise_same_ranks_and_config_check(text_file, tmp_path):
    args = ["--text", text_file, *SMALL, "--dtype", "float32"]
    full = train.run([*args, "--steps", "6", "--ckpt-dir", str(tmp_path / "a"), "--ckpt-every", "3"], MPI.COMM_SELF)
    assert [s for s, _ in list_checkpoints(tmp_path / "a")] == [3, 6]
    # interrupted at 3, then resumed to 6
    part = train.run([*args, "--steps", "3", "--ckpt-dir", str(tmp_path / "b")], MPI.COMM_SELF)
    assert part.losses == {s: full.losses[s] for s in (1, 2, 3)}
    resumed = train.run([*args, "--steps", "6", "--ckpt-dir", str(tmp_path / "b"), "--resume"], MPI.COMM_SELF)
    assert resumed.start_step == 3 and sorted(resumed.losses) == [4, 5, 6]
    assert resumed.losses == {s: full.losses[s] for s in (4, 5, 6)}  # bitwise
    for name, a in full.params.items():
        assert np.array_equal(resumed.params[name], a), name
    # a different config is refused with a clear message, never silently mixed
    with pytest.raises(CheckpointError, match="config mismatch \\(lr: stored 0.01 vs expected 0.02"):
        train.run([*args, "--lr", "0.02", "--steps", "7", "--ckpt-dir", str(tmp_path / "b"), "--resume"],
                  MPI.COMM_SELF)


# --------------------------------------------------------------------------------------------- MPI


def _allclose_params(a: dict, b: dict, rtol: float, atol: float) -> None:
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.mpi
@pytest.mark.skipif(not _have("hpczeco.zeco"), reason="hpczeco.zeco not available in this build")
def test_p_ranks_equal_one_rank(comm, text_file):
    """float64: the P-rank run (ZeCO, slices of unequal length) equals a 1-rank run (chunk_gla) on every rank."""
    args = ["--text", text_file, *SMALL, "--dtype", "float64", "--steps", "3", "--scan", "ring"]
    par = train.run([*args, "--mixer", "zeco"], comm)
    one = train.run([*args, "--mixer", "chunk"], MPI.COMM_SELF)
    assert sorted(par.losses) == [1, 2, 3]
    for s in par.losses:
        assert par.losses[s] == pytest.approx(one.losses[s], rel=1e-11, abs=1e-12)
    _allclose_params(par.params, one.params, rtol=1e-9, atol=1e-11)
    # replicas stay identical (bitwise) across ranks
    digests = comm.allgather(hashlib.sha256(np.concatenate([a.ravel() for a in par.params.values()])).hexdigest())
    assert len(set(digests)) == 1


@pytest.mark.mpi
@pytest.mark.skipif(not _have("hpczeco.zeco"), reason="hpczeco.zeco not available in this build")
def test_resume_on_same_and_other_rank_count(comm, text_file, shared_dir):
    """Resume on the same P: bitwise equal to the uninterrupted run. Resume a P-rank checkpoint on 1 rank
    (every rank, its own copy): equal within float64 tolerance."""
    rank = comm.Get_rank()
    args = ["--text", text_file, *SMALL, "--dtype", "float64", "--mixer", "zeco"]
    a, b = shared_dir / "a", shared_dir / "b"
    full = train.run([*args, "--steps", "4", "--ckpt-dir", str(a), "--ckpt-every", "2"], comm)
    if rank == 0:
        b.mkdir()
        shutil.copy2(a / "ckpt_00000002.h5", b / "ckpt_00000002.h5")
    comm.Barrier()
    same = train.run([*args, "--steps", "4", "--ckpt-dir", str(b), "--resume"], comm)
    assert same.start_step == 2 and same.losses == {3: full.losses[3], 4: full.losses[4]}
    for name, x in full.params.items():
        assert np.array_equal(same.params[name], x), name
    # the P-rank checkpoint at step 2, resumed by a single rank
    mine = shared_dir / f"one-{rank}"
    mine.mkdir()
    shutil.copy2(a / "ckpt_00000002.h5", mine / "ckpt_00000002.h5")
    other = train.run([*args, "--steps", "4", "--ckpt-dir", str(mine), "--resume"], MPI.COMM_SELF)
    assert other.start_step == 2
    for s in (3, 4):
        assert other.losses[s] == pytest.approx(full.losses[s], rel=1e-11, abs=1e-12)
    _allclose_params(other.params, full.params, rtol=1e-9, atol=1e-11)
