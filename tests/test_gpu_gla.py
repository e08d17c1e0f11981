"""GPU GLA kernels (CuPy) against the float64 references; skipped with a reason without CuPy and a GPU.

The same kernels run without a GPU in tests/test_cuda_build.py (CPU emulation); tests/test_gpu_gla_checks.py
covers the GPU machine's shapes, `hpczeco bench gpu-gla` the timings.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import gla_inputs, rel
from hpczeco.base.backend import cupy_available

from hpczeco.gla import recurrent_gla, recurrent_gla_bwd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.mark.parametrize("strong", [False, True])
def test_fp32_forward_backward(rng, strong):
    import cupy as cp
    from hpczeco.gpu import gla as G

    q, k, v, g, do, h0, _ = gla_inputs(rng, 2, 150, 2, 48, 40, strong, g_max=0.5)
    dht = rng.standard_normal(h0.shape).astype(np.float32)
    o, ht = G.chunk_gla(*(cp.asarray(x) for x in (q, k, v, g)), initial_state=cp.asarray(h0), output_final_state=True)
    f64 = [x.astype(np.float64) for x in (q, k, v, g, do, h0, dht)]
    ro, rht = recurrent_gla(*f64[:4], initial_state=f64[5], output_final_state=True)
    assert rel(o.get(), ro) < 1e-4 and rel(ht.get(), rht) < 1e-4
    got = G.chunk_gla_bwd(*(cp.asarray(x) for x in (q, k, v, g, do)), initial_state=cp.asarray(h0), dht=cp.asarray(dht))
    ref = recurrent_gla_bwd(*f64[:5], initial_state=f64[5], dht=f64[6])
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref):
        assert rel(a.get(), b) < 1e-4, name


@pytest.mark.parametrize("strong", [False, True])
def test_bf16_tensor_core_forward(rng, strong):
    import cupy as cp
    from hpczeco.base.bf16 import from_bits as bf16_bits_to_f32
    from hpczeco.base.bf16 import to_bits as f32_to_bf16_bits
    from hpczeco.gpu import gla as G

    q, k, v, g, _, h0, _ = gla_inputs(rng, 1, 333, 2, 128, 64, strong, g_max=0.5)
    bits = [f32_to_bf16_bits(x) for x in (q, k, v, g)]
    o, ht = G.chunk_gla(
        *(cp.asarray(b) for b in bits), initial_state=cp.asarray(h0), output_final_state=True, impl="tc-chunk"
    )
    xs = [bf16_bits_to_f32(b).astype(np.float64) for b in bits]
    ro, rht = recurrent_gla(*xs, initial_state=h0.astype(np.float64), output_final_state=True)
    assert rel(bf16_bits_to_f32(o.get()), ro) < 1e-2
    assert rel(ht.get(), rht) < 1e-2


@pytest.mark.parametrize("strong", [False, True])
def test_float64_runs_on_the_numba_kernels(rng, strong):
    """float64 CuPy arrays: hpczeco.gla.chunk_gla / chunk_gla_bwd and the ZeCO pieces run the Numba CUDA kernels
    (launches counted) in float64, equal to the float64 recurrence to 1e-12 (float32 arithmetic would miss it)."""
    import cupy as cp
    from hpczeco.gpu import gla as G
    from hpczeco.gpu import gla_numba

    from hpczeco.gla import chunk_gla, chunk_gla_bwd

    B, T, H, K, V = 2, 150, 2, 48, 40
    f64 = [x.astype(np.float64) for x in gla_inputs(rng, B, T, H, K, V, strong, g_max=0.5)]
    q, k, v, g, do, h0, dht = f64
    d = [cp.asarray(x) for x in f64]
    before = gla_numba.LAUNCHES.copy()
    o, ht = chunk_gla(*d[:4], initial_state=d[5], output_final_state=True, chunk_size=32)
    grads = chunk_gla_bwd(*d[:5], initial_state=d[5], dht=d[6], chunk_size=32)
    ran = gla_numba.LAUNCHES - before
    assert ran["fwd_output"] == 1 and ran["bwd_dqdk"] == 1 and ran["bwd_dv"] == 1, dict(ran)
    ro, rht = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    ref = recurrent_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht)
    assert o.dtype == np.float64 and ht.dtype == np.float64 and grads[4].dtype == np.float64
    assert rel(o.get(), ro) < 1e-12 and rel(ht.get(), rht) < 1e-12
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), grads, ref):
        assert rel(a.get(), b) < 1e-12, name
    G64 = np.cumsum(g, axis=1)
    Gc = G.decay_cumsum(d[3])
    assert Gc.dtype == np.float64 and rel(Gc.get(), G64) < 1e-13
    o0 = rng.standard_normal((B, T, H, V))
    oc = cp.asarray(o0)
    G.state_correction(oc, d[0], Gc, d[5], scale=0.2)
    assert rel(oc.get(), o0 + 0.2 * np.einsum("bthk,bhkv->bthv", q * np.exp(G64), h0)) < 1e-12
    U = G.initial_state_grad(d[0], d[3], d[4], scale=0.2)
    assert rel(U.get(), 0.2 * np.einsum("bthk,bthv->bhkv", q * np.exp(G64), do)) < 1e-12
    a = np.exp(G64[:, -1])
    want = a[..., None] * h0 + dht
    assert rel(G.final_state(cp.asarray(a), d[5], d[6]).get(), want) < 1e-14
    assert rel(G.scan_combine(cp.asarray(a), d[5], d[6]).get(), want) < 1e-14
    ran = gla_numba.LAUNCHES - before
    assert ran["correction"] == 1 and ran["combine"] >= 4 and ran["seg_finish"] >= 2, dict(ran)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_device_value_flags_match_host_mirror(rng, dtype):
    """The fused bit-pattern checks on the device equal the numpy mirror (packed words and element by element),
    with NaN/Inf/positive values planted, on a side stream and on the current stream."""
    import cupy as cp
    from hpczeco.gpu.checks import start_value_flags, value_flags, value_flags_host

    side = cp.cuda.Stream(non_blocking=True)
    specials = np.array([np.nan, np.inf, -np.inf, 0.5, -0.0, 0.0, 1e-3], dtype=np.float32)
    for n in (0, 7, 1000, 300001):  # empty, one word and a tail, one level, two levels (+ leftover words)
        x = (-np.abs(rng.standard_normal(n)).astype(np.float32))
        if n and rng.random() < 0.8:
            x[rng.integers(0, n)] = specials[rng.integers(0, len(specials))]
        d = cp.asarray(x).astype(dtype)
        h = d.get()
        views = [(d, h)] + ([(d[1:], h[1:]), (d[::3], h[::3])] if n > 3 else [])  # packed, misaligned, strided
        for dv, hv in views:
            for gate in (False, True):
                want = value_flags_host(np.ascontiguousarray(hv), gate)
                assert value_flags([(dv, gate)]) == [want], (dtype, n, gate)
                assert start_value_flags([(dv, gate)], stream=side).result() == [want], (dtype, n, gate)


def test_validate_gla_inputs_device_errors(rng):
    import cupy as cp

    from hpczeco.gla import validate_gla_inputs

    q, k, v, g, do, _, _ = gla_inputs(rng, 1, 70, 2, 16, 8, g_max=0.5)
    arrs = {n: cp.asarray(a) for n, a in dict(q=q, k=k, v=v, g=g, do=do).items()}
    validate_gla_inputs(arrs["q"], arrs["k"], arrs["v"], arrs["g"], do=arrs["do"])
    for name, val, msg in (("k", np.nan, "k contains NaN"), ("g", 0.25, "g is a log forget gate"),
                           ("do", -np.inf, "do contains NaN")):
        bad = dict(arrs)
        bad[name] = arrs[name].copy()
        bad[name][0, 33, 1, 3] = val
        with pytest.raises(ValueError, match=msg):
            validate_gla_inputs(bad["q"], bad["k"], bad["v"], bad["g"], do=bad["do"])
