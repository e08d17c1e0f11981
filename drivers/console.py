"""What the drivers tell the user on the console besides their results: the first-run compile notice, the
oversubscription warning and progress lines for long phases.

- :func:`compile_notice`: rank 0 prints ``compiling kernels (first run only, ~10-30 s)...`` when the Numba
  kernels of the CPU GLA path are not in Numba's on-disk cache yet (a fresh install, a changed source, or a
  new ``NUMBA_CACHE_DIR``), so a first step that sits at 0% says why.
- :func:`warn_oversubscribed`: collective; rank 0 prints one warning per process when ranks oversubscribe
  the cores of a node (:func:`hpczeco.drivers.mpienv.core_oversubscription`).
- :func:`warn_core_sharing`: collective; rank 0 warns when some rank's core also runs other busy work
  (:func:`hpczeco.drivers.mpienv.core_sharing`).
- :class:`Progress`: ``label: 8/32 (12 s)`` lines, at most one every few seconds, for phases that would
  otherwise be silent (plain lines, readable in batch logs and through ``mpiexec``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["COMPILE_NOTICE", "KERNEL_MODULES", "Progress", "compile_notice", "kernels_cached",
           "warn_oversubscribed", "warn_core_sharing"]

#: the modules whose ``@njit(cache=True)`` kernels the CPU GLA path (chunk_gla, ZeCOGLA, train) compiles
KERNEL_MODULES = ("hpczeco.gla.kernels",)
#: measured on a shared 2-core machine: 15-30 s for the first training step with a cold Numba cache
COMPILE_NOTICE = "compiling kernels (first run only, ~10-30 s)..."

_warned: set[str] = set()


def kernels_cached(modules: tuple[str, ...] = KERNEL_MODULES) -> bool:
    """True when most Numba kernels of ``modules`` have a compiled version in Numba's cache (index files of
    the current source). Kernels a path never uses stay uncached, so "most" rather than "all"; False when
    the cache cannot be inspected (unknown: better one line too many than a silent 30 s)."""
    import importlib

    try:
        from numba.core.registry import CPUDispatcher

        found = cached = 0
        for name in modules:
            for obj in vars(importlib.import_module(name)).values():
                if isinstance(obj, CPUDispatcher):
                    found += 1
                    cache = getattr(obj, "_cache", None)
                    cache_file = getattr(cache, "_cache_file", None)
                    if cache_file is not None and cache_file._load_index():
                        cached += 1
        return found > 0 and 2 * cached > found
    except Exception:  # noqa: BLE001 - numba internals: treat as not cached
        return False


def compile_notice(rank: int, say: Callable[[str], Any] | None = None) -> bool:
    """On rank 0, print :data:`COMPILE_NOTICE` when :func:`kernels_cached` is False. Returns whether it printed."""
    if rank != 0 or kernels_cached():
        return False
    (say or (lambda s: print(s, flush=True)))(COMPILE_NOTICE)
    return True


def warn_oversubscribed(comm, prog: str, say: Callable[[str], Any] | None = None):
    """Collective: the :class:`~hpczeco.drivers.mpienv.CoreOversubscription` of ``comm`` (or ``None``); rank 0
    prints ``warning: ...`` the first time a program of this process finds it (a demo running several
    drivers warns once)."""
    from .mpienv import core_oversubscription

    over = core_oversubscription(comm)
    if over is not None and comm.Get_rank() == 0 and over.describe() not in _warned:
        _warned.add(over.describe())
        (say or (lambda s: print(s, flush=True)))(f"{prog}: warning: {over.describe()}")
    return over


def warn_core_sharing(comm, prog: str, say: Callable[[str], Any] | None = None):
    """Collective: :func:`~hpczeco.drivers.mpienv.core_sharing` of ``comm`` (a 50 ms spin on every rank at once);
    rank 0 prints ``warning: ...`` when some rank lost its core to other work. The result (or ``None``)."""
    from .mpienv import core_sharing

    shared = core_sharing(comm)
    if shared is not None and comm.Get_rank() == 0:
        (say or (lambda s: print(s, flush=True)))(f"{prog}: warning: {shared.describe()}")
    return shared


class Progress:
    """``label: done/total (elapsed s)`` lines through ``say``: the first after ``every_s`` seconds, then at
    most one every ``every_s`` seconds, and always the last. Use ``step()`` once per unit of work."""

    def __init__(self, label: str, total: int, say: Callable[[str], Any] | None = None, every_s: float = 5.0):
        self.label, self.total, self.every_s = label, int(total), float(every_s)
        self.say = say or (lambda s: print(s, file=sys.stdout, flush=True))
        self.done = 0
        self.t0 = self._last = time.perf_counter()

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.done >= self.total or now - self._last >= self.every_s:
            self._last = now
            self.say(f"  {self.label}: {self.done}/{self.total} ({now - self.t0:.0f} s)")
