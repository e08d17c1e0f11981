"""The split protocol: a GLA forward or backward cut where the incoming state (gradient) enters.

A sequence-parallel layer (:mod:`hpczeco.zeco`) scans one element per rank and overlaps the scan with the
work that does not need its result. Both backends implement the same two protocols, so the layer has one
code path: numpy arrays get :class:`hpczeco.gla.split.ForwardSplit` / :class:`~hpczeco.gla.split.BackwardSplit`,
CuPy arrays the adapters of :mod:`hpczeco.gla.device_split` over :mod:`hpczeco.gpu.gla`'s prepare/finish
objects. :func:`split_forward` / :func:`split_backward` pick by array type.

Order of use, forward: construct (the local pass from a zero state), scan ``(a, S_local)``,
``overlap(poll)`` while the scan is in flight, ``finish(S_in)`` with its result. Backward: construct, scan
``(a, U)`` in reverse, ``overlap(poll)``, ``finish(dht)``. ``finish`` runs once per object.

With ``cu_seqlens`` (packed documents in the slice, ``B == 1``) both functions return the packed splits of
:mod:`hpczeco.gla.varlen_split`: the incoming state reaches only the slice's first document, the incoming state
gradient only its last, ``a`` is 0 when the slice holds more than one document, and ``finish`` returns the
per-document states ``[N, H, K, V]`` (final states, ``dh0``).
"""

from __future__ import annotations

from typing import Any, Protocol

from ._runner import Poll
from .plain_split import plain_split_backward, plain_split_forward
from .varlen_split import PackedBackwardSplit, PackedForwardSplit
from .workspace import SplitWorkspace

__all__ = ["SplitForward", "SplitBackward", "split_forward", "split_backward"]


class SplitForward(Protocol):
    """A GLA forward of one slice, local pass done. Shapes: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``.

    Attributes:
        a: ``[B, H, K]``, ``exp`` of the gate summed over the slice (the state dtype).
        S_local: ``[B, H, K, V]``, the slice's final state from a zero initial state (the state dtype).
    """

    a: Any
    S_local: Any

    def overlap(self, poll: Poll = None) -> None:
        """The work that needs no incoming state, calling ``poll()`` (if given) about every millisecond of
        host work, from the calling thread. Idempotent; :meth:`finish` runs it if it has not run."""
        ...

    def finish(self, S_in: Any = None) -> tuple[Any, Any]:
        """``(o [B, T, H, V] input dtype, final state [B, H, K, V])`` with the incoming state ``S_in
        [B, H, K, V]`` (None: zeros); ``final = diag(a) S_in + S_local``. Once per object."""
        ...

    @property
    def states(self) -> Any:
        """After :meth:`finish`: what :func:`split_backward` may take as ``states`` (the chunk states
        ``[B, H, N + 1, K, V]`` on numpy, the prepared forward on CuPy), or None where the backend recomputes
        them."""
        ...


class SplitBackward(Protocol):
    """A GLA backward of one slice, its state passes done. Shapes as :class:`SplitForward`, ``do [B, T, H, V]``.

    Attributes:
        a: ``[B, H, K]`` as :attr:`SplitForward.a`.
        U: ``[B, H, K, V]``, the gradient into the slice's initial state when no gradient flows into its
            final state, ``scale sum_t (q_t exp(G_t))^T do_t`` (the state dtype).
    """

    a: Any
    U: Any

    def overlap(self, poll: Poll = None) -> None:
        """The work that needs no incoming state gradient, polling as :meth:`SplitForward.overlap`."""
        ...

    def finish(self, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` with the gradient ``dht [B, H, K, V]`` into the final state (None:
        zeros); ``dh0 = U + diag(a) dht``. Once per object."""
        ...


def split_forward(q: Any, k: Any, v: Any, g: Any, scale: float | None = None, chunk_size: int = 64, *,
                  check_values: bool = True, cu_seqlens: Any = None, initial_state: Any = None,
                  workspace: SplitWorkspace | None = None) -> SplitForward:
    """The forward split for these arrays: :class:`hpczeco.gla.split.ForwardSplit` for numpy (validated as
    :func:`hpczeco.gla.chunk_gla`; ``check_values=False`` skips the value scans), the device adapter for CuPy
    (shapes and dtypes checked by :mod:`hpczeco.gpu.gla`; the value scans are the caller's). With ``cu_seqlens
    [N + 1]``: :class:`hpczeco.gla.varlen_split.PackedForwardSplit` (``initial_state [N, H, K, V]`` or None, the
    documents' own initial states; ``S_in`` adds to row 0). ``initial_state`` needs ``cu_seqlens``. ``workspace``
    (:class:`hpczeco.gla.workspace.SplitWorkspace`): where the numpy split keeps its arrays between calls (the
    other forms ignore it). Local."""
    if cu_seqlens is not None:
        return PackedForwardSplit(q, k, v, g, cu_seqlens, scale=scale, initial_state=initial_state,
                                  chunk_size=chunk_size, check_values=check_values)
    if initial_state is not None:
        raise ValueError("split_forward takes initial_state only with cu_seqlens (else it is finish()'s S_in)")
    return plain_split_forward(q, k, v, g, scale=scale, chunk_size=chunk_size, check_values=check_values,
                               workspace=workspace)


def split_backward(q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, initial_state: Any = None,
                   chunk_size: int = 64, *, states: Any = None, check_values: bool = True, cu_seqlens: Any = None,
                   dht: Any = None, workspace: SplitWorkspace | None = None) -> SplitBackward:
    """The backward split for these arrays (``initial_state [B, H, K, V]`` or None; ``states`` from
    :attr:`SplitForward.states` or None), chosen and checked as :func:`split_forward`. With ``cu_seqlens``:
    :class:`hpczeco.gla.varlen_split.PackedBackwardSplit` (``initial_state``, ``dht`` ``[N, H, K, V]`` or None;
    the ``dht`` handed to ``finish`` adds to row ``N - 1``; ``states`` is not used). ``workspace`` as
    :func:`split_forward`. Local."""
    if cu_seqlens is not None:
        return PackedBackwardSplit(q, k, v, g, do, cu_seqlens, scale=scale, initial_state=initial_state, dht=dht,
                                   chunk_size=chunk_size, check_values=check_values)
    if dht is not None:
        raise ValueError("split_backward takes dht only with cu_seqlens (else it is finish()'s argument)")
    return plain_split_backward(q, k, v, g, do, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                                states=states, check_values=check_values, workspace=workspace)
