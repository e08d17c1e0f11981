"""DAAF attention on GPUs: gpu/daaf_attention.cu, gpu/daaf.py, gpu/daaf_numba.py.

Without a GPU: the CUDA source builds for sm_90 with nvcc (registers/spills checked); the kernels run
on the CPU through the wrappers of gpu/daaf.py on the CUDA emulation (gpu/emu: every CUDA thread a
std::thread, PTX fragment layouts emulated) against the float64 reference (hpczeco.daaf.reference);
the Numba planning kernels run under the CUDA simulator (a subprocess with NUMBA_ENABLE_CUDASIM=1)
against numpy and the CPU planner. With a GPU (marked
``gpu``): every kernel family against the float64 reference, and input validation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import daaf_inputs, rel_max
from hpczeco.base import bf16
from hpczeco.gpu import daaf as gd
from hpczeco.gpu import emu as gemu

from hpczeco.daaf.reference import attention_reference


def reference_attention(q, k, v, global_mask, local_window, scale=None):
    """The float64 DAAF reference for a key-region mask ``[T]``."""
    return attention_reference(q, k, v, global_mask, scale, local_window=local_window)

GPU_DIR = Path(gd.__file__).resolve().parent
SRC = GPU_DIR / "daaf_attention.cu"
TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 1e-2}


def _nvcc() -> str | None:
    for c in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if c and Path(c).exists():
            return c
    return None


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


def test_window_starts_match_planner():
    planner = pytest.importorskip("hpczeco.daaf.planner")
    dn = pytest.importorskip("hpczeco.gpu.daaf_numba")
    for T, w, s in ((1000, 512, None), (1000, 100, 33), (512, 512, None), (777, 1, 5)):
        np.testing.assert_array_equal(dn.window_starts(T, w, s), planner.window_starts(T, w, s))


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


# --------------------------------------------------------------------------- nvcc build for sm_90


@pytest.fixture(scope="module", autouse=True)
def nvcc_build(tmp_path_factory):
    """Start the sm_90 build at module setup, in the background (the emulation tests run meanwhile)."""
    nvcc = _nvcc()
    if nvcc is None:
        yield None
        return
    out = tmp_path_factory.mktemp("nvcc") / "daaf.o"
    proc = subprocess.Popen([nvcc, "-arch=sm_90", "-std=c++17", "-c", "-Xptxas", "-v", str(SRC), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_nvcc_builds_sm90(nvcc_build):
    if nvcc_build is None:
        pytest.skip("nvcc not found (set NVCC=...)")
    _, err = nvcc_build.communicate(timeout=170)
    assert nvcc_build.returncode == 0, err[-4000:]
    report = {}
    cur = None
    for line in err.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
            report[cur] = {}
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and cur:
            report[cur]["spill"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            report[cur]["regs"] = int(m.group(1))
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

    rt = gemu.EmuRuntime(gd.kernel_source(), gd.kernel_names())
    old = gd._set_runtime(rt)
    old_plan = dpl._set_runtime(gemu.EmuRuntime(dpl.kernel_source(), dpl.kernel_names()))
    old_threads, dpl.INDEX_THREADS = dpl.INDEX_THREADS, 64
    yield rt
    gd._set_runtime(old)
    dpl._set_runtime(old_plan)
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


# --------------------------------------------------------------------------- Numba kernels under the CUDA simulator

_SIM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from hpczeco.gpu import daaf_numba as dn
    from hpczeco.daaf import planner
    assert dn.SIMULATOR
    rng = np.random.default_rng(int(sys.argv[1]))
    out = {}
    T = 260
    tok = np.concatenate([rng.integers(0, 4, 90), rng.integers(0, 3000, 110), rng.integers(0, 6, 60)])  # [128,192) high
    for w, s, V, bias in ((64, None, None, "none"), (50, 47, 4000, "miller-madow"), (260, None, 3000, "none")):
        a = dn.window_entropy(tok, w, s, V, bias)
        b = planner.window_entropy(tok, w, s, V, bias)
        out[f"entropy {w} {s} {V} {bias}"] = float(np.abs(a - b).max()) if a.shape == b.shape else 1e9
    st = dn.window_starts(T, 64, 32)
    ch = rng.random(len(st)) < 0.4
    m = dn.windows_to_mask(T, st, ch, 64).astype(bool)
    out["windows_to_mask"] = int((m != planner._mask_of(T, st, 64, ch)).sum())
    for n in (1, 63, 64, 65, 150):
        g = rng.random(n) < 0.3
        idx, before = dn.mask_to_index(g)
        ok = np.array_equal(idx, np.flatnonzero(g)) and np.array_equal(before, np.concatenate([[0], np.cumsum(g)]))
        out[f"mask_to_index {n}"] = int(not ok)
    p = dn.threshold_plan(tok, 64, 0.8, 16)
    cpu = planner.plan(tok, 64, 0.8, 16)
    out["threshold_plan policy"] = cpu.policy
    out["threshold_plan"] = int((p["global_mask"] != cpu.global_mask).sum())
    print(json.dumps(out))
    """
)


def test_numba_planning_kernels_under_cudasim(rng, tmp_path):
    pytest.importorskip("numba")
    pytest.importorskip("hpczeco.daaf.planner")
    script = tmp_path / "sim.py"
    script.write_text(_SIM_SCRIPT)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    seed = int(rng.integers(0, 2**31))
    r = subprocess.run([sys.executable, str(script), str(seed)], capture_output=True, text=True, timeout=170, env=env)
    assert r.returncode == 0, f"seed {seed}: {r.stderr[-4000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for key, val in res.items():
        if key.startswith("entropy"):
            assert val < 1e-12, (seed, key, val, res)
        elif key == "threshold_plan policy":
            assert val == "threshold", (seed, res)
        else:
            assert val == 0, (seed, key, val, res)


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
