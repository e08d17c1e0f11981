"""Tensor-core GLA backward for 16-bit inputs (kernels ``gla_tc_states.cu`` + ``gla_bwd_tc.cu``).

Same semantics as :func:`hpczeco.gpu.gla.chunk_gla_bwd`: gradients of ``sum(o * do) + sum(S_T * dht)``;
``dq, dk, dg [B, T, H, K]`` and ``dv [B, T, H, V]`` in the input dtype, ``dh0 [B, H, K, V]`` fp32 (always).
bf16 / fp16 inputs with K, V multiples of 16, K up to 256 and V up to 512 (see :mod:`.gla_tc_states`).

:func:`bwd_tc_prepare` runs what needs neither the initial state nor dht: the forward state walk (chunk states
inside segments), the reverse walk (gradients into chunk ends inside segments, from ``scale (q exp(b))^T do``),
and both segment scans. :meth:`BwdTC.finish` carries ``initial_state`` and ``dht`` into the segment states and
runs one fused kernel per chunk (scores, dq, dk, dv and dg, the last without any pass over the whole sequence;
``bwd=1``, K and V up to 128), or two tiled ones (``bwd=2``, the default above 128: ``glatc_bwd_kt`` writes dq, dk,
dg per chunk and 128 columns of K, ``glatc_bwd_vt`` dv per chunk and 128 columns of V).
"""

from __future__ import annotations

from typing import Any

from ..base.checks import check_scale
from . import gla_tc_states as st

__all__ = ["BwdTC", "bwd_tc_prepare", "bwd_tc"]


class BwdTC:
    """A backward whose state passes are done; :meth:`finish` writes the gradients.

    ``dh0_local [B, H, K, V]`` fp32: the gradient into the initial state when dht is zero; ``decay [B, H, K]``:
    ``exp`` of the gate summed over T; ``local_final_state``: the final state from a zero initial state. With
    ``dht = D`` the gradient into the initial state is ``dh0_local + decay * D`` (ZeCO's reverse scan pair).
    Keeps references to the inputs until :meth:`finish`. ``fwd`` (optional): a :class:`FwdTC` of the same
    k, v, g (same arrays: ``ValueError`` otherwise) whose chunk states are reused instead of recomputed (its
    ``nc``, ``f32_states``, ``walk``, ``bwd``, ``vpc`` and ``ktile`` then apply).
    """

    def __init__(self, rt: Any, q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, *,
                 nc: int | None = None, f32_states: bool | None = None, walk: int | None = None,
                 bwd: int | None = None, vpc: int | None = None, ktile: int | None = None,
                 fwd: Any = None):  # fmt: skip
        B, T, H, K, V, t = st.check_inputs(rt, q, k, v, g, do)
        self._rt, self._arrays = rt, (q, k, v, g, do)
        self.scale = check_scale(scale, K)
        if fwd is not None:
            if not fwd.same_inputs(k, v, g):
                raise ValueError("fwd is the forward of other arrays than these k, v, g: its chunk states do not apply")
            self.geo, self.fstates = fwd.geo, fwd.states
        else:
            self.geo = st.geometry(rt, B, T, H, K, V, t, nc, f32_states, walk, bwd=bwd, vpc=vpc, ktile=ktile)
            self.fstates = st.state_pass(rt, self.geo, k, v, g, reverse=False)
        self.rstates = st.state_pass(rt, self.geo, q, do, g, reverse=True, scale=self.scale, gseg=self.fstates.gseg)
        self.local_final_state = self.fstates.fin.reshape(B, H, K, V)
        self.dh0_local = self.rstates.fin.reshape(B, H, K, V)
        self.decay = st.decay_total(self.geo, self.fstates)

    def finish(self, initial_state: Any = None, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` with this ``initial_state`` and ``dht`` (None: zeros)."""
        rt, geo, xp = self._rt, self.geo, self._rt.xp
        q, k, v, g, do = self._arrays
        S0 = st.state32(rt, initial_state, geo.B, geo.H, geo.K, geo.V, "initial_state")
        D = st.state32(rt, dht, geo.B, geo.H, geo.K, geo.V, "dht")
        Sf = st.carried(rt, geo, self.fstates, S0, reverse=False)
        Df = st.carried(rt, geo, self.rstates, D, reverse=True)
        dq = xp.empty(q.shape, dtype=q.dtype)
        dk = xp.empty(q.shape, dtype=q.dtype)
        dg = xp.empty(q.shape, dtype=q.dtype)
        dv = xp.empty(v.shape, dtype=q.dtype)
        tail = geo.dims() + (st.i32(geo.NC), st.i32(geo.NT), st.f32(st.SPAN_LIMIT[geo.t]))
        if geo.bwd == 1:
            rt.launch(
                st.bwd_name(geo.t, geo.km, geo.f32_states), (geo.NT, geo.BH), (st.CHUNK_THREADS,),
                (q, k, v, g, do, self.fstates.Hc, Sf, self.fstates.pc, self.rstates.Hc, Df, self.rstates.pc,
                 dq, dk, dv, dg, st.f32(self.scale)) + tail,
                shared_mem=st.smem_bwd(geo.km),
            )  # fmt: skip
        else:  # tiled: dq, dk, dg per (K tile, chunk); dv per (V tile, chunk); blockIdx.x = tile + tiles * chunk
            kt, vt = st.bwd_tiled_names(geo.t, geo.f32_states, geo.ktile)
            smem_kt, smem_vt = st.smem_bwd_tiled(geo.ktile)
            rt.launch(
                kt, (-(-geo.K // geo.ktile) * geo.NT, geo.BH), (st.CHUNK_THREADS,),
                (q, k, v, g, do, self.fstates.Hc, Sf, self.fstates.pc, self.rstates.Hc, Df, self.rstates.pc,
                 dq, dk, dg, st.f32(self.scale)) + tail,
                shared_mem=smem_kt,
            )  # fmt: skip
            rt.launch(
                vt, (geo.v_groups * geo.NT, geo.BH), (st.CHUNK_THREADS,),
                (q, k, g, do, self.rstates.Hc, Df, self.rstates.pc, dv, st.f32(self.scale)) + tail
                + (st.i32(geo.vpc),),
                shared_mem=smem_vt,
            )  # fmt: skip
        dh0 = self.dh0_local.copy() if D is None else self.dh0_local + self.decay[..., None] * D
        return dq, dk, dv, dg, dh0


def bwd_tc_prepare(rt: Any, q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None,
                   **opts: Any) -> BwdTC:  # fmt: skip
    """The state passes of the backward; see :class:`BwdTC` (``opts``: ``nc``, ``f32_states``, ``walk``, ``bwd``,
    ``vpc``, ``ktile``, ``fwd``)."""
    return BwdTC(rt, q, k, v, g, do, scale, **opts)


def bwd_tc(rt: Any, q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, initial_state: Any = None,
           dht: Any = None, **opts: Any) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
    """GLA backward ``(dq, dk, dv, dg, dh0)``; ``bwd_tc_prepare(...).finish(initial_state, dht)``."""
    return BwdTC(rt, q, k, v, g, do, scale, **opts).finish(initial_state, dht)
