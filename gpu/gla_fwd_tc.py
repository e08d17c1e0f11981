"""Chunk-parallel tensor-core GLA forward for 16-bit inputs (kernels ``gla_tc_states.cu`` + ``gla_fwd_tc.cu``).

Same semantics as :func:`hpczeco.gpu.gla.chunk_gla` (``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, states
``[B, H, K, V]`` fp32, ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``), for bf16 / fp16
inputs with K, V multiples of 16, K up to 256 and V up to 512 (see :mod:`.gla_tc_states` for the accepted arrays and
which kernels run at which size). Two launches
before the incoming state is known (:func:`fwd_tc_prepare`: the state walk over segments and the segment scan)
and one or two after it (:meth:`FwdTC.finish`: carrying the initial state into the segment states, then one CTA
per chunk writing ``o``), so ZeCO overlaps its scan over ranks with the first part.

``rt`` is the kernel runtime (see :mod:`.gla_tc_states`); ``nc`` chunks per segment (default: enough segments
to fill the device), ``f32_states`` stores the per-chunk states in fp32 instead of 16 bits (default: 16 bits for
bf16, fp32 for fp16), ``walk`` picks the state walk (2: ``glatc_walk2``, the default; 1: ``glatc_walk``), ``out``
the output kernel (2: ``glatc_fwd_out``, two CTAs per SM, the default at K or V above 64 up to 128; 1:
``glatc_fwd_wide``, the default at K, V <= 64; 3: ``glatc_fwd_vt``, one CTA per chunk and 128 columns of V, any size,
the only one above 128).
"""

from __future__ import annotations

from typing import Any

from ..base.checks import check_scale
from . import gla_tc_states as st

__all__ = ["FwdTC", "fwd_tc_prepare", "fwd_tc"]


class FwdTC:
    """A forward whose local pass is done; :meth:`finish` writes ``o`` for a given initial state.

    ``local_final_state [B, H, K, V]`` fp32: the final state from a zero initial state; ``decay [B, H, K]``:
    ``exp`` of the gate summed over T (the pair ZeCO scans: final state = ``decay * S0 + local_final_state``).
    Keeps references to the inputs: leave them unmodified until :meth:`finish`.
    """

    def __init__(self, rt: Any, q: Any, k: Any, v: Any, g: Any, scale: float | None = None, *,
                 nc: int | None = None, f32_states: bool | None = None, walk: int | None = None,
                 out: int | None = None, bwd: int | None = None, vpc: int | None = None,
                 ktile: int | None = None):  # fmt: skip
        B, T, H, K, V, t = st.check_inputs(rt, q, k, v, g)
        self._rt, self._q, self._k, self._v, self._g = rt, q, k, v, g
        self.scale = check_scale(scale, K)
        self.geo = st.geometry(rt, B, T, H, K, V, t, nc, f32_states, walk, out, bwd, vpc, ktile)
        self.states = st.state_pass(rt, self.geo, k, v, g, reverse=False)
        self.local_final_state = self.states.fin.reshape(B, H, K, V)
        self.decay = st.decay_total(self.geo, self.states)

    def same_inputs(self, k: Any, v: Any, g: Any) -> bool:
        """Whether ``k, v, g`` are this forward's arrays (same shapes and data pointers): its chunk states then
        serve a backward of them (:class:`~hpczeco.gpu.gla_bwd_tc.BwdTC` ``fwd=``)."""
        mine = (self._k, self._v, self._g)
        return all(tuple(a.shape) == tuple(b.shape) and self._rt.ptr(a) == self._rt.ptr(b)
                   for a, b in zip(mine, (k, v, g)))  # fmt: skip

    def finish(self, initial_state: Any = None, output_final_state: bool = False) -> tuple[Any, Any]:
        """``(o [B, T, H, V] in the input dtype, final_state [B, H, K, V] fp32 or None)``."""
        rt, geo = self._rt, self.geo
        S0 = st.state32(rt, initial_state, geo.B, geo.H, geo.K, geo.V, "initial_state")
        Sf = st.carried(rt, geo, self.states, S0, reverse=False)
        o = rt.xp.empty((geo.B, geo.T, geo.H, geo.V), dtype=self._q.dtype)
        tiled = geo.out == 3  # glatc_fwd_vt: blockIdx.x = V tile group + groups * chunk
        rt.launch(
            st.fwd_name(geo.t, geo.km, geo.f32_states, geo.out), ((geo.v_groups if tiled else 1) * geo.NT, geo.BH),
            (st.CHUNK_THREADS,),
            (self._q, self._k, self._v, self._g, self.states.Hc, Sf, self.states.pc, o, st.f32(self.scale))
            + geo.dims() + (st.i32(geo.NC), st.i32(geo.NT), st.f32(st.SPAN_LIMIT[geo.t]))
            + ((st.i32(geo.vpc),) if tiled else ()),
            shared_mem=st.smem_fwd(geo.km, geo.out),
        )  # fmt: skip
        if not output_final_state:
            return o, None
        fin = self.local_final_state.copy() if S0 is None else self.local_final_state + self.decay[..., None] * S0
        return o, fin


def fwd_tc_prepare(rt: Any, q: Any, k: Any, v: Any, g: Any, scale: float | None = None, **opts: Any) -> FwdTC:
    """The local pass of the forward; see :class:`FwdTC` (``opts``: ``nc``, ``f32_states``, ``walk``, ``out``,
    ``vpc`` (V tiles per CTA of the tiled kernels), and ``bwd``, ``ktile``: the backward kernels of a
    :class:`~hpczeco.gpu.gla_bwd_tc.BwdTC` that reuses this forward)."""
    return FwdTC(rt, q, k, v, g, scale, **opts)


def fwd_tc(rt: Any, q: Any, k: Any, v: Any, g: Any, scale: float | None = None, initial_state: Any = None,
           output_final_state: bool = False, **opts: Any) -> tuple[Any, Any]:  # fmt: skip
    """GLA forward: ``(o [B, T, H, V], final_state [B, H, K, V] fp32 or None)``; ``fwd_tc_prepare(...).finish(...)``."""
    return FwdTC(rt, q, k, v, g, scale, **opts).finish(initial_state, output_final_state)
