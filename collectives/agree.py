"""Collective validation: every rank learns of a bad input on any rank and raises the same error.

Call :func:`collective_check` before the first message of an operation: it costs one
``allgather`` of a small Python object. :func:`agree_fast` is the same check with a cheap all-good
path (one ``Allreduce`` of a digest of the agreed values), and with a timeout a point-to-point
exchange that names the ranks that never arrive. Knows nothing about attention.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
from mpi4py import MPI

from .context import AGREE_TAG
from .watchdog import abort_stalled, poll_until

__all__ = ["CollectiveInputError", "collective_check", "local_error", "agree_fast"]


class CollectiveInputError(ValueError):
    """Raised on every rank when the inputs of a collective operation are invalid or disagree."""


class CollectiveTypeError(TypeError, CollectiveInputError):
    """Type flavour of :class:`CollectiveInputError` (wrong dtype / array type on some rank)."""


def local_error(fn: Callable[[], Any]) -> BaseException | None:
    """Run a local check; return the ``ValueError``/``TypeError`` it raised, or None."""
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return exc
    return None


def collective_check(
    comm,
    op: str,
    error: BaseException | None = None,
    agree: Mapping[str, Any] | None = None,
) -> None:
    """Raise the same error on every rank if any rank has ``error`` or the ranks disagree on ``agree``.

    ``op`` names the operation (used in the message). ``agree`` holds values that must be equal on
    every rank (shapes, dtypes, options). The error names the first offending rank. Collective
    over ``comm``; with ``comm=None`` or one rank it only re-raises a local error.
    """
    mine = (None if error is None else (type(error).__name__, str(error)), dict(agree or {}))
    if comm is None or comm.Get_size() == 1:
        everyone = [mine]
    else:
        everyone = comm.allgather(mine)
    for rank, (err, _) in enumerate(everyone):
        if err is not None:
            kind, msg = err
            cls = CollectiveTypeError if kind == "TypeError" else CollectiveInputError
            raise cls(f"{op}: rank {rank}: {msg}")
    ref = everyone[0][1]
    for rank, (_, values) in enumerate(everyone[1:], start=1):
        for key in sorted(set(ref) | set(values)):
            if ref.get(key) != values.get(key):
                raise CollectiveInputError(
                    f"{op}: ranks disagree on {key}: rank 0 has {ref.get(key)!r}, rank {rank} has {values.get(key)!r}"
                )


@lru_cache(maxsize=256)
def _digest_items(items: tuple) -> int:
    text = repr(sorted(items)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def _digest(values: dict[str, Any]) -> int:
    """56-bit digest of ``values`` (cached: a training loop agrees on the same values every step)."""
    items = tuple(values.items())
    try:
        return _digest_items(items)
    except TypeError:  # an unhashable value: digest it uncached
        return _digest_items.__wrapped__(items)


def agree_fast(
    comm: MPI.Comm, op: str, error: BaseException | None, agree: dict[str, Any], timeout: float | None = None
) -> None:
    """:func:`collective_check` with a cheap all-good path: one ``Allreduce`` of a digest.

    Same errors on every rank as :func:`collective_check` (which runs when anything is wrong).
    With ``timeout`` (seconds) the digests are exchanged point to point instead (``P - 1`` small
    messages each way), so that a rank that does not arrive within ``timeout`` is named before the
    job is aborted (see :func:`hpczeco.collectives.scan.scan_start`). ``comm`` should be a private
    communicator (the point-to-point exchange uses tag :data:`~.context.AGREE_TAG`).
    """
    if comm.Get_size() == 1:
        collective_check(None, op, error, agree)
        return
    h = _digest(agree)
    buf = np.array([1 if error is not None else 0, h, -h], dtype=np.int64)
    if timeout is None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    else:
        _agree_p2p(comm, op, buf, timeout)
    if buf[0] != 0 or buf[1] != -buf[2]:
        collective_check(comm, op, error, agree)
        raise AssertionError(f"{op}: ranks disagree but collective_check found no difference")  # pragma: no cover


def _agree_p2p(comm: MPI.Comm, op: str, buf: np.ndarray, timeout: float) -> None:
    """``buf <- max over ranks`` by point-to-point messages, aborting (naming the absent ranks) after ``timeout``."""
    P, rank = comm.Get_size(), comm.Get_rank()
    others = [r for r in range(P) if r != rank]
    got = np.empty((len(others), buf.size), dtype=buf.dtype)
    rreqs = [comm.Irecv(got[i], source=r, tag=AGREE_TAG) for i, r in enumerate(others)]
    sreqs = [comm.Isend(buf, dest=r, tag=AGREE_TAG) for r in others]
    arrived = [False] * len(others)

    def done() -> bool:
        for i, req in enumerate(rreqs):
            if not arrived[i]:
                arrived[i] = bool(req.Test())
        return all(arrived)

    if not poll_until(done, time.monotonic() + timeout):
        missing = [others[i] for i, ok in enumerate(arrived) if not ok]
        abort_stalled(comm, f"{op} (arrival/validation)", f"rank(s) {missing}, which did not call {op}", timeout)
    MPI.Request.Waitall(sreqs)
    np.maximum(buf, got.max(axis=0), out=buf)
