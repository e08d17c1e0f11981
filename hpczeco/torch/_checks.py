"""Checks of the torch arguments (local).

The checks raise only ``TypeError``/``ValueError`` naming the argument, so that
:func:`hpczeco.collectives.agree.agree_fast` (called by :func:`hpczeco.torch.zeco_gla`) can turn an error on one rank
into the same error on every rank before any message of the operation is sent.
"""

from __future__ import annotations

import torch

from ._arrays import CUDA_DTYPES, HOST_DTYPES

__all__ = ["check_tensors"]

_FAST_KEYS = frozenset(("q", "k", "v", "g", "initial_state"))


def check_tensors(**tensors: torch.Tensor | None) -> tuple[torch.device, torch.dtype]:
    """``q, k, v, g`` (and ``initial_state`` if given) must be tensors on one CPU or CUDA device, q, k, v, g of one
    dtype that device takes; ``initial_state`` float32 or the input dtype. Returns ``(device, dtype)``.

    Shapes are left to hpczeco (it names the argument and the expected ``[B, T, H, K]`` form).
    """
    get = tensors.get
    q, k, v, g, h0 = get("q"), get("k"), get("v"), get("g"), get("initial_state")
    T = torch.Tensor
    if (tensors.keys() <= _FAST_KEYS and type(q) is T and type(k) is T and type(v) is T and type(g) is T and q.is_cuda
            and q.dtype in CUDA_DTYPES and k.dtype is q.dtype and v.dtype is q.dtype and g.dtype is q.dtype
            and (h0 is None or (type(h0) is T and h0.dtype in (q.dtype, torch.float32)))):  # the common CUDA call
        d = q.get_device()
        if (k.is_cuda and v.is_cuda and g.is_cuda and k.get_device() == d and v.get_device() == d
                and g.get_device() == d and (h0 is None or (h0.is_cuda and h0.get_device() == d))):
            return q.device, q.dtype
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
