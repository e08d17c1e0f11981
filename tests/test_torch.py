"""hpczeco.torch.chunk_gla on the CPU: values and gradients against a float64 PyTorch recurrence, gradcheck,
dtypes, errors, packed documents (cu_seqlens), a GLA layer built on it, and that the core never imports torch."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the optional 'torch' extra)")

from torch_gla_reference import recurrent_gla_torch, recurrent_gla_varlen_torch  # noqa: E402

import hpczeco.torch as ht  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rel(x, ref) -> float:
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    den = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(x - ref)) / (den if den > 0 else 1.0)


def tensors(rng, B, T, H, K, V, dtype=torch.float64, gate=(-1.0, 0.0)):
    """q, k, v, g, do ``[B, T, H, *]``, h0 and dht ``[B, H, K, V]`` from the numpy Generator (fresh per run)."""
    lo, hi = gate
    arrays = [rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V)),
              rng.uniform(lo, hi, size=(B, T, H, K)), rng.standard_normal((B, T, H, V)),
              rng.standard_normal((B, H, K, V)), rng.standard_normal((B, H, K, V))]
    return [torch.from_numpy(a).to(dtype) for a in arrays]


def leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


def load_example():
    spec = importlib.util.spec_from_file_location("gla_lm_example", ROOT / "examples" / "gla_lm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------------- values, grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("with_final", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_chunk_gla_matches_float64_recurrence(rng, dtype, with_h0, with_final, scale):
    B, H, K, V = 2, 3, 8, 5
    T = int(rng.choice([1, 17, 63, 64, 65, 130]))
    strong = bool(rng.integers(0, 2))
    q, k, v, g, do, h0, dht = tensors(rng, B, T, H, K, V, dtype, gate=(-8.0 if strong else -1.0, 0.0))
    h0 = h0 if with_h0 else None
    ins = [leaf(x) for x in (q, k, v, g, h0)]
    o, fin = ht.chunk_gla(*ins[:4], scale=scale, initial_state=ins[4], output_final_state=with_final)
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert (fin is None) == (not with_final)
    refs = [leaf(x.to(torch.float64)) if x is not None else None for x in (q, k, v, g, h0)]
    ro, states = recurrent_gla_torch(*refs[:4], scale=scale, initial_state=refs[4])
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert rel(o, ro) < tol
    loss = (o * do).sum()
    ref_loss = (ro * do.to(torch.float64)).sum()
    if with_final:
        assert fin.dtype == dtype and fin.shape == (B, H, K, V)  # float32 inputs: float32 states
        assert rel(fin, states[-1]) < tol
        loss = loss + (fin * dht).sum()
        ref_loss = ref_loss + (states[-1] * dht.to(torch.float64)).sum()
    loss.backward()
    ref_loss.backward()
    for name, x, r in zip(("q", "k", "v", "g", "initial_state"), ins, refs):
        if x is None:
            continue
        assert x.grad is not None and x.grad.dtype == x.dtype, name
        assert rel(x.grad, r.grad) < 20 * tol, (name, rel(x.grad, r.grad))


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("with_final", [False, True])
@pytest.mark.parametrize("T", [9, 70])
def test_gradcheck_float64(rng, with_h0, with_final, T):
    """Full Jacobians within one chunk (T = 9); across two chunks (T = 70) gradcheck's fast mode (a random
    projection of the Jacobian), since the full one takes a forward pass per input element."""
    B, H, K, V = 1, 2, 4, 3
    q, k, v, g, _, h0, _ = tensors(rng, B, T, H, K, V, gate=(-2.0, -0.05))  # finite differences keep g < 0
    ins = [leaf(x) for x in (q, k, v, g)] + ([leaf(h0)] if with_h0 else [])

    def fn(*xs):
        o, fin = ht.chunk_gla(*xs[:4], initial_state=xs[4] if with_h0 else None, output_final_state=with_final)
        return (o, fin) if with_final else o

    assert torch.autograd.gradcheck(fn, ins, eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=T > 64)


def test_only_final_state_used(rng):
    """A loss on the final state alone: the backward gets no gradient for o (None), only for the state."""
    B, T, H, K, V = 2, 40, 2, 6, 4
    q, k, v, g, _, h0, dht = tensors(rng, B, T, H, K, V)
    ins = [leaf(x) for x in (q, k, v, g, h0)]
    _, fin = ht.chunk_gla(*ins[:4], initial_state=ins[4], output_final_state=True)
    (fin * dht).sum().backward()
    refs = [leaf(x) for x in (q, k, v, g, h0)]
    _, states = recurrent_gla_torch(*refs[:4], initial_state=refs[4])
    (states[-1] * dht).sum().backward()
    assert refs[0].grad is None and torch.count_nonzero(ins[0].grad) == 0  # the final state does not depend on q
    for x, r in zip(ins[1:], refs[1:]):
        assert rel(x.grad, r.grad) < 1e-11


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_on_the_cpu(rng, dtype):
    """CPU float16/bfloat16 inputs are computed in float32: o and the gradients in the input dtype, states float32."""
    B, T, H, K, V = 1, 50, 2, 8, 8
    q, k, v, g, do, h0, _ = tensors(rng, B, T, H, K, V, dtype)
    ins = [leaf(x) for x in (q, k, v, g)] + [leaf(h0.float())]
    o, fin = ht.chunk_gla(*ins[:4], initial_state=ins[4], output_final_state=True)
    assert o.dtype == dtype and fin.dtype == torch.float32
    refs = [leaf(x.to(torch.float64)) for x in (q, k, v, g, h0.float())]
    ro, states = recurrent_gla_torch(*refs[:4], initial_state=refs[4])
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    assert rel(o, ro) < tol and rel(fin, states[-1]) < 1e-5
    (o * do).sum().backward()
    (ro * do.to(torch.float64)).sum().backward()
    for x, r in zip(ins, refs):
        assert x.grad.dtype == x.dtype and rel(x.grad, r.grad) < tol


def test_float32_initial_state_with_float64_inputs(rng):
    """fla keeps initial states in float32: a float32 h0 with float64 inputs works; its gradient is float32."""
    q, k, v, g, _, h0, _ = tensors(rng, 1, 30, 2, 4, 3)
    h0 = leaf(h0.float())
    o, _ = ht.chunk_gla(q, k, v, g, initial_state=h0)
    o.sum().backward()
    ref_h0 = leaf(h0.detach().double())
    ro, _ = recurrent_gla_torch(q, k, v, g, initial_state=ref_h0)
    ro.sum().backward()
    assert rel(o, ro) < 1e-12 and h0.grad.dtype == torch.float32 and rel(h0.grad, ref_h0.grad) < 1e-6


def test_in_place_change_after_forward_is_caught(rng):
    q, k, v, g, *_ = tensors(rng, 1, 20, 1, 4, 4)
    q = leaf(q)
    x = q * 1.0
    o, _ = ht.chunk_gla(x, k, v, g)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


# ----------------------------------------------------------------------------------------------- errors


def test_argument_errors(rng):
    q, k, v, g, _, h0, _ = tensors(rng, 2, 10, 2, 4, 3)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ht.chunk_gla(q.numpy(), k, v, g)
    with pytest.raises(TypeError, match="g has dtype torch.float32"):
        ht.chunk_gla(q, k, v, g.float())
    with pytest.raises(TypeError, match="on cpu hpczeco.torch takes"):
        ht.chunk_gla(*(x.to(torch.int64) for x in (q, k, v, g)))
    with pytest.raises(TypeError, match="'meta' device"):
        ht.chunk_gla(*(x.to("meta") for x in (q, k, v, g)))
    with pytest.raises(TypeError, match="v is on meta"):
        ht.chunk_gla(q, k, v.to("meta"), g)
    with pytest.raises(TypeError, match="initial_state has dtype torch.int32"):
        ht.chunk_gla(q, k, v, g, initial_state=h0.to(torch.int32))
    with pytest.raises(ValueError, match=r"k has shape \[2, 10, 2, 5\]"):
        ht.chunk_gla(q, torch.zeros(2, 10, 2, 5, dtype=q.dtype), v, g)
    with pytest.raises(ValueError, match="initial_state has shape"):
        ht.chunk_gla(q, k, v, g, initial_state=h0[:1])
    with pytest.raises(ValueError, match="log forget gate"):
        ht.chunk_gla(q, k, v, g.abs())
    with pytest.raises(ValueError, match="batch size must be 1"):
        ht.chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        ht.chunk_gla(q[:1], k[:1], v[:1], g[:1], cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match="one per document"):
        ht.chunk_gla(q[:1], k[:1], v[:1], g[:1], initial_state=h0, cu_seqlens=torch.tensor([0, 3, 5, 10]))


# ----------------------------------------------------------------------------------------------- packed documents

NO_CU_SEQLENS = "hpczeco.gla.chunk_gla has no cu_seqlens yet"


@pytest.mark.skipif(ht.supports_cu_seqlens("cpu"), reason="hpczeco.gla.chunk_gla takes cu_seqlens now")
def test_cu_seqlens_without_kernel_support_is_a_clear_error(rng):
    q, k, v, g, *_ = tensors(rng, 1, 10, 1, 4, 4)
    with pytest.raises(ValueError, match=NO_CU_SEQLENS):
        ht.chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.skipif(not ht.supports_cu_seqlens("cpu"), reason=NO_CU_SEQLENS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_states", [False, True])
def test_cu_seqlens_each_document_alone(rng, dtype, with_states):
    """Packed documents of lengths 0, 1, 15, 64, 65 and random ones equal each document run alone (values, final
    states, gradients of q, k, v, g and of the initial states)."""
    lengths = [0, 1, 15, 64, 65] + [int(x) for x in rng.integers(0, 100, size=3)]
    rng.shuffle(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    N, T, H, K, V = len(lengths), int(sum(lengths)), 2, 8, 6
    q, k, v, g, do, _, _ = tensors(rng, 1, T, H, K, V, dtype)
    h0 = torch.from_numpy(rng.standard_normal((N, H, K, V))).to(dtype) if with_states else None
    dht = torch.from_numpy(rng.standard_normal((N, H, K, V))).to(dtype)
    ins = [leaf(x) for x in (q, k, v, g, h0)]
    o, fin = ht.chunk_gla(*ins[:4], initial_state=ins[4], output_final_state=True, cu_seqlens=cu)
    refs = [leaf(x.to(torch.float64)) if x is not None else None for x in (q, k, v, g, h0)]
    ro, rfin = recurrent_gla_varlen_torch(*refs[:4], cu, initial_state=refs[4])
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert fin.shape == (N, H, K, V)
    assert rel(o, ro) < tol and rel(fin, rfin) < tol
    ((o * do).sum() + (fin * dht).sum()).backward()
    ((ro * do.double()).sum() + (rfin * dht.double()).sum()).backward()
    for name, x, r in zip(("q", "k", "v", "g", "initial_state"), ins, refs):
        if x is not None:
            assert rel(x.grad, r.grad) < 20 * tol, name


# ----------------------------------------------------------------------------------------------- a layer built on it


class RecurrentGLA(torch.nn.Module):
    """The attention of the example's GLA layer, by the float64 recurrence."""

    def forward(self, q, k, v, g):
        return recurrent_gla_torch(q, k, v, g)[0]


def test_gla_layer_on_chunk_gla_equals_the_recurrence_layer(rng):
    """The example's GLA layer (projections, gate, output projection) on hpczeco.torch.chunk_gla and on the
    recurrence, same weights: outputs and every parameter's gradient agree in float64."""
    ex = load_example()
    cfg = ex.Config(d_model=24, heads=2, head_k=8, head_v=6)
    seed = int(rng.integers(2**31))
    layers = []
    for attention in (ex.LocalGLA(), RecurrentGLA()):
        torch.manual_seed(seed)
        layers.append(ex.GLALayer(cfg, attention).double())
    x = torch.from_numpy(rng.standard_normal((2, 77, cfg.d_model)))
    w = torch.from_numpy(rng.standard_normal((2, 77, cfg.d_model)))
    outs = []
    for layer in layers:
        xi = leaf(x)
        y = layer(xi)
        (y * w).sum().backward()
        outs.append((y, xi.grad, [p.grad for p in layer.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    assert rel(y0, y1) < 1e-12 and rel(gx0, gx1) < 1e-12
    assert len(gp0) == len(gp1) == 6  # wq, wk, wv, wg (+ bias), wo
    for a, b in zip(gp0, gp1):
        assert rel(a, b) < 1e-11


# ----------------------------------------------------------------------------------------------- packaging


def test_core_does_not_import_torch():
    code = ("import sys, hpczeco, hpczeco.gla, hpczeco.zeco, hpczeco.collectives, hpczeco.collectives.costmodel, "
            "hpczeco.drivers.cli; "
            "hpczeco.ZeCOGLA; assert 'torch' not in sys.modules, 'torch imported by the core'; print('ok')")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def _mpiexec() -> str | None:
    if os.environ.get("MPIEXEC"):
        return os.environ["MPIEXEC"]
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.slow
def test_example_script_under_mpiexec(tmp_path):
    """`mpiexec -n 2 python examples/gla_lm.py --compare-single`: the script's own P-rank vs 1-rank comparison."""
    exe = _mpiexec()
    if exe is None:
        pytest.skip("no mpiexec")
    env = dict(os.environ, HYDRA_LAUNCHER="fork", MPIR_CVAR_CH4_PROGRESS_THROTTLE="true", OMP_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "losses.json"
    cmd = [exe, "-n", "2", sys.executable, str(ROOT / "examples" / "gla_lm.py"), "--steps", "3", "--tokens", "96",
           "--layers", "1", "--d-model", "32", "--compare-single", "--json", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and len(data["losses"]) == 3 and len(data["single_losses"]) == 3
    assert data["max_loss_diff"] < 1e-10 and data["max_param_diff"] < 1e-10
    assert "largest |loss(P) - loss(1)|" in res.stdout
