"""Compatibility shim for Numba CUDA, applied before ``numba.cuda`` is first imported.

numba-cuda 0.30.4 with numpy >= 2.5 (the GPU machine's pairing) fails while importing its CUDA target:
``module 'numpy' has no attribute 'row_stack'`` (numpy 2.5 removed the alias, deprecated since 2.0).
``np.row_stack`` was exactly ``np.vstack``, so restoring the alias is behaviour-preserving. This is the
only place the project patches a third-party module; drop it once numba-cuda no longer uses the alias.
"""

from __future__ import annotations

import numpy as np


def apply() -> bool:
    """Restore ``numpy.row_stack`` if missing; True when the alias had to be added."""
    if hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack  # type: ignore[attr-defined]
    return True


APPLIED = apply()
