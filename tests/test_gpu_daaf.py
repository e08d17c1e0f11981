"""DAAF attention on GPUs: gpu/daaf_attention.cu, gpu/daaf.py.

Without a GPU: the CUDA source builds for sm_90 with nvcc (registers/spills checked); the kernels run
on the CPU through the wrappers of gpu/daaf.py on the CUDA emulation (gpu/emu: every CUDA thread a
std::thread, PTX fragment layouts emulated) against the float64 reference (hpczeco.daaf.reference).
With a GPU (marked ``gpu``): every kernel family against the float64 reference, and input validation.
The device planner (gpu/daaf_plan.cu) is tested in tests/test_daaf_device_api.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import daaf_inputs, rel_max
from hpczeco.base import bf16
from hpczeco.gpu import build as gbuild
from hpczeco.gpu import daaf as gd
from hpczeco.gpu import emu as gemu

from hpczeco.daaf.reference import attention_reference


def reference_attention(q, k, v, global_mask, local_window, scale=None):
    """The float64 DAAF reference for a key-region mask ``[T]``."""
    return attention_reference(q, k, v, global_mask, scale, local_window=local_window)

GPU_DIR = Path(gd.__file__).resolve().parent
SRC = GPU_DIR / "daaf_attention.cu"
TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 1e-2}


def _mask(T: int, spans=(), p: float = 0.0, rng=None) -> np.ndarray:
    g = np.zeros(T, dtype=bool)
    for a, b in spans:
        g[a:b] = True
    if p:
        g |= rng.random(T) < p
    return g


# --------------------------------------------------------------------------- host helpers


def test_bf16_rounding_is_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -2.5, 3.0e38, np.inf], dtype=np.float32)
    r = bf16.round_to_bf16(x)
    assert r[0] == 1.0
    assert r[1] == 1.0  # tie -> even (mantissa ...0)
    assert r[2] == 1.0 + 4 * 2**-8  # tie -> even (mantissa ...0 after rounding up)
    assert r[3] == 1.0
    assert r[4] == -2.5
    assert np.isinf(r[6])
    assert bf16.to_bits(np.array([np.nan], np.float32))[0] & 0x7F80 == 0x7F80


def test_resolve_impl():
    assert gd.resolve_impl("auto", "bf16", 128, 128) == gd.AUTO_TC
    assert gd.resolve_impl("auto", "f32", 128, 128) == "simple"
    assert gd.resolve_impl("auto", "bf16", 96, 96) == "simple"
    with pytest.raises(ValueError, match="impl"):
        gd.resolve_impl("fast", "bf16", 128, 128)
    with pytest.raises(ValueError, match="D == Dv"):
        gd.resolve_impl("tc", "f32", 128, 128)
    with pytest.raises(ValueError, match="D=128"):
        gd.resolve_impl("tc3", "bf16", 64, 64)


def _plan(T: int, spans=(), W: int = 16, host: bool = True, info: dict | None = None) -> gd.DevicePlan:
    """A DevicePlan on numpy arrays: with its host index (``host``) or without (a device index's plan)."""
    g = _mask(T, spans)
    gi = np.flatnonzero(g).astype(np.int32)
    return gd.DevicePlan(gi, g.astype(np.uint8), T, W, host_idx=gi if host else None, info=info)


def test_resolve_hopper_impls():
    from hpczeco.gpu import daaf_hopper as dh

    assert set(dh.IMPLS) <= set(gd.impl_names()) and set(gd.IMPLS) <= set(gd.impl_names())
    for impl, var in dh.VARIANTS.items():  # every variant resolves for what it supports, on 9.0
        for e in var.elems:
            for d in var.dims:
                assert gd.resolve_impl(impl, e, d, d, cc="90") == impl
    with pytest.raises(ValueError, match=r"D == Dv in \(128,\)"):
        gd.resolve_impl("hwg3", "bf16", 64, 64, cc="90")
    with pytest.raises(ValueError, match="bf16 inputs"):
        gd.resolve_impl("hwg64", "f16", 128, 128, cc="90")
    with pytest.raises(ValueError, match="D == Dv"):
        gd.resolve_impl("hwg", "bf16", 128, 64, cc="90")
    with pytest.raises(ValueError, match="got f32"):
        gd.resolve_impl("hfa2", "f32", 128, 128, cc="90")
    with pytest.raises(ValueError, match="compute capability 9.0, this device is sm_86"):
        gd.resolve_impl("hwg", "bf16", 128, 128, cc="86")
    with pytest.raises(ValueError, match="unknown compute capability"):
        gd.resolve_impl("hwg3", "bf16", 128, 128, cc="unknown")
    assert gd.resolve_impl("hwg3", "bf16", 128, 128, cc=(9, 0)) == "hwg3"
    with pytest.raises(ValueError, match="hwg64"):  # the error lists the Hopper kernels too
        gd.resolve_impl("wgmma", "bf16", 128, 128)


def test_auto_choice_by_device_and_plan(monkeypatch):
    """"auto" from the dtype, head dims, compute capability and the plan's host metadata (the built-in rule,
    without gpu/daaf_hopper.py's choose_impl)."""
    from hpczeco.gpu import daaf_hopper as dh

    monkeypatch.delattr(dh, "choose_impl", raising=False)
    window, one, two = _plan(300), _plan(300, [(0, 96)]), _plan(300, [(10, 40), (200, 230)])
    unknown = _plan(300, [(0, 96)], host=False)  # a device index: its spans are not known on the host
    assert unknown.n_regions is None and one.n_regions == 1 and two.n_regions == 2 and window.n_regions == 0
    assert _plan(300, [(0, 96)], host=False, info={"n_regions": 1}).n_regions == 1  # the planners' count
    choice = gd.auto_choice
    for p in (None, window, one, two, unknown):  # off 9.0 (or unknown): the tensor-core kernel of any GPU
        assert choice("bf16", 128, 128, p, None) == (gd.AUTO_TC, None)
        assert choice("bf16", 128, 128, p, "86") == (gd.AUTO_TC, None)
        assert choice("f32", 128, 128, p, "90") == ("simple", None)
        assert choice("bf16", 96, 96, p, "90") == ("simple", None)
        assert choice("bf16", 128, 64, p, "90") == ("simple", None)
    assert choice("bf16", 128, 128, window, "90") == (gd.AUTO_WINDOW, None) == ("tc2", None)
    assert choice("bf16", 128, 128, one, "90") == ("hwg3", gd.AUTO_SCHED)
    assert choice("bf16", 128, 128, two, "90") == ("hws", gd.AUTO_SCHED)
    assert choice("bf16", 128, 128, unknown, "90") == ("hws", gd.AUTO_SCHED)
    assert choice("bf16", 128, 128, None, "90") == ("hws", gd.AUTO_SCHED)
    for e, d in (("f16", 128), ("bf16", 64), ("f16", 64)):  # hwg3 exists for bf16 D=128 only, hws for all four
        assert choice(e, d, d, one, "90") == ("hws", gd.AUTO_SCHED)
        assert choice(e, d, d, two, "90") == ("hws", gd.AUTO_SCHED)
        assert choice(e, d, d, window, "90") == ("tc2", None)
    assert gd.resolve_impl("auto", "bf16", 128, 128, plan=one, cc="90") == "hwg3"
    assert gd.resolve_impl("auto", "bf16", 128, 128, plan=one) == gd.AUTO_TC


def test_auto_choice_defers_to_choose_impl(monkeypatch):
    """When gpu/daaf_hopper.py has choose_impl(plan, *, D, cc, elem), "auto" on 9.0 takes its answer (checked)."""
    from hpczeco.gpu import daaf_hopper as dh

    seen = []

    def choose(plan, T=None, D=128, cc="90", elem="bf16"):
        seen.append((plan.n_global, plan.n_regions, elem, D))
        return answer

    monkeypatch.setattr(dh, "choose_impl", choose, raising=False)
    one = _plan(300, [(0, 96)])
    answer = ("hwg", 1)
    assert gd.auto_choice("bf16", 128, 128, one, "90") == ("hwg", 1)
    assert seen == [(96, 1, "bf16", 128)]
    answer = "hwg1"
    assert gd.auto_choice("bf16", 128, 128, one, "90") == ("hwg1", gd.AUTO_SCHED)
    answer = "tc"
    assert gd.auto_choice("bf16", 128, 128, one, "90") == ("tc", None)
    answer = None  # no opinion: the built-in rule
    assert gd.auto_choice("bf16", 128, 128, one, "90") == ("hwg3", gd.AUTO_SCHED)
    answer = "hwg3"  # a choice that does not exist for these inputs is an error, not a silent fallback
    with pytest.raises(ValueError, match="bf16 inputs"):
        gd.auto_choice("f16", 128, 128, one, "90")
    assert gd.auto_choice("bf16", 128, 128, one, "80") == (gd.AUTO_TC, None)  # only asked on 9.0
    assert len(seen) == 5


# --------------------------------------------------------------------------- nvcc build for sm_90


@pytest.fixture(scope="module", autouse=True)
def nvcc_build():
    """Start the sm_90 build at module setup, in the background (the emulation tests run meanwhile)."""
    if gbuild.nvcc_path() is None:
        yield None
        return
    job = gbuild.start(SRC, "sm_90", fast=True)  # the command tests/test_cuda_build.py runs (cached once)
    yield job
    if job[0].poll() is None:
        job[0].kill()
        job[0].wait()


def test_nvcc_builds_sm90(nvcc_build):
    if nvcc_build is None:
        pytest.skip("nvcc not found (set NVCC=...)")
    res = gbuild.finish(nvcc_build, timeout=170)
    assert res.ok, res.output[-4000:]
    report = {k.name: {"regs": k.registers, "spill": k.spill_stores} for k in res.kernels}
    missing = set(gd.kernel_names()) - set(report)
    assert not missing, f"kernels missing from the build: {missing}"
    for name, rep in report.items():
        assert rep["regs"] <= 255, (name, rep)
        # the register-capped / two-m-tile variants may spill a few bytes; the others not at all
        limit = 64 if name.startswith(("daaf_tc2_", "daaf_tc3_")) else 0
        assert rep.get("spill", 0) <= limit, (name, rep)


# --------------------------------------------------------------------------- CPU emulation of the kernels


@pytest.fixture(scope="module")
def emu():
    """The wrappers of gpu/daaf.py on the CPU emulation of the kernels (numpy arrays as device memory; the
    index checks of device plans run gpu/daaf_plan.cu's kernel, emulated as well)."""
    if gemu.compiler() is None:
        pytest.skip("g++ not found: the CPU emulation of the kernels needs it")
    from hpczeco.gpu import daaf_plan as dpl

    rt = gemu.EmuRuntime(gd.KERNELS.source(), gd.kernel_names())
    old = gd.RUNTIME.set(rt)
    old_plan = dpl.RUNTIME.set(gemu.EmuRuntime(dpl.KERNELS.source(), dpl.kernel_names()))
    old_threads, dpl.INDEX_THREADS = dpl.INDEX_THREADS, 64
    yield rt
    gd.RUNTIME.set(old)
    dpl.RUNTIME.set(old_plan)
    dpl.INDEX_THREADS = old_threads


def _emu_tc(rt, q, k, v, g, W, elem, mt, reverse=True):
    B, T, H, D = q.shape
    if elem == "bf16":
        hq, hk, hv = bf16.to_bits(q), bf16.to_bits(k), bf16.to_bits(v)
        fq, fk, fv = (bf16.from_bits(x) for x in (hq, hk, hv))
    else:
        hq, hk, hv = (x.astype(np.float16).view(np.uint16) for x in (q, k, v))
        fq, fk, fv = (x.view(np.float16).astype(np.float32) for x in (hq, hk, hv))
    gidx = np.flatnonzero(g).astype(np.int32)
    scale = D**-0.5
    impl = {1: "tc", 2: "tc2"}[mt]
    storage = "bfloat16" if elem == "bf16" else "float16"
    rt.launched.clear()
    o = gd.prepare(hq, hk, hv, gidx, W, scale, g, impl=impl, storage=storage, reverse=reverse)()
    assert rt.launched == [f"daaf_{impl}_{elem}_d{D}"]
    out = bf16.from_bits(o) if elem == "bf16" else o.view(np.float16).astype(np.float32)
    return out, reference_attention(fq, fk, fv, g, W, scale)


@pytest.mark.parametrize("mt", [1, 2])
def test_emulated_tc_kernel_matches_reference(emu, rng, mt):
    """One case reaching every path: mixed and all-key-region query tiles (full causal, unmasked and
    masked key tiles), gathered key-region tiles (full and partial), the local range, padding rows."""
    T, W = 300, 16
    g = _mask(T, [(10, 140), (200, 210)])
    q, k, v = daaf_inputs(rng, 2 if mt == 1 else 1, T, 1 if mt == 1 else 2, 64)  # batch and head offsets
    out, ref = _emu_tc(emu, q, k, v, g, W, "bf16", mt)
    assert rel_max(out, ref) <= TOL["bf16"]


@pytest.mark.parametrize("mt", [1, 2])
def test_emulated_tc_kernel_d128_fp16_scattered(emu, rng, mt):
    T = 130
    g = _mask(T, p=0.1, rng=rng)
    q, k, v = daaf_inputs(rng, 1, T, 1, 128)
    out, ref = _emu_tc(emu, q, k, v, g, 0, "f16", mt, reverse=False)
    assert rel_max(out, ref) <= TOL["f16"]


def test_emulated_simple_kernel_matches_reference(emu, rng):
    B, T, H, D, Dv, W = 1, 20, 1, 40, 24, 3
    g = _mask(T, [(5, 9)])
    q, k, v = daaf_inputs(rng, B, T, H, D, Dv)
    gidx = np.flatnonzero(g).astype(np.int32)
    emu.launched.clear()
    o = gd.attention(q, k, v, gidx, W, D**-0.5, g, impl="simple")
    assert emu.launched == ["daaf_simple_f32"]
    assert rel_max(o, reference_attention(q, k, v, g, W)) <= TOL["f32"]


# --------------------------------------------------------------------------- the Hopper kernels through gpu/daaf.py

FAULTS = Path(__file__).resolve().parent / "daaf_hopper_faults.cu"


@pytest.fixture(scope="module")
def hopper_emu(emu):
    """The Hopper kernels on the CPU emulation behind gpu/daaf.py's wrappers, on a device that says compute
    capability 9.0 (the same build as tests/test_daaf_hopper_emu.py's, so the compiled library is shared); "auto"
    with the table of these wgmma kernels (the FA3-design kernel it takes for key regions by default is emulated
    in tests/test_daaf_fa3_emu.py)."""
    from hpczeco.gpu import daaf_hopper as dh

    hrt = gemu.EmuRuntime(dh.KERNELS.source() + "\n" + FAULTS.read_text(), [*dh.GROUPS, "daaf_wgmma_fault_check"])
    old = dh.RUNTIME.set(hrt)
    old_auto = dict(dh.AUTO_IMPLS)
    dh.AUTO_IMPLS.update(one_span="hwg3", key_regions="hws")
    emu.compute_capability = "90"
    yield hrt
    del emu.compute_capability
    dh.AUTO_IMPLS.update(old_auto)
    dh.RUNTIME.set(old)


def _bits_of(x, elem):
    if elem == "bf16":
        h = bf16.to_bits(x)
        return h, bf16.from_bits(h)
    h = x.astype(np.float16).view(np.uint16)
    return h, h.view(np.float16).astype(np.float32)


def _vals_of(o, elem):
    return bf16.from_bits(o) if elem == "bf16" else o.view(np.float16).astype(np.float32)


def _emu_run(q, k, v, gidx, W, elem, mask=None, **kw):
    """gd.prepare on 16-bit bits of float inputs: (Prepared, output as float32, float64 reference)."""
    (hq, fq), (hk, fk), (hv, fv) = (_bits_of(x, elem) for x in (q, k, v))
    storage = "bfloat16" if elem == "bf16" else "float16"
    p = gd.prepare(hq, hk, hv, gidx, W, None, mask, storage=storage, **kw)
    out = _vals_of(p(), elem)
    T = q.shape[1]
    g = np.zeros(T, bool)
    if kw.get("plan") is not None:
        g = np.asarray(kw["plan"].gmask if isinstance(kw["plan"], gd.DevicePlan) else kw["plan"].global_mask, bool)
    else:
        g[np.asarray(gidx, dtype=np.int64)] = True
    return p, out, reference_attention(fq, fk, fv, g, W)


HOPPER_CASES = [("hwg", "bf16", 64), ("hwg", "f16", 128), ("hwg64", "bf16", 128), ("hwg3", "bf16", 128),
                ("hwg1", "bf16", 128), ("hwg_nosw", "bf16", 128), ("hfa2", "f16", 64), ("hfa2s2", "bf16", 128),
                ("hws", "f16", 64), ("hwsp", "bf16", 128), ("hws64", "bf16", 128), ("hws3", "bf16", 128),
                ("hws3p", "bf16", 128), ("hwin", "bf16", 64), ("hwin2", "bf16", 128)]
WINDOW_ONLY = ("hwin", "hwin2")  # the window kernels take plans without key regions only


def test_hopper_cases_cover_every_variant():
    from hpczeco.gpu import daaf_hopper as dh

    missing = set(dh.IMPLS) - {c[0] for c in HOPPER_CASES}
    assert not missing, f"add the new Hopper variants to HOPPER_CASES: {missing}"


@pytest.mark.parametrize("impl,elem,D", HOPPER_CASES)
def test_emulated_hopper_impls_through_daaf_py(hopper_emu, rng, impl, elem, D):
    """Each Hopper kernel named through gd.prepare (host index, host mask, both schedules' reverse bit): the
    float64 reference, and the emulated tc2 kernel on the same inputs."""
    from hpczeco.gpu import daaf_hopper as dh

    T, W = 130, 16
    g = _mask(T, [] if impl in WINDOW_ONLY else [(10, 40), (90, 100)])
    q, k, v = daaf_inputs(rng, 1, T, 2 if impl == "hwg3" else 1, D)  # (emulation time: one head mostly)
    gidx = np.flatnonzero(g)
    for reverse, want_sched in ((True, 3), (False, 2)):
        hopper_emu.launched.clear()
        p, out, ref = _emu_run(q, k, v, gidx, W, elem, g, impl=impl, reverse=reverse)
        assert (p.impl, p.sched, p.name) == (impl, want_sched, dh.kernel_name(impl, elem, D))
        assert hopper_emu.launched == [p.name]
        assert rel_max(out, ref) <= TOL[elem], (impl, reverse)
    _, out_tc2, _ = _emu_run(q, k, v, gidx, W, elem, g, impl="tc2")
    assert rel_max(out, out_tc2) <= 2 * TOL[elem]


def test_emulated_auto_choice(hopper_emu, emu, rng):
    """impl="auto" on a 9.0 device: the window kernel hwin without key regions, hwg3 for one span, hws for
    several spans or an index whose spans the host does not know; each output equals the reference."""
    import hpczeco.daaf as daaf
    from hpczeco.daaf import device_planner as dpl

    T, W, D = 160, 16, 128
    q, k, v = daaf_inputs(rng, 1, T, 1, D)
    lead = np.flatnonzero(_mask(T, [(0, 48)]))
    two = np.flatnonzero(_mask(T, [(20, 40), (100, 120)]))
    cases = [  # (index or plan, what "auto" must pick)
        (dict(gidx=np.zeros(0, np.int32)), "hwin"),
        (dict(gidx=list(lead)), "hwg3"),  # a host list: its spans are counted on the host
        (dict(gidx=None, plan=daaf.plan_from_mask(_mask(T, [(0, 48)]), W)), "hwg3"),  # a Plan: its regions
        (dict(gidx=list(two)), "hws"),
        (dict(gidx=lead.astype(np.int32)), "hws"),  # numpy is device memory here: spans unknown on the host
    ]
    tok = np.concatenate([rng.integers(0, 3, 64), rng.integers(0, 5000, 32), rng.integers(0, 3, 32),
                          rng.integers(0, 5000, 32)])
    dp = dpl.plan(tok, 32, 0.8, W, threads=32, select_threads=32)  # the device planner: its n_regions
    assert dp.n_regions == 2 and dp.n_global == 64
    cases.append((dict(gidx=None, plan=dp), "hws"))
    for kw, want in cases:
        gidx = kw.pop("gidx")
        p, out, ref = _emu_run(q, k, v, gidx, W, "bf16", **kw)
        assert p.impl == want, (kw, p.impl)
        assert p.sched == (None if want == "tc2" else gd.AUTO_SCHED)
        assert rel_max(out, ref) <= TOL["bf16"], want


def test_emulated_hopper_errors(hopper_emu, emu, rng):
    T = 64
    q, k, v = daaf_inputs(rng, 1, T, 1, 128)
    bits = [bf16.to_bits(x) for x in (q, k, v)]
    gi = np.array([3, 4, 5], np.int32)
    with pytest.raises(ValueError, match="bf16/f16 inputs"):  # float32
        gd.prepare(q, k, v, gi, 8, impl="hwg")
    with pytest.raises(ValueError, match=r"D == Dv in \(128,\)"):
        gd.prepare(*(b[..., :64].copy() for b in bits), gi, 8, impl="hwg3", storage="bfloat16")
    with pytest.raises(ValueError, match="D == Dv"):
        gd.prepare(bits[0], bits[1], bits[2][..., :64].copy(), gi, 8, impl="hwg", storage="bfloat16")
    with pytest.raises(ValueError, match="sched must be in"):
        gd.prepare(*bits, gi, 8, impl="hwg", storage="bfloat16", sched=4)
    emu.compute_capability = "86"
    try:
        with pytest.raises(ValueError, match="compute capability 9.0, this device is sm_86"):
            gd.prepare(*bits, gi, 8, impl="hwg3", storage="bfloat16")
        emu.launched.clear()
        p = gd.prepare(*bits, gi, 8, storage="bfloat16")  # "auto" off 9.0: the tensor-core kernel
        assert (p.impl, p.sched) == (gd.AUTO_TC, None)
        p()
        assert emu.launched == ["daaf_tc_bf16_d128"]
    finally:
        emu.compute_capability = "90"


# --------------------------------------------------------------------------- on a GPU


def _gpu_or_skip():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:
        pytest.skip(f"needs a CUDA GPU with CuPy ({type(exc).__name__}: {exc})")
    return cupy


GPU_CASES = [  # (T, W, key-region spans, scattered fraction)
    (1, 0, (), 0.0),
    (65, 128, (), 0.0),
    (200, 16, ((20, 90),), 0.0),
    (333, 5, ((0, 64), (150, 170)), 0.05),
    (257, 0, ((0, 257),), 0.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,elem,D", [("simple", "f32", 40), ("simple", "bf16", 128), ("tc", "bf16", 128),
                                         ("tc", "f16", 64), ("tc2", "bf16", 128), ("tc2", "f16", 64),
                                         ("tc3", "bf16", 128)])
def test_gpu_kernels_match_reference(rng, impl, elem, D):
    cp = _gpu_or_skip()
    for T, W, spans, p in GPU_CASES:
        g = _mask(T, spans, p, rng)
        q, k, v = daaf_inputs(rng, 2, T, 2, D)
        if elem == "bf16":
            hq, hk, hv = bf16.to_bits(q), bf16.to_bits(k), bf16.to_bits(v)
            fq, fk, fv = (bf16.from_bits(x) for x in (hq, hk, hv))
            storage = "bfloat16"
        elif elem == "f16":
            hq, hk, hv = q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
            fq, fk, fv = (x.astype(np.float32) for x in (hq, hk, hv))
            storage = None
        else:
            hq, hk, hv, fq, fk, fv = q, k, v, q, k, v
            storage = None
        o = gd.attention(cp.asarray(hq), cp.asarray(hk), cp.asarray(hv), np.flatnonzero(g), W, None,
                         cp.asarray(g), impl=impl, storage=storage).get()
        of = bf16.from_bits(o) if elem == "bf16" else o.astype(np.float32)
        err = rel_max(of, reference_attention(fq, fk, fv, g, W))
        assert err <= TOL[elem], f"T={T} W={W} spans={spans} p={p}: rel err {err:.3g} > {TOL[elem]}"


@pytest.mark.gpu
def test_gpu_bad_inputs_raise():
    cp = _gpu_or_skip()
    q = cp.zeros((1, 8, 2, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="strictly increasing"):
        gd.attention(q, q, q, np.array([3, 1]), 4)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        gd.attention(q, q, q, np.array([9]), 4)
    with pytest.raises(ValueError, match="exactly at global_idx"):
        gd.attention(q, q, q, np.array([1]), 4, None, cp.zeros(8, dtype=bool))
    with pytest.raises(TypeError, match="dtype"):
        gd.attention(q, q, q.astype(cp.float32), np.array([], np.int32), 4)
    with pytest.raises(ValueError, match="k has shape"):
        gd.attention(q, q[:, :4], q, np.array([], np.int32), 4)
    with pytest.raises(ValueError, match="local_window"):
        gd.attention(q, q, q, np.array([], np.int32), -1)
    with pytest.raises(TypeError, match="storage"):
        gd.attention(q.view(cp.uint16), q.view(cp.uint16), q.view(cp.uint16), np.array([], np.int32), 4)


def test_emulated_auto_falls_back_when_hopper_cubins_fail(hopper_emu, emu, rng, monkeypatch):
    """A Hopper module that does not build here: "auto" warns once and takes tc2 (whose output is right)."""
    monkeypatch.setattr(gd, "_HOPPER_USABLE", {})
    monkeypatch.setattr(hopper_emu, "available", lambda file, group=None: False)
    T = 64
    q, k, v = daaf_inputs(rng, 1, T, 1, 128)
    bits = [bf16.to_bits(x) for x in (q, k, v)]
    gi = list(range(0, 20))
    with pytest.warns(RuntimeWarning, match="does not build here"):
        p = gd.prepare(*bits, gi, 8, storage="bfloat16")
    assert p.impl == "tc2"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = gd.prepare(*bits, gi, 8, storage="bfloat16")
    assert p.impl == "tc2" and not caught  # warned once
    p()
    out, ref = _vals_of(p.out, "bf16"), reference_attention(*(bf16.from_bits(b) for b in bits),
                                                           np.arange(T) < 20, 8)
    assert rel_max(out, ref) <= TOL["bf16"]


# --------------------------------------------------------------------------- the benchmark's host side


def test_bench_parser_bound_and_table():
    from hpczeco.drivers import bench_gpu_daaf as bench

    args = bench.build_parser("x").parse_args([])
    assert bench._csv(args.impls)[0] == "auto" and args.ttft_impl == "auto" and args.models == "small,7b"
    assert bench.build_parser("x").parse_args(["--no-model"]).no_ttft  # the former option still works
    assert set(bench._csv(bench.DEFAULT_IMPLS)) <= set(gd.impl_names())
    assert bench.amdahl(0.0) == 1.0 and bench.amdahl(0.5) == pytest.approx(2.0) and bench.amdahl(0.75) == 4.0
    assert bench.tflops(10**6, 16, 128, 1.0) == pytest.approx(4 * 10**6 * 16 * 128 / 1e9)
    shapes = bench._model_shapes(args)
    assert shapes["7b"] == dict(layers=2, H=32, D=128, mlp="swiglu", ffn=11008)
    assert shapes["small"]["H"] * shapes["small"]["D"] == 2048 and shapes["small"]["ffn"] == 8192
    tables = {
        "timings": [{"T": 8192, "plan": "w128+8x512", "method": "daaf-auto", "choice": "hwg64/s3", "median_ms": 0.5,
                     "tflops": 300.0, "vs_flex": 0.77}, {"name": "T=8192 flex", "error": "boom"}],
        "api": [{"T": 8192, "plan": "w128", "form": "attention_torch(plan=Plan)", "stream_ms": 0.12,
                 "synced_ms": 0.2, "stream_ratio": 1.02, "synced_ratio": 1.4, "host_us": 14.5}],
        "ttft": [{"model": "7b", "T": 32768, "impl": "hwg64/s3", "ttft_exact_ms": 100.0, "ttft_daaf_ms": 60.0,
                  "speedup": 100 / 60, "amdahl_bound": 2.0, "of_bound": 100 / 120, "attn_fraction_exact": 0.5,
                  "plan_ms": 0.3, "hidden_rel_err": 0.1, "needle_daaf_key_pct": 100.0},
                 {"model": "7b", "T": 131072, "skipped": "out of memory"}],
    }
    text = bench.table(tables)
    assert "hwg64/s3" in text and "0.77x" in text and "boom" in text and "1.40" in text and "14.5" in text
    assert bench.TARGET_VS_FLEX == {"window": 0.4, "key_regions_8k": 0.75, "key_regions": 0.7}  # issue 32
    row = next(line for line in text.splitlines() if line.startswith("7b") and "32768" in line).split()
    assert row[5:9] == ["1.67x", "2.00x", "83%", "50%"] and row[-1] == "100%"
    assert "skipped: out of memory" in text
    check = bench.build_parser("x").parse_args(["--check", "--quick", "--sanitize", "racecheck"])
    assert check.check and check.quick and check.sanitize == "racecheck" and "hwin" in check.sanitize_impls
    assert bench.check_lines({}) == []
    lines = bench.check_lines({"device_checks": [
        {"stage": "unit", "check": "bf16 sw128 mode 0", "ok": True, "detail": ""},
        {"stage": "probe", "check": "hws bf16 D=128 T=65 W=16 regions sched=1", "ok": False, "detail": "NaN"}]})
    assert lines[1:] == ["device checks (--check): 1 of 2 passed",
                         "  FAIL probe: hws bf16 D=128 T=65 W=16 regions sched=1: NaN"]


def test_bench_model_on_cpu():
    """The TTFT models' prefill (GELU and SwiGLU MLPs) on the CPU: contiguous [1, T, H, D] q/k/v into the
    attention, the shapes out, and the same result for the same seed."""
    torch = pytest.importorskip("torch")
    from hpczeco.drivers.gpu_daaf_model import TinyModel

    seen = []

    def attn(q, k, v):
        seen.append((tuple(q.shape), q.is_contiguous() and k.is_contiguous() and v.is_contiguous()))
        qh, kh, vh = (x.transpose(1, 2).float() for x in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2).to(q.dtype)

    tok = torch.randint(0, 50, (24,))
    for mlp, ffn in (("gelu", None), ("swiglu", 40)):
        m = TinyModel(2, 2, 8, 2.0, 50, seed=3, mlp=mlp, ffn=ffn, device="cpu")
        assert m.ffn == (32 if ffn is None else 40) and ("wg" in m.layers[0]) == (mlp == "swiglu")
        h, logits = m.prefill(tok, attn)
        assert h.shape == (24, 16) and logits.shape == (50,) and bool(torch.isfinite(logits.float()).all())
        h2, _ = TinyModel(2, 2, 8, 2.0, 50, seed=3, mlp=mlp, ffn=ffn, device="cpu").prefill(tok, attn)
        assert torch.equal(h, h2)
        assert m.param_bytes() == 2 * (50 * 16 + 2 * (4 * 16 * 16 + (3 if mlp == "swiglu" else 2) * 16 * m.ffn))
    assert seen and all(s == ((1, 24, 2, 8), True) for s in seen)
    with pytest.raises(ValueError, match="mlp"):
        TinyModel(1, 1, 8, 2.0, 10, seed=0, mlp="relu", device="cpu")
