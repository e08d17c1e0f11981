"""Chunked gated linear attention on the GPU (CuPy + CUDA C++ kernels from the ``*.cu`` files here, and Numba CUDA
kernels for float64).

Same semantics as :mod:`hpczeco.gla` (flash-linear-attention's ``chunk_gla``): ``q, k, g: [B, T, H, K]``,
``v, o: [B, T, H, V]``, states ``[B, H, K, V]``, ``g`` the log forget gate (<= 0)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,      o_t = scale * q_t S_t   (inclusive)

Inputs (one convention for every function here): CuPy arrays of float64, float32, float16 or bfloat16 -- CuPy's
``bfloat16`` dtype (CuPy with ml_dtypes) or ``uint16`` arrays holding raw bfloat16 bit patterns. Outputs
(``o``, ``dq``, ``dk``, ``dv``, ``dg``) come in the same form as the inputs; states, ``dh0``, ``decay`` and
the ZeCO pieces' states are float32 (float64 for float64 inputs); ``initial_state`` / ``dht`` are cast to that.
Arithmetic and states are float32 for float32 and 16-bit inputs, float64 for float64 inputs. Every decay factor is
``exp`` of a non-positive number (taken relative to a later position in the same chunk / sub-chunk), so gates down
to -8 per token and beyond are safe.

Implementations (``impl``), same results to rounding:

- ``"tc-chunk"`` (bf16/fp16, K and V multiples of 16, K up to 256 and V up to 512, chunk size 64, 16-byte aligned
  inputs): the
  chunk-parallel tensor-core kernels (``mma.sync`` bf16/fp16 -> fp32; :mod:`.gla_fwd_tc`, :mod:`.gla_bwd_tc`):
  state walks over segments of chunks, a segment scan, then one CTA per chunk for ``o`` (forward) or for
  dq, dk, dv, dg together (backward); see docs/benchmarks/gla_tc_design.md;
- ``"simt"``: general kernels (any K, V, chunk size 1..64, fp32 too) on CUDA cores, fp32 FMA -- the reference
  the tensor-core kernels are checked against;
- ``"numba"`` (float64 inputs, and only those): the Numba CUDA kernels of :mod:`.gla_numba`, float64 throughout.

``impl="auto"`` takes ``"numba"`` for float64 inputs, else ``"tc-chunk"`` where it applies, else ``"simt"``.
Nothing here talks MPI. This module is the forward/backward API; the pieces the ZeCO layer needs are exported here
too (from :mod:`hpczeco.gpu.gla_zeco`): :func:`decay_cumsum`, :func:`state_correction`, :func:`final_state`,
:func:`scan_combine`, :func:`initial_state_grad`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..base.checks import check_chunk_size, check_scale
from . import gla_tc_states
from .gla_bwd_tc import BwdTC
from .gla_common import (
    KERNELS,  # noqa: F401 - re-exported
    NT_SIMT,
    RUNTIME,
    check_inputs,
    contig,
    cumsum_T,
    f32,
    i32,
    kernel_group,  # noqa: F401 - re-exported
    kernel_names,
    local_states,
    prefix_suffix,
    state32,
    state64,
    state_scan,
    warn_once,
)
from .gla_fwd_tc import FwdTC
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
    "FORWARD_IMPLS",
    "BACKWARD_IMPLS",
    "decay_cumsum",
    "state_correction",
    "final_state",
    "scan_combine",
    "initial_state_grad",
    "kernel_names",
    "memory_floor",
    "KERNELS",
    "RUNTIME",
]

if TYPE_CHECKING:
    from .gla_numba import NumbaBackward, NumbaForward

#: accepted ``impl`` values of the forward and of the backward
FORWARD_IMPLS = ("auto", "tc-chunk", "simt", "numba")
BACKWARD_IMPLS = FORWARD_IMPLS


def _numba() -> Any:
    """:mod:`hpczeco.gpu.gla_numba` (imported on first use: it imports ``numba.cuda``)."""
    from . import gla_numba  # noqa: PLC0415

    return gla_numba


def _chunk_tc_built(rt: Any, t: str, backward: bool, large: bool = False) -> bool:
    """The chunk-parallel tensor-core modules this call needs compile (NVRTC; the emulation has them all); ``large``:
    K or V above 128 (the tiled kernels of gla_tc_large.cu)."""
    group = t + ("-f32s" if t == "f16" else "")  # fp16 keeps fp32 chunk states (gla_tc_states.geometry)
    chunk_file = "gla_tc_large.cu" if large else ("gla_bwd_tc.cu" if backward else "gla_fwd_tc.cu")
    needs = (("gla_tc_states.cu", "common"), ("gla_tc_states.cu", group), (chunk_file, group))
    for file, grp in needs:
        if not rt.available(file, grp):
            warn_once(f"chunk-parallel tensor-core GLA kernels unavailable ({file} [{grp}]: "
                      f"{getattr(rt, 'errors', {}).get(file + ':' + grp, '?')[:300]}); using the simt kernels")
            return False
    return True


def _pick(rt: Any, impl: str, allowed: tuple[str, ...], t: str, K: int, V: int, C: int, arrays, backward: bool) -> str:
    """The implementation a call runs: ``impl`` checked against what applies, or the best that applies."""
    if impl not in allowed:
        raise ValueError(f"impl must be one of {', '.join(repr(a) for a in allowed)}, got {impl!r}")
    if (t == "f64") != (impl == "numba") and impl != "auto":
        raise ValueError(f"impl={impl!r} does not take {'float64' if t == 'f64' else t} inputs: float64 inputs run "
                         "on impl='numba' (or 'auto'), the other dtypes on 'tc-chunk' or 'simt'")
    if t == "f64":
        return "numba"
    if impl == "simt":
        return impl
    # the chunk-parallel kernels: K up to 256, V up to 512 (gla_tc_states)
    applies = C == 64 and gla_tc_states.applies(t, K, V)
    aligned = all(rt.ptr(x) % 16 == 0 for x in arrays)  # the tensor-core kernels load 16 bytes at a time
    if impl != "auto":
        if not applies:
            raise ValueError(
                f"impl={impl!r} needs bf16/fp16 inputs, K and V multiples of 16 (K up to 256, V up to 512) and "
                f"chunk_size 64 (got {t}, K={K}, V={V}, chunk_size={C})"
            )
        if not aligned:
            raise ValueError(f"impl={impl!r} needs input arrays whose data pointers are 16-byte aligned")
        return impl
    if not (applies and aligned):
        return "simt"
    if _chunk_tc_built(rt, t, backward, max(K, V) > 128):
        return "tc-chunk"
    return "simt"


# ---------------------------------------------------------------------------------------------- forward


class GLAForward:
    """A chunked GLA forward whose local pass is done (:func:`chunk_gla_prepare`); :meth:`finish` writes ``o``.

    ``local_final_state [B, H, K, V]`` (fp32): the final state from a zero initial state.
    ``decay [B, H, K]`` (fp32): ``exp`` of the gate summed over T. With an initial state ``S0`` the final
    state is ``decay[..., None] * S0 + local_final_state`` -- the pair ZeCO scans over ranks, so a rank
    can prepare, scan, then finish with the incoming state (no correction pass over ``o``).
    ``impl``: the implementation that runs ("tc-chunk" or "simt"; float64 inputs get
    :class:`hpczeco.gpu.gla_numba.NumbaForward`, "numba", with the same interface). A "tc-chunk" forward can hand
    its chunk states to the backward of the same arrays (:func:`chunk_gla_bwd_prepare` ``fwd=``).
    """

    def __init__(self, rt, q, k, v, g, scale, t, dims, impl, st=None, gtot=None, fin0=None, tc=None):
        self._rt, self._q, self._k, self._v, self._g = rt, q, k, v, g
        self.scale, self._t, self._dims, self.impl = scale, t, dims, impl
        self.tensor_cores = impl != "simt"
        self._tc: FwdTC | None = tc
        B, T, H, K, V, C = dims
        if tc is not None:
            self.local_final_state, self.decay = tc.local_final_state, tc.decay
            return
        self._st, self._gtot = st, gtot
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
        if self._tc is not None:
            return self._tc.finish(S0, output_final_state)
        pre = self._pre if S0 is not None else None
        o = xp.empty((B, T, H, V), dtype=self._q.dtype)
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
) -> GLAForward | NumbaForward:
    """The local pass of the forward (chunk or segment states from a zero start); see :class:`GLAForward`.

    ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]`` CuPy arrays (T >= 1). ``impl`` as :func:`chunk_gla`.
    Keeps references to the inputs: leave them unmodified until :meth:`GLAForward.finish` (and until the
    backward that reuses its chunk states).
    """
    rt = RUNTIME.get()
    B, T, H, K, V, t = check_inputs(q, k, v, g, rt=rt)
    C = check_chunk_size(chunk_size, device=True)
    s = check_scale(scale, K)
    if impl not in FORWARD_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(repr(a) for a in FORWARD_IMPLS)}, got {impl!r}")
    if T == 0 or B * H == 0:
        raise ValueError(f"chunk_gla_prepare needs T >= 1 and B*H >= 1, got q of shape {list(q.shape)}")
    q, k, v, g = (contig(x, rt) for x in (q, k, v, g))
    use = _pick(rt, impl, FORWARD_IMPLS, t, K, V, C, (q, k, v, g), backward=False)
    dims = (B, T, H, K, V, C)
    if use == "numba":
        return _numba().NumbaForward(rt.xp, q, k, v, g, s, C)
    if use == "tc-chunk":
        return GLAForward(rt, q, k, v, g, s, t, dims, use, tc=FwdTC(rt, q, k, v, g, s))
    NT = -(-T // C)
    st, gtot = local_states(rt, k, v, g, t, B, T, H, K, V, C, NT, 0, 1.0)
    fin0 = state_scan(rt, st, gtot, None, NT, K, V, B * H, reverse=False)
    return GLAForward(rt, q, k, v, g, s, t, dims, use, st, gtot, fin0)


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
    """GLA forward on the GPU: ``(o [B, T, H, V] in the input form, final_state [B, H, K, V] or None)`` (the final
    state fp32, float64 for float64 inputs).

    ``impl``: "auto" | "tc-chunk" | "simt" | "numba" (see the module docstring). Runs on the current CuPy stream; no
    host synchronisation. Same as ``chunk_gla_prepare(...).finish(initial_state, output_final_state)``.
    """
    rt = RUNTIME.get()
    B, T, H, K, V, t = check_inputs(q, k, v, g, h0=initial_state, rt=rt)
    check_chunk_size(chunk_size, device=True)
    check_scale(scale)
    if T == 0 or B * H == 0:
        xp = rt.xp
        h0 = (state64 if t == "f64" else state32)(initial_state, rt)
        o = xp.zeros((B, T, H, V), dtype=q.dtype)
        fin = xp.zeros((B, H, K, V), dtype=xp.float64 if t == "f64" else xp.float32) if h0 is None else h0.copy()
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
    initial state is ``dh0_local + decay[..., None] * D`` -- ZeCO's reverse scan pair. ``impl``: "tc-chunk" or
    "simt"; ``reused_forward``: whether the forward's chunk states were reused.
    """

    def __init__(self, rt, arrays, scale, t, dims, impl, S_in=None, S_T0=None, dS=None, U=None, gtot=None, A=None,
                 dA=None, tc=None, reused_forward=False):  # fmt: skip
        self._rt, self._arrays, self.scale, self._t, self._dims = rt, arrays, scale, t, dims
        self.impl, self.reused_forward = impl, reused_forward
        self._tc: BwdTC | None = tc
        B, T, H, K, V, C = dims
        if tc is not None:
            self.decay, self.dh0_local, self.local_final_state = tc.decay, tc.dh0_local, tc.local_final_state
            return
        self._S_in, self._dS, self._A, self._dA = S_in, dS, A, dA
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
        if self._tc is not None:
            return self._tc.finish(S0, D)
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
    q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, chunk_size: int = 64, *,
    impl: str = "auto", fwd: GLAForward | None = None,
) -> GLABackward | NumbaBackward:  # fmt: skip
    """The state passes of the backward (zero-start chunk states and d-states; simt: also the intra-chunk scores).

    Shapes as :func:`chunk_gla_bwd` (T >= 1); ``impl``: "auto" | "tc-chunk" | "simt" | "numba". ``fwd``: the
    :class:`GLAForward` of the same ``k, v, g`` (same arrays) and scale, whose chunk states a "tc-chunk" backward
    reuses instead of recomputing them (ignored where it does not apply). Keeps references to the inputs until
    :meth:`GLABackward.finish`.
    """
    rt = RUNTIME.get()
    B, T, H, K, V, t = check_inputs(q, k, v, g, do=do, rt=rt)
    C = check_chunk_size(chunk_size, device=True)
    s = check_scale(scale, K)
    if T == 0 or B * H == 0:
        raise ValueError(f"chunk_gla_bwd_prepare needs T >= 1 and B*H >= 1, got q of shape {list(q.shape)}")
    xp = rt.xp
    q, k, v, g, do = (contig(x, rt) for x in (q, k, v, g, do))
    dims = (B, T, H, K, V, C)
    use = _pick(rt, impl, BACKWARD_IMPLS, t, K, V, C, (q, k, v, g, do), backward=True)
    if use == "numba":
        return _numba().NumbaBackward(xp, q, k, v, g, do, s, C)
    if use == "tc-chunk":
        ftc = fwd._tc if isinstance(fwd, GLAForward) else None
        reuse = ftc is not None and ftc.same_inputs(k, v, g)
        tc = BwdTC(rt, q, k, v, g, do, s, fwd=ftc if reuse else None)
        return GLABackward(rt, (q, k, v, g, do), s, t, dims, use, tc=tc, reused_forward=reuse)
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
    return GLABackward(rt, (q, k, v, g, do), s, t, dims, use, S_in, S_T0, dS, U, gtot, A, dA)


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
    *,
    impl: str = "auto",
) -> tuple[Any, Any, Any, Any, Any]:
    """GLA backward on the GPU: ``(dq, dk, dv, dg, dh0)``.

    Gradients of ``sum(o * do) + sum(S_T * dht)``; dq, dk, dg ``[B, T, H, K]`` and dv ``[B, T, H, V]``
    in the input form; ``dh0 [B, H, K, V]`` always returned (fp32; float64 for float64 inputs). ``dg =
    reverse_cumsum(q*dq - k*dk) + rowsum(S_T * dht)`` at every position. ``impl``: "auto" | "tc-chunk" | "simt" |
    "numba". Runs on the current CuPy stream. Same as ``chunk_gla_bwd_prepare(...).finish(initial_state, dht)``
    (which can also reuse a forward's chunk states).
    """
    rt = RUNTIME.get()
    B, T, H, K, V, t = check_inputs(q, k, v, g, do=do, h0=initial_state, dht=dht, rt=rt)
    check_chunk_size(chunk_size, device=True)
    check_scale(scale)
    if impl not in BACKWARD_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(repr(a) for a in BACKWARD_IMPLS)}, got {impl!r}")
    if T == 0 or B * H == 0:
        xp = rt.xp
        dH = (state64 if t == "f64" else state32)(dht, rt)
        z = xp.zeros((B, T, H, K), dtype=q.dtype)
        dh0 = xp.zeros((B, H, K, V), dtype=xp.float64 if t == "f64" else xp.float32) if dH is None else dH.copy()
        return z, z.copy(), xp.zeros((B, T, H, V), dtype=q.dtype), z.copy(), dh0
    plan = chunk_gla_bwd_prepare(q, k, v, g, do, scale=scale, chunk_size=chunk_size, impl=impl)
    return plan.finish(initial_state, dht)


# ---------------------------------------------------------------------------------------------- numbers


def memory_floor(B: int, T: int, H: int, K: int, V: int, itemsize: int = 2, bandwidth: float = 4.3e12,
                 backward: bool = False) -> dict:  # fmt: skip
    """Bytes of q, k, v, g read once and o written once (``backward``: q, k, v, g, do read once and dq, dk, dv, dg
    written once), and that over ``bandwidth`` (seconds)."""
    E = B * T * H
    nbytes = (3 * E * K + 2 * E * V) * itemsize if not backward else (6 * E * K + 3 * E * V) * itemsize
    return {"bytes": nbytes, "seconds": nbytes / bandwidth, "bandwidth": bandwidth}
