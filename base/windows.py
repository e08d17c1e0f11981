"""The scan windows of DAAF's entropy planner over a token stream of ``T`` tokens (host, numpy).

Windows of ``window`` tokens start every ``stride`` tokens (default: ``window``, back to back); when the last
regular window ends before ``T``, one more window is aligned to the end (start ``T - window``). Used by the
CPU planner (:mod:`hpczeco.daaf.planner`) and the device planner.
"""

from __future__ import annotations

import numpy as np

from .checks import check_int

__all__ = ["window_starts"]


def window_starts(T: int, window: int, stride: int | None = None) -> np.ndarray:
    """Start positions ``[n_windows]`` (int64) of the scan windows; ``ValueError`` if ``window > T``."""
    T = check_int("T", T, 1)
    window = check_int("window", window, 1)
    stride = window if stride is None else check_int("stride", stride, 1)
    if window > T:
        raise ValueError(f"window ({window}) is larger than the text ({T} tokens)")
    starts = np.arange(0, T - window + 1, stride, dtype=np.int64)
    if starts[-1] + window < T:
        starts = np.append(starts, T - window)
    return starts
