"""The FlashAttention-3-design Hopper kernels hfa3 / hfa3p (gpu/daaf_fa3.cu, gpu/daaf_fa3.py) without and with a GPU.

Without a GPU: the source builds with nvcc for sm_90a (no spills, no wgmma serialisation, no ignored setmaxnreg);
the wrappers run the kernels on the CPU emulation (gpu/emu: TMA tiled loads with the 128-byte swizzle and zero fill,
mbarrier transaction counts, the wgmma model, setmaxnreg, named barriers) against the float64 reference on fresh
random inputs: every head dim (64, 128, 256), bf16 and f16, ping-pong or not, key regions none / one run / spans /
scattered (tiles gathered by cp.async) / all, T not a multiple of the tile, batch and head offsets, the persistent
queue over several CTAs; the emulation's tensor-copy checks are shown to fire on planted faults
(tests/daaf_fa3_faults.cu). With a GPU (marked ``gpu``, Hopper): every kernel against the reference, and the per-call
entry with impl="hfa3".
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hpczeco.base import bf16
from hpczeco.drivers.gpu_daaf_model import key_regions
from hpczeco.gpu import build as gbuild
from hpczeco.gpu import daaf_fa3 as fa3
from hpczeco.gpu import emu as gemu

from hpczeco.daaf.reference import attention_reference

GPU_DIR = Path(fa3.__file__).resolve().parent
FAULTS = Path(__file__).resolve().parent / "daaf_fa3_faults.cu"
FAULT_KERNEL = "daaf_tma_fault_check"
FAULT_SMEM = (64 + 128) * 128 * 2 + 64 + 1024  # FA3_FAULT_SMEM_BYTES
TOL = {"bf16": 1e-2, "f16": 5e-3}
# an emulated block runs its 384 threads one at a time: slow tests
pytestmark = [pytest.mark.emulation, pytest.mark.timeout(1800)]


def test_names_groups_and_sizes():
    """Kernel names, compile groups (as FA3_IN_GROUP blocks of the source), shared memory, the variant checks."""
    names = fa3.kernel_names()
    assert len(set(names)) == len(names) == 2 * 2 * 3 + 1
    assert fa3.kernel_name("hfa3p", "f16", 256) == "daaf_hfa3_f16_d256_pp"
    text = (GPU_DIR / "daaf_fa3.cu").read_text()
    found = {}
    for m in re.finditer(r"#if FA3_IN_GROUP\((\d+)\)\n(.*?)#endif", text, re.S):
        for name in re.findall(r"^FA3_KERNEL\((\w+),", m.group(2), re.M):
            found[name] = int(m.group(1))
    assert found == fa3.GROUPS
    for impl, var in fa3.VARIANTS.items():  # the instantiations use the variants' (BN, ST, NQ)
        for D in var.dims:
            BN, ST, NQ = var.shape(D)
            name, pp = fa3.kernel_name(impl, "bf16", D), str(var.pingpong).lower()
            assert re.search(rf"FA3_KERNEL\({name}, true, {D}, {BN}, {ST}, {NQ}, {pp}\)", text), name
            assert fa3.smem_bytes(D, impl) <= 232448
    with pytest.raises(ValueError, match="D == Dv"):
        fa3.resolve("hfa3", "bf16", 96, 96)
    with pytest.raises(ValueError, match="impl"):
        fa3.resolve("fa3", "bf16", 128, 128)


@pytest.fixture(scope="module")
def nvcc_build():
    """The sm_90a build of every kernel, started at module setup (the emulation tests run meanwhile)."""
    if gbuild.nvcc_path() is None:
        yield None
        return
    job = gbuild.start(GPU_DIR / "daaf_fa3.cu", "sm_90a")
    yield job
    if job[0].poll() is None:
        job[0].kill()
        job[0].wait()


@pytest.fixture(scope="module")
def emu_rt():
    """The CPU emulation of daaf_fa3.cu and the planted-fault kernel, built once."""
    if gemu.compiler() is None:
        pytest.skip("g++ not found: the CPU emulation of the kernels needs it")
    return gemu.EmuRuntime(fa3.KERNELS.source() + "\n" + FAULTS.read_text(), [*fa3.kernel_names(), FAULT_KERNEL])


@pytest.fixture
def emu(emu_rt):
    """The wrappers on the emulation (a wait no thread of the block can end is recorded as a deadlock)."""
    old = fa3.RUNTIME.set(emu_rt)
    yield emu_rt
    fa3.RUNTIME.set(old)


def _bits(x, elem):
    return bf16.to_bits(x) if elem == "bf16" else x.astype(np.float16).view(np.uint16)


def _vals(bits, elem):
    return bf16.from_bits(bits) if elem == "bf16" else bits.view(np.float16).astype(np.float32)


def _mask(T: int, plan: str, rng) -> np.ndarray:
    """key_regions' layouts, and "sparse": a few scattered key tokens early on (later tiles gather them by index)."""
    if plan == "sparse":
        g = np.zeros(T, bool)
        g[rng.choice(min(T, 250), min(T, 6), replace=False)] = True
        return g
    return key_regions(T, plan, rng)


def emu_attention(impl, B, T, H, D, g, W, elem, sched, rng):
    """``impl`` through fa3.prepare on fresh random inputs rounded to ``elem``: (out, float64 reference)."""
    q = rng.standard_normal((B, T, H, D)).astype(np.float32) * 1.5
    k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(2))
    hq, hk, hv = (_bits(x, elem) for x in (q, k, v))
    o = np.full_like(hq, 0x7FC0)  # NaN: every element must be written
    gidx = np.flatnonzero(g).astype(np.int32)
    plan = SimpleNamespace(global_idx=gidx, gmask=g.astype(np.uint8), n_global=len(gidx), local_window=W, T=T)
    p = fa3.prepare(hq, hk, hv, plan, impl=impl, storage="bfloat16" if elem == "bf16" else "float16", out=o,
                    sched=sched)
    assert p() is o
    ref = attention_reference(*(_vals(x, elem) for x in (hq, hk, hv)), g, local_window=W)
    return _vals(o, elem), ref


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    return float(np.abs(out - ref).max() / np.abs(ref).max())


# (T, W, plan, B, H, sched): gathered tiles by cp.async (sparse) and by TMA (first: one run), spans crossing tile
# edges, window only, causal everywhere, T off the tile size, one token; batch and head offsets
CASES = [(700, 16, "sparse", 1, 1, 3), (461, 5, "first", 1, 2, 1), (333, 128, "regions", 2, 1, 2),
         (257, 0, "all", 1, 1, 0), (200, 1, "none", 1, 2, 3), (1, 0, "none", 1, 1, 3)]


@pytest.mark.parametrize("impl,D,elem", [("hfa3", 128, "bf16"), ("hfa3p", 128, "f16"), ("hfa3", 64, "f16"),
                                          ("hfa3p", 64, "bf16"), ("hfa3", 256, "bf16"), ("hfa3p", 256, "f16"),
                                          ("hfa3s3", 128, "bf16")])
def test_emulated_matches_reference(emu, rng, impl, D, elem):
    cases = CASES if D == 128 else CASES[:4]  # (D = 256: ~4x the emulated work per tile)
    for T, W, plan, B, H, sched in cases:
        g = _mask(T, plan, rng)
        out, ref = emu_attention(impl, B, T, H, D, g, W, elem, sched, rng)
        err = _rel(out, ref)
        assert err <= TOL[elem], f"{impl} {elem} D={D} T={T} W={W} plan={plan} B={B} H={H}: rel err {err:.3g}"


def test_persistent_queue_over_several_ctas(emu, rng, monkeypatch):
    """Three persistent CTAs share the queue (the emulation runs blocks one after another: the first takes every
    tile, the others find it drained); the last CTA leaves the counter at zero, so the next launch (same arrays)
    works again."""
    monkeypatch.setattr(emu, "sm_count", 3)
    monkeypatch.setattr(fa3, "_SMS", {})
    T, W, D = 520, 9, 64
    g = _mask(T, "regions", rng)
    out, ref = emu_attention("hfa3", 1, T, 2, D, g, W, "bf16", 3, rng)
    assert _rel(out, ref) <= TOL["bf16"]
    assert all(np.asarray(qa).tolist() == [0, 0] for qa in fa3._QUEUES.values())
    assert any(name.startswith("daaf_hfa3") for name in emu.launched)


@pytest.mark.parametrize("fault,message", [
    (0, None),
    (1, "a tensor copy wrote before this thread waited"),
    (2, "never completed"),
    (3, "not aligned to the swizzle"),
    (4, "not a tensor map"),
])
def test_emulation_catches_tma_faults(emu, rng, fault, message):
    """The tensor-copy checks: reading a copy's bytes without waiting on its mbarrier, a transaction count that
    never balances, a destination off the swizzle pattern's alignment, a map that is not one."""
    a = bf16.to_bits(rng.standard_normal((64, 128)))
    b = bf16.to_bits(rng.standard_normal((128, 128)))
    d = np.full((64, 128), np.nan, np.float32)
    ma = gemu.tensor_map(a.ctypes.data, (128, 1, 64, 1), (256, 256, 64 * 256), (64, 1, 64, 1), 2, 3)
    mb = gemu.tensor_map(b.ctypes.data, (128, 1, 128, 1), (256, 256, 128 * 256), (64, 1, 128, 1), 2, 3)
    launch = emu.bind(FAULT_KERNEL, (1,), (256,), (ma, mb, d, np.int32(fault)), FAULT_SMEM)
    if message is None:
        launch()
        ref = bf16.from_bits(a).astype(np.float64) @ bf16.from_bits(b).astype(np.float64).T
        assert np.abs(d - ref).max() / np.abs(ref).max() < 1e-5
    else:
        with pytest.raises(gemu.EmuCheckError) as exc:
            launch()
        assert message in str(exc.value)


@pytest.mark.timeout(1800)
def test_nvcc_builds_sm90a(nvcc_build):
    """Every kernel builds for sm_90a: no spills, within the entry cap, wgmma not serialised (C7514), setmaxnreg not
    ignored (C7508)."""
    if nvcc_build is None:
        pytest.skip("nvcc not found (set NVCC=...)")
    res = gbuild.finish(nvcc_build, timeout=900)
    assert res.ok, res.output[-4000:]
    report = {k.name: k for k in res.kernels}
    assert set(fa3.kernel_names()) <= set(report), set(fa3.kernel_names()) - set(report)
    for name in fa3.kernel_names():
        assert report[name].spill_stores == 0 and report[name].registers <= 168, (name, report[name])
    assert not re.findall(r"C7514.*function '(\w+)'", res.output), res.output[-3000:]
    assert "C7508" not in res.output, res.output[-3000:]


# --------------------------------------------------------------------------- on a Hopper GPU


def _hopper_or_skip():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
        cc = cupy.cuda.Device().compute_capability
        if cc != "90":
            raise RuntimeError(f"compute capability {cc}, not 9.0")
    except Exception as exc:
        pytest.skip(f"needs a Hopper GPU with CuPy ({type(exc).__name__}: {exc})")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("impl,D,elem", [(i, d, e) for i, v in fa3.VARIANTS.items() for d in v.dims for e in v.elems])
def test_gpu_kernels_match_reference(rng, impl, D, elem):
    cp = _hopper_or_skip()
    from hpczeco.gpu import daaf as gd

    big = [(2000, 128, "first", 1, 3, 3), (1300, 64, "sparse", 2, 2, 3)] if (D, elem) == (128, "bf16") else []
    for T, W, plan, B, H, _ in [*CASES, *big]:
        g = _mask(T, plan, rng)
        q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
        hq, hk, hv = (_bits(x, elem) for x in (q, k, v))
        dp = gd.device_plan(np.flatnonzero(g), W, T, cp.asarray(g))
        storage = "bfloat16" if elem == "bf16" else "float16"
        p = fa3.prepare(cp.asarray(hq), cp.asarray(hk), cp.asarray(hv), dp, impl=impl, storage=storage)
        out = _vals(cp.asnumpy(p()), elem)
        out2 = _vals(cp.asnumpy(p()), elem)  # again: the queue was left at zero
        ref = attention_reference(*(_vals(x, elem) for x in (hq, hk, hv)), g, local_window=W)
        err = _rel(out, ref)
        assert err <= TOL[elem], f"{impl} {elem} D={D} T={T} W={W} plan={plan}: rel err {err:.3g}"
        np.testing.assert_array_equal(out, out2)


@pytest.mark.gpu
def test_gpu_per_call_hfa3(rng):
    """attention_torch(impl="hfa3"): the cached per-call launch equals the prepared one (bit for bit), across
    layers' tensors and head dims."""
    _hopper_or_skip()
    torch = pytest.importorskip("torch")
    from hpczeco.gpu import daaf as gd

    for D in fa3.DIMS:
        T, H, W = 3000, 2, 128
        g = np.zeros(T, bool)
        g[:512] = True
        g[1500:1628] = True
        gidx = np.flatnonzero(g)
        for _ in range(2):  # two "layers"
            q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            want = gd.prepare_torch(q, k, v, gidx, W, impl="hfa3")().clone()
            for _ in range(3):
                assert torch.equal(gd.attention_torch(q, k, v, gidx, W, impl="hfa3"), want)
