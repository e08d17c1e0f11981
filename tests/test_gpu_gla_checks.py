"""The GLA GPU kernels (:mod:`hpczeco.gpu.gla`) against the float64 references on fresh random inputs, at the
shapes the GPU machine runs: forward (simt and the tensor-core kernels) and backward in fp32, bf16 and
fp16 (CuPy kernels) and float64 (Numba CUDA kernels), strong decays (g down to -8), T not a multiple of the chunk,
K != V, initial_state, dht; the ZeCO pieces (CuPy and Numba CUDA kernels); prepare/finish over two slices as two
ZeCO ranks; the tensor-core kernels against the simt ones and against flash-linear-attention at the benchmark
shape; the device value checks; the NVRTC build of every kernel group.

Tests marked ``gpu`` need CuPy and a CUDA GPU (skipped with a reason elsewhere). The checks that the CPU
emulation of the CUDA kernels can run (:func:`helpers.emulated_gla_runtime`: float and bf16 kernels,
numpy arrays) run here too at smaller shapes.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from helpers import FAKE_CUPY_PATH, emulated_gla_runtime, gla_inputs, rel
from hpczeco.base import bf16
from hpczeco.base.backend import cupy_available

from hpczeco.gla import recurrent_gla, recurrent_gla_bwd

NEEDS_GPU = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA GPU")
GPU = [pytest.mark.gpu, NEEDS_GPU]


class Device:
    """Where a check runs (``xp``: CuPy, or numpy through the CPU emulation) and one input precision
    ``dt`` (fp64, fp32, bf16 as uint16 bit patterns, fp16): host rounding, upload, download."""

    def __init__(self, xp):
        self.xp = xp

    @staticmethod
    def round(x: np.ndarray, dt: str) -> np.ndarray:
        if dt == "bf16":
            return bf16.from_bits(bf16.to_bits(x))
        if dt == "fp16":
            return x.astype(np.float16).astype(np.float32)
        if dt == "fp64":
            return x.astype(np.float64)
        return x.astype(np.float32)

    def up(self, x: np.ndarray, dt: str):
        if dt == "bf16":
            return self.xp.asarray(bf16.to_bits(x))
        if dt == "fp16":
            return self.xp.asarray(x.astype(np.float16))
        if dt == "fp64":
            return self.xp.asarray(x.astype(np.float64))
        return self.xp.asarray(x.astype(np.float32))

    @staticmethod
    def down(x, dt: str = "fp32") -> np.ndarray:
        h = x.get() if hasattr(x, "get") else np.asarray(x)
        if dt == "bf16" and h.dtype == np.uint16:
            return bf16.from_bits(h)
        return h if h.dtype == np.float64 else h.astype(np.float32)


@pytest.fixture(scope="module")
def gpu():
    import cupy

    return Device(cupy)


@pytest.fixture
def emu():
    """The emulated runtime for one test (the built library is cached on disk), so that a GPU test after an
    emulated one gets the CuPy runtime back."""
    cm = emulated_gla_runtime()
    try:
        cm.__enter__()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    yield Device(np)
    cm.__exit__(None, None, None)


def _inputs(rng, B, T, H, K, V, strong=False):
    q, k, v, g, do, h0, dht = gla_inputs(rng, B, T, H, K, V, strong, gates="logsigmoid")
    return dict(q=q, k=k, v=v, g=g, do=do, h0=h0, dht=dht)


# ------------------------------------------------------------------------------------------- forward

# dtype, B, T, H, K, V, strong gates, impl, initial state, tolerance
FWD_CASES = [
    ("fp32", 2, 300, 3, 64, 48, False, "simt", True, 1e-4),
    ("fp32", 1, 200, 2, 128, 128, True, "simt", True, 1e-4),
    ("fp32", 1, 77, 2, 40, 72, False, "simt", False, 1e-4),
    ("bf16", 1, 300, 2, 96, 80, False, "simt", True, 1e-2),
    ("bf16", 1, 300, 2, 128, 64, False, "tc-chunk", True, 1e-2),
    ("bf16", 1, 1000, 2, 128, 128, False, "tc-chunk", True, 1e-2),
    ("bf16", 1, 515, 2, 128, 128, True, "tc-chunk", True, 1e-2),
    ("bf16", 2, 300, 2, 64, 128, False, "tc-chunk", False, 1e-2),
    ("bf16", 1, 1, 2, 128, 64, False, "tc-chunk", True, 1e-2),
    ("fp16", 1, 400, 2, 128, 128, False, "tc-chunk", True, 1e-2),
    ("fp16", 1, 400, 2, 64, 64, True, "tc-chunk", True, 1e-2),
    ("fp64", 1, 300, 2, 128, 96, True, "numba", True, 1e-12),
    ("fp64", 2, 77, 2, 40, 72, False, "auto", False, 1e-12),
    ("bf16", 1, 700, 2, 256, 512, False, "tc-chunk", True, 1e-2),  # large heads: the tiled kernels
    ("bf16", 1, 515, 2, 128, 256, True, "tc-chunk", True, 1e-2),
    ("bf16", 2, 200, 1, 192, 80, False, "tc-chunk", False, 1e-2),
    ("fp16", 1, 400, 2, 256, 512, False, "tc-chunk", True, 1e-2),
]
FWD_EMU = [  # the same kinds of case at shapes the emulation runs in seconds
    ("fp32", 2, 70, 2, 24, 16, False, "simt", True, 1e-4),
    ("fp32", 1, 50, 1, 32, 32, True, "simt", True, 1e-4),
    ("fp32", 1, 77, 1, 20, 36, False, "simt", False, 1e-4),
    ("bf16", 1, 90, 1, 48, 32, True, "tc-chunk", False, 1e-2),
    ("bf16", 1, 70, 1, 48, 32, False, "simt", True, 1e-2),
    ("bf16", 1, 130, 1, 32, 48, True, "tc-chunk", True, 1e-2),
]


def _case_id(c) -> str:
    dt, B, T, H, K, V, strong, impl, h0, _ = c
    return f"{dt}-{impl}-B{B}T{T}H{H}K{K}V{V}" + ("-strong" if strong else "") + ("-h0" if h0 else "")


def check_forward(dev: Device, rng, case) -> None:
    from hpczeco.gpu import gla as G

    dt, B, T, H, K, V, strong, impl, use_h0, tol = case
    x = _inputs(rng, B, T, H, K, V, strong)
    xs = {n: dev.round(x[n], dt).astype(np.float64) for n in ("q", "k", "v", "g")}
    h0 = x["h0"] if use_h0 else None
    o, ht = G.chunk_gla(*(dev.up(x[n], dt) for n in ("q", "k", "v", "g")),
                        initial_state=None if h0 is None else dev.xp.asarray(h0), output_final_state=True, impl=impl)
    ro, rht = recurrent_gla(*(xs[n] for n in ("q", "k", "v", "g")),
                            initial_state=None if h0 is None else h0.astype(np.float64), output_final_state=True)
    eo, eh = rel(dev.down(o, dt), ro), rel(dev.down(ht), rht)
    assert eo <= tol and eh <= tol, f"o {eo:.2e} ht {eh:.2e} (tol {tol})"


@pytest.mark.parametrize("case", FWD_CASES, ids=[_case_id(c) for c in FWD_CASES])
@pytest.mark.gpu
@NEEDS_GPU
def test_forward_matches_reference(gpu, rng, case):
    check_forward(gpu, rng, case)


@pytest.mark.parametrize("case", FWD_EMU, ids=[_case_id(c) for c in FWD_EMU])
def test_forward_matches_reference_emulated(emu, rng, case):
    check_forward(emu, rng, case)


# ------------------------------------------------------------------------------------------- backward

# dtype, B, T, H, K, V, strong gates, initial state + dht, tolerance, impl ("auto": the chunk-parallel
# tensor-core kernels for 16-bit inputs with K, V multiples of 16, else simt)
BWD_CASES = [
    ("fp32", 2, 300, 3, 64, 48, False, True, 1e-4, "auto"),
    ("fp32", 1, 200, 2, 128, 128, True, True, 1e-4, "auto"),
    ("fp32", 1, 77, 1, 40, 72, False, False, 1e-4, "auto"),
    ("bf16", 1, 300, 2, 128, 128, False, True, 1e-2, "auto"),
    ("bf16", 1, 130, 2, 64, 96, True, True, 1e-2, "auto"),
    ("bf16", 1, 1, 2, 128, 64, False, True, 1e-2, "auto"),
    ("bf16", 1, 300, 2, 128, 128, False, True, 1e-2, "simt"),
    ("fp16", 1, 200, 2, 128, 128, False, True, 1e-2, "auto"),
    ("fp64", 1, 300, 2, 128, 96, True, True, 1e-12, "auto"),
    ("fp64", 2, 77, 1, 40, 72, False, False, 1e-12, "numba"),
    ("bf16", 1, 300, 2, 256, 512, False, True, 1e-2, "auto"),  # large heads: the tiled kernels
    ("bf16", 1, 130, 2, 128, 256, True, True, 1e-2, "auto"),
    ("fp16", 1, 200, 1, 256, 512, False, True, 1e-2, "auto"),
]
BWD_EMU = [
    ("fp32", 2, 70, 2, 24, 16, False, True, 1e-4, "auto"),
    ("fp32", 1, 50, 1, 32, 32, True, True, 1e-4, "auto"),
    ("fp32", 1, 40, 1, 20, 36, False, False, 1e-4, "auto"),
    ("bf16", 1, 70, 1, 32, 48, True, True, 1e-2, "auto"),
    ("bf16", 1, 70, 1, 32, 48, True, True, 1e-2, "simt"),
]


def _bwd_id(c) -> str:
    dt, B, T, H, K, V, strong, h0, _, impl = c
    return f"{dt}-{impl}-B{B}T{T}H{H}K{K}V{V}" + ("-strong" if strong else "") + ("-h0-dht" if h0 else "")


def check_backward(dev: Device, rng, case) -> None:
    from hpczeco.gpu import gla as G

    dt, B, T, H, K, V, strong, use_h0, tol, impl = case
    x = _inputs(rng, B, T, H, K, V, strong)
    xs = {n: dev.round(x[n], dt).astype(np.float64) for n in ("q", "k", "v", "g", "do")}
    got = G.chunk_gla_bwd(*(dev.up(x[n], dt) for n in ("q", "k", "v", "g", "do")),
                          initial_state=dev.xp.asarray(x["h0"]) if use_h0 else None,
                          dht=dev.xp.asarray(x["dht"]) if use_h0 else None, impl=impl)
    ref = recurrent_gla_bwd(*(xs[n] for n in ("q", "k", "v", "g", "do")),
                            initial_state=x["h0"].astype(np.float64) if use_h0 else None,
                            dht=x["dht"].astype(np.float64) if use_h0 else None)
    errs = {n: rel(dev.down(a, dt if n != "dh0" else "fp32"), b)
            for n, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref)}
    assert max(errs.values()) <= tol, " ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f" (tol {tol})"


@pytest.mark.parametrize("case", BWD_CASES, ids=[_bwd_id(c) for c in BWD_CASES])
@pytest.mark.gpu
@NEEDS_GPU
def test_backward_matches_reference(gpu, rng, case):
    check_backward(gpu, rng, case)


@pytest.mark.parametrize("case", BWD_EMU, ids=[_bwd_id(c) for c in BWD_EMU])
def test_backward_matches_reference_emulated(emu, rng, case):
    check_backward(emu, rng, case)


# ------------------------------------------------------------------------------------------- ZeCO pieces


def check_zeco_pieces(dev: Device, rng, dt: str, shape, tol: float) -> None:
    """decay_cumsum, state_correction, initial_state_grad against float64 einsums."""
    from hpczeco.gpu import gla as G

    B, T, H, K, V = shape
    x = _inputs(rng, B, T, H, K, V)
    xs = {n: dev.round(x[n], dt).astype(np.float64) for n in ("q", "g", "do")}
    Gc = G.decay_cumsum(dev.up(x["g"], dt))
    G64 = np.cumsum(xs["g"], axis=1)
    e1 = rel(dev.down(Gc), G64)
    o0 = dev.round(rng.standard_normal((B, T, H, V)).astype(np.float32), dt)
    o = dev.up(o0, dt)
    G.state_correction(o, dev.up(x["q"], dt), Gc, dev.xp.asarray(x["h0"]), scale=0.1)
    e2 = rel(dev.down(o, dt), o0 + 0.1 * np.einsum("bthk,bhkv->bthv", xs["q"] * np.exp(G64), x["h0"]))
    U = G.initial_state_grad(dev.up(x["q"], dt), dev.up(x["g"], dt), dev.up(x["do"], dt), scale=0.1)
    e3 = rel(dev.down(U), 0.1 * np.einsum("bthk,bthv->bhkv", xs["q"] * np.exp(G64), xs["do"]))
    assert max(e1, e2, e3) <= tol, f"cumsum {e1:.2e} correction {e2:.2e} U {e3:.2e} (tol {tol})"


@pytest.mark.parametrize("dt,tol", [("fp32", 1e-4), ("bf16", 1e-2)])
@pytest.mark.gpu
@NEEDS_GPU
def test_zeco_pieces_cupy_kernels(gpu, rng, dt, tol):
    check_zeco_pieces(gpu, rng, dt, (1, 333, 2, 128, 96), tol)


@pytest.mark.parametrize("dt,tol", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_zeco_pieces_emulated(emu, rng, dt, tol):
    check_zeco_pieces(emu, rng, dt, (1, 70, 2, 32, 48), tol)


@pytest.mark.gpu
@NEEDS_GPU
def test_zeco_pieces_numba_kernels(gpu, rng):
    """float64: decay_cumsum, state_correction, initial_state_grad, final_state, scan_combine on the Numba CUDA
    kernels (launches counted), to 1e-12."""
    cp = gpu.xp
    from hpczeco.gpu import gla as G
    from hpczeco.gpu import gla_numba

    before = gla_numba.LAUNCHES.copy()
    check_zeco_pieces(gpu, rng, "fp64", (1, 333, 2, 128, 96), 1e-12)
    B, H, K, V = 1, 2, 128, 96
    a = rng.uniform(0.2, 1.0, (B, H, K))
    S, L = rng.standard_normal((B, H, K, V)), rng.standard_normal((B, H, K, V))
    f = G.final_state(cp.asarray(a), cp.asarray(S), cp.asarray(L))
    c = G.scan_combine(cp.asarray(a), cp.asarray(S), cp.asarray(L))
    e3, e4 = rel(f.get(), a[..., None] * S + L), rel(c.get(), a[..., None] * S + L)
    assert max(e3, e4) <= 1e-14, f"final {e3:.2e} combine {e4:.2e}"
    ran = gla_numba.LAUNCHES - before
    assert ran["seg_finish"] == 1 and ran["correction"] == 1 and ran["chunk_outer"] == 1 and ran["combine"] == 2, ran


def check_compose(dev: Device, rng, dt: str, shape, cut: int, tol: float) -> None:
    """Two slices as two ZeCO ranks (prepare, pass the scan pair by hand, finish) vs the float64 references
    on the whole sequence."""
    from hpczeco.gpu import gla as G

    B, T, H, K, V = shape
    x = _inputs(rng, B, T, H, K, V)
    xs = {n: dev.round(x[n], dt).astype(np.float64) for n in ("q", "k", "v", "g", "do")}
    h0, dht = x["h0"], x["dht"]
    ro, rht = recurrent_gla(*(xs[n] for n in ("q", "k", "v", "g")), initial_state=h0.astype(np.float64),
                            output_final_state=True)
    ref = recurrent_gla_bwd(*(xs[n] for n in ("q", "k", "v", "g", "do")), initial_state=h0.astype(np.float64),
                            dht=dht.astype(np.float64))
    parts = [[dev.up(np.ascontiguousarray(x[n][:, sl]), dt) for n in ("q", "k", "v", "g", "do")]
             for sl in (slice(0, cut), slice(cut, T))]
    fw = [G.chunk_gla_prepare(*p[:4]) for p in parts]
    H0, DHT = dev.xp.asarray(h0), dev.xp.asarray(dht)
    S1 = fw[0].decay[..., None] * H0 + fw[0].local_final_state
    o0, _ = fw[0].finish(H0)
    o1, fin = fw[1].finish(S1, output_final_state=True)
    bw = [G.chunk_gla_bwd_prepare(*p) for p in parts]
    D0 = bw[1].decay[..., None] * DHT + bw[1].dh0_local
    g0, g1 = bw[0].finish(H0, D0), bw[1].finish(S1, DHT)
    errs = {"o": rel(np.concatenate([dev.down(o0, dt), dev.down(o1, dt)], axis=1), ro), "ht": rel(dev.down(fin), rht)}
    for i, n in enumerate(("dq", "dk", "dv", "dg")):
        errs[n] = rel(np.concatenate([dev.down(g0[i], dt), dev.down(g1[i], dt)], axis=1), ref[i])
    errs["dh0"] = rel(dev.down(g0[4]), ref[4])
    assert max(errs.values()) <= tol, " ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f" (tol {tol})"


@pytest.mark.parametrize("dt,tol", [("fp32", 1e-4), ("bf16", 1e-2)])
@pytest.mark.gpu
@NEEDS_GPU
def test_prepare_finish_over_two_slices(gpu, rng, dt, tol):
    check_compose(gpu, rng, dt, (1, 700, 2, 128, 128), 333, tol)


@pytest.mark.parametrize("dt,tol", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_prepare_finish_over_two_slices_emulated(emu, rng, dt, tol):
    check_compose(emu, rng, dt, (1, 100, 2, 32, 32), 37, tol)


# ------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@NEEDS_GPU
def test_every_kernel_group_builds(gpu):
    """NVRTC builds every kernel of every .cu file, group by group (common, bf16, float, f16, bf16-f32s, f16-f32s)."""
    from hpczeco.gpu import gla as G
    from hpczeco.gpu.gla_common import KERNEL_FILES, RUNTIME

    built = 0
    for file in KERNEL_FILES:
        names = G.kernel_names(file)
        for group in sorted({G.kernel_group(n) for n in names}):
            for name in (n for n in names if G.kernel_group(n) == group):
                assert RUNTIME.get().function(name) is not None, f"{file} [{group}]: {name}"
                built += 1
    assert built == sum(len(G.kernel_names(f)) for f in KERNEL_FILES)


BENCH_SHAPE = (1, 32768, 16, 128, 128)  # B, T, H, K, V of `hpczeco bench gpu-gla`


@pytest.fixture(scope="module")
def bench_inputs(gpu):
    """bf16 inputs at the benchmark shape (bit patterns on the device), the simt forward on them, the seed
    (``HPCZECO_TEST_SEED`` or the clock: module scope, so not the ``rng`` fixture)."""
    from hpczeco.gpu import gla as G

    seed = int(os.environ.get("HPCZECO_TEST_SEED") or time.time_ns() % 2**31)
    x = _inputs(np.random.default_rng(seed), *BENCH_SHAPE)
    dev = {n: gpu.up(x[n], "bf16") for n in ("q", "k", "v", "g")}
    o, ht = G.chunk_gla(*(dev[n] for n in ("q", "k", "v", "g")), output_final_state=True, impl="simt")
    return dev, bf16.from_bits(o.get()), ht.get(), seed


@pytest.mark.parametrize("walk,out", [(2, 2), (1, 2), (2, 1)])
@pytest.mark.gpu
@NEEDS_GPU
def test_chunk_parallel_kernels_match_simt_at_bench_shape(gpu, bench_inputs, walk, out):
    """The chunk-parallel tensor-core forward and backward (both state walks, both output kernels) against the simt
    kernels at the benchmark shape; the backward reusing the forward's chunk states."""
    cp = gpu.xp
    from hpczeco.gpu import gla as G
    from hpczeco.gpu import gla_bwd_tc, gla_fwd_tc
    from hpczeco.gpu.gla_common import RUNTIME

    dev, ref_o, ref_h, seed = bench_inputs
    rng = np.random.default_rng(seed + 1)
    do = gpu.up(rng.standard_normal(dev["v"].shape).astype(np.float32), "bf16")
    plan = gla_fwd_tc.fwd_tc_prepare(RUNTIME.get(), *(dev[n] for n in ("q", "k", "v", "g")), walk=walk, out=out)
    o, ht = plan.finish(output_final_state=True)
    eo, eh = rel(bf16.from_bits(o.get()), ref_o), rel(ht.get(), ref_h)
    assert max(eo, eh) <= 1e-2, f"o {eo:.2e} ht {eh:.2e} (inputs seed {seed})"
    got = gla_bwd_tc.bwd_tc(RUNTIME.get(), *(dev[n] for n in ("q", "k", "v", "g")), do, fwd=plan)
    ref = G.chunk_gla_bwd(*(dev[n] for n in ("q", "k", "v", "g")), do, impl="simt")
    errs = {n: rel(gpu.down(a, "bf16" if a.dtype == cp.uint16 else "fp32"),
                   gpu.down(b, "bf16" if b.dtype == cp.uint16 else "fp32"))
            for n, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref)}
    assert max(errs.values()) <= 1e-2, " ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f" (seed {seed})"


@pytest.mark.gpu
@NEEDS_GPU
def test_forward_matches_flash_linear_attention_at_bench_shape(gpu, bench_inputs):
    torch = pytest.importorskip("torch")
    fla_gla = pytest.importorskip("fla.ops.gla")
    cp = gpu.xp
    from hpczeco.gpu import gla as G

    dev, _, _, seed = bench_inputs
    scale = BENCH_SHAPE[3] ** -0.5
    ours = bf16.from_bits(G.chunk_gla(*(dev[n] for n in ("q", "k", "v", "g")), scale=scale)[0].get())
    t = {n: torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16) for n, a in dev.items()}
    o, _ = fla_gla.chunk_gla(t["q"], t["k"], t["v"], t["g"], scale=scale, output_final_state=False)
    torch.cuda.synchronize()
    err = rel(ours, o.float().cpu().numpy())
    assert err <= 2e-2, f"rel(ours, fla) {err:.2e} (inputs seed {seed})"


@pytest.mark.gpu
@NEEDS_GPU
def test_validate_gla_inputs_on_bf16_device_arrays(gpu, rng):
    """A NaN, +Inf, positive gate or -Inf planted in q, v, g, do (bf16 bit patterns) is found and named."""
    from hpczeco.gla import validate_gla_inputs

    B, T, H, K, V = 1, 4096, 16, 128, 128
    x = _inputs(rng, B, T, H, K, V)
    arrs = {n: gpu.up(x[n], "bf16") for n in ("q", "k", "v", "g", "do")}
    views = lambda a: [a[n].view("bfloat16") for n in ("q", "k", "v", "g")]
    validate_gla_inputs(*views(arrs), do=arrs["do"].view("bfloat16"))  # clean: no error
    bits = {"q": 0x7FC0, "v": 0x7F80, "g": 0x3F00, "do": 0xFF80}  # NaN, +Inf, +0.5, -Inf (bf16)
    for name, b in bits.items():
        bad = dict(arrs)
        bad[name] = arrs[name].copy()
        bad[name][0, T // 2, 3, 5] = b
        with pytest.raises(ValueError) as info:
            validate_gla_inputs(*views(bad), do=bad["do"].view("bfloat16"))
        assert str(info.value).startswith(name + " "), f"{name}: {info.value}"


# ------------------------------------------------------------------------------------------- the bench, dry

_BENCH_DRY_RUN = r"""
import json, re, sys
import numpy as np
sys.path.insert(0, sys.argv[1])  # tests/fake_cupy: numpy arrays that look like CuPy arrays
import cupy
from hpczeco.drivers import bench_gpu_gla as bg, benchkit, gpu_gla_checks as chk
from hpczeco.gpu import emu as gemu, gla as G

rt = gemu.EmuRuntime(G.KERNELS.source(), G.kernel_names())  # bf16, fp16 (the checks) and float kernels
rt.xp = cupy
rt.function = lambda name, shared_mem=0: name  # the bench's compile step
G.RUNTIME.set(rt)
bg.variant_runtime = lambda defines: rt  # -D builds: the same emulated kernels
bg.COPY_BYTES = 1 << 20
bg.GRID_T, bg.GRID_KV, bg.GRID_GN = (1, 65), ((32, 16), (24, 16)), (0.1, 1.0)
chk.SMALL = [(1, 1, 1, 16, 32, False, None, False), (1, 70, 2, 32, 48, True, 1, False),
             (1, 66, 1, 128, 64, False, 1, True)]
chk.SMALL_FP16 = [(1, 70, 1, 32, 32, True, 1, False)]
chk.TWO_SLICES = (1, 100, 1, 32, 16, 37)
chk.VARIANT_SMALL = (1, 70, 1, 32, 32, True)
benchkit.cuda_event_time = lambda fn, repeats, warmup=3, sets=1, **kw: (fn(0), {"median_ms": 1.0})[1]
rc = bg.main(["--out", sys.argv[2], "--shapes", "1x65x2x32x16,1x40x1x16x32,1x40x1x144x160", "--grid", "--variants",
              "walk1,walk1-ctas2,nc2,f32,tiled", "--no-fla", "--repeats", "2", "--check", "--impls", "simt"])
sys.exit(rc)
"""


@pytest.mark.emulation
@pytest.mark.timeout(1800)
def test_bench_gpu_gla_dry_run(tmp_path):
    """`hpczeco bench gpu-gla --check` end to end without a GPU: numpy standing in for CuPy, every kernel emulated,
    tiny shapes (one a large head: the tiled kernels), the grid, the variants, the device checks and another impl's
    timings; each step ran, the checks against simt, the device checks against float64 (small bf16/fp16 shapes, two
    slices, the device recurrence, each variant) and the grid cases pass, the table prints."""
    import json
    import subprocess
    import sys

    from hpczeco.gpu import emu as gemu

    if gemu.compiler() is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulation")
    out = tmp_path / "bench"
    res = subprocess.run([sys.executable, "-c", _BENCH_DRY_RUN, str(FAKE_CUPY_PATH), str(out)],
                         capture_output=True, text=True, timeout=1700)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "gpu_gla.json").read_text())
    assert not data.get("failures"), data.get("failures")
    assert [r["shape"] for r in data["summary"]] == ["B=1 T=65 H=2 K=32 V=16", "B=1 T=40 H=1 K=16 V=32",
                                                     "B=1 T=40 H=1 K=144 V=160"]
    assert all(c["ok"] and c["impl"] == "tc-chunk" for c in data["checks"]), data["checks"]
    names = [r["name"] for r in data["timings"]]
    assert any(n.startswith("ours fwd+bwd, states reused") for n in names)
    assert any("reverse walk (glatc_walk2" in r["name"] for r in data["kernels"])
    assert any("glatc_bwd_kt" in r["name"] and "K=144" in r["name"] for r in data["kernels"])
    assert len(data["grid"]) == 8 and all(r["targets ok"] and "error" not in r for r in data["grid"]), data["grid"]
    assert {r["impl"] for r in data["grid"]} == {"tc-chunk", "simt"}
    assert [v["variant"] for v in data["variants"]] == ["default", "walk1", "walk1-ctas2", "nc2", "f32", "tiled"]
    assert all(v.get("ok", True) and "error" not in v for v in data["variants"]), data["variants"]
    assert "==== hpczeco bench gpu-gla" in res.stdout and "accuracy grid: 8/8" in res.stdout
    device = data["device_checks"]
    assert [c["check"].split(":")[0] for c in device] == [
        "float64 recurrence on the device == hpczeco.gla's CPU recurrence", "bf16 vs float64", "bf16 vs float64",
        "bf16 vs float64", "f16 vs float64", "prepare/finish over two slices (ZeCO composition), bf16, strong gates",
        "variant default", "variant walk1", "variant walk1-ctas2", "variant nc2", "variant f32", "variant tiled",
    ], device
    assert all(c["ok"] and "error" not in c for c in device), device
    assert all(c["o"] <= 4e-3 and c["dh0"] <= 5e-3 for c in device[1:]), device
    assert f"device checks (--check, vs float64): {len(device)}/{len(device)} passed" in res.stdout
    assert any(n.startswith("ours bwd, states recomputed") for n in names)
    # two rows per shape (3 shapes)
    assert sum(n.startswith(("impl=simt fwd [", "impl=simt fwd + impl=simt bwd [")) for n in names) == 6, names
