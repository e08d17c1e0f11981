"""Halo exchange and variable-count collectives on arrays split along one axis. Knows no attention.

A global array is split along ``axis`` over the ranks of ``comm`` in rank order: rank ``p`` holds rows
``[s_p, s_p + n_p)`` with ``s_p = n_0 + ... + n_{p-1}``; slices may be uneven or empty. All
functions are collective over ``comm`` and validate collectively first (every rank raises the same
error when any rank's input is bad, before any data moves). ``comm=None`` means one rank.

- :func:`halo_exchange`  the ``width`` rows just before each rank's slice (the halo may span several
  earlier ranks; it is shorter than ``width`` near the start of the array);
- :func:`allgather_v`    the concatenation of every rank's slice (MPI ``Allgatherv``);
- :func:`reduce_scatter_v` an elementwise sum/max over ranks whose result is scattered in row blocks;
- :func:`allreduce`      elementwise sum/max over ranks;
- :func:`gather_lengths` every rank's slice length.

Point-to-point traffic goes through the :mod:`~hpczeco.collectives.transport` seam (host or device
buffers). The variable-count collectives take numpy arrays; CuPy arrays are staged through host. Every wait is
bounded by the collective timeout (:mod:`.timed`: the collectives run on the communicator's private duplicate).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from . import timed
from .agree import collective_check, local_error
from .selection import get_transport

__all__ = ["halo_exchange", "allgather_v", "reduce_scatter_v", "allreduce", "gather_lengths", "HALO_TAG"]

HALO_TAG = 7301
_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _size(comm) -> int:
    return 1 if comm is None else comm.Get_size()


def _rank(comm) -> int:
    return 0 if comm is None else comm.Get_rank()


def _is_array(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    return type(x).__module__.startswith("cupy") and hasattr(x, "__cuda_array_interface__")


def _check_local(x: Any, axis: int) -> None:
    if not _is_array(x):
        raise TypeError(f"x must be a numpy or cupy array, got {type(x).__name__}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for x with {x.ndim} dimensions")


def _agree(x: Any, axis: int, **extra: Any) -> dict:
    """What every rank must have in common: ndim, dtype, the shape off the split axis, options."""
    if not _is_array(x) or not -x.ndim <= axis < x.ndim:
        return {}
    ax = axis % x.ndim
    rest = tuple(s for i, s in enumerate(x.shape) if i != ax)
    return {"ndim": x.ndim, "axis": ax, "dtype": str(x.dtype), "shape off the split axis": rest, **extra}


def _host(x: Any) -> np.ndarray:
    return x.get() if not isinstance(x, np.ndarray) and hasattr(x, "get") else np.asarray(x)


def _xp(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return np
    import cupy  # noqa: PLC0415 - x is a CuPy array, so CuPy is there

    return cupy


def _like(x_host: np.ndarray, like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return x_host
    import cupy  # noqa: PLC0415 - like is a CuPy array, so CuPy is there

    return cupy.asarray(x_host)


def gather_lengths(n: int, comm) -> list[int]:
    """Every rank's slice length (``allgather`` of ``n``)."""
    return [int(n)] if _size(comm) == 1 else [int(m) for m in timed.allgather(comm, int(n), "gather_lengths")]


def halo_exchange(x: Any, width: int, comm, axis: int = 1) -> Any:
    """The ``min(width, s_p)`` rows just before this rank's slice, in order, as an array like ``x``
    with that length along ``axis`` (gathered from as many earlier ranks as needed; ``0`` rows on
    rank 0 or with ``width = 0``). ``x`` is this rank's slice; collective over ``comm``.
    """

    def check() -> None:
        _check_local(x, axis)
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
            raise TypeError(f"width must be an int, got {type(width).__name__}")
        if width < 0:
            raise ValueError(f"width must be >= 0, got {width}")

    err = local_error(check)
    collective_check(comm, "halo_exchange", err, _agree(x, axis, width=int(width) if err is None else None))
    ax = axis % x.ndim
    lengths = gather_lengths(x.shape[ax], comm)
    me = _rank(comm)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    xm = x if ax == 0 else x.swapaxes(0, ax)  # rows first (a view)
    lo = max(0, starts[me] - int(width))
    transport = get_transport(comm, x) if _size(comm) > 1 else None
    out = _xp(x).empty((starts[me] - lo, *xm.shape[1:]), dtype=x.dtype)
    reqs, keep, peers = [], [], []
    # receive the pieces of [lo, s_me) owned by earlier ranks
    for q in range(me):
        a, b = max(lo, starts[q]), min(starts[q + 1], starts[me])
        if b > a:
            reqs.append(transport.irecv(out[a - lo : b - lo], q, HALO_TAG))
            peers.append(q)
    # send my rows to every later rank whose halo reaches into my slice
    for p in range(me + 1, _size(comm)):
        plo = max(0, starts[p] - int(width))
        a, b = max(plo, starts[me]), min(starts[me + 1], starts[p])
        if b > a:
            buf = xm[a - starts[me] : b - starts[me]]
            buf = buf if buf.flags.c_contiguous else buf.copy(order="C")
            keep.append(buf)
            reqs.append(transport.isend(buf, p, HALO_TAG))
            peers.append(p)
    if comm is not None:
        timed.wait_requests(comm, reqs, "halo_exchange", peers)
    return out if ax == 0 else out.swapaxes(0, ax)


def allgather_v(x: Any, comm, axis: int = 1) -> Any:
    """The concatenation along ``axis`` of every rank's ``x`` in rank order (slices may differ in
    length, including 0). Collective over ``comm``."""
    err = local_error(lambda: _check_local(x, axis))
    collective_check(comm, "allgather_v", err, _agree(x, axis))
    if _size(comm) == 1:
        return x.copy()
    ax = axis % x.ndim
    xh = np.ascontiguousarray(np.moveaxis(_host(x), ax, 0))
    lengths = gather_lengths(xh.shape[0], comm)
    row = int(np.prod(xh.shape[1:], dtype=np.int64))
    out = np.empty((sum(lengths), *xh.shape[1:]), dtype=xh.dtype)
    counts = [n * row for n in lengths]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    timed.Allgatherv(comm, xh, out, counts, displs, "allgather_v")
    return _like(np.moveaxis(out, 0, ax), x)


def reduce_scatter_v(x: Any, counts: list[int], comm, axis: int = 0, op: str = "sum") -> Any:
    """Reduce ``x`` elementwise over ranks (``op``: "sum", "max" or "min"), then give rank ``r`` rows
    ``[c_0 + ... + c_{r-1}, ... + c_r)`` along ``axis``. ``x`` has the same shape on every rank and
    ``sum(counts) == x.shape[axis]``. Collective over ``comm``."""

    def check() -> None:
        _check_local(x, axis)
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        if len(counts) != _size(comm) or any(int(c) < 0 for c in counts):
            raise ValueError(f"counts must hold {_size(comm)} non-negative ints, got {list(counts)}")
        total = sum(int(c) for c in counts)
        if total != x.shape[axis]:
            raise ValueError(f"counts sum to {total} but x has {x.shape[axis]} rows on axis {axis}")

    err = local_error(check)
    agree = _agree(x, axis, op=op, counts=[int(c) for c in counts] if err is None else None,
                   rows=x.shape[axis] if err is None else None)
    collective_check(comm, "reduce_scatter_v", err, agree)
    if _size(comm) == 1:
        return x.copy()
    ax = axis % x.ndim
    xh = np.ascontiguousarray(np.moveaxis(_host(x), ax, 0))
    row = int(np.prod(xh.shape[1:], dtype=np.int64))
    mine = int(counts[_rank(comm)])
    out = np.empty((mine, *xh.shape[1:]), dtype=xh.dtype)
    timed.Reduce_scatter(comm, xh, out, [int(c) * row for c in counts], _OPS[op], "reduce_scatter_v")
    return _like(np.moveaxis(out, 0, ax), x)


def allreduce(x: Any, comm, op: str = "sum") -> Any:
    """Elementwise ``op`` ("sum", "max", "min") of ``x`` over ranks; same shape on every rank."""

    def check() -> None:
        if not _is_array(x):
            raise TypeError(f"x must be a numpy or cupy array, got {type(x).__name__}")
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")

    err = local_error(check)
    agree = {"shape": tuple(x.shape), "dtype": str(x.dtype), "op": op} if err is None and _is_array(x) else {}
    collective_check(comm, "allreduce", err, agree)
    if _size(comm) == 1:
        return x.copy()
    out = np.array(_host(x), order="C", copy=True)
    timed.Allreduce(comm, out, _OPS[op], "allreduce")
    return _like(out, x)
