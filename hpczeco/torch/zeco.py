"""``zeco_gla`` for torch tensors: ZeCO sequence parallelism (All-Scan forward, reverse-scan backward) with autograd.

One long sequence is split over the ranks of an mpi4py communicator, rank p holding the contiguous slice
``q, k, g: [B, L_p, H, K]``, ``v: [B, L_p, H, V]`` (slices may differ in length, including zero). The
forward is :meth:`hpczeco.ZeCOGLA.forward`, the backward :meth:`hpczeco.ZeCOGLA.backward`, on numpy views of
CPU tensors or CuPy views of CUDA tensors (zero-copy, torch's current stream; the device transports of
``ZeCOGLA``: CUDA-aware MPI, staged, NCCL). Both are collective: every rank of ``comm`` calls the forward,
and every rank backpropagates through it.

States across ranks (as ``ZeCOGLA``):

- ``initial_state [B, H, K, V]`` is the state before the global sequence: given on rank 0 only (None
  elsewhere); its gradient arrives on rank 0.
- ``final_state`` (with ``output_final_state``) is, on every rank, the state after that rank's slice -- on the
  last rank the global final state. It is differentiable on the last rank only: a loss that uses the final
  state of another rank raises the same error on every rank in the backward (use ``final_state.detach()``).

Validation is collective: a bad tensor on one rank (type, device, dtype, shape, NaN) raises the same
``TypeError``/``ValueError`` on every rank (:class:`hpczeco.collectives.CollectiveInputError`) before any
message of the layer is sent.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..collectives import CollectiveInputError
from ..collectives.agree import agree_fast, local_error
from ._arrays import compute_dtype, cuda_stream, cupy_module, device_index, from_device, from_host, to_device, to_host
from ._checks import check_tensors

__all__ = ["zeco_gla", "ZeCOGLAttention", "ZeCOGLAFunction"]


@dataclass
class _Call:
    """One call of the layer: the ``ZeCOGLA`` object (it keeps what its backward needs), how tensors map to arrays."""

    layer: Any
    device: torch.device
    dtype: torch.dtype  # of q, k, v, g (and of o, dq, dk, dv, dg)
    array_dtype: torch.dtype  # what the arrays hold: the dtype (CUDA bf16: raw bits), or float32 (CPU half inputs)
    want_final: bool
    arrays: tuple | None = None

    def to_array(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> Any:
        if t is None:
            return None
        dtype = dtype or self.array_dtype
        if t.dtype != dtype:
            t = t.to(dtype)
        return to_device(t) if self.device.type == "cuda" else to_host(t)

    def to_tensor(self, a: Any, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return from_device(a, dtype) if self.device.type == "cuda" else from_host(a, dtype)

    def stream(self) -> Any:
        """torch's current stream as CuPy's (CUDA), or nothing (CPU)."""
        return cuda_stream(device_index(self.device)) if self.device.type == "cuda" else contextlib.nullcontext()


class ZeCOGLAFunction(torch.autograd.Function):
    """Autograd of one ZeCO call (prepared and validated by :func:`zeco_gla`; call it through that)."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, call: _Call):
        ctx.set_materialize_grads(False)
        with call.stream():
            qa, ka, va, ga, h0a = call.arrays
            call.arrays = None  # the layer keeps what it needs
            o = call.layer.forward(qa, ka, va, ga, initial_state=h0a)
            o_t = call.to_tensor(o, call.dtype)
            fin = call.to_tensor(call.layer.final_state) if call.want_final else None
        ctx.call = call
        ctx.save_for_backward(q, k, v, g, initial_state)  # torch then catches in-place changes before the backward
        return o_t, fin

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dfin):
        call: _Call = ctx.call
        q, k, v, g, h0 = ctx.saved_tensors
        if do is None:  # only the final state was used
            do = torch.zeros(q.shape[:3] + v.shape[3:], dtype=q.dtype, device=q.device)
        with call.stream():
            sdt = compute_dtype(call.array_dtype)
            try:
                grads = call.layer.backward(call.to_array(do), dht=call.to_array(dfin, sdt))
            except CollectiveInputError as exc:
                if "dht" not in str(exc):
                    raise
                raise type(exc)(f"hpczeco.torch.zeco_gla backward: {exc}. The final state is differentiable on the "
                                "last rank only (the global final state); on other ranks use final_state.detach()"
                                ) from exc
            dq, dk, dv, dg = (call.to_tensor(x, call.dtype) for x in grads[:4])
            dh0 = None if (h0 is None or grads[4] is None) else call.to_tensor(grads[4], h0.dtype)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                dg if need[3] else None, dh0 if need[4] else None, None)


def zeco_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    comm: Any,
    *,
    topology: str = "ring",
    blocks: int | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    transport: Any = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sequence-parallel GLA on this rank's slice: ``(o [B, L_p, H, V], final_state [B, H, K, V] or None)``.

    ``q, k, g: [B, L_p, H, K]``, ``v: [B, L_p, H, V]``: rank p's contiguous slice of one sequence (ranks in
    order). Collective over ``comm`` (an mpi4py communicator), forward and backward. The keyword options are
    :func:`hpczeco.zeco_gla`'s: ``topology``, ``blocks``, ``chunk_size``, ``scale`` (default ``K ** -0.5``),
    ``transport``, ``check_values`` as :class:`hpczeco.ZeCOGLA`. ``initial_state``: on rank 0 only;
    ``final_state`` (with ``output_final_state``): this slice's final state, differentiable on the last rank only
    (see the module docstring). Devices and dtypes as :func:`hpczeco.torch.chunk_gla`
    (CUDA bfloat16 travels zero-copy as raw bits, ``uint16``, the form hpczeco's ZeCO layer takes).
    Gradients for q, k, v, g and (rank 0) initial_state.
    """
    from ..zeco import ZeCOGLA  # noqa: PLC0415

    call: list[_Call] = []
    records = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, g, initial_state))

    def check() -> None:
        dev, dtype = check_tensors(q=q, k=k, v=v, g=g, initial_state=initial_state)
        layer = ZeCOGLA(comm, topology, blocks, chunk_size, scale, transport=transport, check_values=check_values)
        array_dtype = dtype
        if dev.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
            array_dtype = torch.float32
        if dev.type == "cuda":
            try:
                cupy_module()
            except ImportError as exc:
                raise TypeError(str(exc)) from exc
        c = _Call(layer, dev, dtype, array_dtype, bool(output_final_state))
        try:
            with c.stream():
                c.arrays = (*(c.to_array(x) for x in (q, k, v, g)),
                            c.to_array(initial_state, compute_dtype(array_dtype)))
        except (TypeError, ValueError):
            raise  # already this rank's input error
        except Exception as exc:  # noqa: BLE001 - a CUDA/DLPack failure becomes this rank's input error too
            msg = f"could not view the tensors as {dev.type} arrays: {type(exc).__name__}: {exc}"
            raise TypeError(msg) from exc
        call.append(c)

    err = local_error(check)
    agree_fast(comm, "hpczeco.torch.zeco_gla", err, {
        "device type": getattr(getattr(q, "device", None), "type", None),
        "dtype": str(getattr(q, "dtype", None)),
        "records autograd (a tensor requires grad)": records,
        "output_final_state": bool(output_final_state),
    })
    o, fin = ZeCOGLAFunction.apply(q, k, v, g, initial_state, call[0])
    return o, (fin if output_final_state else None)


class ZeCOGLAttention(torch.nn.Module):
    """:func:`zeco_gla` as a module (no parameters): ``forward(q, k, v, g, initial_state=None,
    output_final_state=False) -> (o, final_state or None)`` over the communicator given here.

    ``q, k, g: [B, L_p, H, K]``, ``v: [B, L_p, H, V]`` (this rank's slice); options as :class:`hpczeco.ZeCOGLA`, in
    its order ``(comm, topology, blocks, chunk_size, scale)``.
    """

    def __init__(self, comm: Any, topology: str = "ring", blocks: int | None = None, chunk_size: int = 64,
                 scale: float | None = None, transport: Any = None, check_values: bool = True):
        super().__init__()
        self.comm, self.topology, self.blocks = comm, topology, blocks
        self.chunk_size, self.scale, self.transport, self.check_values = chunk_size, scale, transport, check_values

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                initial_state: torch.Tensor | None = None,
                output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return zeco_gla(q, k, v, g, self.comm, topology=self.topology, blocks=self.blocks, chunk_size=self.chunk_size,
                        scale=self.scale, initial_state=initial_state, output_final_state=output_final_state,
                        transport=self.transport, check_values=self.check_values)

    def extra_repr(self) -> str:
        return (f"ranks={self.comm.Get_size()}, topology={self.topology!r}, blocks={self.blocks}, "
                f"chunk_size={self.chunk_size}, scale={self.scale}")
