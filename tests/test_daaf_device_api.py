"""DAAF on the device without a GPU: the device planner (gpu/daaf_plan.cu) against the CPU planner, and the
per-call attention API (hpczeco.daaf.attention on CuPy arrays, hpczeco.gpu.daaf.attention) counted for host
synchronisations and uploads.

The kernels run on the CPU emulation (gpu/emu); CuPy is a numpy stand-in that counts every host read of device
memory (tests/fake_cupy/cupy). On a GPU (marked ``gpu``): the device planner against the CPU planner at 32k
tokens and the per-call API's outputs against the prepared launch.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import fake_cupy, rel_max
from hpczeco.gpu import daaf as gd
from hpczeco.gpu import daaf_launch as dl
from hpczeco.gpu import daaf_plan as dk
from hpczeco.gpu import emu as gemu

import hpczeco.daaf as daaf
from hpczeco.daaf import device_planner as dpl
from hpczeco.daaf import planner

pytestmark = pytest.mark.emulation  # the CPU emulation of the CUDA kernels: no MPI in it

# --------------------------------------------------------------------------- fixtures


class _CountingEmu(gemu.EmuRuntime):
    """The emulated kernels with the counting CuPy as ``xp``: only its arrays are "device" arrays."""

    def __init__(self, source, names, xp):
        super().__init__(source, names)
        self.xp = xp

    def is_native(self, x):
        return isinstance(x, self.xp.ndarray)


@pytest.fixture(scope="module")
def emu_sources():
    if gemu.compiler() is None:
        pytest.skip("g++ not found: the CPU emulation of the kernels needs it")
    return (gd.KERNELS.source(), ["daaf_simple_f32"]), (dk.KERNELS.source(), dk.kernel_names())


@pytest.fixture
def plan_emu(emu_sources, monkeypatch):
    """The device planner on the emulation with numpy arrays as device memory (small blocks)."""
    rt = gemu.EmuRuntime(*emu_sources[1])
    old = dk.RUNTIME.set(rt)
    monkeypatch.setattr(dk, "INDEX_THREADS", 64)
    yield rt
    dk.RUNTIME.set(old)


@pytest.fixture
def cp(emu_sources, monkeypatch):
    """The counting CuPy as ``cupy``, in both runtime slots (emulated kernels), and fresh plan caches."""
    mod = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", mod)
    old_a = gd.RUNTIME.set(_CountingEmu(*emu_sources[0], mod))
    old_p = dk.RUNTIME.set(_CountingEmu(*emu_sources[1], mod))
    monkeypatch.setattr(dk, "INDEX_THREADS", 64)
    gd._HOST_PLANS.clear()
    dl.clear()
    yield mod
    gd.RUNTIME.set(old_a)
    dk.RUNTIME.set(old_p)
    gd._HOST_PLANS.clear()
    dl.clear()


def _stream(rng, pieces) -> np.ndarray:
    """Token ids: ``pieces`` of (length, vocabulary) drawn uniformly (small vocabulary: low entropy)."""
    return np.concatenate([rng.integers(0, v, n) for n, v in pieces]).astype(np.int64)


def _same_plan(dp, cpu: planner.Plan, ent_rtol: float = 1e-12) -> None:
    hp = dpl.host_plan(dp)
    assert hp.policy == cpu.policy, (hp.reason, cpu.reason)
    assert hp.reason == cpu.reason
    np.testing.assert_allclose(hp.weights, cpu.weights, rtol=ent_rtol, atol=1e-15)
    np.testing.assert_array_equal(hp.selected, cpu.selected)
    np.testing.assert_array_equal(hp.global_mask, cpu.global_mask)
    np.testing.assert_array_equal(hp.window_starts, cpu.window_starts)
    assert hp.regions == cpu.regions and hp.stride == cpu.stride
    # a percentile rule's threshold is a window's score (equal up to rounding)
    assert (hp.threshold is None) == (cpu.threshold is None)
    assert hp.threshold is None or hp.threshold == pytest.approx(cpu.threshold, rel=ent_rtol, abs=1e-15)
    gidx = _host(dp.global_idx)
    assert dp.n_global == cpu.n_global == int(gidx.size)
    np.testing.assert_array_equal(gidx, np.flatnonzero(cpu.global_mask))
    np.testing.assert_array_equal(_host(dp.info["spans"]), np.asarray(cpu.regions, np.int64).reshape(-1, 2))


def _host(x) -> np.ndarray:
    """A device array (CuPy: ``.get()``, which np.asarray refuses) or a host one, as numpy."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


# --------------------------------------------------------------------------- device planner vs CPU planner


@pytest.mark.parametrize("window,stride,vocab,bias", [(64, None, None, "none"), (50, 47, 4000, "miller-madow"),
                                                       (40, 55, 2**17, "none"), (96, 32, 2**17, "miller-madow")])
def test_device_entropy_matches_cpu(plan_emu, rng, window, stride, vocab, bias):
    top = vocab or 2**17
    tok = _stream(rng, [(150, 3), (int(rng.integers(100, 260)), top), (90, 2), (77, top), (31, 5)])
    got = dpl.window_entropy(tok, window, stride, vocab, bias, threads=32)
    want = planner.window_entropy(tok, window, stride, vocab, bias)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_device_plan_threshold_rule_matches_cpu(plan_emu, rng):
    for trial in range(3):  # fresh streams: low/high entropy regions, T not a multiple of the window
        pieces = [(int(rng.integers(40, 300)), int(rng.choice([2, 4, 3000, 2**17]))) for _ in range(5)]
        tok = _stream(rng, pieces)
        window, W = int(rng.choice([32, 64, 100])), int(rng.integers(0, 40))
        vocab = 2**17 if trial == 2 else None
        dp = dpl.plan(tok, window, 0.8, W, vocab_size=vocab, threads=32, select_threads=64, n_global_before=True)
        cpu = planner.plan(tok, window, 0.8, W, vocab_size=vocab)
        _same_plan(dp, cpu)
        before = planner.plan_arrays(cpu)["n_global_before"]
        np.testing.assert_array_equal(np.asarray(dp.info["n_global_before"]), before)


def test_device_plan_at_the_default_window(plan_emu, rng):
    """window 512 (one 512-id sort per block), int32 ids up to 2^17, T not a multiple of the window."""
    tok = _stream(rng, [(700, 6), (1200, 2**17), (313, 9)]).astype(np.int32)
    dp = dpl.plan(tok, 512, 0.8, 128, vocab_size=2**17, threads=64, select_threads=128)
    _same_plan(dp, planner.plan(tok, 512, 0.8, 128, vocab_size=2**17))
    assert dp.info["policy"] == "threshold" and dp.n_global > 0


def test_device_plan_short_text_and_fallbacks(plan_emu, rng):
    kw = dict(threads=32, select_threads=64)
    short = _stream(rng, [(45, 1000)])  # T < window: dense, one window over the whole text
    _same_plan(dpl.plan(short, 64, 0.8, 8, **kw), planner.plan(short, 64, 0.8, 8))
    uniform = _stream(rng, [(500, 2**17)])  # every window scores ~1: too uniform to separate
    _same_plan(dpl.plan(uniform, 64, 0.8, 8, **kw), planner.plan(uniform, 64, 0.8, 8))
    low = _stream(rng, [(200, 3), (200, 40)])  # no window reaches the threshold
    for pol in ("dense", "budget"):
        cpu = planner.plan(low, 64, 0.95, 8, policy=pol, uniform_eps=0.0)
        assert cpu.policy == f"fallback-{pol}"
        dp = dpl.plan(low, 64, 0.95, 8, policy=pol, uniform_eps=0.0, **kw)
        _same_ranked_plan(dp, cpu, low, 64, 8, dict(policy=pol, uniform_eps=0.0), threshold=0.95)


def _same_ranked_plan(dp, cpu: planner.Plan, tok, window: int, W: int, args: dict, threshold: float = 0.8,
                      rtol: float = 1e-12) -> None:
    """A percentile rule's device plan: the host ranks the device's scores (exactly ``choose_windows`` on
    them), and equals the CPU plan except for windows whose CPU score is within ``rtol`` of the CPU's cut.

    Two windows with different id-count multisets can score equal in exact arithmetic (e.g. counts {4} and
    {2, 2, 2, 2} among ones: the same sum of c log c), and each side's rounding may break that tie its own way
    (module docstring of hpczeco.daaf.device_planner)."""
    hp = dpl.host_plan(dp)
    np.testing.assert_allclose(hp.weights, cpu.weights, rtol=rtol, atol=1e-15)
    starts = planner.window_starts(len(tok), window, args.get("stride"))
    rule = {k: v for k, v in args.items() if k != "stride"}
    mine = planner.choose_windows(hp.weights, starts, len(tok), window, W, threshold, **rule)
    np.testing.assert_array_equal(hp.selected, mine.selected)
    assert hp.policy == mine.policy and hp.reason == mine.reason
    np.testing.assert_array_equal(hp.global_mask, planner._mask_of(len(tok), starts, window, hp.selected))
    gidx = _host(dp.global_idx)
    np.testing.assert_array_equal(gidx, np.flatnonzero(hp.global_mask))
    differ = np.flatnonzero(hp.selected != cpu.selected)
    if differ.size:
        assert cpu.threshold is not None, "plans differ without a percentile cut"
        near = np.abs(cpu.weights[differ] - cpu.threshold) <= rtol * abs(cpu.threshold)
        assert near.all(), (differ, cpu.weights[differ], cpu.threshold)
    else:
        _same_plan(dp, cpu, ent_rtol=rtol)


def test_device_plan_percentile_rules(plan_emu, rng):
    tok = _stream(rng, [(130, 4), (150, 3000), (90, 2), (120, 500), (61, 7)])
    kw = dict(threads=32, select_threads=64)
    for args in (dict(budget=0.3), dict(budget=0.0), dict(work_budget=0.4), dict(stride=20, budget=0.5)):
        _same_ranked_plan(dpl.plan(tok, 48, 0.8, 10, **args, **kw), planner.plan(tok, 48, 0.8, 10, **args),
                          tok, 48, 10, args)


def test_device_plan_percentile_tie_in_exact_arithmetic(plan_emu):
    """The CI case (seed 1457427625): windows 6 and 12 of a stride-20 scan hold different count multisets of
    equal exact entropy; the CPU scored them 1 ulp apart one way, the device the other way."""
    rng = np.random.default_rng(1457427625)
    tok = _stream(rng, [(130, 4), (150, 3000), (90, 2), (120, 500), (61, 7)])
    args = dict(stride=20, budget=0.5)
    cpu = planner.plan(tok, 48, 0.8, 10, **args)
    _same_ranked_plan(dpl.plan(tok, 48, 0.8, 10, **args, threads=32, select_threads=64), cpu, tok, 48, 10, args)


def test_device_plan_ties_at_the_threshold(plan_emu, rng):
    """A score equal to the threshold is chosen on both sides: all-distinct windows score exactly 1.0 and
    constant windows exactly 0.0."""
    tok = np.concatenate([np.zeros(64, np.int64), rng.permutation(5000)[:128], np.zeros(64, np.int64) + 7])
    for thr in (1.0, 0.0 + 1e-300, 0.5):
        cpu = planner.plan(tok, 32, thr, 4)
        dp = dpl.plan(tok, 32, thr, 4, threads=32, select_threads=32)
        _same_plan(dp, cpu, ent_rtol=0.0)
    assert planner.plan(tok, 32, 1.0, 4).selected.sum() == 4  # the 4 all-distinct windows


def test_permuted_windows_tie_and_rank_by_position(plan_emu, rng):
    """Windows equal up to a permutation of ids score exactly equal on each side, so a percentile rule that
    can take only some of them takes the earliest, on the device as on the CPU."""
    base = rng.integers(0, 9, 32)
    tok = np.concatenate([rng.integers(0, 2, 32)] + [rng.permutation(base) + 100 * i for i in range(6)]
                         + [rng.integers(0, 2, 32)])
    cpu = planner.plan(tok, 32, 0.8, 4, budget=3 * 32 / len(tok))
    w = planner.window_entropy(tok, 32)
    assert len(set(w[1:7].tolist())) == 1 and cpu.selected[1:4].all() and not cpu.selected[4:].any()
    _same_plan(dpl.plan(tok, 32, 0.8, 4, budget=3 * 32 / len(tok), threads=32, select_threads=32), cpu)
    d = np.asarray(dpl.window_entropy(tok, 32, threads=32))
    assert len(set(d[1:7].tolist())) == 1


def test_device_plan_bad_inputs(plan_emu):
    with pytest.raises(ValueError, match="tokens must be non-negative"):
        dpl.plan(np.array([1, -2, 3, 4]), 2, threads=32, select_threads=32)
    with pytest.raises(ValueError, match="vocab_size"):
        dpl.plan(np.arange(40), 8, vocab_size=39, threads=32, select_threads=32)
    with pytest.raises(ValueError, match="vocab_size"):  # an id in a gap between windows (stride > window)
        dpl.window_entropy(np.r_[np.zeros(5, int), 99, np.zeros(10, int)], 4, 6, vocab_size=50, threads=32)
    with pytest.raises(ValueError, match="larger than the text"):
        dpl.window_entropy(np.arange(10), 11, threads=32)
    with pytest.raises(ValueError, match="window <= "):
        dpl.plan(np.arange(10), dpl.MAX_WINDOW + 1)
    with pytest.raises(TypeError, match="tokens must hold int"):
        dpl.plan(np.array([1.5, 2.0]), 2)
    with pytest.raises(ValueError, match="tokens is empty"):
        dpl.plan(np.array([], np.int64), 2)
    with pytest.raises(ValueError, match="policy"):
        dpl.plan(np.arange(10), 2, policy="local")
    with pytest.raises(ValueError, match="threads"):
        dpl.plan(np.arange(10), 2, threads=48)


# --------------------------------------------------------------------------- device index checks (daaf_plan_index)


def test_device_index_checks(plan_emu, emu_sources, rng):
    """Device ``global_idx`` (every numpy array is a device array on the plain emulation): the one-kernel
    checks raise the host checks' errors; the mask is built on the device."""
    old = gd.RUNTIME.set(gemu.EmuRuntime(*emu_sources[0]))
    try:
        T = 30
        g = np.sort(rng.choice(T, 7, replace=False)).astype(np.int32)
        dp = gd.device_plan(g, 4, T)
        want = np.zeros(T, np.uint8)
        want[g] = 1
        np.testing.assert_array_equal(dp.gmask, want)
        assert dp.n_global == 7
        m = want.astype(bool)
        assert gd.device_plan(g, 4, T, m).n_global == 7
        with pytest.raises(ValueError, match="strictly increasing"):
            gd.device_plan(g[::-1].copy(), 4, T)
        with pytest.raises(ValueError, match=r"\[0, 30\), got \[-1, "):
            gd.device_plan(np.r_[-1, g].astype(np.int32), 4, T)
        with pytest.raises(ValueError, match=r"\[0, 30\)"):
            gd.device_plan(np.r_[g, 30].astype(np.int32), 4, T, np.r_[m, False][:T])
        bad = m.copy()
        bad[int(np.flatnonzero(~m)[0])] = True
        with pytest.raises(ValueError, match="exactly at global_idx"):
            gd.device_plan(g, 4, T, bad)
        with pytest.raises(ValueError, match="global_idx is empty"):
            gd.device_plan(np.zeros(0, np.int32), 4, T, bad)
        gd.device_plan(g[::-1].copy(), 4, T, validate=False)  # unchecked: no error
    finally:
        gd.RUNTIME.set(old)


# --------------------------------------------------------------------------- per-call API: synchronisations


def _qkv(cp, rng, T, H=1, D=16):
    host = [rng.standard_normal((1, T, H, D)).astype(np.float32) for _ in range(3)]
    return host, [cp.asarray(x) for x in host]


class _HostFlags:
    """Stand-in for hpczeco.gpu.checks.start_value_flags (its reductions are CuPy ReductionKernels): the same
    flags from the numpy mirror; reading them is one synchronisation, as on the GPU."""

    def __init__(self, cp):
        self.cp = cp

    def __call__(self, arrays, stream=None):
        from hpczeco.gpu import checks

        flags = [checks.value_flags_host(np.asarray(x), gate) for x, gate in arrays]
        cp = self.cp

        class Result:
            def result(self):
                cp.cuda.Event().synchronize()
                return flags

        return Result()


def test_daaf_attention_per_call_costs_no_synchronisation(cp, rng, monkeypatch):
    from hpczeco.gpu import checks

    from hpczeco.daaf.reference import attention_reference

    monkeypatch.setattr(checks, "start_value_flags", _HostFlags(cp))
    T, W = 40, 5
    g = np.zeros(T, bool)
    g[[3, 4, 5, 20, 21]] = True
    p = planner.plan_from_mask(g, W)
    host, (q, k, v) = _qkv(cp, rng, T)
    ref = attention_reference(*host, g, None, local_window=W)
    o = daaf.attention(q, k, v, p, check=False)  # first call: the plan's device arrays are built
    assert isinstance(o, cp.ndarray)
    np.testing.assert_allclose(np.asarray(o), ref, rtol=0, atol=1e-4)
    cp.reset()
    cp.state["strict"] = True
    for _ in range(3):
        o = daaf.attention(q, k, v, p, check=False)
    cp.state["strict"] = False
    assert cp.counts == {"sync": 0, "upload": 0}
    np.testing.assert_allclose(np.asarray(o), ref, rtol=0, atol=1e-4)
    # with the value checks: one wait for their flags per call, after the kernel is queued
    cp.reset()
    for _ in range(2):
        daaf.attention(q, k, v, p)
    assert cp.counts == {"sync": 2, "upload": 0} and cp.state["where"] == ["event.synchronize"] * 2
    bad = cp.asarray(np.where(np.arange(T)[None, :, None, None] == 7, np.nan, host[1]).astype(np.float32))
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        daaf.attention(q, bad, v, p)
    daaf.attention(q, bad, v, p, check=False)  # unchecked: no error
    daaf.exact_attention(q, k, v, check=False)  # the dense plan is cached per T as well
    cp.reset()
    e = daaf.exact_attention(q, k, v, check=False)
    assert cp.counts == {"sync": 0, "upload": 0}
    np.testing.assert_allclose(np.asarray(e), attention_reference(*host, np.ones(T, bool), None, local_window=0),
                               rtol=0, atol=1e-4)


def test_gpu_attention_per_call_synchronisations(cp, rng):
    T, W = 40, 3
    g = np.array([0, 1, 2, 17, 30, 31], np.int32)
    m = np.zeros(T, bool)
    m[g] = True
    host, (q, k, v) = _qkv(cp, rng, T)
    from hpczeco.daaf.reference import attention_reference

    ref = attention_reference(*host, m, None, local_window=W)

    def count(fn, n=3):
        fn()  # warm: a cache miss may upload (and synchronise once)
        cp.reset()
        cp.state["strict"] = True
        try:
            for _ in range(n):
                out = fn()
        finally:
            cp.state["strict"] = False
        np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=1e-4)
        return dict(cp.counts)

    none = {"sync": 0, "upload": 0}
    # host index (and host mask): checked on the host, device arrays from the content cache
    assert count(lambda: gd.attention(q, k, v, g, W, impl="simple")) == none
    assert count(lambda: gd.attention(q, k, v, list(g), W, None, m, impl="simple")) == none
    assert count(lambda: gd.attention(q, k, v, g.copy(), W, None, m.astype(np.uint8), impl="simple")) == none
    # a device plan, a Plan
    dp = gd.device_plan(g, W, T)
    assert count(lambda: gd.attention(q, k, v, None, 0, plan=dp, impl="simple")) == none
    p = planner.plan_from_mask(m, W)
    assert count(lambda: gd.attention(q, k, v, None, 0, plan=p, impl="simple")) == none
    # a device index: used in place; unchecked costs nothing, checked costs one read of the flags per call
    gdev, mdev = cp.asarray(g), cp.asarray(m)
    assert count(lambda: gd.attention(q, k, v, gdev, W, validate=False, impl="simple")) == none
    assert count(lambda: gd.attention(q, k, v, gdev, W, None, mdev, validate=False, impl="simple")) == none
    cp.reset()
    gd.attention(q, k, v, gdev, W, None, mdev, impl="simple")
    assert cp.counts == {"sync": 1, "upload": 0} and cp.state["where"] == ["get"]
    # the prepared launch itself
    pr = gd.prepare(q, k, v, g, W, impl="simple")
    assert count(pr) == none


def test_gpu_attention_bad_plans_still_raise(cp, rng):
    T = 16
    _, (q, k, v) = _qkv(cp, rng, T)
    m = np.zeros(T, bool)
    m[[2, 5]] = True
    for gi in (np.array([5, 2]), cp.asarray(np.array([5, 2], np.int32))):
        with pytest.raises(ValueError, match="strictly increasing"):
            gd.attention(q, k, v, gi, 2, impl="simple")
    for gi in (np.array([2, 16]), cp.asarray(np.array([2, 16], np.int32))):
        with pytest.raises(ValueError, match=r"\[0, 16\)"):
            gd.attention(q, k, v, gi, 2, impl="simple")
    for mm in (np.roll(m, 1), cp.asarray(np.roll(m, 1))):
        with pytest.raises(ValueError, match="exactly at global_idx"):
            gd.attention(q, k, v, np.array([2, 5]), 2, None, mm, impl="simple")
    with pytest.raises(ValueError, match="exactly at global_idx"):
        gd.attention(q, k, v, cp.asarray(np.array([2, 5], np.int32)), 2, None, cp.asarray(np.roll(m, 1)),
                     impl="simple")
    with pytest.raises(ValueError, match="shape"):
        gd.attention(q, k, v, np.array([2, 5]), 2, None, m[:-1], impl="simple")
    with pytest.raises(TypeError, match="integers"):
        gd.attention(q, k, v, np.array([2.0, 5.0]), 2, impl="simple")
    with pytest.raises(ValueError, match="plan covers T=17"):
        gd.attention(q, k, v, None, 2, plan=planner.plan_from_mask(np.zeros(17, bool), 2), impl="simple")
    with pytest.raises(TypeError, match="plan must be"):
        gd.attention(q, k, v, None, 2, plan=m, impl="simple")


def test_host_index_cache_is_by_content(cp, rng):
    """The same host index array, changed in place, gets the device arrays of its new content."""
    T = 24
    g = np.array([1, 4, 9], np.int32)
    a = gd.device_plan(g, 2, T)
    assert gd.device_plan(g.copy(), 2, T) is a
    g[1] = 5
    b = gd.device_plan(g, 2, T)
    assert b is not a and np.flatnonzero(np.asarray(b.gmask)).tolist() == [1, 5, 9]
    assert gd.device_plan(g, 3, T) is not b and gd.device_plan(g, 3, T).local_window == 3


def test_per_call_cache_cupy(cp, rng):
    """hpczeco.gpu.daaf.attention with a host index: the first call makes the plan (two uploads on the stream, no
    host synchronisation) and the launch; later calls, with other q, k, v of the same shape too (another layer),
    upload and read nothing and are served from the cache; an index changed in place is a new plan; a content first
    seen unchecked is checked when a later call asks for it."""
    from hpczeco.daaf.reference import attention_reference

    T, W = 40, 3
    g = np.array([0, 1, 2, 17, 30, 31], np.int32)
    m = np.zeros(T, bool)
    m[g] = True
    host, (q, k, v) = _qkv(cp, rng, T)
    ref = attention_reference(*host, m, None, local_window=W)
    cp.reset()
    o1 = gd.attention(q, k, v, g, W, impl="simple")
    assert cp.counts == {"sync": 0, "upload": 2} and dl.stats()["miss"] == 1  # the plan's two arrays, no wait
    np.testing.assert_allclose(np.asarray(o1), ref, rtol=0, atol=1e-4)
    host2, (q2, k2, v2) = _qkv(cp, rng, T)  # another layer: same shape, other arrays
    ref2 = attention_reference(*host2, m, None, local_window=W)
    cp.reset()
    cp.state["strict"] = True
    try:
        outs = [gd.attention(*x, g, W, impl="simple") for x in ((q, k, v), (q2, k2, v2), (q, k, v))]
        o_out = cp.asarray(np.full((1, T, 1, 16), np.nan, np.float32))
        cp.reset()
        assert gd.attention(q2, k2, v2, g, W, impl="simple", out=o_out) is o_out
    finally:
        cp.state["strict"] = False
    assert cp.counts == {"sync": 0, "upload": 0} and dl.stats() == {"hit": 4, "miss": 1, "full": 0}
    assert len({id(o) for o in (o1, *outs)}) == 4  # a new output per call
    for o, r in zip((*outs, o_out), (ref, ref2, ref, ref2)):
        np.testing.assert_allclose(np.asarray(o), r, rtol=0, atol=1e-4)
    g[3] = 18  # in place: the cached plan is not this content any more
    m2 = np.zeros(T, bool)
    m2[g] = True
    o = gd.attention(q, k, v, g, W, impl="simple")
    np.testing.assert_allclose(np.asarray(o), attention_reference(*host, m2, None, local_window=W), rtol=0, atol=1e-4)
    assert dl.stats()["miss"] == 2
    bad = np.array([9, 4], np.int32)  # unsorted: first unchecked (a launch), then checked (an error)
    gd.attention(q, k, v, bad, W, impl="simple", validate=False)
    with pytest.raises(ValueError, match="strictly increasing"):
        gd.attention(q, k, v, bad, W, impl="simple")
    with pytest.raises(ValueError, match="strictly increasing"):  # ... and on every later call
        gd.attention(q, k, v, bad, W, impl="simple")
    with pytest.raises(ValueError, match="exactly at global_idx"):  # a mask that disagrees is still checked
        gd.attention(q, k, v, g, W, None, m, impl="simple")
    o = gd.attention(q, k, v, g, W, None, m2, impl="simple")
    mm = m2.copy()
    gd.attention(q, k, v, g, W, None, mm, impl="simple")
    mm[0] = not mm[0]  # the same mask array, changed in place: checked again
    with pytest.raises(ValueError, match="exactly at global_idx"):
        gd.attention(q, k, v, g, W, None, mm, impl="simple")


def test_plan_uploaded_on_one_stream_is_ordered_on_another(cp, rng):
    """A plan uploaded without a host sync: a launch on another stream first waits for the upload's event (once)."""
    g = np.array([2, 5], np.int32)
    dp = gd.device_plan(g, 2, 16)
    ev, streams = dp._upload
    assert streams == {0}
    waited = []

    class Ext:
        def __init__(self, ptr):
            self.ptr = ptr

        def wait_event(self, e):
            waited.append((self.ptr, e))

    cuda = cp.cuda
    old = cuda.ExternalStream
    cuda.ExternalStream = Ext
    try:
        dl.order_plan(dp, 0, cp)
        dl.order_plan(dp, 7, cp)
        dl.order_plan(dp, 7, cp)
    finally:
        cuda.ExternalStream = old
    assert waited == [(7, ev)] and streams == {0, 7}


def test_launcher_parameter_block(rng):
    """The driver path of Launcher: one parameter block whose pointer slots are rewritten per call, each argument
    with its C size, launched on the given stream (a stand-in driver reads the block back)."""
    import ctypes
    from types import SimpleNamespace

    seen = []

    def launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        ptrs = (ctypes.c_void_p * 8).from_address(params)
        seen.append({"f": f, "dims": (gx, gy, gz, bx, by, bz), "smem": smem, "stream": stream, "extra": extra,
                     "u64": [ctypes.c_uint64.from_address(ptrs[i]).value for i in (0, 1, 2, 3, 4)],
                     "i32": ctypes.c_int32.from_address(ptrs[5]).value,
                     "f32": ctypes.c_float.from_address(ptrs[6]).value,
                     "map": bytes((ctypes.c_ubyte * 128).from_address(ptrs[7]))})

    class Dev(np.ndarray):
        pass

    class Rt:
        xp = SimpleNamespace(cuda=SimpleNamespace(driver=SimpleNamespace(launchKernel=launch_kernel)))

        @staticmethod
        def is_native(x):
            return isinstance(x, Dev)

        @staticmethod
        def ptr(x):
            return int(x.ctypes.data)

        def function(self, name, smem):
            assert (name, smem) == ("kern", 4096)
            return SimpleNamespace(kernel=SimpleNamespace(ptr=0xF00))

    arrays = [np.zeros(4, np.float32).view(Dev) for _ in range(5)]
    tmap = (ctypes.c_ubyte * 128)(*range(128))
    spec = dl.LaunchSpec(Rt(), "kern", (3, 2), (128,), 4096, (*arrays, np.int32(-7), np.float32(0.5), tmap),
                         retarget=lambda p, s: {7: (ctypes.c_ubyte * 128)(*[(p[0] + s + i) % 256 for i in range(128)])})
    launcher = dl.Launcher(spec)
    assert launcher.direct and launcher.spec.args[:4] == (None,) * 4  # the first call's arrays are not kept
    launcher((16, 32, 48, 64), 99)
    launcher((160, 320, 480, 640), 5)
    assert [s["u64"][:4] for s in seen] == [[16, 32, 48, 64], [160, 320, 480, 640]]
    assert all(s["u64"][4] == arrays[4].ctypes.data and s["i32"] == -7 and s["f32"] == 0.5 for s in seen)
    assert [s["stream"] for s in seen] == [99, 5] and all(s["f"] == 0xF00 and s["smem"] == 4096 for s in seen)
    assert all(s["dims"] == (3, 2, 1, 128, 1, 1) and s["extra"] == 0 for s in seen)
    assert seen[1]["map"] == bytes((160 + 5 + i) % 256 for i in range(128))


@pytest.fixture
def torch_as_cuda(cp, monkeypatch):
    """CPU tensors stand in for CUDA tensors on device 0 (stream 0) in hpczeco.gpu.daaf's torch entry points."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    monkeypatch.setattr(dl, "_torch_device", lambda x: 0)
    monkeypatch.setattr(dl, "_torch_current_device", lambda: 0)
    monkeypatch.setattr(dl, "_torch_stream", lambda dev: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bits = {torch.bfloat16: ("bfloat16", torch.int16), torch.float16: ("float16", torch.int16),
            torch.float32: (None, None)}
    monkeypatch.setattr(gd, "_torch_views", lambda q, k, v: bits[q.dtype])
    return torch


def test_per_call_cache_torch(torch_as_cuda, cp, rng):
    """attention_torch per call: after the first call of a shape and plan, no upload, no host read, a new output
    tensor each call equal to the reference; another layer's tensors reuse the launch; the forms with a Plan and a
    DevicePlan too; an index or mask changed in place is taken as new (and checked)."""
    torch = torch_as_cuda
    from hpczeco.daaf.reference import attention_reference

    T, W = 48, 4
    g = np.zeros(T, bool)
    g[[1, 2, 3, 20, 21, 40]] = True
    gidx = np.flatnonzero(g)
    mask = torch.from_numpy(g.copy())
    layers = [[torch.from_numpy(rng.standard_normal((1, T, 2, 16)).astype(np.float32)) for _ in range(3)]
              for _ in range(2)]
    refs = [attention_reference(*(x.numpy() for x in lay), g, None, local_window=W) for lay in layers]
    cp.reset()
    o = gd.attention_torch(*layers[0], gidx, W, None, mask, impl="simple")
    assert cp.counts == {"sync": 0, "upload": 2}
    np.testing.assert_allclose(o.numpy(), refs[0], rtol=0, atol=1e-4)
    plan, dplan = planner.plan_from_mask(g, W), gd.device_plan(gidx, W, T)
    for form in (dict(global_idx=gidx, is_global_query_mask=mask), dict(global_idx=None, plan=plan),
                 dict(global_idx=None, plan=dplan)):
        gd.attention_torch(*layers[0], local_window=W, impl="simple", **form)  # first call of the form
        cp.reset()
        cp.state["strict"] = True
        try:
            outs = [gd.attention_torch(*layers[i % 2], local_window=W, impl="simple", **form) for i in range(4)]
        finally:
            cp.state["strict"] = False
        assert cp.counts == {"sync": 0, "upload": 0}, form
        assert len({id(x) for x in outs}) == 4
        for i, x in enumerate(outs):
            np.testing.assert_allclose(x.numpy(), refs[i % 2], rtol=0, atol=1e-4)
    assert dl.stats()["hit"] >= 12
    mask[7] = True  # in place: checked again
    with pytest.raises(ValueError, match="exactly at global_idx"):
        gd.attention_torch(*layers[0], gidx, W, None, mask, impl="simple")
    gidx[0] = 0  # the index changed in place: a new plan, from the new content
    g2 = np.zeros(T, bool)
    g2[gidx] = True
    o = gd.attention_torch(*layers[1], gidx, W, impl="simple")
    np.testing.assert_allclose(o.numpy(), attention_reference(*(x.numpy() for x in layers[1]), g2, None,
                                                              local_window=W), rtol=0, atol=1e-4)
    # not eligible for the cache (not contiguous): the full path, the same result
    qt = layers[1][0].transpose(1, 2).contiguous().transpose(1, 2)
    full = dl.stats()["full"]
    o = gd.attention_torch(qt, *layers[1][1:], gidx, W, impl="simple")
    np.testing.assert_allclose(o.numpy(), attention_reference(*(x.numpy() for x in layers[1]), g2, None,
                                                              local_window=W), rtol=0, atol=1e-4)
    assert dl.stats()["full"] == full  # (not counted: it never reached a lookup)


def test_device_planner_reads_back_once(cp, rng):
    tok = cp.asarray(_stream(rng, [(100, 3), (90, 3000), (70, 5)]))
    cp.reset()
    dp = dpl.plan(tok, 32, 0.8, 4, threads=32, select_threads=32)
    assert cp.counts == {"sync": 1, "upload": 0}
    _same_plan(dp, planner.plan(np.asarray(tok), 32, 0.8, 4))
    cp.reset()
    dpl.plan(tok, 32, 0.8, 4, budget=0.3, threads=32, select_threads=32)  # host ranking: scores back, chosen up
    assert cp.counts == {"sync": 2 + 1, "upload": 1}  # info, scores, info again


# --------------------------------------------------------------------------- on a GPU


def _gpu_or_skip():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:
        pytest.skip(f"needs a CUDA GPU with CuPy ({type(exc).__name__}: {exc})")
    return cupy


@pytest.mark.gpu
def test_gpu_device_planner_matches_cpu_at_32k(rng):
    cupy = _gpu_or_skip()
    for vocab in (32000, 2**17):
        tok = _stream(rng, [(5000, 50), (3000, vocab), (9000, 200), (4096, vocab), (11671, 30)])
        dp = dpl.plan(cupy.asarray(tok), 512, 0.8, 128, vocab_size=vocab, n_global_before=True)
        cpu = planner.plan(tok, 512, 0.8, 128, vocab_size=vocab)
        _same_plan(dp, cpu, ent_rtol=1e-10)
        assert dp.n_global > 0


@pytest.mark.gpu
def test_gpu_per_call_equals_prepared(rng):
    cupy = _gpu_or_skip()
    T, H, D, W = 2048 + 77, 4, 128, 128
    g = np.zeros(T, bool)
    g[:300] = True
    g[1000:1100] = True
    q, k, v = (cupy.asarray(rng.standard_normal((1, T, H, D)).astype(np.float16)) for _ in range(3))
    p = planner.plan_from_mask(g, W)
    want = gd.prepare(q, k, v, np.flatnonzero(g), W)().get()
    for o in (daaf.attention(q, k, v, p), daaf.attention(q, k, v, p, check=False),
              gd.attention(q, k, v, np.flatnonzero(g), W), gd.attention(q, k, v, None, W, plan=p),
              gd.attention(q, k, v, cupy.asarray(np.flatnonzero(g).astype(np.int32)), W, validate=False)):
        np.testing.assert_array_equal(o.get(), want)
    assert math.isfinite(float(np.abs(want.astype(np.float32)).max()))


def test_planner_kernels_build_for_sm90():
    """nvcc builds gpu/daaf_plan.cu for sm_90a without spills (NVRTC compiles the same source on the GPU)."""
    from hpczeco.gpu import build as gbuild

    if gbuild.nvcc_path() is None:
        pytest.skip("nvcc not found (set NVCC=...)")
    res = gbuild.finish(gbuild.start(dk.KERNEL_SOURCE, "sm_90a", fast=True), timeout=170)
    assert res.ok, res.output[-4000:]
    assert {k.name for k in res.kernels} == set(dk.kernel_names())
    assert all(k.spill_stores == 0 for k in res.kernels), res.output


@pytest.mark.gpu
def test_gpu_torch_per_call_forms(rng):
    _gpu_or_skip()
    torch = pytest.importorskip("torch")
    T, H, D, W = 1000, 2, 64, 32
    g = np.zeros(T, bool)
    g[100:300] = True
    gidx = np.flatnonzero(g)
    q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tg = torch.from_numpy(g).cuda()
    want = gd.prepare_torch(q, k, v, gidx, W)().clone()
    p = planner.plan_from_mask(g, W)
    for o in (gd.attention_torch(q, k, v, gidx, W, None, tg), gd.attention_torch(q, k, v, gidx, W, None, tg),
              gd.attention_torch(q, k, v, None, W, plan=p), gd.attention_torch(q, k, v, None, W,
                                                                               plan=gd.device_plan(gidx, W, T))):
        assert torch.equal(o, want)
    tg[5] = True  # in place: the checked-mask cache sees the new version
    with pytest.raises(ValueError, match="exactly at global_idx"):
        gd.attention_torch(q, k, v, gidx, W, None, tg)
    tok = torch.from_numpy(_stream(rng, [(3000, 8), (1500, 2**17), (2000, 8)])).cuda()
    dp = dpl.plan_torch(tok, 512, 0.8, W)
    _same_plan(dp, planner.plan(tok.cpu().numpy(), 512, 0.8, W), ent_rtol=1e-10)
    o = gd.attention_torch(q[:, :1], k[:, :1], v[:, :1], None, W, plan=dpl.plan_torch(tok[:1], 512, 0.8, W))
    assert o.shape == (1, 1, H, D)


# --------------------------------------------------------------------------- Hopper kernels: no sync per call

HOPPER_FAULTS = Path(__file__).resolve().parent / "daaf_hopper_faults.cu"


@pytest.fixture(scope="module")
def hopper_sources():
    """gpu/daaf.py's kernels (all of them: tc2 is "auto"'s window kernel) and the Hopper kernels (the build of
    tests/test_daaf_hopper_emu.py, so the compiled library is shared)."""
    if gemu.compiler() is None:
        pytest.skip("g++ not found: the CPU emulation of the kernels needs it")
    from hpczeco.gpu import daaf_hopper as dh

    return ((gd.KERNELS.source(), gd.kernel_names()),
            (dh.KERNELS.source() + "\n" + HOPPER_FAULTS.read_text(), [*dh.GROUPS, "daaf_wgmma_fault_check"]))


@pytest.fixture
def cph(cp, hopper_sources, monkeypatch):
    """The counting CuPy with the Hopper kernels behind gpu/daaf.py, on a device that says compute capability
    9.0 (the ``cp`` fixture's runtimes otherwise)."""
    from hpczeco.gpu import daaf_hopper as dh

    rt = _CountingEmu(*hopper_sources[0], cp)
    rt.compute_capability = "90"
    old_a = gd.RUNTIME.set(rt)
    old_h = dh.RUNTIME.set(_CountingEmu(*hopper_sources[1], cp))
    # "auto" with the table of the wgmma kernels (hws/hwg3: their emulation is quick); the FA3-design kernel that
    # "auto" takes for key regions now has its own per-call test (test_hfa3_per_call)
    monkeypatch.setitem(dh.AUTO_IMPLS, "one_span", "hwg3")
    monkeypatch.setitem(dh.AUTO_IMPLS, "key_regions", "hws")
    yield cp
    gd.RUNTIME.set(old_a)
    dh.RUNTIME.set(old_h)


def _bf16_qkv(cp, rng, T, H=1, D=128):
    from hpczeco.base import bf16

    bits = [bf16.to_bits(rng.standard_normal((1, T, H, D)).astype(np.float32)) for _ in range(3)]
    return [bf16.from_bits(b) for b in bits], [cp.asarray(b) for b in bits]


def test_hopper_per_call_costs_no_synchronisation(cph, rng):
    """Every per-call form on the Hopper kernels ("auto" and named) reads nothing back and uploads nothing once
    its plan exists; "auto" picks from the plan's host metadata (one span: hwg3; several: hws; none: hwin)."""
    from hpczeco.base import bf16

    from hpczeco.daaf.reference import attention_reference

    cp = cph
    T, W = 72, 8
    host, (q, k, v) = _bf16_qkv(cp, rng, T)
    sb = dict(storage="bfloat16")

    def check(prepare, g, want_impl, n=2):
        prepare()()  # warm: a cache miss may upload (and synchronise once)
        cp.reset()
        cp.state["strict"] = True
        try:
            for _ in range(n):  # one call = prepare + launch
                p = prepare()
                o = p()
        finally:
            cp.state["strict"] = False
        assert cp.counts == {"sync": 0, "upload": 0}, (want_impl, cp.state["where"])
        assert p.impl == want_impl
        ref = attention_reference(*host, g, None, local_window=W)
        assert rel_max(bf16.from_bits(np.asarray(o)), ref) <= 1e-2, want_impl

    lead = np.zeros(T, bool)
    lead[:20] = True
    two = np.zeros(T, bool)
    two[[*range(10, 18), *range(40, 52)]] = True
    for g, want in ((lead, "hwg3"), (two, "hws"), (np.zeros(T, bool), "hwin")):
        gi = np.flatnonzero(g).astype(np.int32)
        check(lambda gi=gi: gd.prepare(q, k, v, gi, W, **sb), g, want)  # host index: checked on the host
        check(lambda gi=gi, g=g: gd.prepare(q, k, v, gi, W, None, g, **sb), g, want)
        dp = gd.device_plan(gi, W, T)
        check(lambda dp=dp: gd.prepare(q, k, v, None, 0, plan=dp, **sb), g, want)
        p = planner.plan_from_mask(g, W)
        check(lambda p=p: gd.prepare(q, k, v, None, 0, plan=p, **sb), g, want)
    gi = np.flatnonzero(two).astype(np.int32)
    for impl in ("hwg", "hwg3", "hfa2"):  # named kernels: the same costs
        check(lambda impl=impl: gd.prepare(q, k, v, gi, W, impl=impl, **sb), two, impl, n=1)
    # a device index without checks: used in place, no read; its spans are unknown on the host -> hws
    gdev = cp.asarray(np.flatnonzero(lead).astype(np.int32))
    check(lambda: gd.prepare(q, k, v, gdev, W, validate=False, **sb), lead, "hws")


def test_hopper_auto_on_the_device_planner(cph, rng):
    """The device planner's plan (one read back, when it is made) carries the span count "auto" needs: no
    read per call after it."""
    from hpczeco.base import bf16

    from hpczeco.daaf.reference import attention_reference

    cp = cph
    T, W = 96, 8
    tok = cp.asarray(_stream(rng, [(32, 3), (32, 5000), (32, 2)]))
    cp.reset()
    dp = dpl.plan(tok, 32, 0.8, W, threads=32, select_threads=32)
    assert cp.counts["sync"] == 1 and dp.n_regions == 1 and dp.n_global == 32
    host, (q, k, v) = _bf16_qkv(cp, rng, T)
    cp.reset()
    cp.state["strict"] = True
    try:
        p = gd.prepare(q, k, v, None, 0, plan=dp, storage="bfloat16")
        o = p()
    finally:
        cp.state["strict"] = False
    assert cp.counts == {"sync": 0, "upload": 0} and (p.impl, p.sched) == ("hwg3", gd.AUTO_SCHED)
    g = np.asarray(dp.gmask).astype(bool)
    ref = attention_reference(*host, g, None, local_window=W)
    assert rel_max(bf16.from_bits(np.asarray(o)), ref) <= 1e-2


@pytest.fixture(scope="module")
def fa3_sources():
    """The FA3-design kernels (the build of tests/test_daaf_fa3_emu.py, so the compiled library is shared)."""
    if gemu.compiler() is None:
        pytest.skip("g++ not found: the CPU emulation of the kernels needs it")
    from hpczeco.gpu import daaf_fa3 as fa3

    faults = Path(__file__).resolve().parent / "daaf_fa3_faults.cu"
    return fa3.KERNELS.source() + "\n" + faults.read_text(), [*fa3.kernel_names(), "daaf_tma_fault_check"]


def test_hfa3_per_call(cph, fa3_sources, rng, monkeypatch):
    """The FA3-design kernel through hpczeco.gpu.daaf: impl="hfa3" by name and "auto" at D = 256 (its only
    tensor-core kernel) pick it; per call after the first no upload and no host read, the tensor maps follow the
    new arrays, the queue is left at zero; bf16 and f16 against the reference."""
    from hpczeco.base import bf16
    from hpczeco.gpu import daaf_fa3 as fa3

    from hpczeco.daaf.reference import attention_reference

    cp = cph
    rt = _CountingEmu(*fa3_sources, cp)
    old = fa3.RUNTIME.set(rt)
    try:
        T, W = 150, 8
        g = np.zeros(T, bool)
        g[[3, 4, 5, 6, 40, 41, 90]] = True
        gi = np.flatnonzero(g).astype(np.int32)
        for D, elem, impl, want in ((128, "bf16", "hfa3", "hfa3"), (256, "f16", "auto", "hfa3"),
                                    (64, "bf16", "hfa3p", "hfa3p")):
            storage = "bfloat16" if elem == "bf16" else "float16"

            def qkv(D=D, elem=elem):
                x = [rng.standard_normal((1, T, 1, D)).astype(np.float32) for _ in range(3)]
                bits = [bf16.to_bits(a) if elem == "bf16" else a.astype(np.float16).view(np.uint16) for a in x]
                vals = [bf16.from_bits(b) if elem == "bf16" else b.view(np.float16).astype(np.float32) for b in bits]
                return vals, [cp.asarray(b) for b in bits]

            layers = [qkv() for _ in range(2)]
            gd.attention(*layers[0][1], gi, W, impl=impl, storage=storage)  # the first call: plan, launch
            cp.reset()
            cp.state["strict"] = True
            try:
                outs = [gd.attention(*layers[i % 2][1], gi, W, impl=impl, storage=storage) for i in range(3)]
            finally:
                cp.state["strict"] = False
            assert cp.counts == {"sync": 0, "upload": 0}, (D, cp.state["where"])
            for i, o in enumerate(outs):
                got = bf16.from_bits(np.asarray(o)) if elem == "bf16" else np.asarray(o).view(np.float16)
                ref = attention_reference(*layers[i % 2][0], g, None, local_window=W)
                assert rel_max(got.astype(np.float32), ref) <= 1e-2, (D, elem, i)
            p = gd.prepare(*layers[0][1], gi, W, impl=impl, storage=storage)
            assert p.impl == want and p.name == fa3.kernel_name(want, elem, D)
        assert all(np.asarray(qa).tolist() == [0, 0] for qa in fa3._QUEUES.values())
        assert sum(name.startswith("daaf_hfa3") for name in rt.launched) >= 12
    finally:
        fa3.RUNTIME.set(old)
