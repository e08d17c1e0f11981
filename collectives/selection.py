"""Which transport carries a collective: the ``transport`` argument's check and the cached choice.

A collective takes ``transport=`` as None (the buffers' transport: host for numpy, for CuPy the
device kind of ``$HPCZECO_TRANSPORT`` as the context read it, :attr:`.context.CommContext.device_kind`, or
detection), a name (:data:`.names.TRANSPORT_NAMES`) or a
:class:`~.transport.Transport`. :func:`check_transport` is the argument's local check;
:func:`transport_for` turns it into a transport on the context's private communicator, kept in the
context's one cache (:attr:`.context.CommContext.transports`). Knows nothing about attention.
"""

from __future__ import annotations

from typing import Any

from hpczeco.base.backend import get_array_module, is_device_array
from mpi4py import MPI

from .context import CommContext, get_context
from .device import device_transport, get_device_transport
from .names import check_transport_name
from .transport import HostTransport, Transport

__all__ = ["check_transport", "transport_name", "transport_for", "host_transport", "get_transport"]


def check_transport(transport: Any, like: Any, P: int, rank: int) -> None:
    """Local checks of a ``transport`` argument: None, a name, or a Transport for this communicator
    (``P`` ranks, this one ``rank``) moving arrays like ``like``."""
    if transport is None:
        return
    if isinstance(transport, str):
        check_transport_name(transport, is_device_array(like))
        return
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a Transport, a transport name or None, got {type(transport).__name__}")
    if transport.size != P or transport.rank != rank:
        raise ValueError(f"transport is for rank {transport.rank} of {transport.size}, this is rank {rank} of {P}")
    if transport.xp is not get_array_module(like):
        raise TypeError(f"transport {transport.name!r} moves {transport.xp.__name__} arrays, these are not")


def transport_name(transport: Transport | str | None) -> str | None:
    """What the ranks agree on: the name given, or the Transport's name."""
    return transport if (transport is None or isinstance(transport, str)) else transport.name


def host_transport(ctx: CommContext) -> HostTransport:
    """The context's (cached) host transport on ``ctx.pcomm``."""
    tr = ctx.transports.get("host")
    if tr is None:
        tr = ctx.transports["host"] = HostTransport(ctx.pcomm)
    return tr


def transport_for(ctx: CommContext, transport: Transport | str | None, like: Any) -> Transport:
    """``transport`` itself, or the context's cached transport for buffers like ``like`` (of the kind
    ``transport`` names; collective when a device transport is first built)."""
    if transport is not None and not isinstance(transport, str):
        return transport
    if not is_device_array(like):
        return host_transport(ctx)
    return device_transport(ctx, ctx.device_kind if transport in (None, "auto") else transport)


def get_transport(comm: MPI.Comm, like: Any = None, kind: str | None = None) -> Transport:
    """A transport for buffers like ``like`` on ``comm``.

    numpy (or ``None``) -> a :class:`~.transport.HostTransport` on ``comm`` itself. CuPy -> the device
    transport ``kind`` of ``comm``'s context (None: :attr:`.context.CommContext.device_kind`, what
    ``$HPCZECO_TRANSPORT`` names, else "auto"; :func:`.device.get_device_transport`). A device pointer is never
    handed to an MPI not known to be CUDA-aware.
    """
    if like is None or not is_device_array(like):
        if kind is not None:
            check_transport_name(kind, False)
        return HostTransport(comm)
    return get_device_transport(comm, get_context(comm).device_kind if kind is None else kind)
