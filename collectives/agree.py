"""Collective validation: every rank learns of a bad input on any rank and raises the same error.

Call :func:`collective_check` before the first message of an operation. It costs one
``allgather`` of a small Python object. Knows nothing about attention.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CollectiveInputError", "collective_check", "local_error"]


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
