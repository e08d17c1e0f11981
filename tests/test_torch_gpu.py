"""hpczeco.torch on a CUDA GPU: chunk_gla forward and backward against a float64 recurrence and (bf16 cases, with
HPCZECO_TEST_FLA=1 and fla importable) against flash-linear-attention's chunk_gla on the same tensors; torch's current
stream and zero-copy views; zeco_gla on CUDA tensors under mpiexec; the example on the GPU; the glue benchmark runs.

Skipped with a reason without a CUDA build of PyTorch, CuPy and a GPU. The CUDA branch's glue also runs without a
GPU, on the emulated kernels, in tests/test_torch_cuda_emu.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the optional 'torch' extra)")

from hpczeco.base.backend import cupy_available  # noqa: E402
from torch_gla_reference import recurrent_gla_torch  # noqa: E402

import hpczeco.torch as ht  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                                                  reason="needs a CUDA build of PyTorch, CuPy and a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]
# (B, T, H, K, V, gate normaliser): fla's grid in spirit (T = 1, not a multiple of 64, K != V, weak/strong gates)
CASES = [(1, 1, 1, 64, 64, 1.0), (1, 63, 2, 64, 64, 1.0), (2, 777, 4, 60, 64, 1.0), (2, 1000, 4, 64, 128, 0.1),
         (2, 1024, 4, 128, 128, 10.0), (1, 777, 2, 256, 512, 1.0), (2, 1000, 2, 128, 256, 0.1),
         (1, 63, 2, 256, 512, 10.0)]  # the last three: fla's GLA layer heads (the tiled tensor-core kernels)
# with HPCZECO_TEST_FLA=1 the bf16 cases also run through fla: its first call at each new shape autotunes for 1-3 min
# (a whole step of the device runs went by in it), so the cross-check is asked for; the float64 check always runs
FLA_CASES = {(torch.bfloat16, c) for c in CASES} if os.environ.get("HPCZECO_TEST_FLA") == "1" else set()
# RMS error ratio bounds against float64 (fla's own tolerances for 16-bit inputs)
TOL = {torch.bfloat16: {"o": 0.004, "grad": 0.005}, torch.float16: {"o": 0.004, "grad": 0.005},
       torch.float32: {"o": 2e-4, "grad": 2e-4}}


def err_ratio(x, ref) -> float:
    """fla's measure: RMS of the error over the RMS of the reference."""
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300))


def fla_chunk_gla():
    try:
        from fla.ops.gla import chunk_gla  # noqa: PLC0415
    except Exception:  # noqa: BLE001
        return None
    return chunk_gla


def make(rng, B, T, H, K, V, norm, dtype, dev):
    """fla-style inputs (uniform q, k, v; g = logsigmoid(uniform) / norm), h0 and dht float32; all on ``dev``."""
    f = lambda *s: torch.from_numpy(rng.random(s))
    q, k, v = f(B, T, H, K), f(B, T, H, K), f(B, T, H, V)
    g = torch.nn.functional.logsigmoid(f(B, T, H, K)) / norm
    do = torch.from_numpy(rng.standard_normal((B, T, H, V)))
    h0, dht = f(B, H, K, V), torch.from_numpy(rng.standard_normal((B, H, K, V)))
    ins = [x.to(dev, dtype) for x in (q, k, v, g, do)]
    return ins + [h0.to(dev, torch.float32), dht.to(dev, torch.float32)]


def run(fn, q, k, v, g, do, h0, dht):
    """``(o, final, dq, dk, dv, dg, dh0)`` of ``fn(q, k, v, g, initial_state=, output_final_state=True)``."""
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, fin = fn(*ins[:4], initial_state=ins[4], output_final_state=True)
    ((o * do).sum() + (fin * dht).sum()).backward()
    return [o, fin] + [x.grad for x in ins]


def reference(q, k, v, g, do, h0, dht):
    def fn(q, k, v, g, initial_state, output_final_state):
        o, states = recurrent_gla_torch(q, k, v, g, initial_state=initial_state)
        return o, states[-1]

    return run(fn, *(x.to(torch.float64) for x in (q, k, v, g, do, h0, dht)))


NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dh0")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-H{}-K{}-V{}-norm{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_chunk_gla_against_float64_and_fla(rng, case, dtype):
    *shape, norm = case
    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v, g, do, h0, dht = make(rng, *shape, norm, dtype, dev)
    ours = run(ht.chunk_gla, q, k, v, g, do, h0, dht)
    ref = reference(q, k, v, g, do, h0, dht)
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    assert all(x.dtype == dtype for x in ours[2:6]) and ours[6].dtype == torch.float32
    errs = {n: err_ratio(a, r) for n, a, r in zip(NAMES, ours, ref)}
    fla = fla_chunk_gla() if (dtype, case) in FLA_CASES else None
    fla_errs = {}
    if fla is not None:
        theirs = run(fla, q, k, v, g, do, h0, dht)
        fla_errs = {n: err_ratio(a, r) for n, a, r in zip(NAMES, theirs, ref)}
        between = {n: err_ratio(a, b) for n, a, b in zip(NAMES, ours, theirs)}
    print(f"{case} {dtype}: hpczeco {errs}" + (f"; fla {fla_errs}" if fla_errs else "; fla not run (HPCZECO_TEST_FLA)"))
    tol = TOL[dtype]
    for n in NAMES:
        assert errs[n] <= (tol["o"] if n == "o" else tol["grad"]), (n, errs[n], fla_errs.get(n))
        if fla_errs:  # both within tolerance of float64, hence of each other
            assert between[n] <= 2 * (tol["o"] if n == "o" else tol["grad"]), (n, between[n])


def test_cuda_runs_on_torchs_current_stream_and_views_are_zero_copy(rng):
    from hpczeco.torch import _arrays  # noqa: PLC0415

    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v, g, do, h0, dht = make(rng, 2, 300, 2, 64, 64, 1.0, torch.bfloat16, dev)
    expected, _ = ht.chunk_gla(q, k, v, g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o, _ = ht.chunk_gla(q, k, v, g)
        after = o.float() * 2.0  # torch work queued behind the kernels on the same stream
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(after, expected.float() * 2.0)
    with _arrays.cuda_stream(dev.index):
        a = _arrays.to_device(q)
        assert str(a.dtype) == "uint16" and int(a.data.ptr) == q.data_ptr()
        back = _arrays.from_device(a)
        assert back.dtype == torch.bfloat16 and back.data_ptr() == q.data_ptr()


def test_cached_views_are_looked_up_by_address_dtype_and_shape(rng):
    """``to_device(t, cached=True)``: the same view for the same (address, dtype, shape), another for another
    shape or dtype at that address; a tensor given freed memory by the allocator reads its own values through the
    view found for that address (the allocator reuses the block as a rule; the test holds either way)."""
    from hpczeco.torch import _arrays  # noqa: PLC0415

    dev = torch.device("cuda", torch.cuda.current_device())
    with _arrays.cuda_stream(dev.index):
        t = torch.randn(4, 64, device=dev)
        a = _arrays.to_device(t, cached=True)
        assert _arrays.to_device(t, cached=True) is a and int(a.data.ptr) == t.data_ptr()
        flat = t.view(256)
        b = _arrays.to_device(flat, cached=True)
        assert b is not a and b.shape == (256,) and int(b.data.ptr) == t.data_ptr()
        assert str(_arrays.to_device(t.view(torch.int32), cached=True).dtype) == "int32"
        ptr = t.data_ptr()
        del t, flat
        u = torch.randn(4, 64, device=dev)  # the caching allocator hands out the block just freed
        view = _arrays.to_device(u, cached=True)
        assert (int(view.data.ptr) == ptr) == (view is a)
        assert torch.equal(_arrays.from_device(view.copy()), u)
        nc = torch.randn(64, 4, device=dev).t()  # not contiguous: a copy that the view owns, never cached
        assert _arrays.to_device(nc, cached=True) is not _arrays.to_device(nc, cached=True)


def test_backward_uses_the_saved_tensors_where_hooks_move_them(rng):
    """Under ``torch.autograd.graph.save_on_cpu`` the saved q, k, v, g of temporaries come back at other addresses
    while the forward's memory is freed and reused: the gradients equal those of a plain call."""
    dev = torch.device("cuda", torch.cuda.current_device())
    *xs, do, _, _ = make(rng, 1, 300, 2, 64, 64, 1.0, torch.bfloat16, dev)

    def grads(hooks):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        with hooks:
            o, _ = ht.chunk_gla(*(x * 1 for x in leaves))  # temporaries: only the saved copies outlive the call
        junk = [torch.randn(x.shape, device=dev).to(x.dtype) for x in xs for _ in range(4)]  # take the freed blocks
        out = torch.autograd.grad(o, leaves, do)
        del junk
        return out

    plain = grads(contextlib.nullcontext())
    moved = grads(torch.autograd.graph.save_on_cpu())
    for name, a, b in zip("qkvg", moved, plain):
        assert err_ratio(a, b) < 1e-3, (name, err_ratio(a, b))


@pytest.mark.parametrize("K,V", [(128, 128), (256, 512)])
def test_one_memory_pool_torch_counts_every_buffer(rng, K, V):
    """Under hpczeco.torch every buffer of the kernels (outputs, chunk states, workspaces) comes from torch's caching
    allocator: CuPy's own pool does not grow, torch's counters see the outputs while they live and, at the peak of
    forward + backward, the chunk states; CuPy used outside hpczeco.torch keeps its own pool, unseen by torch."""
    import cupy  # noqa: PLC0415

    dev = torch.device("cuda", torch.cuda.current_device())
    B, T, H = 1, 4096, 2
    q, k, v, g, do, _, _ = make(rng, B, T, H, K, V, 1.0, torch.bfloat16, dev)
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    ht.chunk_gla(*ins)[0].backward(do)  # warm-up: kernels built, per-call caches of earlier calls settled
    for x in ins:
        x.grad = None
    pool = cupy.get_default_memory_pool()
    torch.cuda.synchronize()
    pool.free_all_blocks()
    cupy_total = pool.total_bytes()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    o, _ = ht.chunk_gla(*ins)
    # the peak, not the current count: the call may free a buffer an earlier call left cached (a [B, H, K, V] state)
    assert torch.cuda.max_memory_allocated(dev) - base >= o.numel() * o.element_size()
    o.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - base
    chunk_states = B * H * (-(-T // 64)) * K * V * 2  # the forward walk's bf16 chunk states [B H, NT, K, V]
    assert peak >= chunk_states + o.numel() * o.element_size(), (peak, chunk_states)
    assert pool.total_bytes() == cupy_total, "hpczeco.torch allocated from CuPy's pool"
    held = torch.cuda.memory_allocated(dev)
    x = cupy.empty(1 << 24, dtype=cupy.uint8)  # plain CuPy: its own pool
    assert pool.total_bytes() >= cupy_total + (1 << 24) and torch.cuda.memory_allocated(dev) == held
    del x


def test_cuda_float64_is_a_clear_error(rng):
    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v, g, *_ = make(rng, 1, 8, 1, 4, 4, 1.0, torch.float64, dev)
    with pytest.raises(TypeError, match="on cuda hpczeco.torch takes"):
        ht.chunk_gla(q, k, v, g)


def test_glue_benchmark_runs():
    from hpczeco.drivers.bench_torch import bench_chunk_gla  # noqa: PLC0415

    r = bench_chunk_gla(1, 256, 2, 64, 64, repeats=3, warmup=1, with_fla=False)  # fla would autotune this shape
    for key in ("bare fwd", "torch fwd", "bare fwd+bwd", "torch fwd+bwd", "glue ratio fwd", "glue ratio fwd+bwd",
                "torch fwd in a row", "host torch fwd+bwd", "glue ratio fwd+bwd in a row", "glue ratio fwd paired",
                "glue ratio fwd+bwd paired"):
        assert r[key] > 0, key


# ----------------------------------------------------------------------------------------------- under mpiexec


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_zeco_gla_matches_whole_sequence(comm, rng, dtype):
    P, r = comm.Get_size(), comm.Get_rank()
    torch.cuda.set_device(r % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    B, H, K, V = 1, 2, 64, 64
    T = 200 * P + int(rng.integers(0, 50))
    q, k, v, g, do, h0, dht = make(rng, B, T, H, K, V, 1.0, dtype, dev)
    ref = reference(q, k, v, g, do, h0, dht)
    lo, hi = T * r // P, T * (r + 1) // P
    mine = [x[:, lo:hi].detach().clone().requires_grad_() for x in (q, k, v, g)]
    h = h0.clone().requires_grad_() if r == 0 else None
    o, fin = ht.zeco_gla(*mine, comm, initial_state=h, output_final_state=True)
    loss = (o * do[:, lo:hi]).sum() + ((fin * dht).sum() if r == P - 1 else 0.0)
    loss.backward()
    tol = TOL[dtype]
    assert o.dtype == dtype and err_ratio(o, ref[0][:, lo:hi]) <= tol["o"]
    if r == P - 1:
        assert err_ratio(fin, ref[1]) <= tol["grad"]
    for name, x, rg in zip(("dq", "dk", "dv", "dg"), mine, ref[2:6]):
        assert x.grad.dtype == dtype and err_ratio(x.grad, rg[:, lo:hi]) <= 2 * tol["grad"], name
    if r == 0:
        assert err_ratio(h.grad, ref[6]) <= 2 * tol["grad"]


@pytest.mark.mpi
def test_example_trains_on_the_gpu(comm, rng):
    """examples/gla_lm.py on CUDA float32: the P-rank losses follow the 1-rank ones (to float32 rounding) and fall."""
    from mpi4py import MPI  # noqa: PLC0415

    torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    spec = importlib.util.spec_from_file_location("gla_lm_example", ROOT / "examples" / "gla_lm.py")
    ex = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ex
    spec.loader.exec_module(ex)
    cfg = ex.Config(vocab=32, d_model=64, layers=2, heads=2, head_k=16, head_v=16)
    tokens = ex.markov_tokens(1024 + 1, cfg.vocab, int(rng.integers(2**31)))
    device = f"cuda:{torch.cuda.current_device()}"
    split = ex.train(comm, tokens, cfg, steps=4, lr=1e-2, dtype=torch.float32, device=device)
    alone = ex.train(MPI.COMM_SELF, tokens, cfg, steps=4, lr=1e-2, dtype=torch.float32, device=device)
    assert np.allclose(split["losses"], alone["losses"], rtol=1e-4, atol=0)
    assert split["losses"][-1] < split["losses"][0]
