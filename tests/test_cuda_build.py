"""GPU code checked without a GPU.

1. every ``gpu/*.cu`` compiles with nvcc for sm_90 (``-c``, one instantiation per template; skipped with
   a reason where nvcc is missing);
2. the GLA kernels run in the CPU emulation of the CUDA model (``gpu/emu``) through the very wrappers
   of :mod:`hpczeco.gpu.gla`, against the float64 references on fresh random inputs (skipped where g++
   is missing): simt forward/backward (fp32, partial chunks, K and V off the tile sizes, initial state,
   dht, strong decays), the ZeCO pieces (simt and tensor cores);
3. the host side of the kernels: shared-memory layouts, compile groups, the nvcc cache, the CuPy runtime.

The Numba CUDA kernels (the float64 path) run under the CUDA simulator in tests/test_gla_numba.py.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import gla_inputs, rel
from hpczeco.base import bf16
from hpczeco.gpu import build as gbuild
from hpczeco.gpu import emu as gemu
from hpczeco.gpu import gla as ggla
from hpczeco.gpu import runtime as gruntime

from hpczeco.gla import recurrent_gla, recurrent_gla_bwd

pytestmark = pytest.mark.emulation  # the CPU emulation of the CUDA kernels: no MPI in it

NVCC = gbuild.nvcc_path()
CXX = gemu.compiler()


@pytest.fixture(scope="module")
def nvcc_jobs():
    """nvcc compiles started in the background (they overlap with the emulation build)."""
    if NVCC is None:
        return None
    return {p.name: gbuild.start(p, "sm_90", fast=True) for p in gbuild.cu_files()}


@pytest.fixture(scope="module")
def emu_rt(nvcc_jobs):
    if CXX is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulation")
    names = [n for n in ggla.kernel_names() if not re.search(r"(?<!b)f16", n)]  # float + bf16 (fp16: on the GPU)
    rt = gemu.EmuRuntime(ggla.KERNELS.source(), names)
    old = ggla.RUNTIME.set(rt)
    yield rt
    ggla.RUNTIME.set(old)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA compile check skipped")
@pytest.mark.parametrize("name", [p.name for p in gbuild.cu_files()])
def test_nvcc_compiles(nvcc_jobs, name):
    res = gbuild.finish(nvcc_jobs[name], timeout=170)
    assert res.ok, f"{' '.join(res.cmd)}\n{res.output[-3000:]}"
    if name.startswith("gla"):
        assert res.kernels, "ptxas reported no kernels"
        for k in res.kernels:  # no register array fell into local memory in the GLA kernels
            assert k.spill_stores <= 64, f"{k.name}: {k.spill_stores} bytes of spill stores"


def test_emulated_simt_forward_backward(emu_rt, rng):
    B, T, H, K, V, C = 1, 70, 2, 40, 24, 32
    q, k, v, g, do, h0, dht = gla_inputs(rng, B, T, H, K, V, strong=True)
    o, ht = ggla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=C)
    f64 = lambda *xs: [x.astype(np.float64) for x in xs]
    ro, rht = recurrent_gla(*f64(q, k, v, g), initial_state=h0.astype(np.float64), output_final_state=True)
    assert o.dtype == np.float32 and ht.dtype == np.float32
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    grads = ggla.chunk_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht, chunk_size=C)
    ref = recurrent_gla_bwd(*f64(q, k, v, g, do), initial_state=h0.astype(np.float64), dht=dht.astype(np.float64))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), grads, ref):
        assert rel(a, b) < 1e-5, f"{name}: rel err {rel(a, b):.2e}"
    # no initial state, no dht, bf16 (uint16 bits), chunk 64 with a partial chunk
    T = 67
    q, k, v, g, do, _, _ = gla_inputs(rng, B, T, 1, 36, 20)
    Q, Kk, Vv, G, DO = (bf16.to_bits(x) for x in (q, k, v, g, do))
    q, k, v, g, do = (bf16.from_bits(x) for x in (Q, Kk, Vv, G, DO))
    o, _ = ggla.chunk_gla(Q, Kk, Vv, G, impl="simt")
    assert o.dtype == np.uint16
    assert rel(bf16.from_bits(o), recurrent_gla(*f64(q, k, v, g))[0]) < 5e-3
    grads = ggla.chunk_gla_bwd(Q, Kk, Vv, G, DO)
    ref = recurrent_gla_bwd(*f64(q, k, v, g, do))
    for name, a, b in zip(("dq", "dk", "dv", "dg"), grads[:4], ref[:4]):
        assert rel(bf16.from_bits(a), b) < 5e-3, name
    assert rel(grads[4], ref[4]) < 1e-5


def test_emulated_zeco_pieces(emu_rt, rng):
    B, T, H, K, V = 1, 50, 2, 20, 12
    q, _, _, g, do, S, _ = gla_inputs(rng, B, T, H, K, V)
    G = ggla.decay_cumsum(g, chunk_size=16)
    G64 = np.cumsum(g.astype(np.float64), axis=1)
    assert rel(G, G64) < 1e-6
    o = rng.standard_normal((B, T, H, V)).astype(np.float32)
    ref = o + 0.3 * np.einsum("bthk,bhkv->bthv", q * np.exp(G64), S)
    ggla.state_correction(o, q, G, S, scale=0.3)
    assert rel(o, ref) < 1e-5
    U = ggla.initial_state_grad(q, g, do, scale=0.3, chunk_size=16)
    assert rel(U, 0.3 * np.einsum("bthk,bthv->bhkv", q * np.exp(G64), do)) < 1e-5
    with pytest.raises(TypeError, match="float64, float32"):
        ggla.chunk_gla(q.astype(np.int32), q.astype(np.int32), do.astype(np.int32), g.astype(np.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        ggla.chunk_gla(q, q, do, g, chunk_size=128)
    for bad in (0.0, -0.3, float("nan")):  # one rule for scale (hpczeco.base.checks.check_scale), here too
        with pytest.raises(ValueError, match="scale"):
            ggla.chunk_gla(q, q, do, g, scale=bad)
        with pytest.raises(ValueError, match="scale"):
            ggla.state_correction(o, q, G, S, scale=bad)


def test_emulated_zeco_tensor_core_pieces(emu_rt, rng):
    B, T, H, K, V = 1, 200, 2, 32, 48
    q, _, _, g, do, S, _ = gla_inputs(rng, B, T, H, K, V)
    Q, Gb, DO = (bf16.to_bits(x) for x in (q, g, do))
    q, g, do = (bf16.from_bits(x).astype(np.float64) for x in (Q, Gb, DO))
    G64 = np.cumsum(g, axis=1)
    G = ggla.decay_cumsum(Gb)
    o0 = bf16.to_bits(rng.standard_normal((B, T, H, V)).astype(np.float32))
    o = o0.copy()
    emu_rt.launched.clear()
    ggla.state_correction(o, Q, G, S, scale=0.3)
    assert emu_rt.launched == ["zeco_tc_correction<bf16>"]
    ref = bf16.from_bits(o0) + 0.3 * np.einsum("bthk,bhkv->bthv", q * np.exp(G64), S)
    assert rel(bf16.from_bits(o), ref) < 1e-2
    emu_rt.launched.clear()
    U = ggla.initial_state_grad(Q, Gb, DO, scale=0.3, nc=2)  # 4 chunks -> 2 segments, summed
    assert "zeco_tc_qT_do<bf16>" in emu_rt.launched
    assert rel(U, 0.3 * np.einsum("bthk,bthv->bhkv", q * np.exp(G64), do)) < 1e-2


def test_emulated_prepare_finish_compose_like_zeco(emu_rt, rng):
    """Two slices run as ZeCO ranks would (prepare, pass the pair, finish) equal one pass over the whole."""
    B, T, H, K, V = 1, 100, 2, 24, 16
    q, k, v, g, do, h0, dht = gla_inputs(rng, B, T, H, K, V, strong=True)
    f64 = [x.astype(np.float64) for x in (q, k, v, g, do, h0, dht)]
    ro, rht = recurrent_gla(*f64[:4], initial_state=f64[5], output_final_state=True)
    ref = recurrent_gla_bwd(*f64[:5], initial_state=f64[5], dht=f64[6])
    cut = 37  # slices [0, 37) and [37, 100), chunk 16: partial chunks on both sides
    sl = [slice(0, cut), slice(cut, T)]
    part = [[np.ascontiguousarray(x[:, s_]) for x in (q, k, v, g, do)] for s_ in sl]
    fw = [ggla.chunk_gla_prepare(*p[:4], chunk_size=16) for p in part]
    S_in1 = fw[0].decay[..., None] * h0 + fw[0].local_final_state  # the forward scan over two ranks
    o0, _ = fw[0].finish(h0)
    o1, fin = fw[1].finish(S_in1, output_final_state=True)
    assert rel(np.concatenate([o0, o1], axis=1), ro) < 1e-5
    assert rel(fin, rht) < 1e-5
    bw = [ggla.chunk_gla_bwd_prepare(*p, chunk_size=16) for p in part]
    D0 = bw[1].decay[..., None] * dht + bw[1].dh0_local  # the reverse scan over two ranks
    g0 = bw[0].finish(initial_state=h0, dht=D0)
    g1 = bw[1].finish(initial_state=S_in1, dht=dht)
    for i, name in enumerate(("dq", "dk", "dv", "dg")):
        assert rel(np.concatenate([g0[i], g1[i]], axis=1), ref[i]) < 1e-5, name
    assert rel(g0[4], ref[4]) < 1e-5  # dh0 of the whole sequence


def test_numba_shim_restores_row_stack(monkeypatch):
    from hpczeco.gpu import _numba_shim

    monkeypatch.delattr(np, "row_stack", raising=False)
    assert _numba_shim.apply() is True
    assert np.row_stack is np.vstack
    assert _numba_shim.apply() is False


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) to preprocess gla_zeco.cu")
def test_zeco_shared_memory_layout_matches_python(tmp_path):
    src = tmp_path / "layout.cpp"
    src.write_text(
        f'#include "{gemu.HEADER}"\n#include "{gruntime.HERE / "gla_zeco.cu"}"\nZC ZC_SMEM_CORRECTION\n'
    )
    res = subprocess.run([CXX, "-std=c++20", "-E", "-P", str(src)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    zc = [ln.split(" ", 1)[1] for ln in res.stdout.splitlines() if ln.startswith("ZC ")]
    assert eval(zc[0], {}) == ggla.ZC_SMEM_CORRECTION  # noqa: S307 - integer arithmetic from our own macros
    assert ggla.ZC_SMEM_CORRECTION <= 227 * 1024  # fits an H100/H200 block's opt-in shared memory


def test_kernel_groups_split_compilation_by_input_type():
    from hpczeco.gpu.gla_common import KERNEL_FILES  # noqa: PLC0415

    groups = {n: ggla.kernel_group(n) for f in KERNEL_FILES for n in ggla.kernel_names(f)}
    assert groups["zeco_tc_correction<bf16>"] == "bf16" and groups["zeco_tc_qT_do<f16>"] == "f16"
    assert groups["seg_finish<float, bf16>"] == "bf16"
    assert groups["gla_chunk_output<float>"] == "float"
    assert groups["seg_chunk_sum<float>"] == "common" and groups["gla_state_scan"] == "common"
    assert groups["glatc_scan"] == "common" and groups["glatc_walk2<bf16, true, false, 128>"] == "bf16"
    assert groups["glatc_bwd<bf16, 128, true>"] == "bf16-f32s" and groups["glatc_fwd_out<f16, 64, true>"] == "f16-f32s"
    # a bf16 forward + backward (16-bit chunk states, the default) needs only the bf16 and common modules
    default = [n for n in groups if ("bf16" in n and not (n.startswith("glatc_") and "true" in n.split(",")[2]))
               or groups[n] == "common"]  # fmt: skip
    assert default and all(groups[n] in ("bf16", "common") for n in default)


def test_nvcc_cache_reads_a_compile_back_and_misses_on_any_change(tmp_path, monkeypatch):
    """gpu/build.py's compile cache with a stand-in nvcc that counts its runs: the same compile twice runs it
    once; another flag, another source or another header of gpu/ compiles again; failures are not kept;
    HPCZECO_NVCC_CACHE=0 turns it off."""
    runs = tmp_path / "runs"
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n"
                    "[ \"$1\" = --version ] && { echo 'fake nvcc 1.0'; exit 0; }\n"
                    f"echo x >> {runs}\n"
                    "for a; do case $a in *bad.cu) echo 'error: bad'; exit 2;; esac; done\n"
                    "echo \"ptxas info    : Compiling entry function 'k' for 'sm_90'\"\n"
                    "echo 'ptxas info    : Used 40 registers, 0 bytes smem'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NVCC", str(fake))
    monkeypatch.setenv("HPCZECO_NVCC_CACHE", str(tmp_path / "cache"))
    here = tmp_path / "gpu"
    here.mkdir()
    (here / "a.cuh").write_text("// header\n")
    src = here / "k.cu"
    src.write_text("__global__ void k() {}\n")
    monkeypatch.setattr(gbuild, "HERE", here)

    def count() -> int:
        return len(runs.read_text().splitlines()) if runs.exists() else 0

    first = gbuild.finish(gbuild.start(src, "sm_90"))
    assert first.ok and [k.registers for k in first.kernels] == [40] and count() == 1
    again = gbuild.finish(gbuild.start(src, "sm_90"))
    assert again.ok and again.output == first.output and again.kernels == first.kernels and count() == 1
    gbuild.finish(gbuild.start(src, "sm_90a"))  # another flag
    assert count() == 2
    src.write_text("__global__ void k() { }\n")  # another source
    gbuild.finish(gbuild.start(src, "sm_90"))
    assert count() == 3
    (here / "a.cuh").write_text("// header, changed\n")  # another header of the folder
    gbuild.finish(gbuild.start(src, "sm_90"))
    gbuild.finish(gbuild.start(src, "sm_90"))
    assert count() == 4
    bad = here / "bad.cu"
    bad.write_text("oops\n")
    assert not gbuild.finish(gbuild.start(bad, "sm_90")).ok
    assert not gbuild.finish(gbuild.start(bad, "sm_90")).ok and count() == 6  # a failure is compiled again
    monkeypatch.setenv("HPCZECO_NVCC_CACHE", "0")
    gbuild.finish(gbuild.start(src, "sm_90"))
    assert count() == 7


def test_cupy_runtime_available_compiles_once_per_device_and_keeps_failures(monkeypatch):
    """CupyRuntime.available (asked on every wrapper call) with a stand-in cupy that counts module builds: a
    group builds once per device, later asks do not touch the module, a failing group stays False, and another
    device builds again."""
    import contextlib  # noqa: PLC0415
    import types  # noqa: PLC0415

    builds, dev = [], [0]

    class Module:
        def __init__(self, code, options, name_expressions):
            builds.append((dev[0], tuple(name_expressions or ())))
            if any("f16" in n and "bf16" not in n for n in name_expressions or ()):
                raise RuntimeError("NVRTC: stand-in failure")

        def get_function(self, name):
            return types.SimpleNamespace(max_dynamic_shared_size_bytes=0)

    fake = types.ModuleType("cupy")
    fake.RawModule = Module
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: dev[0]),
                                      Device=lambda d=None: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from hpczeco.gpu.gla_common import KERNELS  # noqa: PLC0415

    rt = gruntime.CupyRuntime(KERNELS)
    file = "gla_zeco.cu"
    assert rt.available(file, "bf16") and rt.available(file, "bf16")
    assert len(builds) == 1
    assert not rt.available(file, "f16") and not rt.available(file, "f16")
    assert len(builds) == 2 and "NVRTC: stand-in failure" in next(iter(rt.errors.values()))
    dev[0] = 1
    assert rt.available(file, "bf16") and len(builds) == 3


def test_every_listed_kernel_is_defined_in_its_file():
    """Each name expression the runtime compiles a module of a GLA tensor-core file with (NVRTC's name map, one module
    per file) is a ``__global__`` template of that file, not of another: the emulation builds every file in one
    translation unit and would not notice (a kernel listed under gla_fwd_tc.cu but defined in gla_tc_large.cu failed
    every NVRTC build of the tensor-core forward on the H200)."""
    import re  # noqa: PLC0415

    from hpczeco.gpu import gla_tc_states as st  # noqa: PLC0415
    from hpczeco.gpu.runtime import kernel_source  # noqa: PLC0415

    for file in st.KERNEL_FILES:
        src = kernel_source((file,))
        names = st.file_kernel_names(file)
        assert names, file
        missing = [n for n in names if not re.search(r"__global__[^;{]*\b" + re.escape(n.split("<")[0].strip()) + r"\b",
                                                       src)]
        assert missing == [], (file, missing)
