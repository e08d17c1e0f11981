"""The DAAF GPU kernels (:mod:`hpczeco.gpu.daaf`, the device planner :mod:`hpczeco.daaf.device_planner`) at the
shapes the GPU machine
runs: every kernel family (simple, tc, tc2, tc3; on compute capability 9.0 the Hopper kernels through
``hpczeco.gpu.daaf``, also against tc2, and what ``impl="auto"`` picks) in fp32/fp16/bf16 against the float64 reference
(``hpczeco.daaf.reference``) on small random inputs over several T, local windows and key-region sets;
the device planner's entropy scan, key-region index and threshold plan against the CPU planner; medium T against
PyTorch SDPA with an explicit boolean mask; the benchmark's plans against FlexAttention; the device plan
of a synthetic text finding its planted key regions; needles planted in key regions retrieved.

All marked ``gpu`` (CuPy and a CUDA GPU; PyTorch where SDPA, FlexAttention or the needles need it), skipped
with a reason elsewhere. The kernels' CPU emulation runs in tests/test_gpu_daaf.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import daaf_inputs, rel_max
from hpczeco.base import bf16
from hpczeco.base.backend import cupy_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA GPU")]

TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 1e-2}


def global_set(T: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """bool [T]: "none", "regions" (two spans), "scatter" (~10 % random tokens), "all", "first70"."""
    g = np.zeros(T, dtype=bool)
    if kind == "all":
        g[:] = True
    elif kind == "regions":
        g[T // 5 : T // 5 + max(1, T // 8)] = True
        g[T // 2 + 3 : T // 2 + 3 + max(1, T // 10)] = True
    elif kind == "scatter":
        g[rng.random(T) < 0.1] = True
    elif kind == "first70":
        g[: min(T, 70)] = True
    elif kind != "none":
        raise ValueError(kind)
    return g


def kernel_cases() -> list[tuple]:
    """(impl, elem, B, T, H, D, Dv, W, key-region set): every family, dtype, several T, windows and sets."""
    Ts = (1, 63, 64, 65, 200, 700)
    kinds = ("none", "regions", "scatter", "all", "first70")
    Ws = (0, 1, 16, 128, 10**6)
    out = []
    for i, T in enumerate(Ts):  # the simple kernel: every dtype, odd head dims too
        for elem in ("f32", "f16", "bf16"):
            j = (i + len(elem)) % len(Ws)
            out.append(("simple", elem, 2, T, 3, 40 if elem == "f32" else 64, 24 if elem == "f32" else 64, Ws[j],
                        kinds[j]))
    out.append(("simple", "f32", 1, 300, 2, 128, 128, 128, "regions"))
    for impl in ("tc", "tc2", "tc3"):  # tensor cores: both dtypes, D = 64 and 128 (tc3: 128), every set
        n = 0
        for T in Ts:
            for kind in kinds:
                for D in (128,) if impl == "tc3" else (64, 128):
                    out.append((impl, ("bf16", "f16")[n % 2], 2 if T < 500 else 1, T, 2, D, D, Ws[n % len(Ws)], kind))
                    n += 1
    return out


KERNEL_CASES = kernel_cases()


def _is_hopper_impl(impl: str) -> bool:
    from hpczeco.gpu import daaf as gd

    return impl not in gd.IMPLS


def _hopper_or_skip() -> None:
    """Skip unless the current device is compute capability 9.0 (the Hopper kernels are sm_90a cubins)."""
    from hpczeco.gpu import daaf as gd

    cc = gd.compute_capability()
    if cc != gd.HOPPER_CC:
        pytest.skip(f"the Hopper kernels need compute capability 9.0, this device is {cc}")


def hopper_cases() -> list[tuple]:
    """(impl, elem, B, T, H, D, W, key-region set): each Hopper variant on each dtype and D it has, over T,
    windows and key-region sets (fewer per variant than the tc families: every variant shares its loops)."""
    from hpczeco.gpu import daaf_hopper as dh

    Ts = (1, 63, 64, 65, 200, 700)
    kinds = ("none", "regions", "scatter", "all", "first70")
    Ws = (0, 1, 16, 128, 10**6)
    out = []
    n = 0
    for impl, var in dh.VARIANTS.items():
        for elem in var.elems:
            for D in var.dims:
                for T in Ts:
                    W, kind = Ws[n % len(Ws)], kinds[n % len(kinds)]
                    if var.kind == "win":  # the window kernels: plans without key regions, local_window <= 128
                        W, kind = min(W, dh.WIN_MAX_WINDOW), "none"
                    out.append((impl, elem, 2 if T < 500 else 1, T, 2, D, W, kind))
                    n += 1
    return out


HOPPER_CASES = hopper_cases()


@pytest.mark.parametrize("impl,elem,B,T,H,D,W,kind", HOPPER_CASES,
                         ids=["{}-{}-B{}T{}H{}D{}W{}-{}".format(*c) for c in HOPPER_CASES])
def test_hopper_kernel_matches_reference(rng, impl, elem, B, T, H, D, W, kind):
    """The Hopper kernels named through hpczeco.gpu.daaf.attention: the float64 reference, and tc2 on the same
    inputs (two bf16/fp16 kernels: within twice the tolerance of each other)."""
    _hopper_or_skip()
    import cupy as cp
    from hpczeco.gpu import daaf as gd

    from hpczeco.daaf.reference import attention_reference

    q, k, v = daaf_inputs(rng, B, T, H, D)
    g = global_set(T, kind, rng)
    if elem == "bf16":
        hq, hk, hv = bf16.to_bits(q), bf16.to_bits(k), bf16.to_bits(v)
        fq, fk, fv = bf16.from_bits(hq), bf16.from_bits(hk), bf16.from_bits(hv)
    else:
        hq, hk, hv = (x.astype(np.float16).view(np.uint16) for x in (q, k, v))
        fq, fk, fv = (x.view(np.float16).astype(np.float32) for x in (hq, hk, hv))
    storage = "bfloat16" if elem == "bf16" else "float16"
    args = (cp.asarray(hq), cp.asarray(hk), cp.asarray(hv), np.flatnonzero(g).astype(np.int32), W, None,
            cp.asarray(g))
    p = gd.prepare(*args, impl=impl, storage=storage)
    assert p.impl == impl and p.sched == gd.AUTO_SCHED
    o = p().get()
    ref_tc2 = gd.attention(*args, impl="tc2", storage=storage).get()
    val = (lambda x: bf16.from_bits(x)) if elem == "bf16" else (lambda x: x.view(np.float16).astype(np.float32))
    err = rel_max(val(o), attention_reference(fq, fk, fv, g, local_window=W))
    assert err <= TOL[elem], f"max rel err {err:.3g} > {TOL[elem]}"
    assert rel_max(val(o), val(ref_tc2)) <= 2 * TOL[elem]


def test_auto_picks_by_plan_on_hopper(rng):
    """impl="auto" at the benchmark's plans: what gd.auto_choice says for the plan (without choose_impl in
    gpu/daaf_hopper.py: tc2 for the window alone, hwg3 for the leading block, hwg64 for 8 regions); the output
    equals the named kernel's."""
    _hopper_or_skip()
    torch = _torch()
    from hpczeco.drivers.gpu_daaf_model import bench_plans
    from hpczeco.gpu import daaf as gd
    from hpczeco.gpu import daaf_hopper as dh

    T, H, D, W = 8192, 4, 128, 128
    q, k, v = (torch.randn(1, T, H, D, device="cuda").to(torch.bfloat16) for _ in range(3))
    rule = {"w128": "tc2", "w128+first4096": "hwg3", "w128+8x512": "hwg64"}
    for pname, g in bench_plans(T).items():
        gidx = np.flatnonzero(g).astype(np.int32)
        dp = gd.device_plan(gidx, W, T)
        want = gd.auto_choice("bf16", D, D, dp, "90")
        if not hasattr(dh, "choose_impl"):
            assert want[0] == rule[pname], (pname, want)
        p = gd.prepare_torch(q, k, v, None, W, plan=dp)
        assert (p.impl, p.sched) == want, pname
        named = gd.attention_torch(q, k, v, None, W, plan=dp, impl=want[0])
        assert torch.equal(p(), named), pname


@pytest.mark.parametrize("impl,elem,B,T,H,D,Dv,W,kind", KERNEL_CASES,
                         ids=["{}-{}-B{}T{}H{}D{}Dv{}W{}-{}".format(*c) for c in KERNEL_CASES])
def test_kernel_matches_reference(rng, impl, elem, B, T, H, D, Dv, W, kind):
    import cupy as cp
    from hpczeco.gpu import daaf as gd

    from hpczeco.daaf.reference import attention_reference

    q, k, v = daaf_inputs(rng, B, T, H, D, Dv)
    g = global_set(T, kind, rng)
    if elem == "bf16":
        hq, hk, hv = bf16.to_bits(q), bf16.to_bits(k), bf16.to_bits(v)
        fq, fk, fv = bf16.from_bits(hq), bf16.from_bits(hk), bf16.from_bits(hv)
        storage = "bfloat16"
    elif elem == "f16":
        hq, hk, hv = q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
        fq, fk, fv = hq.astype(np.float32), hk.astype(np.float32), hv.astype(np.float32)
        storage = None
    else:
        hq, hk, hv, fq, fk, fv = q, k, v, q, k, v
        storage = None
    o = gd.attention(cp.asarray(hq), cp.asarray(hk), cp.asarray(hv), np.flatnonzero(g).astype(np.int32), W, None,
                     cp.asarray(g), impl=impl, storage=storage).get()
    of = bf16.from_bits(o) if elem == "bf16" else o.astype(np.float32)
    err = rel_max(of, attention_reference(fq, fk, fv, g, local_window=W))
    assert err <= TOL[elem], f"max rel err {err:.3g} > {TOL[elem]}"


def test_kernel_info_reports_every_kernel():
    """The RawModule builds; every kernel reports its registers, spills and shared memory."""
    from hpczeco.gpu import daaf as gd

    info = gd.kernel_info()
    assert set(info) == set(gd.kernel_names())
    for name, d in info.items():
        assert 0 < d["num_regs"] <= 255, (name, d)
        assert d["max_threads_per_block"] >= 128, (name, d)


# --------------------------------------------------------------------------- the device planner


def _tokens(rng) -> np.ndarray:
    tok = rng.integers(0, 16, 20000)
    for s in (3000, 9000, 15000):
        tok[s : s + 1024] = rng.integers(0, 32768, 1024)
    return tok


@pytest.mark.parametrize("window,stride,vocab,bias,mod", [(512, None, 32768, "none", None),
                                                          (512, 128, None, "miller-madow", None),
                                                          (2048, 700, 40000, "none", None),
                                                          (64, 64, None, "none", None),
                                                          (64, 50, 16, "none", 16)])
def test_window_entropy_matches_cpu_planner(rng, window, stride, vocab, bias, mod):
    import cupy as cp

    from hpczeco.daaf import device_planner, planner

    tok = _tokens(rng)
    ids = tok if mod is None else tok % mod
    dev = cp.asnumpy(device_planner.window_entropy(cp.asarray(ids), window, stride, vocab, bias))
    ref = planner.window_entropy(ids, window, stride, vocab, bias)
    assert dev.shape == ref.shape
    assert float(np.abs(dev - ref).max()) <= 1e-9


def test_threshold_plan_matches_cpu_plan(rng):
    """The device plan's mask, its compaction to ``global_idx`` and ``n_global_before`` equal the CPU plan's."""
    import cupy as cp

    from hpczeco.daaf import device_planner, planner

    tok = _tokens(rng)
    dp = device_planner.plan(cp.asarray(tok), 512, 0.8, 128, n_global_before=True)
    cpu = planner.plan(tok, 512, 0.8, 128)
    assert cpu.policy == "threshold" and dp.info["policy"] == "threshold"
    g = cp.asnumpy(dp.gmask).astype(bool)
    assert int((g != cpu.global_mask).sum()) == 0
    np.testing.assert_array_equal(cp.asnumpy(dp.global_idx), np.flatnonzero(cpu.global_mask))
    np.testing.assert_array_equal(cp.asnumpy(dp.info["n_global_before"]), np.concatenate([[0], np.cumsum(g)]))


# --------------------------------------------------------------------------- PyTorch comparisons


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


SDPA_CASES = [(4096, 8, "regions", 128), (8192, 4, "first4096", 128), (16384, 2, "8x512", 64)]


@pytest.mark.parametrize("impl,elem", [("simple", "f32"), ("simple", "bf16"), ("tc", "bf16"), ("tc2", "bf16"),
                                       ("tc3", "bf16"), ("auto", "bf16"), ("hwg", "bf16"), ("hwg64", "bf16"),
                                       ("hwg3", "bf16"), ("hfa2", "bf16")])
@pytest.mark.parametrize("T,H,kind,W", SDPA_CASES)
def test_kernel_matches_sdpa_with_boolean_mask(rng, T, H, kind, W, impl, elem):
    """Medium T against PyTorch SDPA in fp32 with the DAAF rule as an explicit boolean mask."""
    torch = _torch()
    if _is_hopper_impl(impl):
        _hopper_or_skip()
    from hpczeco.drivers.gpu_daaf_model import allowed_mask_torch, bench_plans
    from hpczeco.gpu import daaf as gd

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if kind == "regions":
        g = global_set(T, "regions", rng)
    elif kind == "first4096":
        g = np.zeros(T, dtype=bool)
        g[:4096] = True
    else:
        g = bench_plans(T)["w128+8x512"]
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    q = torch.randn(1, T, H, 128, device="cuda", generator=gen) * 1.5
    k = torch.randn(1, T, H, 128, device="cuda", generator=gen)
    v = torch.randn(1, T, H, 128, device="cuda", generator=gen)
    dt = torch.float32 if elem == "f32" else torch.bfloat16
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    gt = torch.from_numpy(g).cuda()
    o = gd.attention_torch(q, k, v, np.flatnonzero(g).astype(np.int32), W, None, gt, impl=impl)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=allowed_mask_torch(gt, W)[None, None]).transpose(1, 2)
    err = float((o.float() - ref).abs().max() / ref.abs().max())
    assert err <= TOL[elem], f"max rel err {err:.3g} > {TOL[elem]}"


@pytest.mark.parametrize("impl", ["simple", "tc", "tc2", "tc3", "auto", "hwg", "hwg64", "hwg3", "hfa2"])
def test_bench_plans_match_flex_attention(rng, impl):
    """The timed plans of `hpczeco bench gpu-daaf` at T = 8192: DAAF output vs FlexAttention's (both bf16)."""
    torch = _torch()
    if _is_hopper_impl(impl):
        _hopper_or_skip()
    pytest.importorskip("torch.nn.attention.flex_attention")
    from hpczeco.drivers.gpu_daaf_model import bench_plans, make_flex
    from hpczeco.gpu import daaf as gd

    T, H, D, W = 8192, 16, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    flex, block_mask = make_flex(T, W)
    for pname, g in bench_plans(T).items():
        if impl == "simple" and g.any():
            continue  # the warp-per-row kernel: too slow for long key-region rows (checked at small T above)
        o = gd.attention_torch(q, k, v, np.flatnonzero(g).astype(np.int32), W, None, torch.from_numpy(g).cuda(),
                               impl=impl)
        fo = flex(qh, kh, vh, block_mask=block_mask(g)).transpose(1, 2).float()
        err = float((o.float() - fo).abs().max() / fo.abs().max())
        assert err <= 2e-2, f"{pname}: max rel diff {err:.3g}"


@pytest.mark.parametrize("T", [8192, 32768, 131072])
def test_device_plan_finds_planted_key_regions(rng, T):
    """The device planner's plan of a synthetic text marks exactly its high-entropy regions."""
    import cupy as cp
    from hpczeco.drivers.gpu_daaf_model import synthetic_tokens

    from hpczeco.daaf import device_planner

    W = 128
    tok, regions = synthetic_tokens(T, rng)
    dp = device_planner.plan(cp.asarray(tok), 512, 0.8, W)
    expect = np.zeros(T, dtype=bool)
    for a, b in regions:
        expect[a:b] = True
    assert int((cp.asnumpy(dp.gmask).astype(bool) != expect).sum()) == 0


@pytest.mark.parametrize("T,impl", [(8192, "tc"), (32768, "tc"), (131072, "tc"), (32768, "tc2"), (32768, "tc3"),
                                    (8192, "auto"), (32768, "auto"), (131072, "auto"), (32768, "hwg64"),
                                    (32768, "hwg3")])
def test_needles_in_key_regions_are_retrieved(rng, T, impl):
    """A key/value planted in each key region is returned, in every head, to the query that matches it."""
    torch = _torch()
    if _is_hopper_impl(impl):
        _hopper_or_skip()
    from hpczeco.drivers.gpu_daaf_model import needle_rates, synthetic_tokens

    torch.manual_seed(int(rng.integers(2**31)))  # the needles' q, k, v come from torch's generator
    _, regions = synthetic_tokens(T, rng)
    res = needle_rates(T, regions, impl, 16, 128)
    assert res["needle_daaf_key_pct"] == 100.0, res
