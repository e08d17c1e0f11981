"""Hopper DAAF kernels (gpu/daaf_hopper.cu, gpu/daaf_hopper.py) without and with a GPU.

Without a GPU: the source builds with nvcc for sm_90a (registers, no spills, no wgmma serialisation, no
ignored setmaxnreg);
the wrappers of gpu/daaf_hopper.py run the kernels on the CPU emulation (gpu/emu: cuda_emu.h with its
wgmma model wgmma_emu.h -- descriptor and fragment layouts from the PTX ISA, retired asynchronously at
wait_group, with checks for missing fences and for operands changed while an MMA is pending, which raise
EmuCheckError; with the mbarrier model: copies completed on an mbarrier, the consumer's proxy fence, deadlocks)
against the float64 reference on fresh random inputs; the emulation's own checks are shown to fire on planted
faults (tests/daaf_hopper_faults.cu); the auto rule (choose_impl). With a GPU (marked ``gpu``, Hopper only): the
wgmma unit kernel against numpy, every kernel against the reference.
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
from hpczeco.gpu import daaf_hopper as dh
from hpczeco.gpu import emu as gemu

from hpczeco.daaf.reference import attention_reference

GPU_DIR = Path(dh.__file__).resolve().parent
FAULTS = Path(__file__).resolve().parent / "daaf_hopper_faults.cu"  # the planted-fault kernel (emulation only)
FAULT_KERNEL = "daaf_wgmma_fault_check"
MBAR_FAULT_KERNEL = "daaf_mbar_fault_check"  # the producer/consumer (mbarrier) faults
TOL = {"bf16": 1e-2, "f16": 5e-3}
TS = (1, 63, 64, 65, 200)
WS = (0, 1, 16, 128)
PLANS = ("none", "first", "scattered", "all", "regions")
# an emulated block runs its threads (384-512 for the warp-specialised kernels) one at a time: slow tests
pytestmark = [pytest.mark.emulation, pytest.mark.timeout(900)]


# --------------------------------------------------------------------------- host-side logic


def test_kernel_names_and_resolve():
    assert dh.kernel_name("hwg", "bf16", 128) == "daaf_hwg_bf16_d128_n128_w2_s3"
    assert dh.kernel_name("hwg_nosw", "bf16", 128).endswith("_nosw")
    assert dh.kernel_name("hfa2", "f16", 64) == "daaf_hfa2_f16_d64_s3"
    assert len(set(dh.kernel_names())) == len(dh.kernel_names())
    assert dh.resolve("hwg", "bf16", 64, 64).rows == 128
    assert dh.resolve("hwg3", "bf16", 128, 128).threads == 384
    with pytest.raises(ValueError, match="impl"):
        dh.resolve("wg", "bf16", 128, 128)
    with pytest.raises(ValueError, match="D == Dv"):
        dh.resolve("hwg", "bf16", 128, 64)
    with pytest.raises(ValueError, match="bf16"):
        dh.resolve("hwg64", "f16", 128, 128)
    for impl in dh.IMPLS:  # every kernel fits the 227 KB a block may have on Hopper
        for d in dh.VARIANTS[impl].dims:
            assert dh.smem_bytes(impl, d) <= 232448, (impl, d)


# --------------------------------------------------------------------------- nvcc build for sm_90a


@pytest.fixture(scope="module")
def nvcc_build():
    """The sm_90a build, started at module setup in the background (the emulation tests run meanwhile)."""
    if gbuild.nvcc_path() is None:
        yield None
        return
    job = gbuild.start(GPU_DIR / "daaf_hopper.cu", "sm_90a")
    yield job
    if job[0].poll() is None:
        job[0].kill()
        job[0].wait()


@pytest.mark.timeout(1800)  # the sm_90a build of every kernel, and the emulation's g++ build (first user)
def test_nvcc_builds_sm90a(nvcc_build, emu, rng):
    if nvcc_build is None:
        pytest.skip("nvcc not found (set NVCC=...)")
    res = gbuild.finish(nvcc_build, timeout=600)
    assert res.ok, res.output[-4000:]
    report = {k.name: k for k in res.kernels}
    names = set(dh.kernel_names()) | {dh.unit_kernel_name("bf16", True), dh.unit_kernel_name("bf16", False),
                                      dh.unit_kernel_name("f16", True)}
    assert names <= set(report), f"kernels missing from the build: {names - set(report)}"
    caps = {dh.kernel_name(i, e, d): 65536 // v.threads // 8 * 8 for i, v in dh.VARIANTS.items() for e in v.elems
            for d in v.dims}
    for name, rep in report.items():
        assert rep.spill_stores == 0, (name, rep)
        assert rep.registers <= min(255, caps.get(name, 255)), (name, rep)
    # ptxas serialises wgmma when it cannot prove the accumulators untouched in flight (C7514), and ignores
    # setmaxnreg when the kernel has no register cap at entry or the roles are not one branch each (C7508)
    serialised = re.findall(r"C7514.*function '(\w+)'", res.output)
    assert not serialised, f"wgmma serialised in {serialised}"
    assert "C7508" not in res.output, res.output[-3000:]
    # the C++ shared-memory sizes equal the launcher's: every kernel, launched once in the emulation with
    # dh.smem_bytes, checks its layout's SMEM_BYTES against the launch (EmuCheckError otherwise)
    for impl, v in dh.VARIANTS.items():
        for e in v.elems:
            for d in v.dims:
                emu_attention(impl, *_inputs(rng, 1, 1, 1, d), np.zeros(1, bool), 0, e)


# --------------------------------------------------------------------------- CPU emulation


@pytest.fixture(scope="module")
def emu_rt():
    """The CPU emulation of daaf_hopper.cu (and of the planted-fault kernel), built once."""
    if gemu.compiler() is None:
        pytest.skip("g++ not found: the CPU emulation of the kernels needs it")
    names = [*dh.GROUPS, FAULT_KERNEL, MBAR_FAULT_KERNEL]
    return gemu.EmuRuntime(dh.KERNELS.source() + "\n" + FAULTS.read_text(), names)


@pytest.fixture
def emu(emu_rt):
    """The wrappers of gpu/daaf_hopper.py on the emulation for one test (the GPU tests keep CuPy)."""
    old = dh.RUNTIME.set(emu_rt)
    yield emu_rt
    dh.RUNTIME.set(old)


def _bits(x, elem):
    return bf16.to_bits(x) if elem == "bf16" else x.astype(np.float16).view(np.uint16)


def _vals(bits, elem):
    return bf16.from_bits(bits) if elem == "bf16" else bits.view(np.float16).astype(np.float32)


def emu_attention(impl, q, k, v, g, W, elem="bf16", sched=dh.SCHED_DEFAULT):
    """Run ``impl`` through dh.prepare on the emulation (the ``emu`` fixture) on float inputs rounded to
    ``elem``; (out, float64 reference). A failed emulation check raises EmuCheckError."""
    hq, hk, hv = (_bits(x, elem) for x in (q, k, v))
    o = np.full_like(hq, 0x7FC0)  # NaN: every element must be written
    gidx = np.flatnonzero(g).astype(np.int32)
    plan = SimpleNamespace(global_idx=gidx, gmask=g.astype(np.uint8), n_global=len(gidx), local_window=W, T=len(g))
    storage = "bfloat16" if elem == "bf16" else "float16"
    p = dh.prepare(hq, hk, hv, plan, impl=impl, storage=storage, out=o, sched=sched)
    assert p() is o
    ref = attention_reference(*(_vals(x, elem) for x in (hq, hk, hv)), g, local_window=W)
    return _vals(o, elem), ref


def _rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _inputs(rng, B, T, H, D):
    return (rng.standard_normal((B, T, H, D)).astype(np.float32) * 1.5,
            rng.standard_normal((B, T, H, D)).astype(np.float32),
            rng.standard_normal((B, T, H, D)).astype(np.float32))


@pytest.mark.parametrize("fault,message", [
    (0, None),
    (1, "without fence.proxy.async"),
    (2, "overwritten before wait_group"),
    (3, "changed while their wgmma was pending"),
    (4, "without wgmma.fence"),
    (5, None),
])
def test_emulation_catches_planted_faults(emu, rng, fault, message):
    """The emulation's checks are not vacuous: each planted fault is reported (5: read before the
    wait, which the GPU would not report either, gives stale accumulators)."""
    a = bf16.to_bits(rng.standard_normal((64, 128)))
    b = bf16.to_bits(rng.standard_normal((128, 128)))
    d = np.full((64, 128), np.nan, np.float32)
    ref = bf16.from_bits(a).astype(np.float64) @ bf16.from_bits(b).astype(np.float64).T
    launch = emu.bind(FAULT_KERNEL, (1,), (128,), (a, b, d, np.int32(fault)), dh.UNIT_SMEM_BYTES)
    if message is None:
        launch()
        err = np.abs(d - ref).max() / np.abs(ref).max()
        assert (err < 1e-5) == (fault == 0), err
    else:
        with pytest.raises(gemu.EmuCheckError) as exc:
            launch()
        assert message in str(exc.value)


@pytest.mark.parametrize("fault,message", [
    (0, None),
    (1, "without fence.proxy.async"),
    (2, "overwritten before wait_group"),
    (3, "never completed"),
    (4, "left over at block exit"),
    (5, "used before mbarrier.init"),
    (6, "setmaxnreg.inc"),
])
def test_emulation_catches_mbarrier_faults(emu, rng, fault, message):
    """The producer/consumer checks of the emulation (mbarrier-completed cp.async, the consumer's proxy fence,
    refills while a wgmma is pending, deadlocks, named-barrier arrivals left over, setmaxnreg increases the
    CTA's decreases do not cover) fire on planted faults."""
    a = bf16.to_bits(rng.standard_normal((64, 128)))
    b = bf16.to_bits(rng.standard_normal((128, 128)))
    d = np.full((64, 128), np.nan, np.float32)
    ref = bf16.from_bits(a).astype(np.float64) @ bf16.from_bits(b).astype(np.float64).T
    launch = emu.bind(MBAR_FAULT_KERNEL, (1,), (384,), (a, b, d, np.int32(fault)), dh.UNIT_SMEM_BYTES + 64)
    if message is None:
        launch()
        assert np.abs(d - ref).max() / np.abs(ref).max() < 1e-5
    else:
        with pytest.raises(gemu.EmuCheckError) as exc:
            launch()
        assert message in str(exc.value)


@pytest.mark.parametrize("elem,swizzle", [("bf16", True), ("bf16", False), ("f16", True)])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_emulated_wgmma_unit(emu, rng, elem, swizzle, mode):
    """D = A B through the descriptors and layouts of the attention kernel (mode bit 0: B MN-major
    as the V tile, else K-major as the K tile; bit 1: A from registers as P)."""
    a = _bits(rng.standard_normal((64, 128)).astype(np.float32), elem)
    b = _bits(rng.standard_normal((128, 128)).astype(np.float32), elem)
    d = dh.wgmma_unit(a, b, mode, elem, swizzle)
    fa, fb = _vals(a, elem).astype(np.float64), _vals(b, elem).astype(np.float64)
    ref = fa @ (fb if mode & 1 else fb.T)
    assert np.abs(d - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("impl", ["hwg", "hws"])
@pytest.mark.parametrize("plan", PLANS)
def test_emulated_hwg_matches_reference(emu, rng, impl, plan):
    """The wgmma kernels (hwg; hws, warp-specialised) on every T x W of the brief, per key-region layout (fresh
    inputs each)."""
    for T in TS:
        for W in WS:
            g = key_regions(T, plan, rng)
            q, k, v = _inputs(rng, 1, T, 1, 128)
            out, ref = emu_attention(impl, q, k, v, g, W)
            err = _rel(out, ref)
            assert err <= TOL["bf16"], f"{impl} T={T} W={W} plan={plan}: rel err {err:.3g}"


@pytest.mark.parametrize("impl,elem,D", [("hwin", "bf16", 128), ("hwin", "f16", 64), ("hwin2", "bf16", 128)])
def test_emulated_window_kernels(emu, rng, impl, elem, D):
    """The window-only kernels on every T x W of the brief (no key regions), batch and head offsets."""
    for T in TS:
        for W in WS:
            g = np.zeros(T, bool)
            q, k, v = _inputs(rng, 2 if T <= 65 else 1, T, 2, D)
            out, ref = emu_attention(impl, q, k, v, g, W, elem, sched=int(rng.integers(0, 4)))
            err = _rel(out, ref)
            assert err <= TOL[elem], f"{impl} {elem} D={D} T={T} W={W}: rel err {err:.3g}"


def test_window_kernel_rejects_other_plans(emu, rng):
    """hwin covers plans without key regions and a window <= 128 only: anything else is refused."""
    q, k, v = _inputs(rng, 1, 200, 1, 128)
    for g, W in ((key_regions(200, "first", rng), 16), (np.zeros(200, bool), 129)):
        with pytest.raises(ValueError, match="without key regions"):
            emu_attention("hwin", q, k, v, g, W)


def test_choose_impl(monkeypatch):
    """The auto rule from host metadata: window-only plans -> the window kernel (None when wider than its band:
    gpu/daaf.py's), key regions -> the FA3-design kernel hfa3 (the fastest measured), and with the former table
    one span -> hwg3, several or unknown -> hws; None off Hopper; element types and head dims the preferred kernel
    lacks fall back to one that has them."""
    from hpczeco.gpu import daaf_fa3 as fa3

    plan = SimpleNamespace(n_global=0, local_window=128, T=32768)
    assert dh.choose_impl(plan) == dh.AUTO_IMPLS["window"] == "hwin"
    assert dh.choose_impl(SimpleNamespace(n_global=0, local_window=256, T=32768)) is None
    assert dh.choose_impl(SimpleNamespace(n_global=0, local_window=256, T=100)) == "hwin"  # window clipped to T
    assert dh.AUTO_IMPLS["one_span"] == "hfa3" and dh.AUTO_IMPLS["key_regions"] == "hfa3"
    for n_regions in (None, 1, 8):
        assert dh.choose_impl(SimpleNamespace(n_global=4096, local_window=128, T=32768, n_regions=n_regions)) == "hfa3"
    monkeypatch.setitem(dh.AUTO_IMPLS, "one_span", "hwg3")
    monkeypatch.setitem(dh.AUTO_IMPLS, "key_regions", "hws")
    assert dh.choose_impl(SimpleNamespace(n_global=4096, local_window=128, T=32768)) == "hws"  # spans unknown
    assert dh.choose_impl(SimpleNamespace(n_global=4096, local_window=128, T=32768, n_regions=None)) == "hws"
    assert dh.choose_impl(SimpleNamespace(n_global=4096, local_window=128, T=32768, n_regions=1)) == "hwg3"
    assert dh.choose_impl(SimpleNamespace(n_global=4096, local_window=128, T=32768, n_regions=8)) == "hws"
    monkeypatch.undo()
    assert dh.choose_impl(plan, cc="80") is None and dh.choose_impl(plan, cc=90) == "hwin"
    assert dh.choose_impl(plan, D=96) is None
    for n_global, n_regions in ((0, 0), (8, 1), (8, 3), (8, None)):
        for D in (64, 128):
            for elem in ("bf16", "f16"):
                impl = dh.choose_impl(SimpleNamespace(n_global=n_global, n_regions=n_regions, local_window=64,
                                                      T=1000), D=D, elem=elem)
                v = dh.VARIANTS.get(impl) or fa3.VARIANTS[impl]
                assert elem in v.elems and D in v.dims, (n_global, n_regions, D, elem, impl)
                assert (dh.VARIANTS.get(impl) is not None and v.kind == "win") == (n_global == 0), impl


# (impl, elem, D, B, H): each variant over the hardest cases; batch and head offsets, both schedules
VARIANT_CASES = [
    ("hwg", "f16", 128, 1, 2),
    ("hwg", "bf16", 64, 2, 1),
    ("hwg", "f16", 64, 1, 1),
    ("hwg64", "bf16", 128, 1, 2),
    ("hwg3", "bf16", 128, 2, 1),
    ("hwg1", "bf16", 128, 1, 1),
    ("hwg_nosw", "bf16", 128, 1, 2),
    ("hws", "f16", 128, 1, 2),
    ("hws", "bf16", 64, 2, 1),
    ("hws", "f16", 64, 1, 1),
    ("hwsp", "bf16", 128, 2, 1),
    ("hws64", "bf16", 128, 1, 2),
    ("hws3", "bf16", 128, 2, 1),
    ("hws3p", "bf16", 128, 1, 2),
    ("hwin", "f16", 128, 2, 1),
    ("hwin", "bf16", 64, 1, 2),
    ("hwin2", "bf16", 128, 1, 2),
]


@pytest.mark.parametrize("impl,elem,D,B,H", VARIANT_CASES)
def test_emulated_hwg_variants(emu, rng, impl, elem, D, B, H):
    window_only = dh.VARIANTS[impl].kind == "win"
    for T, W, plan, sched in ((200, 16, "regions", 3), (200, 1, "scattered", 1), (65, 128, "none", 0),
                              (130, 0, "first", 2), (1, 0, "all", 1)):
        g = key_regions(T, "none" if window_only else plan, rng)
        q, k, v = _inputs(rng, B, T, H, D)
        out, ref = emu_attention(impl, q, k, v, g, W, elem, sched)
        err = _rel(out, ref)
        assert err <= TOL[elem], f"{impl} {elem} D={D} T={T} W={W} plan={plan}: rel err {err:.3g}"


@pytest.mark.parametrize("impl,elem,D", [("hfa2", "bf16", 128), ("hfa2", "f16", 64), ("hfa2s2", "bf16", 128)])
def test_emulated_hfa2(emu, rng, impl, elem, D):
    """The mma.sync fallback (slow to emulate: each mma is a warp-wide exchange, so fewer cases)."""
    cases = ((200, 16, "regions", 3), (129, 128, "scattered", 1), (64, 0, "none", 0))
    if impl == "hfa2" and elem == "bf16":
        cases += ((65, 1, "first", 1), (63, 16, "all", 2))
    for T, W, plan, sched in cases:
        g = key_regions(T, plan, rng)
        q, k, v = _inputs(rng, 1, T, 1, D)
        out, ref = emu_attention(impl, q, k, v, g, W, elem, sched)
        err = _rel(out, ref)
        assert err <= TOL[elem], f"{impl} {elem} D={D} T={T} W={W} plan={plan}: rel err {err:.3g}"


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
@pytest.mark.parametrize("swizzle", [True, False])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_gpu_wgmma_unit(rng, swizzle, mode):
    cp = _hopper_or_skip()
    a = bf16.to_bits(rng.standard_normal((64, 128)))
    b = bf16.to_bits(rng.standard_normal((128, 128)))
    d = cp.asnumpy(dh.wgmma_unit(a, b, mode, "bf16", swizzle))
    fa, fb = bf16.from_bits(a).astype(np.float64), bf16.from_bits(b).astype(np.float64)
    ref = fa @ (fb if mode & 1 else fb.T)
    assert np.abs(d - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("impl", dh.IMPLS)
def test_gpu_kernels_match_reference(rng, impl):
    cp = _hopper_or_skip()
    from hpczeco.gpu import daaf as gd

    window_only = dh.VARIANTS[impl].kind == "win"  # the window kernels take plans without key regions only
    for T, W, plan in ((1, 0, "none"), (65, 128, "none"), (200, 16, "regions"), (333, 5, "scattered"),
                       (257, 0, "all"), (700, 128, "first")):
        plan = "none" if window_only else plan
        g = key_regions(T, plan, rng)
        q, k, v = _inputs(rng, 2, T, 2, 128)
        hq, hk, hv = (bf16.to_bits(x) for x in (q, k, v))
        plan_d = gd.device_plan(np.flatnonzero(g), W, T, cp.asarray(g))
        p = dh.prepare(cp.asarray(hq), cp.asarray(hk), cp.asarray(hv), plan_d, impl=impl, storage="bfloat16")
        out = bf16.from_bits(cp.asnumpy(p()))
        ref = attention_reference(*(bf16.from_bits(x) for x in (hq, hk, hv)), g, local_window=W)
        err = _rel(out, ref)
        assert err <= TOL["bf16"], f"{impl} T={T} W={W} plan={plan}: rel err {err:.3g}"


def test_compile_groups_match_source():
    """gpu/daaf_hopper.py's GROUPS names every kernel of daaf_hopper.cu under its DH_IN_GROUP block."""
    text = (GPU_DIR / "daaf_hopper.cu").read_text()
    found: dict[str, int] = {}
    for m in re.finditer(r"#if DH_IN_GROUP\((\d+)\)\n(.*?)#endif", text, re.S):
        for name in re.findall(r"^DH_\w+_KERNEL\((\w+),", m.group(2), re.M):
            found[name] = int(m.group(1))
    assert found == dh.GROUPS
    unit = {dh.unit_kernel_name("bf16", True), dh.unit_kernel_name("bf16", False), dh.unit_kernel_name("f16", True)}
    assert set(dh.kernel_names()) | unit == set(found)


# --------------------------------------------------------------------------- bench gpu-daaf --check, on the emulation


@pytest.fixture
def check_cp(emu, monkeypatch):
    """The numpy stand-in for CuPy as ``cupy`` and as the emulation's array module: the device arrays of the checks
    of ``hpczeco bench gpu-daaf --check`` (:mod:`hpczeco.drivers.gpu_daaf_checks`)."""
    import sys

    from helpers import fake_cupy

    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(emu, "xp", cp, raising=False)
    return cp


def test_bench_device_checks_on_the_emulation(check_cp, tmp_path):
    """The stages of `hpczeco bench gpu-daaf --check` in-process without a GPU: the wgmma unit check in every layout
    mode, a warp-specialised and a window kernel probed (each element type and head dim, both schedules) and their
    small (sanitizer) cases, against float64; every check ran and passed, and is in the bench's table."""
    from hpczeco.drivers import benchkit
    from hpczeco.drivers import gpu_daaf_checks as chk

    rec = benchkit.Recorder(tmp_path, "checks")
    chk.unit(rec, check_cp, 1)
    cases = [(1, 0, "none"), (65, 16, "regions"), (130, 128, "first")]
    for impl in ("hwsp", "hwin"):
        chk.probe(rec, check_cp, impl, 2 + dh.IMPLS.index(impl), cases=cases)
        chk.small(rec, check_cp, impl, 3)
    rows = rec.tables[chk.TABLE]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    by_stage = {st: [r for r in rows if r["stage"] == st] for st in ("unit", "probe", "small")}
    assert len(by_stage["unit"]) == 10 and all(r["value"] <= chk.UNIT_TOL for r in by_stage["unit"])
    assert len(by_stage["probe"]) == 3 * 2 * (1 + 4)  # cases x schedules x (hwsp: bf16 D128; hwin: bf16/f16, D64/128)
    assert {r["plan"] for r in by_stage["probe"] if r["impl"] == "hwsp"} == {"none", "regions", "first"}
    assert {r["plan"] for r in by_stage["probe"] if r["impl"] == "hwin"} == {"none"}  # window-only plans
    assert len(by_stage["small"]) == 4
    assert all(0 <= r["value"] <= r["tol"] for r in by_stage["probe"] + by_stage["small"])
    assert check_cp.counts["upload"] > 0  # the inputs went to the (stand-in) device


def test_bench_device_checks_fail_on_a_wrong_output(check_cp, tmp_path, monkeypatch):
    """A kernel whose output is wrong fails its probe (NaN-poisoned output never written, or scaled)."""
    from hpczeco.drivers import benchkit
    from hpczeco.drivers import gpu_daaf_checks as chk

    real = dh.prepare

    def off_by_a_bit(*a, **k):
        p = real(*a, **k)
        out = k["out"]

        def call():
            p()
            out[...] = bf16.to_bits(bf16.from_bits(out) * 1.05)

        return call

    monkeypatch.setattr(dh, "prepare", off_by_a_bit)
    rec = benchkit.Recorder(tmp_path, "checks")
    chk.small(rec, check_cp, "hwin", 3)
    rows = rec.tables[chk.TABLE]
    assert len(rows) == 2 and not any(r["ok"] for r in rows) and all(r["value"] > chk.TOL["bf16"] for r in rows)


_FAKE_CHILD = r"""
import json, sys
args = sys.argv[1:]
out, stem = args[args.index("--out") + 1], args[args.index("--stem") + 1]
rows = [{"stage": args[args.index("-m") + 2], "check": "c", "ok": True, "value": 0.0, "tol": 1.0}]
with open(f"{out}/{stem}.json", "w") as fh:
    json.dump({"device_checks": rows}, fh)
"""


def test_bench_device_check_children(tmp_path):
    """The bench runs each stage in a process of its own: its records are merged; a child that crashes (or records
    nothing) is a failed check, not a silent pass."""
    import sys

    from hpczeco.drivers import benchkit
    from hpczeco.drivers import gpu_daaf_checks as chk

    script = tmp_path / "child.py"
    script.write_text(_FAKE_CHILD)
    rec = benchkit.Recorder(tmp_path, "t")
    assert chk.run_child(rec, tmp_path, "probe", 1, "hws", prefix=(sys.executable, str(script)))
    assert rec.tables[chk.TABLE] == [{"stage": "probe", "check": "c", "ok": True, "value": 0.0, "tol": 1.0}]
    assert not chk.run_child(rec, tmp_path, "unit", 1, prefix=(sys.executable, "-c", "import sys; sys.exit(5)"))
    last = rec.tables[chk.TABLE][-1]
    assert last["check"] == "unit child process" and not last["ok"] and last["detail"].startswith("exit 5, 0 checks")


def test_bench_plans_pairs_flex_checks_and_targets(rng, tmp_path, monkeypatch):
    """The bench's plans and pair count (its TFLOP/s) equal the reference mask's; the timed outputs' distance to
    Flex becomes checks; the targets summary: best and auto pick per (T, plan) against 0.8 (window) / 1.0 (key
    regions), and the AUTO_IMPLS suggestion."""
    from hpczeco.drivers import benchkit
    from hpczeco.drivers import gpu_daaf_checks as chk
    from hpczeco.drivers.gpu_daaf_model import bench_plans

    from hpczeco.daaf import attention_pairs
    from hpczeco.daaf.reference import allowed_mask

    for T, W, plan in ((300, 16, "regions"), (257, 128, "scattered"), (64, 0, "all"), (1, 0, "none")):
        g = key_regions(T, plan, rng)
        assert attention_pairs(g, W) == int(allowed_mask(g, W).sum())
    plans = bench_plans(32768)
    assert set(plans) == {"w128", "w128+first4096", "w128+8x512"}
    assert plans["w128+first4096"][:4096].all() and plans["w128+first4096"].sum() == 4096
    assert plans["w128+8x512"].sum() == 8 * 512
    rec = benchkit.Recorder(tmp_path, "t")
    chk.flex_checks(rec, [{"T": 8192, "plan": "w128", "method": "daaf-hwin/s3", "max_rel_diff_vs_flex": 0.01},
                          {"T": 8192, "plan": "w128", "method": "daaf-tc2", "max_rel_diff_vs_tc2": 0.0},
                          {"T": 8192, "plan": "w128", "method": "daaf-hws/s3", "max_rel_diff_vs_tc2": 0.05},
                          {"T": 8192, "plan": "w128", "method": "flex"}])
    assert [(r["check"], r["ok"]) for r in rec.tables[chk.TABLE]] == [
        ("T=8192 w128 daaf-hwin/s3 vs flex output", True), ("T=8192 w128 daaf-hws/s3 vs tc2 output", False)]
    rows = [{"T": T, "plan": p, "method": m, "median_ms": t * (2 if T == 32768 else 1), "tflops": 1.0}
            for T in (8192, 32768) for p, m, t in (
                ("w128", "daaf-hwin/s3", 0.05), ("w128", "daaf-hws/s3", 0.09), ("w128", "flex", 0.1),
                ("w128", "daaf-auto", 0.01), ("w128", "sdpa-flash", 0.5),
                ("w128+first4096", "daaf-hws/s3", 1.1), ("w128+first4096", "daaf-hwg3/s3", 0.9),
                ("w128+first4096", "flex", 1.0))]
    monkeypatch.setitem(dh.AUTO_IMPLS, "one_span", "hws")  # the auto rule these rows time (no hfa3 rows here)
    monkeypatch.setitem(dh.AUTO_IMPLS, "key_regions", "hws")
    lines = chk.targets(rec, rows)
    assert "MISS  target: T=8192 w128: best daaf-hwin/s3 0.050 ms = 0.50 x Flex (target <= 0.4)" in lines
    assert "MISS  target: T=8192 w128+first4096: auto=hws daaf-hws/s3 1.100 ms = 1.10 x Flex (target <= 0.75, " \
           "moonshot 0.6)" in lines
    assert "MISS  target: T=32768 w128+first4096: best daaf-hwg3/s3 1.800 ms = 0.90 x Flex (target <= 0.7, " \
           "moonshot 0.6)" in lines
    sugg = {r["plan_kind"]: r["suggest"] for r in rec.tables["targets"] if "suggest" in r}
    assert sugg == {"window": "daaf-hwin/s3", "key_regions": "daaf-hwg3/s3"}


@pytest.mark.parametrize("impl", ["hwg", "hwg3", "hfa2", "hws", "hwsp", "hws3p", "hwin"])
def test_emulated_long_rows(emu, rng, impl):
    """Rows over many key tiles: the stage ring wraps several times (gathered key-region tiles, a
    causal key-region tile of ~6 x 128 keys, a local window over several tiles); for hwin, many query tiles."""
    cases = [(700, 16, "first"), (700, 300, "none"), (640, 1, "all")]
    if impl == "hfa2":
        cases = cases[:1]
    if impl == "hwin":
        cases = [(700, 128, "none"), (777, 100, "none")]
    for T, W, plan in cases:
        g = key_regions(T, plan, rng)
        q, k, v = _inputs(rng, 1, T, 1, 128)
        out, ref = emu_attention(impl, q, k, v, g, W)
        err = _rel(out, ref)
        assert err <= TOL["bf16"], f"{impl} T={T} W={W} plan={plan}: rel err {err:.3g}"
