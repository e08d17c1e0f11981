"""What the host side of the GPU GLA (:mod:`hpczeco.gpu.gla`, ``gla_zeco``, ``gla_*_tc``) shares.

The kernel registry of ``gla_kernels.cu``, ``gla_zeco.cu`` and the chunk-parallel tensor-core files
``gla_tc_states.cu``, ``gla_fwd_tc.cu``, ``gla_bwd_tc.cu`` (name expressions, and the group each compiles in:
input type, plus fp32 chunk-state storage for the last three) and its runtime slot; the argument checks; the simt
launches every pass uses: the chunk local states (``gla_chunk_outer``), the scan over chunk states
(``gla_state_scan``), cumulative sums along T (``seg_*``), and the exclusive prefix / suffix decays of chunk
totals. Layouts: ``[B, T, H, K]`` inputs, chunk states ``[B*H, NT, K, V]`` and chunk decay totals ``[B*H, NT, K]``
float32. Nothing here talks MPI.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np

from . import gla_tc_states
from .runtime import KernelSet, RuntimeSlot

NT_SIMT = 256  # threads per block of the simt kernels (GLA_NT in gla_kernels.cu)
KERNEL_FILES = ("gla_kernels.cu", "gla_zeco.cu") + gla_tc_states.KERNEL_FILES
_TYPES = {"float32": "float", "float16": "f16", "bfloat16": "bf16", "uint16": "bf16", "float64": "f64"}
_TYPE_OF_DTYPE: dict[Any, str] = {}  # dtype object -> its entry of _TYPES

i32 = np.int32
f32 = np.float32


# ---------------------------------------------------------------------------------------------- kernels


def _file_kernel_names(file: str) -> list[str]:
    if file in gla_tc_states.KERNEL_FILES:
        return gla_tc_states.file_kernel_names(file)
    names: dict[str, list[str]] = {"gla_kernels.cu": ["gla_state_scan", "seg_carry"], "gla_zeco.cu": []}
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
        names["gla_zeco.cu"] += [f"zeco_tc_correction<{t}>", f"zeco_tc_qT_do<{t}>"]
    return names[file]


@functools.cache
def kernel_group(name: str) -> str:
    """The module a kernel name expression compiles in: its input type "bf16", "f16", "float", or "common"; the
    chunk-parallel tensor-core kernels (``glatc_*``) with fp32 chunk states in "bf16-f32s" / "f16-f32s"."""
    lt = name.find("<")
    if lt < 0:
        return "common"
    args = [a.strip() for a in name[lt + 1 : name.rfind(">")].split(",")]
    for a in args:
        if a in ("bf16", "f16"):
            return a + "-f32s" if name.startswith("glatc_") and args[2] == "true" else a
    return "common" if name.startswith("seg_") else "float"  # small fp32 sums serve every input type


#: the GLA kernels: one NVRTC module per file and input type (a bf16 run never compiles the fp32/fp16 ones)
KERNELS = KernelSet(
    label="hpczeco.gpu.gla",
    files=KERNEL_FILES,
    names=_file_kernel_names,
    options=("-std=c++17", "--use_fast_math"),
    group=kernel_group,
)
#: the runtime the GLA wrappers launch on (CuPy unless a test has set another, e.g. the CPU emulation)
RUNTIME = RuntimeSlot(KERNELS)


def kernel_names(file: str | None = None) -> list[str]:
    """Kernel name expressions (template instantiations) of ``file`` (a ``gpu/*.cu`` name), or of all files."""
    return KERNELS.kernel_names(file)


_WARNED: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------- checks


def type_of(name: str, x: Any) -> str:
    """The kernels' element type of ``x``: "float", "f16", "bf16" (the CuPy kernels) or "f64" (the Numba kernels,
    :mod:`hpczeco.gpu.gla_numba`); ``TypeError`` for any other dtype."""
    t = _TYPE_OF_DTYPE.get(x.dtype)  # str(dtype) is slow Python in numpy; asked several times per call
    if t is not None:
        return t
    dt = str(x.dtype)
    if dt not in _TYPES:
        raise TypeError(
            f"{name} has dtype {dt}; the GPU GLA takes float64, float32, float16 or bfloat16 "
            "(or uint16 raw bfloat16 bits)"
        )
    _TYPE_OF_DTYPE[x.dtype] = _TYPES[dt]
    return _TYPES[dt]


_STATE_DTYPES = ("float32", "float16", "bfloat16", "float64")


def check_inputs(q, k, v, g, do=None, h0=None, dht=None, rt=None):
    """Check device, rank, shapes and dtypes; ``(B, T, H, K, V, element type)``. ``initial_state`` / ``dht`` are
    floating arrays (float32 preferred; raw ``uint16`` bits are taken for q, k, v, g, do only)."""
    rt = rt or RUNTIME.get()
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
        if x is not None and str(x.dtype) not in _STATE_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; states are float32 (raw uint16 bfloat16 bits are taken "
                            "for q, k, v, g and do only)")
    t = type_of("q", q)
    for name, x in (("k", k), ("v", v), ("g", g), ("do", do)):
        if x is not None and x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, expected {q.dtype} (the dtype of q)")
    if K < 1 or V < 1:
        raise ValueError(f"K and V must be >= 1, got K={K}, V={V}")
    return B, T, H, K, V, t


def contig(x, rt):
    return None if x is None else rt.xp.ascontiguousarray(x)


def state32(x, rt):
    return None if x is None else rt.xp.ascontiguousarray(x, dtype=rt.xp.float32)


def state64(x, rt):
    return None if x is None else rt.xp.ascontiguousarray(x, dtype=rt.xp.float64)


# ---------------------------------------------------------------------------------------------- simt passes


def local_states(rt, left, right, g, t, B, T, H, K, V, C, NT, mode, scale):
    """Per-chunk local states ``[B*H, NT, K, V]`` and chunk decay totals ``[B*H, NT, K]`` (fp32, simt kernels).

    mode 0: ``sum_t (left_t * exp(bL - b_t))^T right_t`` (the chunk's state from zero); mode 1:
    ``scale * sum_t (left_t * exp(b_t))^T right_t`` (its d-state), ``b`` the gate's cumulative sum in the chunk.
    """
    xp = rt.xp
    st = xp.empty((B * H, NT, K, V), dtype=xp.float32)
    gtot = xp.empty((B * H, NT, K), dtype=xp.float32)
    grid = (NT, B * H, -(-K // 32) * -(-V // 32))
    rt.launch(
        f"gla_chunk_outer<{t}>", grid, (NT_SIMT,),
        (left, right, g, st, gtot, i32(B), i32(T), i32(H), i32(K), i32(V), i32(C), i32(NT), i32(mode), f32(scale)),
    )  # fmt: skip
    return st, gtot


def state_scan(rt, st, gtot, init, NT, K, V, BH, reverse: bool):
    """In place over chunks of ``st [BH, NT, K, V]`` (local -> incoming states, or reverse: gradients into the
    chunk ends); returns the final state ``[BH, K, V]`` fp32."""
    xp = rt.xp
    fin = xp.empty((BH, K, V), dtype=xp.float32)
    rt.launch(
        "gla_state_scan", (-(-K * V // NT_SIMT), BH), (NT_SIMT,),
        (st, gtot, init, fin, i32(NT), i32(K), i32(V), i32(1 if reverse else 0)),
    )  # fmt: skip
    return fin


def cumsum_T(rt, x, tin: str, tout: str, out_dtype, B, T, H, K, C, reverse: bool, base=None):
    """Inclusive (reverse: suffix) cumulative sum of ``x [B, T, H, K]`` along T, plus ``base [B*H, K]``."""
    xp = rt.xp
    NT = -(-T // C)
    ctot = xp.empty((B * H, NT, K), dtype=xp.float32)
    rt.launch(
        f"seg_chunk_sum<{tin}>", (NT, B * H), (NT_SIMT,), (x, ctot, i32(B), i32(T), i32(H), i32(K), i32(C), i32(NT))
    )
    rt.launch(
        "seg_carry", (-(-B * H * K // NT_SIMT),), (NT_SIMT,),
        (ctot, base, i32(B * H), i32(K), i32(NT), i32(1 if reverse else 0)),
    )  # fmt: skip
    out = xp.empty((B, T, H, K), dtype=out_dtype)
    rt.launch(
        f"seg_finish<{tin}, {tout}>", (NT, B * H), (NT_SIMT,),
        (x, ctot, out, i32(B), i32(T), i32(H), i32(K), i32(C), i32(NT), i32(1 if reverse else 0)),
    )  # fmt: skip
    return out


def prefix_suffix(xp, gtot):
    """Per chunk (or segment) c of ``gtot [BH, N, K]`` (its total log decay): the log decay before c
    (exclusive prefix), after c (exclusive suffix) and over everything ``[BH, K]``; all fp32, <= 0."""
    inc = xp.cumsum(gtot, axis=1)
    zero = xp.zeros_like(gtot[:, :1])
    pre = xp.ascontiguousarray(xp.concatenate([zero, inc[:, :-1]], axis=1), dtype=xp.float32)
    rinc = xp.flip(xp.cumsum(xp.flip(gtot, axis=1), axis=1), axis=1)
    suf = xp.ascontiguousarray(xp.concatenate([rinc[:, 1:], zero], axis=1), dtype=xp.float32)
    return pre, suf, xp.ascontiguousarray(inc[:, -1], dtype=xp.float32)
