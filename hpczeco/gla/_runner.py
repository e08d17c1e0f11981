"""The one thread runner of the CPU GLA: (batch, head) sequences over worker threads, with optional polling.

Every phase of :mod:`hpczeco.gla.fused` and :mod:`hpczeco.gla.split` is a function ``fn(units, tick)`` over a
list of ``(b, h)`` sequences; :func:`run_units` splits all ``B H`` sequences into contiguous blocks, one per
worker thread (the numba kernels release the GIL; BLAS is kept single-threaded inside the workers, see
:mod:`hpczeco.gla._blas`). With a ``poll`` callable (a scan handle's ``test``), ``poll()`` runs in the calling
thread about every ``POLL_S`` seconds of work, so it may make MPI progress without MPI_THREAD_MULTIPLE.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ._blas import single_threaded_blas

__all__ = ["POLL_S", "UNIT_BLOCK", "Poll", "Tick", "num_threads", "run_units", "unit_blocks"]

POLL_S = 1e-3  # poll about every millisecond of work
UNIT_BLOCK = 8  # sequences whose token rows one kernel call walks together

Poll = Callable[[], Any] | None
Tick = Callable[[], None]


def num_threads(units: int) -> int:
    """Worker threads: ``HPCZECO_GLA_THREADS``, else ``OMP_NUM_THREADS``, else the usable cores; at most
    one per (batch, head) sequence. Under MPI with several ranks per node set one of them (e.g. 1)."""
    for var in ("HPCZECO_GLA_THREADS", "OMP_NUM_THREADS"):
        env = os.environ.get(var, "").strip()
        if env.isdigit() and int(env) > 0:
            return max(1, min(int(env), units))
    return max(1, min(len(os.sched_getaffinity(0)), units))


class _Ticker:
    """Calls ``poll`` when at least ``POLL_S`` has passed since the last call (single-thread runs)."""

    def __init__(self, poll: Poll):
        self.poll = poll
        self.last = time.perf_counter()

    def __call__(self) -> None:
        if self.poll is not None:
            now = time.perf_counter()
            if now - self.last >= POLL_S:
                self.poll()
                self.last = time.perf_counter()


def _no_tick() -> None:
    return None


def run_units(B: int, H: int, fn: Callable[[list[tuple[int, int]], Tick], None], poll: Poll = None) -> None:
    """Run ``fn(units, tick)`` over all ``(b, h)`` sequences, split into contiguous blocks over threads.

    Each ``fn`` walks time in its outer loop and its sequences inside, so the rows of ``[B, T, H, D]``
    inputs are read from memory once, not once per head; it calls ``tick()`` between chunk groups. With
    ``poll``: ``poll()`` once at the start, then about every ``POLL_S`` from this thread — through ``tick``
    when one thread computes, while waiting for the workers otherwise.
    """
    units = [(b, h) for b in range(B) for h in range(H)]
    nt = num_threads(len(units))
    if poll is not None:
        poll()
    if nt == 1:
        with single_threaded_blas():  # we parallelise; BLAS thread pools would fight the workers
            fn(units, _Ticker(poll) if poll is not None else _no_tick)
        return

    def work(part):
        with single_threaded_blas():
            fn(part, _no_tick)

    bounds = [len(units) * i // nt for i in range(nt + 1)]
    with ThreadPoolExecutor(nt) as ex:
        futs = [ex.submit(work, units[bounds[i] : bounds[i + 1]]) for i in range(nt)]
        if poll is not None:
            pending = set(futs)
            while pending:
                _, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                poll()
        for f in futs:
            f.result()


def unit_blocks(units: list[tuple[int, int]]) -> list[tuple[list[tuple[int, int]], np.ndarray, np.ndarray]]:
    """``units`` in blocks of at most ``UNIT_BLOCK`` sequences: ``(units, b indices, h indices)``. The
    token-row kernels walk tokens in the outer loop and a block's sequences inside, so the rows of
    ``[B, T, H, D]`` arrays are touched in memory order (a per-sequence walk strides over the heads)."""
    out = []
    for i in range(0, len(units), UNIT_BLOCK):
        part = units[i : i + UNIT_BLOCK]
        out.append((part, np.array([b for b, _ in part], np.int64), np.array([h for _, h in part], np.int64)))
    return out
