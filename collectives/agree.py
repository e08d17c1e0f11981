"""Collective validation: every rank learns of a bad input on any rank and raises the same error.

Call :func:`collective_check` before the first message of an operation: it costs one
``allgather`` of a small Python object. :func:`agree_fast` is the same check with a cheap all-good
path (one ``Allreduce`` of a digest of the agreed values), and with a timeout a point-to-point
exchange that names the ranks that never arrive. Both talk over the communicator's private duplicate
(:mod:`.context`) and honour its collective timeout (:mod:`.timed`).

Agreed values are compared by a canonical form (:func:`canonical`): numbers by value whatever their
type (``0.5`` and ``np.float32(0.5)`` agree, ``0.1`` and ``np.float32(0.1)`` do not), booleans apart
from numbers, tuples and lists alike, dicts by sorted items; the digest of the fast path hashes the
same form, so the two can never disagree. Knows nothing about attention.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

from . import timed
from .context import AGREE_TAG, get_context
from .errors import CollectiveInputError, CollectiveTypeError
from .watchdog import abort_stalled, poll_until

__all__ = ["CollectiveInputError", "collective_check", "local_error", "agree_fast", "canonical"]


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
    mine = (None if error is None else (type(error).__name__, str(error)), {k: (canonical(v), repr(v))
                                                                            for k, v in dict(agree or {}).items()})
    if comm is None or comm.Get_size() == 1:
        everyone = [mine]
    else:
        everyone = timed.allgather(comm, mine, op)
    for rank, (err, _) in enumerate(everyone):
        if err is not None:
            kind, msg = err
            cls = CollectiveTypeError if kind == "TypeError" else CollectiveInputError
            raise cls(f"{op}: rank {rank}: {msg}")
    ref = everyone[0][1]
    missing = (None, "None")
    for rank, (_, values) in enumerate(everyone[1:], start=1):
        for key in sorted(set(ref) | set(values)):
            a, b = ref.get(key, missing), values.get(key, missing)
            if repr(a[0]) != repr(b[0]):
                raise CollectiveInputError(f"{op}: ranks disagree on {key}: rank 0 has {a[1]}, rank {rank} has {b[1]}")


def canonical(value: Any) -> Any:
    """The form in which agreed values are compared and digested (see the module docstring)."""
    t = type(value)
    if t is str or t is int or value is None:  # the common cases first: this runs on every layer call
        return value
    if t is tuple:
        return tuple([canonical(v) for v in value])
    if isinstance(value, (bool, np.bool_)):
        return ("bool", bool(value))
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return int(f) if f.is_integer() else f
    if isinstance(value, (tuple, list)):
        return tuple(canonical(v) for v in value)
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), canonical(v)) for k, v in value.items())))
    if isinstance(value, np.dtype):
        return ("dtype", value.str)
    return (type(value).__name__, repr(value))


def _digest_items(items: tuple) -> int:
    text = repr(sorted(items)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def _typed(value: Any) -> Any:
    """A hashable key that tells values apart by type as well as value (1, 1.0, True and np.int64(1) are
    equal and hash alike in Python, so a cache keyed on the values alone would confuse them)."""
    t = type(value)
    if t is tuple or t is list:
        return (t, tuple([_typed(v) for v in value]))
    if t is dict:
        return (t, tuple(sorted((str(k), _typed(v)) for k, v in value.items())))
    return (t, value)


_DIGESTS: dict[tuple, int] = {}


def _digest(values: dict[str, Any]) -> int:
    """56-bit digest of the canonical form of ``values``, cached by values and types (a training loop agrees
    on the same values every step)."""
    try:
        key: tuple | None = tuple([(k, _typed(v)) for k, v in values.items()])
        hit = _DIGESTS.get(key)
    except TypeError:  # an unhashable value: digest it uncached
        key, hit = None, None
    if hit is None:
        hit = _digest_items(tuple((k, canonical(v)) for k, v in values.items()))
        if key is not None:
            if len(_DIGESTS) >= 256:
                _DIGESTS.clear()
            _DIGESTS[key] = hit
    return hit


def agree_fast(
    comm: MPI.Comm, op: str, error: BaseException | None, agree: dict[str, Any], timeout: float | None = None,
    flags: tuple[int, ...] = (),
) -> tuple[int, ...]:
    """:func:`collective_check` with a cheap all-good path: one ``Allreduce`` of a digest.

    Same errors on every rank as :func:`collective_check` (which runs when anything is wrong).
    With a timeout (``timeout`` seconds, or None: the communicator's, ``$HPCZECO_COLLECTIVE_TIMEOUT``, by default
    600 s) the digests are exchanged point to point instead (``P - 1`` small messages each way), so that a
    rank that does not arrive within it is named before the job is aborted (see
    :func:`hpczeco.collectives.scan.scan_start`). The messages go over ``comm``'s private duplicate.

    ``flags``: small non-negative ints reduced by maximum in the same message and returned (the
    maximum over ranks of each) -- e.g. whether the one rank that may pass an optional argument did,
    which would otherwise cost a broadcast.
    """
    if comm.Get_size() == 1:
        collective_check(None, op, error, agree)
        return tuple(int(f) for f in flags)
    ctx = get_context(comm)
    tmo = ctx.timeout if timeout is None else timeout
    index = ctx.begin()
    h = _digest(agree)
    buf = np.array([1 if error is not None else 0, h, -h, *flags], dtype=np.int64)
    if tmo is None:
        ctx.pcomm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    else:
        _agree_p2p(ctx.pcomm, op, buf, tmo, ctx.watch(index, op))
    if buf[0] != 0 or buf[1] != -buf[2]:
        collective_check(comm, op, error, agree)
        raise AssertionError(f"{op}: ranks disagree but collective_check found no difference")  # pragma: no cover
    return tuple(int(f) for f in buf[3:])


def _agree_p2p(comm: MPI.Comm, op: str, buf: np.ndarray, timeout: float,
               watch: Callable[[], None] | None = None) -> None:
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

    if not poll_until(done, time.monotonic() + timeout, watch):
        missing = [others[i] for i, ok in enumerate(arrived) if not ok]
        abort_stalled(comm, f"{op} (arrival/validation)", f"rank(s) {missing}, which did not call {op}", timeout)
    MPI.Request.Waitall(sreqs)
    np.maximum(buf, got.max(axis=0), out=buf)
