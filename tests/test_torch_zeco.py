"""hpczeco.torch.zeco_gla under mpiexec: values and gradients on uneven slices (one possibly empty) equal a float64
PyTorch recurrence on the whole sequence; final states per rank; collective errors for a bad tensor on one rank;
the module wrapper; the example language model's P-rank loss equals its 1-rank loss."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the optional 'torch' extra)")

from hpczeco.collectives import CollectiveInputError  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_gla_reference import recurrent_gla_torch  # noqa: E402

import hpczeco.torch as ht  # noqa: E402

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ["ring", "tree", "allgather", "serial", "exscan"]


def rel(x, ref) -> float:
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    den = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(x - ref)) / (den if den > 0 else 1.0)


def leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


def slice_bounds(rng, T: int, P: int, force_empty: bool) -> list[int]:
    """Uneven contiguous slices covering [0, T), the same on every rank; with force_empty a middle rank gets none."""
    cuts = np.sort(rng.integers(0, T + 1, size=P - 1))
    bounds = np.concatenate([[0], cuts, [T]])
    if force_empty and P >= 3:
        bounds[P // 2] = bounds[P // 2 + 1]
    return [int(b) for b in np.maximum.accumulate(bounds)]


def whole(rng, B, T, H, K, V, dtype):
    """The whole sequence's q, k, v, g, do and h0, dht (identical on every rank: the rng is)."""
    arrays = [rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V)),
              rng.uniform(-1.5, 0.0, size=(B, T, H, K)), rng.standard_normal((B, T, H, V)),
              rng.standard_normal((B, H, K, V)), rng.standard_normal((B, H, K, V))]
    return [torch.from_numpy(a).to(dtype) for a in arrays]


TOL = {torch.float64: 1e-12, torch.float32: 3e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_states", [False, True])
def test_zeco_gla_matches_whole_sequence_recurrence(comm, rng, topology, dtype, with_states):
    P, r = comm.Get_size(), comm.Get_rank()
    B, H, K, V = 2, 2, 8, 5
    T = int(rng.integers(10, 30)) * P
    q, k, v, g, do, h0, dht = whole(rng, B, T, H, K, V, dtype)
    bounds = slice_bounds(rng, T, P, force_empty=with_states)
    lo, hi = bounds[r], bounds[r + 1]
    h0 = h0.float() if with_states else None  # fla's convention: float32 initial states (float64 ones work too)

    refs = [leaf(x.to(torch.float64)) if x is not None else None for x in (q, k, v, g, h0)]
    ro, states = recurrent_gla_torch(*refs[:4], initial_state=refs[4])
    ref_loss = (ro * do.double()).sum() + ((states[-1] * dht.double()).sum() if with_states else 0.0)
    ref_loss.backward()

    mine = [leaf(x[:, lo:hi]) for x in (q, k, v, g)] + [leaf(h0) if r == 0 else None]
    o, fin = ht.zeco_gla(*mine[:4], comm, topology=topology, initial_state=mine[4], output_final_state=True)
    assert o.dtype == dtype and o.shape == (B, hi - lo, H, V)
    assert fin.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = TOL[dtype]
    assert rel(o, ro[:, lo:hi]) < tol
    assert rel(fin, states[hi]) < max(tol, 1e-5)  # this slice's final state (the global one on the last rank)
    loss = (o * do[:, lo:hi]).sum()
    if with_states and r == P - 1:
        loss = loss + (fin * dht.to(fin.dtype)).sum()
    loss.backward()
    for name, x, ref in zip(("q", "k", "v", "g"), mine, refs):
        assert x.grad is not None and x.grad.dtype == dtype, name
        assert rel(x.grad, ref.grad[:, lo:hi]) < 20 * tol, (name, rel(x.grad, ref.grad[:, lo:hi]))
    if with_states and r == 0:
        assert mine[4].grad.dtype == torch.float32 and rel(mine[4].grad, refs[4].grad) < max(20 * tol, 1e-5)


def test_only_the_last_ranks_final_state_in_the_loss(comm, rng):
    """o unused on the last rank (its backward gets None for o), only its final state; o used elsewhere."""
    P, r = comm.Get_size(), comm.Get_rank()
    B, H, K, V = 1, 2, 6, 4
    T = 16 * P
    q, k, v, g, do, h0, dht = whole(rng, B, T, H, K, V, torch.float64)
    lo, hi = T * r // P, T * (r + 1) // P
    last = r == P - 1
    refs = [leaf(x) for x in (q, k, v, g, h0)]
    ro, states = recurrent_gla_torch(*refs[:4], initial_state=refs[4])
    w = do.clone()
    w[:, T * (P - 1) // P :] = 0.0  # the last rank's slice of o is not in the loss
    ((ro * w).sum() + (states[-1] * dht).sum()).backward()
    mine = [leaf(x[:, lo:hi]) for x in (q, k, v, g)] + [leaf(h0) if r == 0 else None]
    o, fin = ht.zeco_gla(*mine[:4], comm, initial_state=mine[4], output_final_state=True)
    ((fin * dht).sum() if last else (o * do[:, lo:hi]).sum()).backward()
    for x, ref in zip(mine[:4], refs[:4]):
        assert rel(x.grad, ref.grad[:, lo:hi]) < 1e-11
    if r == 0:
        assert rel(mine[4].grad, refs[4].grad) < 1e-11


def test_final_state_of_another_rank_in_the_loss_raises_everywhere(comm, rng):
    P = comm.Get_size()
    if P == 1:
        pytest.skip("needs 2+ ranks (on one rank the final state is the global one)")
    B, H, K, V = 1, 1, 4, 4
    q, k, v, g, *_ = whole(rng, B, 8, H, K, V, torch.float64)
    mine = [leaf(x) for x in (q, k, v, g)]
    o, fin = ht.zeco_gla(*mine, comm, output_final_state=True)
    with pytest.raises(CollectiveInputError, match="differentiable on the last rank only"):
        (o.sum() + fin.sum()).backward()
    # the communicator is still usable: a correct call afterwards gives the right answer
    o, fin = ht.zeco_gla(q, k, v, g, comm, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(fin).all()


BAD = ["dtype", "mixed dtype", "meta device", "not a tensor", "shape", "nan", "initial_state on rank 1",
       "no grad", "bad topology", "int dtype"]


@pytest.mark.parametrize("bad", BAD)
def test_bad_tensor_on_one_rank_raises_the_same_error_everywhere(comm, rng, bad):
    P, r = comm.Get_size(), comm.Get_rank()
    culprit = P - 1 if bad != "initial_state on rank 1" else min(1, P - 1)
    B, H, K, V = 1, 2, 4, 3
    T = 6 * P
    q, k, v, g, _, h0, _ = whole(rng, B, T, H, K, V, torch.float64)
    lo, hi = T * r // P, T * (r + 1) // P
    xs = [leaf(x[:, lo:hi]) for x in (q, k, v, g)]
    kw = {"initial_state": h0 if r == 0 else None, "topology": "ring"}
    if r == culprit:
        if bad == "dtype":
            xs = [x.float() for x in xs]
        elif bad == "mixed dtype":
            xs[3] = xs[3].float()
        elif bad == "meta device":
            xs = [x.to("meta") for x in xs]
        elif bad == "not a tensor":
            xs[0] = xs[0].detach().numpy()
        elif bad == "shape":
            xs[2] = torch.zeros(B, hi - lo, H, V + 1, dtype=torch.float64)
        elif bad == "nan":
            xs[2] = xs[2].detach().clone()
            xs[2][..., 0] = float("nan") if hi > lo else 0.0
            xs[2] = xs[2].requires_grad_()
        elif bad == "initial_state on rank 1":
            kw["initial_state"] = h0
        elif bad == "no grad":
            xs = [x.detach() for x in xs]
        elif bad == "bad topology":
            kw["topology"] = "bogus"
        elif bad == "int dtype":
            xs = [x.detach().to(torch.int32) for x in xs]
    if P == 1 and bad in ("initial_state on rank 1", "dtype", "no grad"):
        pytest.skip("needs 2+ ranks (on one rank this is a valid call, not a disagreement)")
    with pytest.raises(CollectiveInputError) as info:
        ht.zeco_gla(*xs, comm, output_final_state=True, **kw)
    assert f"rank {culprit}" in str(info.value) or "disagree" in str(info.value)
    msgs = comm.allgather(str(info.value))
    assert len(set(msgs)) == 1, msgs  # the same error on every rank
    # nothing was left in flight: a correct call afterwards gives the right answer
    good = [leaf(x[:, lo:hi]) for x in (q, k, v, g)]
    o, _ = ht.zeco_gla(*good, comm)
    ro, _ = recurrent_gla_torch(q, k, v, g)
    assert rel(o, ro[:, lo:hi]) < 1e-12


def test_module_wrapper_equals_the_function(comm, rng):
    P, r = comm.Get_size(), comm.Get_rank()
    B, H, K, V = 2, 2, 8, 8
    T = 12 * P
    q, k, v, g, do, h0, _ = whole(rng, B, T, H, K, V, torch.float32)
    lo, hi = T * r // P, T * (r + 1) // P
    h = h0 if r == 0 else None
    layer = ht.ZeCOGLAttention(comm, "tree", None, 64, 0.25)  # ZeCOGLA's order: topology, blocks, chunk_size, scale
    assert "topology='tree'" in repr(layer) and "scale=0.25" in repr(layer) and list(layer.parameters()) == []
    a = [leaf(x[:, lo:hi]) for x in (q, k, v, g)]
    b = [leaf(x[:, lo:hi]) for x in (q, k, v, g)]
    oa, fa = layer(*a, initial_state=h, output_final_state=True)
    ob, fb = ht.zeco_gla(*b, comm, topology="tree", scale=0.25, initial_state=h, output_final_state=True)
    assert torch.equal(oa, ob) and torch.equal(fa, fb)
    (oa * do[:, lo:hi]).sum().backward()
    (ob * do[:, lo:hi]).sum().backward()
    for x, y in zip(a, b):
        assert torch.equal(x.grad, y.grad)
    o, _ = layer(*a)
    ro, _ = recurrent_gla_torch(q, k, v, g, scale=0.25)
    assert rel(o, ro[:, lo:hi]) < 3e-5


def test_numpy_and_torch_forms_take_the_same_options():
    """hpczeco.zeco_gla and hpczeco.torch.zeco_gla: the same keyword options with the same defaults; ZeCOGLA and
    ZeCOGLAttention: the same leading arguments in the same order."""
    import inspect

    import hpczeco

    def options(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert options(hpczeco.zeco_gla)[5:] == options(ht.zeco_gla)[5:]
    assert {name for name, kind, _ in options(ht.zeco_gla)[5:] if kind is inspect.Parameter.KEYWORD_ONLY} == {
        "topology", "blocks", "chunk_size", "scale", "initial_state", "output_final_state", "transport",
        "check_values"}
    lead = ["comm", "topology", "blocks", "chunk_size", "scale", "transport"]
    assert list(inspect.signature(hpczeco.ZeCOGLA).parameters)[:6] == lead
    assert list(inspect.signature(ht.ZeCOGLAttention).parameters)[:6] == lead
    assert options(hpczeco.ZeCOGLA)[1:5] == options(ht.ZeCOGLAttention)[1:5]


# ----------------------------------------------------------------------------------------------- the example


def load_example():
    spec = importlib.util.spec_from_file_location("gla_lm_example", ROOT / "examples" / "gla_lm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_example_loss_on_p_ranks_equals_one_rank(comm, rng):
    """examples/gla_lm.py: training on the sequence split over the ranks gives, step by step, the loss (and at the
    end the parameters) of training on the whole sequence on one rank (each rank also runs that, on COMM_SELF)."""
    ex = load_example()
    cfg = ex.Config(vocab=32, d_model=32, layers=2, heads=2, head_k=8, head_v=8)
    seed = int(rng.integers(2**31))
    tokens = ex.markov_tokens(int(rng.integers(100, 160)) + 1, cfg.vocab, seed)
    split = ex.train(comm, tokens, cfg, steps=4, lr=1e-2, seed=seed)
    alone = ex.train(MPI.COMM_SELF, tokens, cfg, steps=4, lr=1e-2, seed=seed)
    diffs = [abs(a - b) for a, b in zip(split["losses"], alone["losses"])]
    assert len(diffs) == 4 and max(diffs) < 1e-10, diffs
    assert np.max(np.abs(split["params"] - alone["params"])) < 1e-10
    assert split["losses"][-1] < split["losses"][0]  # it learns
    assert len(set(comm.allgather(tuple(split["losses"])))) == 1  # the same loss on every rank
