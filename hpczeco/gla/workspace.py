"""Reusable scratch for the phase-split CPU GLA (:mod:`hpczeco.gla.split`): arrays kept between calls.

A fresh large numpy array costs a page fault per page on first touch (glibc hands big freed blocks back to
the kernel), and the split keeps several ``[B, H, N, C, K]``-sized arrays between its phases that the
unsplit form never allocates. A :class:`SplitWorkspace` holds them between calls, so a layer that runs the
split every step (the ZeCO layer, :mod:`hpczeco.zeco`) touches warm pages.

Contract: :meth:`SplitWorkspace.take` returns an array of undefined contents, valid until the next ``take``
of the same name (a later split object with the same workspace overwrites it). Not thread-safe: one split
object at a time per name. Local: no communication.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SplitWorkspace"]


class SplitWorkspace:
    """Named scratch arrays reused across calls: ``take(name, shape, dtype)`` hands back the array held under
    ``name`` when its shape and dtype match (else a new one, which replaces it)."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array ``shape`` of ``dtype`` (C-contiguous, contents undefined) held under ``name``."""
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        x = self._arrays.get(name)
        if x is None or x.shape != shape or x.dtype != dtype:
            self._arrays.pop(name, None)  # drop the old one first: peak memory of one array, not two
            x = self._arrays[name] = np.empty(shape, dtype)
        return x

    def clear(self) -> None:
        """Drop every held array."""
        self._arrays.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(x.nbytes for x in self._arrays.values())

    def names(self) -> list[str]:
        """The names of the held arrays."""
        return sorted(self._arrays)
