"""The split of one sequence (no ``cu_seqlens``) for numpy or CuPy arrays.

numpy arrays get :class:`hpczeco.gla.split.ForwardSplit` / :class:`~hpczeco.gla.split.BackwardSplit`, CuPy arrays
the adapters of :mod:`hpczeco.gla.device_split`. :mod:`hpczeco.gla.protocol` adds the packed documents on top;
the packed splits (:mod:`hpczeco.gla.varlen_split`) and runners (:mod:`hpczeco.gla.varlen`) run their plain
documents through these. Local.
"""

from __future__ import annotations

from typing import Any

from ..base.backend import is_device_array
from .device_split import DeviceBackwardSplit, DeviceForwardSplit
from .split import BackwardSplit, ForwardSplit
from .workspace import SplitWorkspace

__all__ = ["plain_split_backward", "plain_split_forward"]


def plain_split_forward(q: Any, k: Any, v: Any, g: Any, scale: float | None = None, chunk_size: int = 64, *,
                        check_values: bool = True, workspace: SplitWorkspace | None = None,
                        ) -> ForwardSplit | DeviceForwardSplit:
    """The forward split of ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]`` by array type (see
    :func:`hpczeco.gla.protocol.split_forward`; ``check_values`` and ``workspace`` apply to numpy only)."""
    if is_device_array(q):
        return DeviceForwardSplit(q, k, v, g, scale=scale, chunk_size=chunk_size)
    return ForwardSplit(q, k, v, g, scale=scale, chunk_size=chunk_size, check_values=check_values, workspace=workspace)


def plain_split_backward(q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None,
                         initial_state: Any = None, chunk_size: int = 64, *, states: Any = None,
                         check_values: bool = True, workspace: SplitWorkspace | None = None,
                         ) -> BackwardSplit | DeviceBackwardSplit:
    """The backward split (``do: [B, T, H, V]``, ``initial_state [B, H, K, V]`` or None) by array type (see
    :func:`hpczeco.gla.protocol.split_backward`)."""
    if is_device_array(q):
        return DeviceBackwardSplit(q, k, v, g, do, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                                   states=states)
    return BackwardSplit(q, k, v, g, do, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                         states=states, check_values=check_values, workspace=workspace)
