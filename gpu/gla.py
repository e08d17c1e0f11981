"""Chunked gated linear attention on the GPU (CuPy + CUDA C++ kernels from the ``*.cu`` files here).

Same semantics as :mod:`hpczeco.gla` (flash-linear-attention's ``chunk_gla``): ``q, k, g: [B, T, H, K]``,
``v, o: [B, T, H, V]``, states ``[B, H, K, V]`` float32, ``g`` the log forget gate (<= 0)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,      o_t = scale * q_t S_t   (inclusive)

Inputs: CuPy arrays of float32, float16 or bfloat16 (CuPy's ``bfloat16`` through ml_dtypes, or
``uint16`` arrays holding raw bfloat16 bit patterns for CuPy builds without it; outputs then are
uint16 bit patterns too). Arithmetic and states are float32. Every decay factor is ``exp`` of a
non-positive number (taken relative to a later position in the same chunk / sub-chunk), so gates
down to -8 per token and beyond are safe.

Two implementations, same results to rounding:

- ``"simt"``: general kernels (any K, V, chunk size 1..64) on CUDA cores, fp32 FMA.
- ``"tc"`` (forward, bf16/fp16, K and V multiples of 16 up to 128): tensor cores (``mma.sync`` bf16/
  fp16 -> fp32) over segments of several chunks; see ``gla_tc.cu``.

``impl="auto"`` takes ``"tc"`` where it applies (16-bit inputs), else ``"simt"``. Nothing here
talks MPI. The pieces the ZeCO layer needs are exposed too: :func:`decay_cumsum`,
:func:`state_correction`, :func:`final_state`, :func:`scan_combine`, :func:`initial_state_grad`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "chunk_gla",
    "chunk_gla_bwd",
    "chunk_gla_prepare",
    "chunk_gla_bwd_prepare",
    "GLAForward",
    "GLABackward",
    "decay_cumsum",
    "state_correction",
    "final_state",
    "scan_combine",
    "initial_state_grad",
    "kernel_names",
    "kernel_source",
    "memory_floor",
]

_HERE = Path(__file__).resolve().parent
_NT = 256  # threads per block of the simt kernels
_KERNEL_FILES = ("gla_kernels.cu", "gla_tc.cu", "gla_zeco.cu")
_TYPES = {"float32": "float", "float16": "f16", "bfloat16": "bf16", "uint16": "bf16"}


# ---------------------------------------------------------------------------------------------- kernels


def kernel_names(file: str | None = None) -> list[str]:
    """Kernel name expressions (template instantiations) of ``file`` (a ``gpu/*.cu`` name), or of all files."""
    names: dict[str, list[str]] = {"gla_kernels.cu": ["gla_state_scan", "seg_carry"], "gla_tc.cu": []}
    names["gla_zeco.cu"] = []
    for t in ("float", "bf16", "f16"):
        names["gla_kernels.cu"] += [
            f"gla_chunk_outer<{t}>",
            f"gla_chunk_output<{t}>",
            f"gla_bwd_scores<{t}>",
            f"gla_bwd_dqdk<{t}>",
            f"gla_bwd_dv<{t}>",
            f"seg_chunk_sum<{t}>",
            f"gla_state_correction<{t}>",
            f"seg_finish<{t}, float>",
        ]
        if t != "float":
            names["gla_kernels.cu"].append(f"seg_finish<float, {t}>")
    for t in ("bf16", "f16"):
        names["gla_tc.cu"] += [f"gla_tc_seg_state<{t}, true>", f"gla_tc_seg_state<{t}, false>"]
        names["gla_tc.cu"].append(f"gla_tc_chunk_outer<{t}>")
        for lds, pf in (("true", "true"), ("true", "false"), ("false", "false")):
            names["gla_tc.cu"].append(f"gla_tc_seg_output<{t}, {lds}, {pf}>")
        names["gla_zeco.cu"] += [f"zeco_tc_correction<{t}>", f"zeco_tc_qT_do<{t}>"]
    files = [file] if file is not None else [f for f in _KERNEL_FILES if (_HERE / f).exists()]
    return [n for f in files for n in names[f]]


def kernel_source(files: tuple[str, ...] | None = None) -> str:
    """Kernel sources as one translation unit: local ``#include "..."`` inlined once each (no include paths)."""
    seen: set[str] = set()

    def inline(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        out = []
        for line in (_HERE / name).read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith('#include "') and stripped.endswith('"'):
                out.append(inline(stripped[len('#include "') : -1]))
            elif stripped != "#pragma once":
                out.append(line)
        return "\n".join(out)

    return "\n".join(inline(f) for f in (files or _KERNEL_FILES) if (_HERE / f).exists())


def kernel_group(name: str) -> str:
    """The input type a kernel name expression is instantiated for: "bf16", "f16", "float" or "common"."""
    lt = name.find("<")
    if lt < 0:
        return "common"
    args = [a.strip() for a in name[lt + 1 : name.rfind(">")].split(",")]
    for a in args:
        if a in ("bf16", "f16"):
            return a
    return "common" if name.startswith("seg_") else "float"  # small fp32 sums serve every input type


class _CupyRuntime:
    """Kernels from ``cupy.RawModule`` objects (NVRTC, ``-std=c++17``), one per ``.cu`` file and input type, on the
    current CuPy stream.

    A module compiles on first use of one of its kernels, so a bf16 run never compiles the fp32/fp16
    instantiations (NVRTC needed about a minute for all of gla_kernels.cu on the GPU machine). A module that
    fails to compile leaves the others usable (the tensor-core forward then falls back to simt, with a warning).
    """

    def __init__(self):
        import cupy  # noqa: PLC0415

        self.xp = cupy
        self.modules: dict[str, Any] = {}
        self.owner = {n: (f, kernel_group(n)) for f in _KERNEL_FILES if (_HERE / f).exists() for n in kernel_names(f)}
        self.errors: dict[str, str] = {}
        self._fns: dict[str, Any] = {}
        self._smem: dict[str, int] = {}

    def module(self, file: str, group: str):
        mod = self.modules.get((file, group))
        if mod is None:
            names = [n for n in kernel_names(file) if kernel_group(n) == group]
            mod = self.modules[(file, group)] = self.xp.RawModule(
                code=kernel_source((file,)),
                options=("-std=c++17", "--use_fast_math"),
                name_expressions=names,
            )
        return mod

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module(*self.owner[name]).get_function(name)
        return f

    def available(self, file: str, group: str | None = None) -> bool:
        """Compile ``file``'s module for ``group`` (default: its first kernel's) now; False if NVRTC rejects it."""
        names = [n for n in kernel_names(file) if group is None or kernel_group(n) == group]
        key = f"{file}:{kernel_group(names[0])}" if names else file
        if key in self.errors:
            return False
        try:
            self.fn(names[0])
            return True
        except Exception as exc:  # noqa: BLE001 - any compile/load failure
            self.errors[key] = f"{type(exc).__name__}: {exc}"
            return False

    def launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
        f = self.fn(name)
        if shared_mem > 48 * 1024 and self._smem.get(name, 0) < shared_mem:
            f.max_dynamic_shared_size_bytes = shared_mem  # opt in above the default 48 KB
            self._smem[name] = shared_mem
        conv = tuple(np.uint64(0) if a is None else a for a in args)
        f(tuple(int(x) for x in grid), tuple(int(x) for x in block), conv, shared_mem=shared_mem)

    @staticmethod
    def is_native(x: Any) -> bool:
        return type(x).__module__.startswith("cupy")

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data.ptr)


_RUNTIME: Any = None


def _runtime():
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = _CupyRuntime()
    return _RUNTIME


def _set_runtime(rt: Any) -> Any:
    """Testing hook: run the wrappers on another runtime (e.g. the CPU emulation); returns the old one."""
    global _RUNTIME
    old, _RUNTIME = _RUNTIME, rt
    return old


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------- checks


def _type_of(name: str, x: Any) -> str:
    dt = str(x.dtype)
    if dt not in _TYPES:
        raise TypeError(
            f"{name} has dtype {dt}; the GPU GLA takes float32, float16 or bfloat16 "
            "(or uint16 raw bfloat16 bits); use the CPU path (numpy) for float64"
        )
    return _TYPES[dt]


def _check(q, k, v, g, do=None, h0=None, dht=None, rt=None):
    rt = rt or _runtime()
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("do", do), ("initial_state", h0), ("dht", dht)):
        if x is not None and not rt.is_native(x):
            raise TypeError(f"{name} must be a device (CuPy) array, got {type(x).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("do", do)):
        if x is not None and x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
    B, T, H, K = (int(s) for s in q.shape)
    V = int(v.shape[3])
    expected = (("k", k, (B, T, H, K)), ("g", g, (B, T, H, K)), ("v", v, (B, T, H, V)), ("do", do, (B, T, H, V)))
    for name, x, shp in expected:
        if x is not None and tuple(x.shape) != shp:
            raise ValueError(f"{name} has shape {list(x.shape)}, expected {list(shp)}")
    for name, x in (("initial_state", h0), ("dht", dht)):
        if x is not None and tuple(x.shape) != (B, H, K, V):
            raise ValueError(f"{name} has shape {list(x.shape)}, expected {[B, H, K, V]}")
    t = _type_of("q", q)
    for name, x in (("k", k), ("v", v), ("g", g), ("do", do)):
        if x is not None and str(x.dtype) != str(q.dtype):
            raise TypeError(f"{name} has dtype {x.dtype}, expected {q.dtype} (the dtype of q)")
    if K < 1 or V < 1:
        raise ValueError(f"K and V must be >= 1, got K={K}, V={V}")
    return B, T, H, K, V, t


def _contig(x, rt):
    return None if x is None else rt.xp.ascontiguousarray(x)


def _state32(x, rt):
    return None if x is None else rt.xp.ascontiguousarray(x, dtype=rt.xp.float32)


def _chunk(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if not 1 <= int(chunk_size) <= 64:
        raise ValueError(f"chunk_size must be in [1, 64] on the GPU, got {chunk_size}")
    return int(chunk_size)


def _scale(scale, K: int) -> float:
    return float(K) ** -0.5 if scale is None else float(scale)


i32 = np.int32
f32 = np.float32


# ---------------------------------------------------------------------------------------------- pieces


def _local_states(rt, left, right, g, t, B, T, H, K, V, C, NT, mode, scale):
    """Per-chunk local states ``[B*H, NT, K, V]`` and chunk decay totals ``[B*H, NT, K]`` (fp32).

    ``$HPCZECO_TC_STATES=1`` computes them on tensor cores for 16-bit inputs (operands rounded to 16
    bits: the backward's dg error grows from ~1.7e-3 to ~5.6e-3 in the emulation test), else fp32 simt.
    """
    xp = rt.xp
    st = xp.empty((B * H, NT, K, V), dtype=xp.float32)
    gtot = xp.empty((B * H, NT, K), dtype=xp.float32)
    if (
        os.environ.get("HPCZECO_TC_STATES", "0") == "1"  # opt-in: 16-bit state operands cost dg precision
        and C == 64
        and _tc_applies(t, K, V, C)
        and all(rt.ptr(x) % 16 == 0 for x in (left, right, g))
        and getattr(rt, "available", lambda f, g=None: True)("gla_tc.cu", t)
    ):  # tensor cores (16-bit operands, fp32 accumulation)
        from .gla_tc import SMEM_STATE  # noqa: PLC0415

        rt.launch(
            f"gla_tc_chunk_outer<{t}>", (NT, B * H), (_NT,),
            (left, right, g, st, gtot, i32(B), i32(T), i32(H), i32(K), i32(V), i32(NT), i32(mode), f32(scale)),
            shared_mem=SMEM_STATE,
        )  # fmt: skip
        return st, gtot
    grid = (NT, B * H, -(-K // 32) * -(-V // 32))
    rt.launch(
        f"gla_chunk_outer<{t}>", grid, (_NT,),
        (left, right, g, st, gtot, i32(B), i32(T), i32(H), i32(K), i32(V), i32(C), i32(NT), i32(mode), f32(scale)),
    )  # fmt: skip
    return st, gtot


def _scan(rt, st, gtot, init, NT, K, V, BH, reverse: bool):
    """In place over chunks; returns the final state ``[B*H, K, V]`` fp32."""
    xp = rt.xp
    fin = xp.empty((BH, K, V), dtype=xp.float32)
    rt.launch(
        "gla_state_scan", (-(-K * V // _NT), BH), (_NT,),
        (st, gtot, init, fin, i32(NT), i32(K), i32(V), i32(1 if reverse else 0)),
    )  # fmt: skip
    return fin


def _cumsum_T(rt, x, tin: str, tout: str, out_dtype, B, T, H, K, C, reverse: bool, base=None):
    """Inclusive (reverse: suffix) cumulative sum of ``x [B, T, H, K]`` along T, plus ``base [B*H, K]``."""
    xp = rt.xp
    NT = -(-T // C)
    ctot = xp.empty((B * H, NT, K), dtype=xp.float32)
    rt.launch(f"seg_chunk_sum<{tin}>", (NT, B * H), (_NT,), (x, ctot, i32(B), i32(T), i32(H), i32(K), i32(C), i32(NT)))
    rt.launch(
        "seg_carry", (-(-B * H * K // _NT),), (_NT,),
        (ctot, base, i32(B * H), i32(K), i32(NT), i32(1 if reverse else 0)),
    )  # fmt: skip
    out = xp.empty((B, T, H, K), dtype=out_dtype)
    rt.launch(
        f"seg_finish<{tin}, {tout}>", (NT, B * H), (_NT,),
        (x, ctot, out, i32(B), i32(T), i32(H), i32(K), i32(C), i32(NT), i32(1 if reverse else 0)),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- decays


def _prefix_suffix(xp, gtot):
    """Per chunk (or segment) c of ``gtot [BH, N, K]`` (its total log decay): the log decay before c
    (exclusive prefix), after c (exclusive suffix) and over everything ``[BH, K]``; all fp32, <= 0."""
    inc = xp.cumsum(gtot, axis=1)
    zero = xp.zeros_like(gtot[:, :1])
    pre = xp.ascontiguousarray(xp.concatenate([zero, inc[:, :-1]], axis=1), dtype=xp.float32)
    rinc = xp.flip(xp.cumsum(xp.flip(gtot, axis=1), axis=1), axis=1)
    suf = xp.ascontiguousarray(xp.concatenate([rinc[:, 1:], zero], axis=1), dtype=xp.float32)
    return pre, suf, xp.ascontiguousarray(inc[:, -1], dtype=xp.float32)


# ---------------------------------------------------------------------------------------------- forward


def _tc_applies(t: str, K: int, V: int, C: int) -> bool:
    return t in ("bf16", "f16") and K % 16 == 0 and V % 16 == 0 and K <= 128 and V <= 128 and C == 64


class GLAForward:
    """A chunked GLA forward whose local pass is done (:func:`chunk_gla_prepare`); :meth:`finish` writes ``o``.

    ``local_final_state [B, H, K, V]`` (fp32): the final state from a zero initial state.
    ``decay [B, H, K]`` (fp32): ``exp`` of the gate summed over T. With an initial state ``S0`` the final
    state is ``decay[..., None] * S0 + local_final_state`` -- the pair ZeCO scans over ranks, so a rank
    can prepare, scan, then finish with the incoming state (no correction pass over ``o``).
    """

    def __init__(self, rt, q, k, v, g, scale, t, dims, use_tc, st, gtot, fin0, nc):
        self._rt, self._q, self._k, self._v, self._g = rt, q, k, v, g
        self.scale, self._t, self._dims, self.tensor_cores = scale, t, dims, use_tc
        self._st, self._gtot, self._nc = st, gtot, nc
        B, T, H, K, V, C = dims
        self._pre, _, total = _prefix_suffix(rt.xp, gtot)
        self.local_final_state = fin0.reshape(B, H, K, V)
        self.decay = rt.xp.exp(total).reshape(B, H, K)

    def finish(self, initial_state: Any = None, output_final_state: bool = False) -> tuple[Any, Any]:
        """``(o [B, T, H, V], final_state [B, H, K, V] fp32 or None)`` with ``initial_state`` (or zeros)."""
        rt, xp = self._rt, self._rt.xp
        B, T, H, K, V, C = self._dims
        S0 = _state32(initial_state, rt)
        if S0 is not None and tuple(S0.shape) != (B, H, K, V):
            raise ValueError(f"initial_state has shape {list(S0.shape)}, expected {[B, H, K, V]}")
        pre = self._pre if S0 is not None else None
        o = xp.empty((B, T, H, V), dtype=self._q.dtype)
        if self.tensor_cores:
            from . import gla_tc  # noqa: PLC0415

            gla_tc.finish(rt, self._q, self._k, self._v, self._g, self._st, o, self.scale, S0, pre, self._t,
                          B, T, H, K, V, self._nc)  # fmt: skip
        else:
            NT = -(-T // C)
            rt.launch(
                f"gla_chunk_output<{self._t}>", (NT, B * H, -(-V // 64)), (_NT,),
                (self._q, self._k, self._v, self._g, self._st, o, f32(self.scale), i32(B), i32(T), i32(H), i32(K),
                 i32(V), i32(C), i32(NT), S0, pre),
            )  # fmt: skip
        if not output_final_state:
            return o, None
        fin = self.local_final_state.copy() if S0 is None else self.local_final_state + self.decay[..., None] * S0
        return o, fin


def chunk_gla_prepare(
    q: Any, k: Any, v: Any, g: Any, scale: float | None = None, chunk_size: int = 64, *, impl: str = "auto"
) -> GLAForward:
    """The local pass of the forward (chunk or segment states from a zero start); see :class:`GLAForward`.

    ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]`` CuPy arrays (T >= 1). ``impl`` as :func:`chunk_gla`.
    Keeps references to the inputs: leave them unmodified until :meth:`GLAForward.finish`.
    """
    rt = _runtime()
    B, T, H, K, V, t = _check(q, k, v, g, rt=rt)
    C = _chunk(chunk_size)
    s = _scale(scale, K)
    if impl not in ("auto", "simt", "tc"):
        raise ValueError(f"impl must be 'auto', 'simt' or 'tc', got {impl!r}")
    if T == 0 or B * H == 0:
        raise ValueError(f"chunk_gla_prepare needs T >= 1 and B*H >= 1, got q of shape {list(q.shape)}")
    if impl == "tc" and not _tc_applies(t, K, V, C):
        raise ValueError(
            "impl='tc' needs bf16/fp16 inputs, K and V multiples of 16 up to 128 and chunk_size 64 "
            f"(got {t}, K={K}, V={V}, chunk_size={C})"
        )
    q, k, v, g = (_contig(x, rt) for x in (q, k, v, g))
    aligned = all(rt.ptr(x) % 16 == 0 for x in (q, k, v, g))  # the tensor-core path loads 16 bytes at a time
    if impl == "tc" and not aligned:
        raise ValueError("impl='tc' needs q, k, v, g whose data pointers are 16-byte aligned")
    use_tc = impl == "tc" or (impl == "auto" and aligned and _tc_applies(t, K, V, C))
    if use_tc and impl == "auto" and not getattr(rt, "available", lambda f, g=None: True)("gla_tc.cu", t):
        _warn_once(f"tensor-core GLA kernels unavailable ({rt.errors.get('gla_tc.cu:' + t, '?')[:300]}); using simt")
        use_tc = False
    if use_tc:
        from . import gla_tc  # noqa: PLC0415

        st, gtot, fin0, nc = gla_tc.prepare(rt, k, v, g, t, B, T, H, K, V)
    else:
        NT = -(-T // C)
        st, gtot = _local_states(rt, k, v, g, t, B, T, H, K, V, C, NT, 0, 1.0)
        fin0 = _scan(rt, st, gtot, None, NT, K, V, B * H, reverse=False)
        nc = None
    return GLAForward(rt, q, k, v, g, s, t, (B, T, H, K, V, C), use_tc, st, gtot, fin0, nc)


def chunk_gla(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    *,
    impl: str = "auto",
) -> tuple[Any, Any]:
    """GLA forward on the GPU: ``(o [B, T, H, V] in the input dtype, final_state [B, H, K, V] fp32 or None)``.

    ``impl``: "auto" | "simt" | "tc" (tensor cores; bf16/fp16, K, V multiples of 16 <= 128, chunk 64).
    Runs on the current CuPy stream; no host synchronisation. Same as
    ``chunk_gla_prepare(...).finish(initial_state, output_final_state)``.
    """
    rt = _runtime()
    B, T, H, K, V, t = _check(q, k, v, g, h0=initial_state, rt=rt)
    _chunk(chunk_size)
    if T == 0 or B * H == 0:
        xp = rt.xp
        h0 = _state32(initial_state, rt)
        o = xp.zeros((B, T, H, V), dtype=q.dtype)
        fin = xp.zeros((B, H, K, V), dtype=xp.float32) if h0 is None else h0.copy()
        return o, (fin if output_final_state else None)
    plan = chunk_gla_prepare(q, k, v, g, scale=scale, chunk_size=chunk_size, impl=impl)
    return plan.finish(initial_state, output_final_state)


# ---------------------------------------------------------------------------------------------- backward


class GLABackward:
    """A GLA backward whose state passes are done (:func:`chunk_gla_bwd_prepare`); :meth:`finish` writes the
    gradients for a given initial state and final-state gradient.

    ``dh0_local [B, H, K, V]`` (fp32): the gradient into the initial state when ``dht`` is zero
    (``scale * sum_t (q_t exp(G_t))^T do_t``); ``decay [B, H, K]``: ``exp`` of the gate summed over T;
    ``local_final_state``: the final state from a zero initial state. With ``dht = D`` the gradient into the
    initial state is ``dh0_local + decay[..., None] * D`` -- ZeCO's reverse scan pair.
    """

    def __init__(self, rt, arrays, scale, t, dims, S_in, S_T0, dS, U, gtot, A, dA):
        self._rt, self._arrays, self.scale, self._t, self._dims = rt, arrays, scale, t, dims
        self._S_in, self._dS, self._A, self._dA = S_in, dS, A, dA
        B, T, H, K, V, C = dims
        self._pre, self._suf, total = _prefix_suffix(rt.xp, gtot)
        self.decay = rt.xp.exp(total).reshape(B, H, K)
        self.dh0_local = U.reshape(B, H, K, V)
        self.local_final_state = S_T0.reshape(B, H, K, V)

    def finish(self, initial_state: Any = None, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` as :func:`chunk_gla_bwd` with this ``initial_state`` and ``dht``."""
        rt, xp = self._rt, self._rt.xp
        B, T, H, K, V, C = self._dims
        q, k, v, g, do = self._arrays
        t = self._t
        S0, D = _state32(initial_state, rt), _state32(dht, rt)
        for name, x in (("initial_state", S0), ("dht", D)):
            if x is not None and tuple(x.shape) != (B, H, K, V):
                raise ValueError(f"{name} has shape {list(x.shape)}, expected {[B, H, K, V]}")
        NT, BH = -(-T // C), B * H
        geo = (i32(B), i32(T), i32(H), i32(K), i32(V), i32(C), i32(NT))
        pre = self._pre if S0 is not None else None
        suf = self._suf if D is not None else None
        dq = xp.empty((B, T, H, K), dtype=q.dtype)
        dk = xp.empty((B, T, H, K), dtype=q.dtype)
        dG = xp.empty((B, T, H, K), dtype=xp.float32)
        rt.launch(
            f"gla_bwd_dqdk<{t}>", (NT, BH, -(-K // 32)), (_NT,),
            (q, k, v, g, do, self._S_in, self._dS, self._dA, dq, dk, dG, f32(self.scale)) + geo + (S0, pre, D, suf),
        )  # fmt: skip
        dv = xp.empty((B, T, H, V), dtype=q.dtype)
        rt.launch(
            f"gla_bwd_dv<{t}>", (NT, BH, -(-V // 64)), (_NT,),
            (k, g, do, self._A, self._dS, dv, f32(self.scale)) + geo + (D, suf),
        )  # fmt: skip
        base = None
        if D is not None:
            S_T = self.local_final_state if S0 is None else self.local_final_state + self.decay[..., None] * S0
            base = xp.ascontiguousarray((S_T * D).sum(axis=-1).reshape(BH, K), dtype=xp.float32)
        dg = _cumsum_T(rt, dG, "float", t, q.dtype, B, T, H, K, C, reverse=True, base=base)
        dh0 = self.dh0_local.copy() if D is None else self.dh0_local + self.decay[..., None] * D
        return dq, dk, dv, dg, dh0


def chunk_gla_bwd_prepare(
    q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, chunk_size: int = 64
) -> GLABackward:
    """The state passes of the backward (zero-start chunk states and d-states, intra-chunk scores).

    Shapes as :func:`chunk_gla_bwd` (T >= 1). Keeps references to the inputs until :meth:`GLABackward.finish`.
    """
    rt = _runtime()
    B, T, H, K, V, t = _check(q, k, v, g, do=do, rt=rt)
    C = _chunk(chunk_size)
    s = _scale(scale, K)
    if T == 0 or B * H == 0:
        raise ValueError(f"chunk_gla_bwd_prepare needs T >= 1 and B*H >= 1, got q of shape {list(q.shape)}")
    xp = rt.xp
    q, k, v, g, do = (_contig(x, rt) for x in (q, k, v, g, do))
    NT, BH = -(-T // C), B * H
    # incoming state of every chunk from a zero start, and the final state
    S_in, gtot = _local_states(rt, k, v, g, t, B, T, H, K, V, C, NT, 0, 1.0)
    S_T0 = _scan(rt, S_in, gtot, None, NT, K, V, BH, reverse=False)
    # gradient into every chunk's end state (dht = 0), and into the initial state
    dS, _ = _local_states(rt, q, do, g, t, B, T, H, K, V, C, NT, 1, s)
    U = _scan(rt, dS, gtot, None, NT, K, V, BH, reverse=True)
    A = xp.empty((BH, NT, 64, 64), dtype=xp.float32)
    dA = xp.empty((BH, NT, 64, 64), dtype=xp.float32)
    geo = (i32(B), i32(T), i32(H), i32(K), i32(V), i32(C), i32(NT))
    rt.launch(f"gla_bwd_scores<{t}>", (NT, BH), (_NT,), (q, k, v, g, do, A, dA) + geo)
    return GLABackward(rt, (q, k, v, g, do), s, t, (B, T, H, K, V, C), S_in, S_T0, dS, U, gtot, A, dA)


def chunk_gla_bwd(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    do: Any,
    scale: float | None = None,
    initial_state: Any = None,
    dht: Any = None,
    chunk_size: int = 64,
) -> tuple[Any, Any, Any, Any, Any]:
    """GLA backward on the GPU: ``(dq, dk, dv, dg, dh0)``.

    Gradients of ``sum(o * do) + sum(S_T * dht)``; dq, dk, dg ``[B, T, H, K]`` and dv ``[B, T, H, V]``
    in the input dtype; ``dh0 [B, H, K, V]`` always returned (fp32). ``dg = reverse_cumsum(q*dq - k*dk)
    + rowsum(S_T * dht)`` at every position. Runs on the current CuPy stream. Same as
    ``chunk_gla_bwd_prepare(...).finish(initial_state, dht)``.
    """
    rt = _runtime()
    B, T, H, K, V, t = _check(q, k, v, g, do=do, h0=initial_state, dht=dht, rt=rt)
    _chunk(chunk_size)
    if T == 0 or B * H == 0:
        xp = rt.xp
        dH = _state32(dht, rt)
        z = xp.zeros((B, T, H, K), dtype=q.dtype)
        dh0 = xp.zeros((B, H, K, V), dtype=xp.float32) if dH is None else dH.copy()
        return z, z.copy(), xp.zeros((B, T, H, V), dtype=q.dtype), z.copy(), dh0
    plan = chunk_gla_bwd_prepare(q, k, v, g, do, scale=scale, chunk_size=chunk_size)
    return plan.finish(initial_state, dht)


# ---------------------------------------------------------------------------------------------- ZeCO pieces


#: dynamic shared memory of zeco_tc_correction (mirror of ZC_SMEM_CORRECTION in gla_zeco.cu)
ZC_SMEM_CORRECTION = 64 * 136 * 2 + 128 * 136 * 2


def _zeco_tc(rt: Any, t: str, K: int, V: int, *arrays: Any) -> bool:
    """Tensor-core ZeCO kernels apply: 16-bit data, K, V multiples of 16 up to 128, 16-byte aligned, module builds."""
    if t not in ("bf16", "f16") or K % 16 or V % 16 or K > 128 or V > 128:
        return False
    if any(rt.ptr(x) % 16 for x in arrays):
        return False
    return getattr(rt, "available", lambda f, g=None: True)("gla_zeco.cu", t)


def decay_cumsum(g: Any, chunk_size: int = 64) -> Any:
    """``G = cumsum(g, axis=1)`` (inclusive, float32, ``[B, T, H, K]``): the log decay from the slice start."""
    rt = _runtime()
    if not rt.is_native(g) or g.ndim != 4:
        raise TypeError("g must be a 4-dimensional device array [B, T, H, K]")
    t = _type_of("g", g)
    B, T, H, K = (int(x) for x in g.shape)
    if T == 0 or B * H * K == 0:
        return rt.xp.zeros(g.shape, dtype=rt.xp.float32)
    return _cumsum_T(rt, _contig(g, rt), t, "float", rt.xp.float32, B, T, H, K, _chunk(chunk_size), reverse=False)


def state_correction(o: Any, q: Any, G: Any, S_in: Any, scale: float | None = None) -> Any:
    """In place ``o += scale * (q * exp(G)) @ S_in`` (per b, h); returns ``o``.

    ``o [B, T, H, V]`` and ``q [B, T, H, K]`` share a dtype, ``G [B, T, H, K]`` float32 (from
    :func:`decay_cumsum`), ``S_in [B, H, K, V]``. The ZeCO correction once the scan has delivered S_in.
    """
    rt = _runtime()
    for name, x in (("o", o), ("q", q), ("G", G), ("S_in", S_in)):
        if not rt.is_native(x) or x.ndim != 4:
            raise TypeError(f"{name} must be a 4-dimensional device array")
    B, T, H, K = (int(x) for x in q.shape)
    V = int(o.shape[3])
    if tuple(o.shape) != (B, T, H, V) or tuple(G.shape) != (B, T, H, K) or tuple(S_in.shape) != (B, H, K, V):
        raise ValueError(f"shapes disagree: o {o.shape}, q {q.shape}, G {G.shape}, S_in {S_in.shape}")
    if str(o.dtype) != str(q.dtype):
        raise TypeError(f"o has dtype {o.dtype}, expected {q.dtype} (the dtype of q)")
    if not o.flags.c_contiguous:
        raise ValueError("o must be C-contiguous (it is updated in place)")
    t = _type_of("q", q)
    if T == 0 or B * H == 0:
        return o
    q = _contig(q, rt)
    if _zeco_tc(rt, t, K, V, q, o):
        rt.launch(
            f"zeco_tc_correction<{t}>", (-(-T // 128), B * H), (_NT,),
            (o, q, _state32(G, rt), _state32(S_in, rt), f32(_scale(scale, K)), i32(B), i32(T), i32(H), i32(K), i32(V)),
            shared_mem=ZC_SMEM_CORRECTION,
        )  # fmt: skip
        return o
    rt.launch(
        f"gla_state_correction<{t}>", (-(-T // 64), B * H, -(-V // 64)), (_NT,),
        (o, _contig(q, rt), _state32(G, rt), _state32(S_in, rt), f32(_scale(scale, K)),
         i32(B), i32(T), i32(H), i32(K), i32(V)),
    )  # fmt: skip
    return o


def final_state(a: Any, S_in: Any, S_local: Any) -> Any:
    """``diag(a) S_in + S_local`` with ``a = exp(G_T) [B, H, K]`` (decay over the slice); float32."""
    xp = _runtime().xp
    return xp.asarray(S_local, dtype=xp.float32) + xp.asarray(a, dtype=xp.float32)[..., None] * S_in


def scan_combine(a: Any, S_in: Any, S_local: Any, out: Any = None) -> Any:
    """The scan operator's state part ``a * S_in + S_local`` (``a`` broadcast over the last axis), into ``out``."""
    res = a[..., None] * S_in + S_local
    if out is None:
        return res
    out[...] = res
    return out


def initial_state_grad(q: Any, g: Any, do: Any, scale: float | None = None, chunk_size: int = 64) -> Any:
    """``U = scale * sum_t (q_t * exp(G_t))^T do_t``: ``[B, H, K, V]`` float32 (the gradient into the
    slice's initial state from its own outputs; ZeCO's backward scans these in reverse)."""
    rt = _runtime()
    B, T, H, K, V, t = _check(q, q, do, g, rt=rt)
    C = _chunk(chunk_size)
    if T == 0 or B * H == 0:
        return rt.xp.zeros((B, H, K, V), dtype=rt.xp.float32)
    q, g, do = (_contig(x, rt) for x in (q, g, do))
    if _zeco_tc(rt, t, K, V, q, do):
        from .gla_tc import chunks_per_segment  # noqa: PLC0415

        G = decay_cumsum(g, chunk_size=C)
        NTc = -(-T // 64)
        NC = chunks_per_segment(rt, B * H, NTc)
        NS = -(-NTc // NC)
        part = rt.xp.empty((B * H, NS, K, V), dtype=rt.xp.float32)
        rt.launch(
            f"zeco_tc_qT_do<{t}>", (NS, B * H), (_NT,),
            (q, G, do, part, f32(_scale(scale, K)), i32(B), i32(T), i32(H), i32(K), i32(V), i32(NC), i32(NS)),
        )  # fmt: skip
        return part.sum(axis=1).reshape(B, H, K, V)
    NT = -(-T // C)
    dS, gtot = _local_states(rt, q, do, g, t, B, T, H, K, V, C, NT, 1, _scale(scale, K))
    return _scan(rt, dS, gtot, None, NT, K, V, B * H, reverse=True).reshape(B, H, K, V)


# ---------------------------------------------------------------------------------------------- numbers


def memory_floor(B: int, T: int, H: int, K: int, V: int, itemsize: int = 2, bandwidth: float = 4.3e12) -> dict:
    """Bytes of q, k, v, g read once and o written once, and that over ``bandwidth`` (seconds)."""
    nbytes = (3 * B * T * H * K + 2 * B * T * H * V) * itemsize
    return {"bytes": nbytes, "seconds": nbytes / bandwidth, "bandwidth": bandwidth}
