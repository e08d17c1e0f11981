"""The split protocol (:mod:`hpczeco.gla.protocol`) on CuPy arrays: adapters over :mod:`hpczeco.gpu.gla`'s
prepare/finish objects (:func:`~hpczeco.gpu.gla.chunk_gla_prepare` -> ``GLAForward``,
:func:`~hpczeco.gpu.gla.chunk_gla_bwd_prepare` -> ``GLABackward``).

The device kernels fold the incoming state into the chunk states inside ``finish`` (no correction pass),
so everything that needs no incoming state is queued by the constructor and :meth:`overlap` has no host
work (it does not poll). Slices with no tokens or no heads need no kernels: the adapters answer them
directly (``a = 1``, zero local state; the incoming state passes through). States are float32 (float64 for
float64 inputs); inputs and outputs in any form :mod:`hpczeco.gpu.gla` takes (float64, float32, float16, bfloat16,
raw bf16 bits as ``uint16``).
The forward's chunk states (the chunk-parallel tensor-core kernels: 16 bits per state element, about twice the
size of ``q`` at V = 128) are handed to the backward as :attr:`DeviceForwardSplit.states`, so a layer that keeps
them between forward and backward skips one state walk. The caller validates the inputs (shapes and dtypes are
checked again by :mod:`hpczeco.gpu.gla`, values not at all).
"""

from __future__ import annotations

from typing import Any

from ..base.backend import get_array_module
from ._runner import Poll

__all__ = ["DeviceForwardSplit", "DeviceBackwardSplit"]


def _state_dtype(xp: Any, x: Any) -> Any:
    """The state dtype of inputs like ``x``: float64 for float64, else float32 (as :mod:`hpczeco.gpu.gla`)."""
    return xp.float64 if str(x.dtype) == "float64" else xp.float32


class DeviceForwardSplit:
    """:class:`~hpczeco.gla.protocol.SplitForward` on CuPy arrays ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``:
    ``a [B, H, K]`` and ``S_local [B, H, K, V]`` float32; ``finish(S_in)`` returns ``(o [B, T, H, V] input
    dtype, final [B, H, K, V] float32)``. ``states``: the prepared forward (``hpczeco.gpu.gla.GLAForward``) whose
    chunk states :class:`DeviceBackwardSplit` reuses, or None where they are recomputed (simt kernels, empty slice).
    Keeps references to the inputs: leave them unmodified until :meth:`finish` (and the backward given ``states``)."""

    states: Any = None

    def __init__(self, q: Any, k: Any, v: Any, g: Any, scale: float | None = None, chunk_size: int = 64):
        B, T, H, K = (int(s) for s in q.shape)
        V = int(v.shape[3])
        self._xp = xp = get_array_module(q)
        self._out = ((B, T, H, V), q.dtype)
        self._sdt = sdt = _state_dtype(xp, q)
        if T == 0 or B * H == 0:
            self._fw = None
            self.a = xp.ones((B, H, K), dtype=sdt)
            self.S_local = xp.zeros((B, H, K, V), dtype=sdt)
            return
        from ..gpu.gla import chunk_gla_prepare  # noqa: PLC0415

        self._fw = chunk_gla_prepare(q, k, v, g, scale=scale, chunk_size=chunk_size)
        self.a, self.S_local = self._fw.decay, self._fw.local_final_state
        self.states = self._fw if self._fw.impl == "tc-chunk" else None

    def overlap(self, poll: Poll = None) -> None:
        """No host work: the local pass is queued on the device, the outputs need ``S_in``."""

    def finish(self, S_in: Any = None) -> tuple[Any, Any]:
        """``(o, final)`` with the incoming state ``S_in [B, H, K, V]`` (None: zeros)."""
        xp = self._xp
        if self._fw is None:
            shape, dtype = self._out
            B, _, H, V = shape
            final = (xp.zeros((B, H, self.a.shape[2], V), dtype=self._sdt) if S_in is None
                     else xp.ascontiguousarray(S_in.astype(self._sdt)))
            return xp.zeros(shape, dtype=dtype), final
        return self._fw.finish(initial_state=S_in, output_final_state=True)


class DeviceBackwardSplit:
    """:class:`~hpczeco.gla.protocol.SplitBackward` on CuPy arrays (shapes as :class:`DeviceForwardSplit`,
    ``do [B, T, H, V]``, ``initial_state [B, H, K, V]`` or None): ``a [B, H, K]`` and ``U [B, H, K, V]``
    float32; ``finish(dht)`` returns ``(dq, dk, dv, dg)`` in the input dtype and ``dh0 [B, H, K, V]``
    float32. ``states``: :attr:`DeviceForwardSplit.states` of the forward of the same ``q, k, v, g`` (its chunk
    states are reused), or None. Keeps references to the inputs: leave them unmodified until :meth:`finish`."""

    def __init__(self, q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None,
                 initial_state: Any = None, chunk_size: int = 64, states: Any = None):
        B, T, H, K = (int(s) for s in q.shape)
        V = int(v.shape[3])
        self._xp = xp = get_array_module(q)
        self._shapes = ((B, T, H, K), (B, T, H, V), q.dtype)
        self._h0 = initial_state
        self._sdt = sdt = _state_dtype(xp, q)
        if T == 0 or B * H == 0:
            self._bw = None
            self.a = xp.ones((B, H, K), dtype=sdt)
            self.U = xp.zeros((B, H, K, V), dtype=sdt)
            return
        from ..gpu.gla import chunk_gla_bwd_prepare  # noqa: PLC0415

        self._bw = chunk_gla_bwd_prepare(q, k, v, g, do, scale=scale, chunk_size=chunk_size, fwd=states)
        self.a, self.U = self._bw.decay, self._bw.dh0_local

    def overlap(self, poll: Poll = None) -> None:
        """No host work: the state passes are queued on the device, the gradients need ``dht``."""

    def finish(self, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` with the gradient ``dht [B, H, K, V]`` into the final state (None: zeros)."""
        xp = self._xp
        if self._bw is None:
            qk, vshape, dtype = self._shapes
            dh0 = xp.zeros(self.U.shape, dtype=self._sdt) if dht is None else dht.astype(self._sdt)
            return (xp.zeros(qk, dtype=dtype), xp.zeros(qk, dtype=dtype), xp.zeros(vshape, dtype=dtype),
                    xp.zeros(qk, dtype=dtype), dh0)  # fmt: skip
        return self._bw.finish(initial_state=self._h0, dht=dht)
