"""Checks of the torch arguments (local), and the cheap collective agreement of :func:`hpczeco.torch.zeco_gla`.

The local checks raise only ``TypeError``/``ValueError`` naming the argument, so that
:func:`agree` can turn an error on one rank into the same error on every rank before any message of
the operation is sent (``hpczeco.collectives.collective_check`` semantics).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ..collectives import collective_check
from ._arrays import CUDA_DTYPES, HOST_DTYPES

__all__ = ["check_tensors", "agree"]


def check_tensors(**tensors: torch.Tensor | None) -> tuple[torch.device, torch.dtype]:
    """``q, k, v, g`` (and ``initial_state`` if given) must be tensors on one CPU or CUDA device, q, k, v, g of one
    dtype that device takes; ``initial_state`` float32 or the input dtype. Returns ``(device, dtype)``.

    Shapes are left to hpczeco (it names the argument and the expected ``[B, T, H, K]`` form).
    """
    given = {n: t for n, t in tensors.items() if t is not None}
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    q = given["q"]
    dev = q.device
    for name, t in given.items():
        if t.device != dev:
            raise TypeError(f"{name} is on {t.device}, q on {dev}: all tensors must be on one device")
    if dev.type == "cpu":
        allowed = HOST_DTYPES
    elif dev.type == "cuda":
        allowed = CUDA_DTYPES
    else:
        raise TypeError(f"q is on a {dev.type!r} device; hpczeco.torch takes CPU or CUDA tensors")
    if q.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"q has dtype {q.dtype}; on {dev.type} hpczeco.torch takes {names}")
    for name in ("k", "v", "g"):
        t = given.get(name)
        if t is not None and t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, expected {q.dtype} (the dtype of q): "
                            "q, k, v, g share one dtype")
    h0 = given.get("initial_state")
    if h0 is not None and h0.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"initial_state has dtype {h0.dtype}, expected float32 or {q.dtype} (the dtype of q)")
    return dev, q.dtype


def _digest(values: dict[str, Any]) -> int:
    text = repr(sorted(values.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def agree(comm: Any, op: str, error: BaseException | None, values: dict[str, Any]) -> None:
    """Raise the same error on every rank of ``comm`` if any rank has ``error`` or the ranks disagree on ``values``.

    All good: one ``Allreduce`` of three integers (an error flag and a digest of ``values``); otherwise
    :func:`hpczeco.collectives.collective_check` finds and names the offending rank. Collective.
    """
    if comm.Get_size() == 1:
        collective_check(None, op, error, values)
        return
    from mpi4py import MPI  # noqa: PLC0415

    h = _digest(values)
    buf = np.array([0 if error is None else 1, h, -h], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    if buf[0] != 0 or buf[1] != -buf[2]:
        collective_check(comm, op, error, values)
        raise AssertionError(f"{op}: the digests differ but collective_check found no difference")  # pragma: no cover
