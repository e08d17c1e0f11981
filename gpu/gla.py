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
talks MPI. This module is the forward/backward API; the pieces the ZeCO layer needs are exported here
too (from :mod:`hpczeco.gpu.gla_zeco`): :func:`decay_cumsum`, :func:`state_correction`,
:func:`final_state`, :func:`scan_combine`, :func:`initial_state_grad`.
"""

from __future__ import annotations

from typing import Any

from . import gla_tc
from .gla_common import (
    KERNEL_FILES,
    NT_SIMT,
    check_chunk,
    check_inputs,
    contig,
    cumsum_T,
    default_scale,
    f32,
    i32,
    kernel_group,  # noqa: F401 - re-exported
    kernel_names,
    kernel_source,
    prefix_suffix,
    runtime,
    set_runtime,
    state32,
    state_scan,
    tc_applies,
    warn_once,
)
from .gla_tc import local_states
from .gla_zeco import (
    ZC_SMEM_CORRECTION,  # noqa: F401 - re-exported
    decay_cumsum,
    final_state,
    initial_state_grad,
    scan_combine,
    state_correction,
)

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

# the former private names, reached through this module by drivers/gpu_suite.py and the tests (with
# kernel_group, ZC_SMEM_CORRECTION); new code imports them from gla_common / gla_tc
_KERNEL_FILES = KERNEL_FILES
_runtime = runtime
_set_runtime = set_runtime
_local_states = local_states
_scan = state_scan
_cumsum_T = cumsum_T


# ---------------------------------------------------------------------------------------------- forward


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
        self._pre, _, total = prefix_suffix(rt.xp, gtot)
        self.local_final_state = fin0.reshape(B, H, K, V)
        self.decay = rt.xp.exp(total).reshape(B, H, K)

    def finish(self, initial_state: Any = None, output_final_state: bool = False) -> tuple[Any, Any]:
        """``(o [B, T, H, V], final_state [B, H, K, V] fp32 or None)`` with ``initial_state`` (or zeros)."""
        rt, xp = self._rt, self._rt.xp
        B, T, H, K, V, C = self._dims
        S0 = state32(initial_state, rt)
        if S0 is not None and tuple(S0.shape) != (B, H, K, V):
            raise ValueError(f"initial_state has shape {list(S0.shape)}, expected {[B, H, K, V]}")
        pre = self._pre if S0 is not None else None
        o = xp.empty((B, T, H, V), dtype=self._q.dtype)
        if self.tensor_cores:
            gla_tc.finish(rt, self._q, self._k, self._v, self._g, self._st, o, self.scale, S0, pre, self._t,
                          B, T, H, K, V, self._nc)  # fmt: skip
        else:
            NT = -(-T // C)
            rt.launch(
                f"gla_chunk_output<{self._t}>", (NT, B * H, -(-V // 64)), (NT_SIMT,),
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
    rt = runtime()
    B, T, H, K, V, t = check_inputs(q, k, v, g, rt=rt)
    C = check_chunk(chunk_size)
    s = default_scale(scale, K)
    if impl not in ("auto", "simt", "tc"):
        raise ValueError(f"impl must be 'auto', 'simt' or 'tc', got {impl!r}")
    if T == 0 or B * H == 0:
        raise ValueError(f"chunk_gla_prepare needs T >= 1 and B*H >= 1, got q of shape {list(q.shape)}")
    if impl == "tc" and not tc_applies(t, K, V, C):
        raise ValueError(
            "impl='tc' needs bf16/fp16 inputs, K and V multiples of 16 up to 128 and chunk_size 64 "
            f"(got {t}, K={K}, V={V}, chunk_size={C})"
        )
    q, k, v, g = (contig(x, rt) for x in (q, k, v, g))
    aligned = all(rt.ptr(x) % 16 == 0 for x in (q, k, v, g))  # the tensor-core path loads 16 bytes at a time
    if impl == "tc" and not aligned:
        raise ValueError("impl='tc' needs q, k, v, g whose data pointers are 16-byte aligned")
    use_tc = impl == "tc" or (impl == "auto" and aligned and tc_applies(t, K, V, C))
    if use_tc and impl == "auto" and not rt.available("gla_tc.cu", t):
        warn_once(f"tensor-core GLA kernels unavailable ({rt.errors.get('gla_tc.cu:' + t, '?')[:300]}); using simt")
        use_tc = False
    if use_tc:
        st, gtot, fin0, nc = gla_tc.prepare(rt, k, v, g, t, B, T, H, K, V)
    else:
        NT = -(-T // C)
        st, gtot = local_states(rt, k, v, g, t, B, T, H, K, V, C, NT, 0, 1.0)
        fin0 = state_scan(rt, st, gtot, None, NT, K, V, B * H, reverse=False)
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
    rt = runtime()
    B, T, H, K, V, t = check_inputs(q, k, v, g, h0=initial_state, rt=rt)
    check_chunk(chunk_size)
    if T == 0 or B * H == 0:
        xp = rt.xp
        h0 = state32(initial_state, rt)
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
        self._pre, self._suf, total = prefix_suffix(rt.xp, gtot)
        self.decay = rt.xp.exp(total).reshape(B, H, K)
        self.dh0_local = U.reshape(B, H, K, V)
        self.local_final_state = S_T0.reshape(B, H, K, V)

    def finish(self, initial_state: Any = None, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` as :func:`chunk_gla_bwd` with this ``initial_state`` and ``dht``."""
        rt, xp = self._rt, self._rt.xp
        B, T, H, K, V, C = self._dims
        q, k, v, g, do = self._arrays
        t = self._t
        S0, D = state32(initial_state, rt), state32(dht, rt)
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
            f"gla_bwd_dqdk<{t}>", (NT, BH, -(-K // 32)), (NT_SIMT,),
            (q, k, v, g, do, self._S_in, self._dS, self._dA, dq, dk, dG, f32(self.scale)) + geo + (S0, pre, D, suf),
        )  # fmt: skip
        dv = xp.empty((B, T, H, V), dtype=q.dtype)
        rt.launch(
            f"gla_bwd_dv<{t}>", (NT, BH, -(-V // 64)), (NT_SIMT,),
            (k, g, do, self._A, self._dS, dv, f32(self.scale)) + geo + (D, suf),
        )  # fmt: skip
        base = None
        if D is not None:
            S_T = self.local_final_state if S0 is None else self.local_final_state + self.decay[..., None] * S0
            base = xp.ascontiguousarray((S_T * D).sum(axis=-1).reshape(BH, K), dtype=xp.float32)
        dg = cumsum_T(rt, dG, "float", t, q.dtype, B, T, H, K, C, reverse=True, base=base)
        dh0 = self.dh0_local.copy() if D is None else self.dh0_local + self.decay[..., None] * D
        return dq, dk, dv, dg, dh0


def chunk_gla_bwd_prepare(
    q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, chunk_size: int = 64
) -> GLABackward:
    """The state passes of the backward (zero-start chunk states and d-states, intra-chunk scores).

    Shapes as :func:`chunk_gla_bwd` (T >= 1). Keeps references to the inputs until :meth:`GLABackward.finish`.
    """
    rt = runtime()
    B, T, H, K, V, t = check_inputs(q, k, v, g, do=do, rt=rt)
    C = check_chunk(chunk_size)
    s = default_scale(scale, K)
    if T == 0 or B * H == 0:
        raise ValueError(f"chunk_gla_bwd_prepare needs T >= 1 and B*H >= 1, got q of shape {list(q.shape)}")
    xp = rt.xp
    q, k, v, g, do = (contig(x, rt) for x in (q, k, v, g, do))
    NT, BH = -(-T // C), B * H
    # incoming state of every chunk from a zero start, and the final state
    S_in, gtot = local_states(rt, k, v, g, t, B, T, H, K, V, C, NT, 0, 1.0)
    S_T0 = state_scan(rt, S_in, gtot, None, NT, K, V, BH, reverse=False)
    # gradient into every chunk's end state (dht = 0), and into the initial state
    dS, _ = local_states(rt, q, do, g, t, B, T, H, K, V, C, NT, 1, s)
    U = state_scan(rt, dS, gtot, None, NT, K, V, BH, reverse=True)
    A = xp.empty((BH, NT, 64, 64), dtype=xp.float32)
    dA = xp.empty((BH, NT, 64, 64), dtype=xp.float32)
    geo = (i32(B), i32(T), i32(H), i32(K), i32(V), i32(C), i32(NT))
    rt.launch(f"gla_bwd_scores<{t}>", (NT, BH), (NT_SIMT,), (q, k, v, g, do, A, dA) + geo)
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
    rt = runtime()
    B, T, H, K, V, t = check_inputs(q, k, v, g, do=do, h0=initial_state, dht=dht, rt=rt)
    check_chunk(chunk_size)
    if T == 0 or B * H == 0:
        xp = rt.xp
        dH = state32(dht, rt)
        z = xp.zeros((B, T, H, K), dtype=q.dtype)
        dh0 = xp.zeros((B, H, K, V), dtype=xp.float32) if dH is None else dH.copy()
        return z, z.copy(), xp.zeros((B, T, H, V), dtype=q.dtype), z.copy(), dh0
    plan = chunk_gla_bwd_prepare(q, k, v, g, do, scale=scale, chunk_size=chunk_size)
    return plan.finish(initial_state, dht)


# ---------------------------------------------------------------------------------------------- numbers


def memory_floor(B: int, T: int, H: int, K: int, V: int, itemsize: int = 2, bandwidth: float = 4.3e12) -> dict:
    """Bytes of q, k, v, g read once and o written once, and that over ``bandwidth`` (seconds)."""
    nbytes = (3 * B * T * H * K + 2 * B * T * H * V) * itemsize
    return {"bytes": nbytes, "seconds": nbytes / bandwidth, "bandwidth": bandwidth}
