"""The exceptions of the collectives: the same error raised on every rank for a bad or disagreeing input.

Its own module so that every other module of ``collectives/`` (the context's agreement of the timeout, the
checks of :mod:`.agree`) can raise them without importing one another. Knows nothing about attention.
"""

from __future__ import annotations

__all__ = ["CollectiveInputError", "CollectiveTypeError"]


class CollectiveInputError(ValueError):
    """Raised on every rank when the inputs of a collective operation are invalid or disagree."""


class CollectiveTypeError(TypeError, CollectiveInputError):
    """Type flavour of :class:`CollectiveInputError` (wrong dtype / array type on some rank)."""
