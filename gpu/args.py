"""Argument checks the wrappers in ``gpu/`` share (numpy only)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int"]


def check_int(name: str, value: Any, lo: int) -> int:
    """``value`` as an int; ``TypeError`` unless an int (bool excluded), ``ValueError`` if below ``lo``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return int(value)
