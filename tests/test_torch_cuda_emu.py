"""The CUDA branch of hpczeco.torch.chunk_gla without a GPU: its tensor <-> array views (bf16 as raw bits, zero-copy)
and its calls of hpczeco.gpu.gla, run on the CPU emulation of the CUDA kernels (``gpu/emu``) with numpy standing in
for CuPy (DLPack works the same way for CPU memory). On a GPU machine tests/test_torch_gpu.py runs the real thing."""

from __future__ import annotations

import contextlib
import re
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the optional 'torch' extra)")

from hpczeco.gpu import emu as gemu  # noqa: E402
from hpczeco.gpu import gla as ggla  # noqa: E402
from torch_gla_reference import recurrent_gla_torch, recurrent_gla_varlen_torch  # noqa: E402

import hpczeco.torch as ht  # noqa: E402
from hpczeco.torch import _arrays, chunk  # noqa: E402

pytestmark = pytest.mark.emulation  # the CPU emulation of the CUDA kernels: no MPI in it


class _Stream:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Allocators:
    """CuPy's thread-local allocator as the fake keeps it: ``using_allocator`` stacks, ``current`` is the top."""

    def __init__(self):
        self.stack: list = []

    @property
    def current(self):
        return self.stack[-1] if self.stack else None

    @contextlib.contextmanager
    def using_allocator(self, allocator=None):
        self.stack.append(allocator)
        try:
            yield
        finally:
            self.stack.pop()


class _PythonFunctionAllocator:
    """cupy.cuda.memory.PythonFunctionAllocator: ``malloc(size)`` calls ``malloc_func(size, device)``; the fake's
    'memory pointer' is ``(ptr, release)``, ``release()`` standing for the CuPy array being freed."""

    def __init__(self, malloc_func, free_func):
        self.malloc_func, self.free_func = malloc_func, free_func

    def malloc(self, size):
        ptr = self.malloc_func(size, 0)
        return ptr, lambda: self.free_func(ptr, 0)


ALLOCATORS = _Allocators()
FAKE_CUPY = types.SimpleNamespace(
    from_dlpack=np.from_dlpack, uint16=np.uint16, int16=np.int16, zeros=np.zeros,
    cuda=types.SimpleNamespace(Device=lambda index: contextlib.nullcontext(), ExternalStream=_Stream,
                               runtime=types.SimpleNamespace(getDevice=lambda: 0),
                               get_current_stream=lambda: types.SimpleNamespace(ptr=-1),  # never torch's: switch
                               using_allocator=ALLOCATORS.using_allocator,
                               memory=types.SimpleNamespace(PythonFunctionAllocator=_PythonFunctionAllocator)),
)


@pytest.fixture
def fake_cupy(monkeypatch):
    """numpy as CuPy, and a torch 'current stream' without CUDA."""
    monkeypatch.setattr(_arrays, "cupy_module", lambda: FAKE_CUPY)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_arrays, "_ALLOCATOR", None)  # made again over the fake
    _arrays._STREAMS.clear()
    yield
    _arrays._STREAMS.clear()
    assert ALLOCATORS.stack == [], "an allocator was left installed"


@pytest.fixture(scope="module")
def emu_runtime():
    if gemu.compiler() is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulation")
    names = [n for n in ggla.kernel_names() if not re.search(r"(?<!b)f16", n)]  # float + bf16 (as test_cuda_build)
    old = ggla.RUNTIME.set(gemu.EmuRuntime(ggla.KERNELS.source(), names))
    yield
    ggla.RUNTIME.set(old)


@pytest.fixture
def cuda_branch(fake_cupy, emu_runtime, monkeypatch):
    """hpczeco.torch.chunk_gla takes its CUDA branch for CPU tensors."""
    monkeypatch.setattr(chunk, "_host_forward", chunk._cuda_forward)
    monkeypatch.setattr(chunk, "_host_backward", chunk._cuda_backward)


def rel(x, ref) -> float:
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref))


def test_views_are_zero_copy_and_bf16_travels_as_raw_bits(fake_cupy, rng):
    t = torch.from_numpy(rng.standard_normal((2, 5, 3, 4))).to(torch.bfloat16)
    with _arrays.cuda_stream(0):
        a = _arrays.to_device(t)
        assert a.dtype == np.uint16 and a.ctypes.data == t.data_ptr()
        assert np.array_equal(a.view(np.int16), t.view(torch.int16).numpy())
        back = _arrays.from_device(a)
        assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr() and torch.equal(back, t)
        f = torch.from_numpy(rng.standard_normal((3, 4))).float()
        fa = _arrays.to_device(f)
        assert fa.dtype == np.float32 and fa.ctypes.data == f.data_ptr()
        s = f.t()  # not contiguous: viewed through a contiguous copy
        sa = _arrays.to_device(s)
        assert sa.flags.c_contiguous and np.array_equal(sa, s.numpy())
        assert _arrays.from_device(fa, torch.float64).dtype == torch.float64


def test_cuda_stream_switches_only_where_cupy_is_elsewhere(fake_cupy, monkeypatch):
    entered = []

    class Stream(_Stream):
        def __enter__(self):
            entered.append(self.ptr)
            return self

    monkeypatch.setattr(FAKE_CUPY.cuda, "ExternalStream", Stream)
    with _arrays.cuda_stream(0):  # CuPy's current stream (ptr -1) is not torch's (0): switched
        pass
    assert entered == [0]
    monkeypatch.setattr(FAKE_CUPY.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=0))
    with _arrays.cuda_stream(0):  # CuPy is on torch's stream already: nothing entered
        pass
    assert entered == [0]
    monkeypatch.setattr(FAKE_CUPY.cuda.runtime, "getDevice", lambda: 1)
    with _arrays.cuda_stream(0):  # another current device: switched
        pass
    assert entered == [0, 0]


def test_cupy_allocates_from_torchs_caching_allocator_inside_cuda_stream_only(fake_cupy, monkeypatch):
    """One memory pool: inside cuda_stream CuPy's thread-local allocator is torch's caching allocator (alloc on CuPy's
    current stream = torch's, delete on free), nested blocks and errors restore the previous one, and outside the
    block (plain CuPy use) nothing is installed."""
    calls = []
    monkeypatch.setattr(_arrays, "_RAW_ALLOC", None)  # the public API (a CPU torch has no CUDA allocator)
    monkeypatch.setattr(torch.cuda, "caching_allocator_alloc",
                        lambda size, device=None, stream=None: calls.append(("alloc", size, device, stream)) or 4096)
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", lambda ptr: calls.append(("delete", ptr)))
    assert ALLOCATORS.current is None
    with _arrays.cuda_stream(0):
        alloc = ALLOCATORS.current
        assert alloc is not None and alloc == _arrays.torch_allocator()
        ptr, release = alloc(1 << 20)
        assert ptr == 4096 and calls == [("alloc", 1 << 20, 0, -1)]  # -1: the fake CuPy's current stream
        with _arrays.cuda_stream(0):  # nested (e.g. the ZeCO layer inside a torch call): the same pool
            assert ALLOCATORS.current == alloc
        assert ALLOCATORS.current == alloc
        release()  # the CuPy array dies (here or after the block): its memory goes back to torch
    assert calls[-1] == ("delete", 4096)
    assert ALLOCATORS.current is None
    with pytest.raises(RuntimeError, match="inside"):
        with _arrays.cuda_stream(0):
            raise RuntimeError("inside")
    assert ALLOCATORS.current is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_branch_on_the_emulated_kernels(cuda_branch, rng, dtype):
    B, T, H, K, V = 1, 70, 1, 12, 8
    arrays = [rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V)),
              rng.uniform(-1.0, 0.0, (B, T, H, K)), rng.standard_normal((B, T, H, V))]
    q, k, v, g, do = (torch.from_numpy(a).to(dtype) for a in arrays)
    h0 = torch.from_numpy(rng.standard_normal((B, H, K, V))).to(dtype)  # bf16 h0: converted to float32 for the kernels
    dht = torch.from_numpy(rng.standard_normal((B, H, K, V))).float()
    ins = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, fin = ht.chunk_gla(*ins[:4], initial_state=ins[4], output_final_state=True)
    assert o.dtype == dtype and fin.dtype == torch.float32
    refs = [x.double().requires_grad_() for x in (q, k, v, g, h0)]
    ro, states = recurrent_gla_torch(*refs[:4], initial_state=refs[4])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(o, ro) < tol and rel(fin, states[-1]) < 1e-5
    ((o * do).sum() + (fin * dht).sum()).backward()
    ((ro * do.double()).sum() + (states[-1] * dht.double()).sum()).backward()
    for name, x, r in zip(("q", "k", "v", "g", "initial_state"), ins, refs):
        assert x.grad.dtype == dtype, name
        assert rel(x.grad, r.grad) < 5 * tol, (name, rel(x.grad, r.grad))


def test_cuda_branch_backward_under_saved_tensor_hooks(cuda_branch, rng):
    """Saved-tensor hooks that hand back copies (as checkpointing and save_on_cpu do): the backward runs on what
    they give back and its gradients equal those of a plain call."""
    B, T, H, K, V = 1, 70, 1, 12, 8
    xs = [torch.from_numpy(rng.standard_normal((B, T, H, d))) for d in (K, K, V)]
    xs.append(torch.from_numpy(rng.uniform(-1.0, 0.0, (B, T, H, K))))
    do = torch.from_numpy(rng.standard_normal((B, T, H, V))).float()
    seen = []

    def unpack(t):
        seen.append(t.data_ptr())
        return t

    def grads(hooks):
        leaves = [x.float().requires_grad_() for x in xs]
        with hooks:
            o, _ = ht.chunk_gla(*(x * 1 for x in leaves))
        return torch.autograd.grad(o, leaves, do)

    plain = grads(contextlib.nullcontext())
    moved = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), unpack))
    assert len(seen) >= 4  # the backward asked for the saved tensors
    for a, b in zip(moved, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_branch_takes_cu_seqlens(cuda_branch, rng, dtype):
    """Packed documents on the CUDA branch (hpczeco.gpu.gla_varlen over the emulated kernels) equal each document
    alone: values, final states and every gradient."""
    assert ht.supports_cu_seqlens("cuda")
    cu = torch.tensor([0, 5, 5, 6, 40], dtype=torch.int32)
    N, T, H, K, V = 4, 40, 1, 8, 8
    arrays = [rng.standard_normal((1, T, H, K)), rng.standard_normal((1, T, H, K)), rng.standard_normal((1, T, H, V)),
              rng.uniform(-1.0, 0.0, (1, T, H, K)), rng.standard_normal((1, T, H, V))]
    q, k, v, g, do = (torch.from_numpy(a).to(dtype) for a in arrays)
    h0 = torch.from_numpy(rng.standard_normal((N, H, K, V))).float()
    dht = torch.from_numpy(rng.standard_normal((N, H, K, V))).float()
    ins = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, fin = ht.chunk_gla(*ins[:4], initial_state=ins[4], output_final_state=True, cu_seqlens=cu)
    assert o.dtype == dtype and fin.shape == (N, H, K, V)
    refs = [x.double().requires_grad_() for x in (q, k, v, g, h0)]
    ro, rfin = recurrent_gla_varlen_torch(*refs[:4], cu, initial_state=refs[4])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(o, ro) < tol and rel(fin, rfin) < 1e-4
    ((o * do).sum() + (fin * dht).sum()).backward()
    ((ro * do.double()).sum() + (rfin * dht.double()).sum()).backward()
    for name, x, r in zip(("q", "k", "v", "g", "initial_state"), ins, refs):
        assert rel(x.grad, r.grad) < 5 * tol, (name, rel(x.grad, r.grad))
