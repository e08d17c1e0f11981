"""The kernels of ``daaf_plan.cu`` (CuPy RawKernels): the window entropy scan, the window selection and
key-region index, and the index checks of device plans; each launch takes its parameters explicitly.

* :func:`entropy_scan`: one block per window, the window's ids sorted in shared memory (no vocabulary-sized
  histogram, any int64 ids): normalised plug-in or Miller-Madow entropy (float64) and the window's id range.
* :func:`select`: one single-block kernel for the threshold, the dense fallback, the key-region mask, its
  compaction to a sorted ``global_idx``, the key regions as spans and (optionally) ``n_global_before``; it
  reads one small array back (:class:`SelectInfo`: key-token and region counts, the policy the rule took, the
  id range, the score range).
* :func:`index`: one single-block kernel that scatters a device ``global_idx`` into a mask and/or checks it
  (range, order, agreement with a given mask), used by :func:`hpczeco.gpu.daaf.device_plan`.

The rules these kernels apply (windows, thresholds, the fallbacks, the reasons a plan gives) are those of the
CPU planner; the device planner that puts them together is :mod:`hpczeco.daaf.device_planner`. Windows up to
:data:`MAX_WINDOW` tokens. The kernels load and launch through :mod:`hpczeco.gpu.runtime` (the CPU emulation
runs these wrappers on numpy arrays). Nothing here talks MPI.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from .runtime import HERE, KernelSet, RuntimeSlot

__all__ = ["INDEX_THREADS", "INFO_LEN", "KERNEL_SOURCE", "KERNELS", "MAX_THREADS", "MAX_WINDOW", "POLICY_CODES",
           "RUNTIME", "SELECT_MODES", "SELECT_THREADS", "SelectBuffers", "SelectInfo", "check_threads", "entropy_scan",
           "index", "kernel_names", "select", "to_host"]

KERNEL_SOURCE = HERE / "daaf_plan.cu"
MAX_WINDOW = 16384  # P2 * 8 bytes of ids + (window + 1) * 4 of run-length counts in shared memory (opt-in > 48 KB)
MAX_THREADS = 1024  # DPLAN_MAX_THREADS
SELECT_THREADS = 1024  # block of daaf_plan_select (one block)
INDEX_THREADS = 1024  # block of daaf_plan_index (one block; hpczeco.gpu.daaf's checks of device indices)
ITEMS = 8  # DPLAN_ITEMS
INFO_LEN = 8
#: info[3] of daaf_plan_select
POLICY_CODES = {0: "threshold", 1: "dense", 2: "fallback-dense", 3: "given", 4: "host"}
#: the ``mode`` argument of daaf_plan_select: threshold rule with the dense fallback; every token global; the
#: windows in ``chosen`` as given; threshold rule, reporting "host" when it cannot decide
SELECT_MODES = {"threshold+dense": 0, "dense": 1, "given": 2, "threshold+host": 3}


def kernel_names() -> list[str]:
    """The ``extern "C"`` kernel names of ``daaf_plan.cu``."""
    return ["daaf_plan_entropy_i32", "daaf_plan_entropy_i64", "daaf_plan_select", "daaf_plan_index"]


KERNELS = KernelSet(label="hpczeco.gpu.daaf_plan", files=(KERNEL_SOURCE.name,), names=lambda file: kernel_names(),
                    name_expressions=False)
#: the runtime these kernels launch on (CuPy's, unless a test has set another, e.g. the CPU emulation)
RUNTIME = RuntimeSlot(KERNELS)


def _bits(x: float) -> np.uint64:
    return np.uint64(struct.unpack("<Q", struct.pack("<d", float(x)))[0])


def _double(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


def to_host(x: Any) -> np.ndarray:
    """Device -> host copy (a synchronisation); numpy arrays (the emulation) as they are."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def check_threads(n: int | None, default: int, name: str) -> int:
    """A block size: ``n`` (``default`` when None), a power of two in [32, :data:`MAX_THREADS`]."""
    n = default if n is None else n
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not (32 <= n <= MAX_THREADS) or n & (n - 1):
        raise ValueError(f"{name} must be a power of two in [32, {MAX_THREADS}], got {n}")
    return int(n)


def entropy_scan(tok: Any, window: int, stride: int, n_regular: int, n_windows: int, log2cap: float,
                 miller_madow: bool, threads: int | None = None) -> tuple[Any, Any, Any]:
    """Launch ``daaf_plan_entropy_*`` on ``tok`` (contiguous int32/int64 device array ``[T]``): the windows
    ``[i * stride, i * stride + window)`` for ``i < n_regular``, and when ``n_windows == n_regular + 1`` the tail
    window ``[T - window, T)``; scores normalised by ``log2cap`` (log2 of the largest possible id count).
    Returns device arrays ``(ent float64 [n_windows], wmin int64 [n_windows], wmax int64 [n_windows])``
    (entropies and each window's smallest / largest id). ``threads``: block size (default from the window)."""
    rt = RUNTIME.get()
    xp = rt.xp
    T = int(tok.size)
    P2 = 1 << max(0, (window - 1).bit_length())
    nt = check_threads(threads, min(MAX_THREADS, max(32, P2 // 2)), "threads")
    ent = xp.empty(n_windows, dtype=np.float64)
    wmin = xp.empty(n_windows, dtype=np.int64)
    wmax = xp.empty(n_windows, dtype=np.int64)
    name = "daaf_plan_entropy_i32" if tok.dtype == np.int32 else "daaf_plan_entropy_i64"
    rt.launch(name, (n_windows,), (nt,),
              (tok, np.int32(T), np.int32(window), np.int32(stride), np.int32(n_regular), np.int32(n_windows),
               np.int32(P2), _bits(log2cap), np.int32(1 if miller_madow else 0), ent, wmin, wmax),
              P2 * 8 + (window + 1) * 4)
    return ent, wmin, wmax


class SelectBuffers:
    """The device outputs of :func:`select` for ``n_windows`` windows over ``T`` tokens: ``chosen`` uint8
    ``[n_windows]`` (also an input in mode ``"given"``), ``cpre`` int32 ``[n_windows + 1]`` (scratch), ``mask``
    uint8 ``[T]``, ``gidx`` int32 ``[T]`` (the first ``n_global`` entries used), ``spans`` int32 ``[T + 1]``
    (the first ``2 * n_regions``: start, end pairs), ``before`` int32 ``[T + 1]`` or None, ``info`` int64
    ``[INFO_LEN]``."""

    def __init__(self, n_windows: int, T: int, with_before: bool):
        xp = RUNTIME.get().xp
        self.chosen = xp.empty(n_windows, dtype=np.uint8)
        self.cpre = xp.empty(n_windows + 1, dtype=np.int32)
        self.mask = xp.empty(T, dtype=np.uint8)
        self.gidx = xp.empty(T, dtype=np.int32)
        self.spans = xp.empty(T + 1, dtype=np.int32)
        self.before = xp.empty(T + 1, dtype=np.int32) if with_before else None
        self.info = xp.empty(INFO_LEN, dtype=np.int64)


class SelectInfo(NamedTuple):
    """The host metadata :func:`select` reads back: key-token count, key-region spans, chosen windows, the
    policy the rule took (a value of :data:`POLICY_CODES`), the id range and the entropy range."""

    n_global: int
    n_regions: int
    n_selected: int
    policy: str
    id_min: int
    id_max: int
    entropy_min: float
    entropy_max: float


def select(ent: Any, wmin: Any, wmax: Any, out: SelectBuffers, T: int, window: int, stride: int, n_regular: int,
           mode: str, threshold: float, uniform_eps: float, threads: int = SELECT_THREADS) -> SelectInfo:
    """Launch ``daaf_plan_select`` (one block of ``threads``) on the scan's outputs (:func:`entropy_scan`) in
    ``mode`` (a key of :data:`SELECT_MODES`), write ``out`` and read its ``info`` back (one synchronisation)."""
    rt = RUNTIME.get()
    nw = int(ent.size)
    rt.launch("daaf_plan_select", (1,), (threads,),
              (ent, wmin, wmax, np.int32(nw), np.int32(T), np.int32(window), np.int32(stride), np.int32(n_regular),
               np.int32(SELECT_MODES[mode]), _bits(threshold), _bits(uniform_eps), out.chosen, out.cpre, out.mask,
               out.gidx, out.before, out.spans, out.info))
    inf = to_host(out.info)
    return SelectInfo(int(inf[0]), int(inf[1]), int(inf[2]), POLICY_CODES[int(inf[3])], int(inf[4]), int(inf[5]),
                      _double(inf[6]), _double(inf[7]))


def index(gidx: Any, G: int, T: int, mask_in: Any = None, mask_out: Any = None) -> Any:
    """Launch ``daaf_plan_index`` (one block of :data:`INDEX_THREADS`) on the device index ``gidx`` int32
    ``[G]`` over ``T`` tokens: scatter it into ``mask_out`` uint8 ``[T]`` (when given; zeroed by the caller)
    and check it (and ``mask_in`` uint8 ``[T]``, when given). Returns the device flags int32 ``[4]`` (not read
    back): bit 0 of ``flags[0]`` an index outside ``[0, T)`` (``flags[2:4]``: the smallest and largest), bit 1
    not strictly increasing, bit 2 ``mask_in`` not set at an index; ``flags[1]`` the number of set entries of
    ``mask_in``."""
    rt = RUNTIME.get()
    flags = rt.xp.empty(4, dtype=np.int32)
    rt.launch("daaf_plan_index", (1,), (INDEX_THREADS,),
              (gidx if G else None, np.int32(G), np.int32(T), mask_in, mask_out, flags))
    return flags
