"""DAAF windowed attention on NVIDIA GPUs (CuPy RawKernels from ``daaf_attention.cu``).

Semantics (causal; the same rule as ``hpczeco.daaf.plan_arrays``): with ``W = local_window`` and the
key-region set ``G`` (``global_idx``, sorted; ``is_global_query_mask[t]`` is ``t in G``), query ``t``
attends to key ``j <= t`` iff ``t - j <= W`` or ``j in G`` or ``t in G``; softmax over that set,
each key once. ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]`` -> ``o: [B, T, H, Dv]`` (``v``'s dtype).

Kernels (``impl``):

* ``"tc"``: flash-attention style, tensor cores (mma.sync bf16/fp16, fp32 accumulation), ``D == Dv``
  in {64, 128}; a block owns 64 query rows and visits only the 64-key tiles it needs: key-region
  keys gathered by index, then the local range (a tile holding a key-region query: full causal).
* ``"tc2"``: the same with 128 query rows per block: each warp owns two 16-row tiles that share every
  K/V fragment read from shared memory (half the shared-memory traffic per mma, more registers).
* ``"tc3"``: ``"tc"`` compiled for 3 resident blocks per SM (register cap; D = 128 only).
* ``"simple"``: one warp per query row, fp32 online softmax, any ``D, Dv <= 256``, float32 too.
* the Hopper kernels of :mod:`hpczeco.gpu.daaf_hopper` (``"hwg"``, ``"hwg64"``, ``"hwg3"``, ``"hwg1"``,
  ``"hwg_nosw"``, ``"hfa2"``, ``"hfa2s2"``, and whatever variants it lists in ``VARIANTS``): 16-bit,
  ``D == Dv`` in {64, 128} (most variants: bf16, D = 128), compute capability 9.0 only (sm_90a cubins).
  ``sched`` (:func:`prepare`): bit 0 longest rows first, bit 1 heads fastest (default :data:`AUTO_SCHED`,
  bit 0 cleared when ``reverse=False``).
* the FlashAttention-3-design kernels of :mod:`hpczeco.gpu.daaf_fa3` (``"hfa3"``, ``"hfa3p"``: TMA, a producer
  warp, persistent CTAs; bf16/f16, ``D == Dv`` in {64, 128, 256}), compute capability 9.0 only.
* ``"auto"`` (:func:`auto_choice`, from the dtype, head dims, the device's compute capability and the
  plan's host metadata only, never a device read): 16-bit with ``D == Dv == 256`` -> :data:`AUTO_FA3`
  (``"hfa3"``) on compute capability 9.0, else ``"simple"``; float32 or other head dims -> ``"simple"``; not
  compute capability 9.0 -> :data:`AUTO_TC` (``"tc"``); on 9.0 ``daaf_hopper.choose_impl(plan, D=, cc=,
  elem=)`` when that function exists and returns a choice (the window kernel ``"hwin"`` for plans without
  key regions, the FA3-design ``"hfa3"`` for key regions: ``daaf_hopper.AUTO_IMPLS``), else: no key-region
  token -> :data:`AUTO_WINDOW` (``"tc2"``), key regions in one span -> the first of :data:`AUTO_HOPPER_ONE_SPAN`
  that exists for the dtype and D, several spans (or a count the plan does not know) -> the first of
  :data:`AUTO_HOPPER_SPANS`, with ``sched`` :data:`AUTO_SCHED` (:data:`AUTO_WINDOW` instead, with a warning
  once, when that kernel's sm_90a cubin does not build here).

16-bit inputs: CuPy ``float16``, CuPy ``bfloat16`` (CuPy with ml_dtypes), or raw 16-bit integer
arrays with ``storage="bfloat16"``/``"float16"`` (bf16 bits without ml_dtypes). PyTorch tensors go
through :func:`attention_torch` (zero-copy DLPack views). The kernels load and launch through
:mod:`hpczeco.gpu.runtime` (so the CPU emulation runs these very wrappers on numpy arrays); the float64
reference they must equal is :mod:`hpczeco.daaf.reference`. This module knows nothing of MPI.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ..base.backend import get_array_module
from ..base.checks import check_int, check_scale
from . import daaf_fa3, daaf_hopper, daaf_launch, daaf_plan
from .runtime import HERE, KernelSet, Prepared, RuntimeSlot

__all__ = [
    "AUTO_FA3",
    "AUTO_HOPPER_ONE_SPAN",
    "AUTO_HOPPER_SPANS",
    "AUTO_SCHED",
    "AUTO_TC",
    "AUTO_WINDOW",
    "HOPPER_CC",
    "IMPLS",
    "KERNEL_SOURCE",
    "KERNELS",
    "RUNTIME",
    "DevicePlan",
    "Prepared",
    "attention",
    "attention_torch",
    "auto_choice",
    "compute_capability",
    "device_plan",
    "impl_names",
    "kernel_info",
    "plan_on_device",
    "prepare",
    "prepare_torch",
    "resolve_impl",
    "tc_smem_bytes",
]

KERNEL_SOURCE = HERE / "daaf_attention.cu"
IMPLS = ("auto", "tc", "tc2", "tc3", "simple")  # this module's kernels; impl_names(): with the Hopper ones
AUTO_TC = "tc"  # the tensor-core variant "auto" picks off compute capability 9.0
HOPPER_CC = "90"  # the compute capability the Hopper kernels (sm_90a) run on
AUTO_WINDOW = "tc2"  # "auto" on compute capability 9.0 without key-region tokens
AUTO_HOPPER_ONE_SPAN = ("hwg3", "hws", "hwg", "hfa2")  # ... key regions in one span (e.g. a leading block)
AUTO_HOPPER_SPANS = ("hws", "hwg64", "hwg", "hfa2")  # ... several spans, or their number unknown
AUTO_SCHED = 3  # sched of the Hopper kernels: longest rows first, heads fastest
AUTO_FA3 = "hfa3"  # "auto" on compute capability 9.0 for head dims only daaf_fa3 has a tensor-core kernel for (256)
TC_MTILES = {"tc": 1, "tc2": 2, "tc3": 1}  # 16-row m-tiles per warp
TC_BLOCK_Q = 64  # query rows per block per m-tile (DAAF_TC_BR)
TC_BLOCK_K = 64  # keys per tile (DAAF_TC_BC)
TC_THREADS = 128
TC_DIMS = (64, 128)
SIMPLE_MAX_DIM = 256
SIMPLE_ROWS_PER_BLOCK = 4  # 128 threads, one warp per query row
_STORAGE = ("bfloat16", "float16")


# --------------------------------------------------------------------------- kernel geometry


def tc_smem_bytes(D: int, mtiles: int = 1) -> int:
    """Dynamic shared memory of a tensor-core kernel: 2 stages x (K + V) tiles of 64 padded rows, plus
    the Q tile when ``mtiles == 2`` (DaafTcShape::SMEM_BYTES)."""
    return 4 * TC_BLOCK_K * (D + 8) * 2 + (0 if mtiles == 1 else TC_BLOCK_Q * mtiles * (D + 8) * 2)


def impl_names() -> tuple[str, ...]:
    """Every ``impl`` :func:`prepare` accepts: :data:`IMPLS` and the Hopper kernels (``daaf_hopper.IMPLS``,
    ``daaf_fa3.IMPLS``)."""
    return IMPLS + tuple(daaf_hopper.IMPLS) + tuple(daaf_fa3.IMPLS)


def _hvar(impl: str) -> Any:
    """The variant of a Hopper kernel (daaf_hopper's or daaf_fa3's), None for any other name."""
    return daaf_hopper.VARIANTS.get(impl) or daaf_fa3.VARIANTS.get(impl)


def _hmod(impl: str) -> Any:
    """The module that launches the Hopper kernel ``impl``."""
    return daaf_fa3 if impl in daaf_fa3.VARIANTS else daaf_hopper


def _norm_cc(cc: Any) -> str:
    """A compute capability as CuPy spells it ("90"), from "90", "9.0", 90 or (9, 0)."""
    if isinstance(cc, tuple):
        return "".join(str(int(c)) for c in cc)
    return "".join(ch for ch in str(cc) if ch.isdigit())


def _check_hopper(impl: str, elem: str, D: int, Dv: int, cc: Any) -> None:
    var = _hvar(impl)
    if elem not in var.elems or D != Dv or D not in var.dims:
        raise ValueError(f"impl={impl!r} needs {'/'.join(var.elems)} inputs with D == Dv in {var.dims}; got {elem}, "
                         f"D={D}, Dv={Dv} (use impl='auto')")
    if cc is not None and _norm_cc(cc) != HOPPER_CC:
        here = f"sm_{_norm_cc(cc)}" if _norm_cc(cc) else "of unknown compute capability"
        raise ValueError(f"impl={impl!r} is a Hopper kernel (sm_90a): it needs compute capability 9.0, this device "
                         f"is {here} (use impl='auto', 'tc2' or 'tc')")


def _hopper_for(order: tuple[str, ...], elem: str, D: int) -> str | None:
    variants = daaf_hopper.VARIANTS
    for name in order:
        var = variants.get(name)
        if var is not None and elem in var.elems and D in var.dims:
            return name
    return None


def auto_choice(elem: str, D: int, Dv: int, plan: Any = None, cc: Any = None) -> tuple[str, int | None]:
    """``(impl, sched)`` that ``impl="auto"`` means (``sched`` None: not a Hopper kernel); see the module
    docstring. ``plan``: a :class:`DevicePlan` (its host fields ``n_global``, ``n_regions``; None: key regions
    assumed, their layout unknown); ``cc``: the device's compute capability ("90"; None: unknown, no Hopper)."""
    hopper = cc is not None and _norm_cc(cc) == HOPPER_CC
    if elem in ("f16", "bf16") and D == Dv and D in daaf_fa3.DIMS and D not in TC_DIMS:
        return (AUTO_FA3, AUTO_SCHED) if hopper else ("simple", None)  # D = 256: hfa3 is the tensor-core kernel
    if not (elem in ("f16", "bf16") and D == Dv and D in TC_DIMS):
        return "simple", None
    if not hopper:
        return AUTO_TC, None
    choose = getattr(daaf_hopper, "choose_impl", None)
    if choose is not None and plan is not None:
        got = choose(plan, D=D, cc=cc, elem=elem)
        if got is not None:
            name, sched = got if isinstance(got, tuple) else (got, None)
            resolve_impl(name, elem, D, Dv, cc=cc)  # a choice that does not exist here raises
            if _hvar(name) is None:
                return name, None
            return name, AUTO_SCHED if sched is None else int(sched)
    if plan is not None and plan.n_global == 0:
        return AUTO_WINDOW, None
    one_span = plan is not None and plan.n_regions is not None and plan.n_regions <= 1
    name = _hopper_for(AUTO_HOPPER_ONE_SPAN if one_span else AUTO_HOPPER_SPANS, elem, D)
    return (name, AUTO_SCHED) if name is not None else (AUTO_WINDOW, None)


#: whether a Hopper kernel's module builds and loads: (id(runtime), device, kernel name) -> bool
_HOPPER_USABLE: dict[tuple[int, int, str], bool] = {}


def _hopper_usable(kernel: str, mod: Any = daaf_hopper) -> bool:
    """Whether the Hopper kernel ``kernel`` of ``mod`` (daaf_hopper or daaf_fa3) is there (its cubin builds and
    loads; checked once per device, a failure warned about once): ``"auto"`` falls back to :data:`AUTO_WINDOW`
    (``"simple"`` for kernels tc2 cannot run) otherwise."""
    rt = mod.RUNTIME.get()
    key = (id(rt), _device_id(rt), kernel)
    ok = _HOPPER_USABLE.get(key)
    if ok is None:
        group = mod.GROUPS.get(kernel)
        ok = True if group is None else bool(rt.available(mod.KERNEL_SOURCE.name, str(group)))
        _HOPPER_USABLE[key] = ok
        if not ok:
            warnings.warn(f"hpczeco.gpu.daaf: the Hopper kernel {kernel} does not build here "
                          f"({getattr(rt, 'errors', {})}); impl='auto' uses {AUTO_WINDOW!r} instead",
                          RuntimeWarning, stacklevel=3)
    return ok


def resolve_impl(impl: str, elem: str, D: int, Dv: int, plan: Any = None, cc: Any = None) -> str:
    """The kernel family ``impl`` means for element type ``elem`` ("f32"/"f16"/"bf16") and head dims.

    ``plan`` and ``cc`` (the device's compute capability, "90"; None: not checked, and ``"auto"`` stays off the
    Hopper kernels) matter for ``"auto"`` (:func:`auto_choice`) and the Hopper kernels (which need 9.0)."""
    if impl == "auto":
        return auto_choice(elem, D, Dv, plan, cc)[0]
    if impl not in IMPLS:
        if _hvar(impl) is not None:
            _check_hopper(impl, elem, D, Dv, cc)
            return impl
        raise ValueError(f"impl must be one of {impl_names()}, got {impl!r}")
    tc_ok = elem in ("f16", "bf16") and D == Dv and D in TC_DIMS
    if impl in TC_MTILES and not tc_ok:
        raise ValueError(f"impl={impl!r} needs float16/bfloat16 inputs with D == Dv in {TC_DIMS}; got {elem}, "
                         f"D={D}, Dv={Dv} (use impl='simple' or 'auto')")
    if impl == "tc3" and D != 128:
        raise ValueError(f"impl='tc3' exists for D=128 only, got D={D}")
    if impl == "simple" and max(D, Dv) > SIMPLE_MAX_DIM:
        raise ValueError(f"impl='simple' supports D, Dv <= {SIMPLE_MAX_DIM}, got D={D}, Dv={Dv}")
    return impl


# --------------------------------------------------------------------------- kernels and their runtime


def kernel_names() -> list[str]:
    """The ``extern "C"`` kernel names of ``daaf_attention.cu``."""
    out = [f"daaf_simple_{e}" for e in ("f32", "f16", "bf16")]
    out += [f"daaf_{kind}_{e}_d{d}" for kind in ("tc", "tc2") for d in TC_DIMS for e in ("bf16", "f16")]
    out += [f"daaf_tc3_{e}_d128" for e in ("bf16", "f16")]
    return out


#: the DAAF kernels: one NVRTC module per device (plain names, no name expressions)
KERNELS = KernelSet(
    label="hpczeco.gpu.daaf", files=(KERNEL_SOURCE.name,), names=lambda file: kernel_names(), name_expressions=False
)
#: the runtime the DAAF wrappers launch on (CuPy unless a test has set another, e.g. the CPU emulation)
RUNTIME = RuntimeSlot(KERNELS)


#: compute capability by (xp, device id): a driver attribute, looked up once
_CC: dict[tuple[int, int], str] = {}


def compute_capability(rt: Any = None) -> str | None:
    """The compute capability of the current device as CuPy spells it ("90"), None when unknown. A runtime
    with a ``compute_capability`` attribute (the CPU emulation, in tests) answers for itself. No device read
    (a driver attribute, cached per device)."""
    rt = RUNTIME.get() if rt is None else rt
    own = getattr(rt, "compute_capability", None)
    if own is not None:
        return _norm_cc(own) or None
    cuda = getattr(rt.xp, "cuda", None)
    if cuda is None:
        return None
    dev = _device_id(rt)
    key = (id(rt.xp), dev)
    got = _CC.get(key)
    if got is None:
        try:
            got = _norm_cc(cuda.Device(dev).compute_capability)
        except AttributeError:  # a stand-in without the attribute
            got = ""
        _CC[key] = got
    return got or None


def _smem_of(name: str) -> int:
    """Dynamic shared memory a kernel is launched with (0 for the simple kernels)."""
    if not name.startswith("daaf_tc"):
        return 0
    return tc_smem_bytes(int(name.rsplit("_d", 1)[1]), TC_MTILES[name.split("_")[1]])


def kernel_info() -> dict[str, dict]:
    """Per kernel: registers, local (spill) bytes, static shared bytes, the block limit (compiles the module;
    CuPy only)."""
    rt = RUNTIME.get()
    info = {}
    for name in kernel_names():
        kern = rt.function(name, _smem_of(name))
        info[name] = {
            "num_regs": int(kern.num_regs),
            "local_size_bytes": int(kern.local_size_bytes),
            "shared_size_bytes": int(kern.shared_size_bytes),
            "max_threads_per_block": int(kern.max_threads_per_block),
            "max_dynamic_shared_size_bytes": int(kern.max_dynamic_shared_size_bytes),
        }
    return info


# --------------------------------------------------------------------------- plan arrays on the device


class DevicePlan:
    """Key-region index arrays on the device for one ``T``, and their host metadata.

    Device: ``global_idx`` int32 ``[G]`` (sorted), ``gmask`` uint8 ``[T]`` (1 at key-region tokens).
    Host: ``T``, ``local_window``, ``n_global`` (``G``: a launch parameter, never read from the device per
    call), ``host_idx`` (numpy int32 ``[G]`` when the plan came from host arrays, else None) and ``info``
    (what the planner knows: policy, reason, spans, ...; see :func:`hpczeco.daaf.device_planner.plan`).
    """

    def __init__(self, global_idx, gmask, T: int, local_window: int, n_global: int | None = None,
                 host_idx: np.ndarray | None = None, info: dict | None = None):
        self.global_idx = global_idx
        self.gmask = gmask
        self.T = int(T)
        self.local_window = int(local_window)
        self.n_global = int(global_idx.size) if n_global is None else int(n_global)
        self.host_idx = host_idx
        self.info = dict(info or {})
        # the kernels get a valid pointer even without key-region tokens
        self._gidx_arg = global_idx if self.n_global else get_array_module(global_idx).zeros(1, dtype=np.int32)

    @property
    def n_regions(self) -> int | None:
        """Key-region spans (runs of consecutive key-region tokens): ``info["n_regions"]`` (the planners
        know it), else counted once from ``host_idx``; None when neither is known (a device index)."""
        got = self.info.get("n_regions")
        if got is None and self.host_idx is not None:
            h = self.host_idx
            got = self.info["n_regions"] = 0 if h.size == 0 else 1 + int(np.count_nonzero(np.diff(h) != 1))
        return None if got is None else int(got)

    def with_window(self, local_window: int) -> DevicePlan:
        """The same key regions (the same device arrays) with another local window."""
        W = min(check_int("local_window", local_window, 0), self.T)
        if W == self.local_window:
            return self
        dp = DevicePlan(self.global_idx, self.gmask, self.T, W, self.n_global, self.host_idx, self.info)
        if hasattr(self, "_upload"):  # the same arrays: the same upload to wait for on other streams
            dp._upload = self._upload
        return dp


#: device plans of host index arrays, by content: (xp, device, T, W, G, first, last) -> [(host_idx, plan)]
_HOST_PLANS: OrderedDict[tuple, list] = OrderedDict()
HOST_PLAN_CACHE = 32  # entries kept (least recently used dropped)
#: the attributes of a hpczeco.daaf.Plan that plan_on_device reads
_PLAN_FIELDS = ("T", "global_mask", "local_window", "policy", "reason", "threshold", "regions")
#: device plans of hpczeco.daaf.Plan objects (weakly keyed: dropped with the Plan): Plan -> {(xp, device): plan}
_PLAN_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _device_id(rt) -> int:
    cuda = getattr(rt.xp, "cuda", None)
    return int(cuda.runtime.getDevice()) if cuda is not None else 0


def _torch_view(x: Any, rt) -> Any:
    """A CuPy view of a CUDA tensor (bool as uint8)."""
    import torch  # noqa: PLC0415

    t = x.to(dtype=torch.uint8) if x.dtype == torch.bool else x
    return rt.xp.from_dlpack(t.contiguous())


class _TorchMeta:
    """Shape and dtype of a CUDA tensor in numpy terms (checked before any view is made)."""

    def __init__(self, x: Any):
        self.shape = tuple(x.shape)
        self.ndim = len(self.shape)
        self.size = int(x.numel())
        name = str(x.dtype).replace("torch.", "")
        self.dtype = np.dtype("bool" if name == "bool" else name) if name in ("bool", "uint8") else np.dtype("V1")


def _locate(x: Any, name: str, rt, lazy: bool = False) -> tuple[str, Any, Any]:
    """``("device", array, owner)`` for CuPy / torch CUDA input (``owner``: the torch tensor; ``lazy``: the
    array is only its shape/dtype, :func:`_torch_view` makes it), else ``("host", numpy array, None)``; no copy
    between host and device."""
    if rt.is_native(x):
        return "device", x, None
    if type(x).__module__.startswith("torch"):
        if not x.is_cuda:
            return "host", x.numpy(), None
        return "device", (_TorchMeta(x) if lazy else _torch_view(x, rt)), x
    try:
        return "host", np.asarray(x), None
    except Exception as exc:
        raise TypeError(f"{name} must be an array (numpy, CuPy or torch), got {type(x).__name__}") from exc


def _check_index_meta(gi: Any, T: int) -> None:
    if gi.ndim != 1:
        raise ValueError(f"global_idx must be 1-D [G], got shape {tuple(gi.shape)}")
    if gi.size and gi.dtype.kind not in "iu":
        raise TypeError(f"global_idx must hold integers, got dtype {gi.dtype}")
    if gi.size > T:
        raise ValueError(f"global_idx has {gi.size} entries but T={T}")


def _check_mask_meta(gm: Any, T: int) -> None:
    if gm.ndim != 1 or gm.shape[0] != T:
        raise ValueError(f"is_global_query_mask must have shape [{T}], got {tuple(gm.shape)}")
    if gm.dtype != np.bool_ and gm.dtype != np.uint8:
        raise TypeError(f"is_global_query_mask must be bool, got dtype {gm.dtype}")


def _raise_range(T: int, lo: int, hi: int) -> None:
    raise ValueError(f"global_idx must lie in [0, {T}), got [{lo}, {hi}]")


_SORTED = "global_idx must be strictly increasing (sorted, no repeats)"
_EXACT = "is_global_query_mask must be True exactly at global_idx"


def _check_on_device(gi, G: int, T: int, gm_in, gm_out, validate: bool) -> None:
    """One launch of ``daaf_plan_index``: the mask scatter into ``gm_out`` and/or the checks (read back, one
    synchronisation, when ``validate``)."""
    flags = daaf_plan.index(gi, G, T, gm_in, gm_out)
    if not validate:
        return
    f = daaf_plan.to_host(flags)
    if f[0] & 1:
        _raise_range(T, int(f[2]), int(f[3]))
    if f[0] & 2:
        raise ValueError(_SORTED)
    if gm_in is not None and (f[0] & 4 or int(f[1]) != G):
        raise ValueError(_EXACT + (" (global_idx is empty)" if G == 0 else ""))


def _host_plan_cached(gi: np.ndarray, W: int, T: int, rt, info: dict | None = None) -> DevicePlan:
    """The device plan of the (valid) host index ``gi`` int32 ``[G]``: from the content cache, or uploaded
    (a cache miss uploads two arrays on the current stream without a host synchronisation; a launch on another
    stream waits for the upload's event: :func:`hpczeco.gpu.daaf_launch.order_plan`)."""
    xp = rt.xp
    G = int(gi.size)
    key = (id(xp), _device_id(rt), T, W, G, int(gi[0]) if G else -1, int(gi[-1]) if G else -1)
    bucket = _HOST_PLANS.get(key)
    if bucket is not None:
        for host, dp in bucket:
            if np.array_equal(host, gi):
                _HOST_PLANS.move_to_end(key)
                return dp
    gm = np.zeros(T, dtype=np.uint8)
    gm[gi] = 1
    host = gi.copy()
    dp = DevicePlan(xp.asarray(host), xp.asarray(gm), T, W, G, host, info)
    daaf_launch.mark_uploaded(dp, xp)  # no host sync: launches on other streams wait for the upload's event
    _HOST_PLANS.setdefault(key, []).append((host, dp))
    _HOST_PLANS.move_to_end(key)
    while len(_HOST_PLANS) > HOST_PLAN_CACHE:
        _HOST_PLANS.popitem(last=False)
    return dp


#: device masks found equal to a host index: id(tensor) -> (weakref, _version, data_ptr, T, host index)
_CHECKED_TORCH_MASKS: dict[int, tuple] = {}


def _torch_mask_checked(owner: Any, gi: np.ndarray, T: int) -> bool:
    if owner is None:
        return False
    got = _CHECKED_TORCH_MASKS.get(id(owner))
    return (got is not None and got[0]() is owner and got[1] == owner._version and got[2] == owner.data_ptr()
            and got[3] == T and np.array_equal(got[4], gi))


def _remember_torch_mask(owner: Any, gi: np.ndarray, T: int) -> None:
    if owner is None:
        return
    key = id(owner)
    try:
        ref = weakref.ref(owner, lambda _r, key=key: _CHECKED_TORCH_MASKS.pop(key, None))
    except TypeError:  # pragma: no cover - not weakly referenceable
        return
    _CHECKED_TORCH_MASKS[key] = (ref, owner._version, owner.data_ptr(), T, gi.copy())


def device_plan(global_idx: Any, local_window: int, T: int, is_global_query_mask: Any = None,
                validate: bool = True) -> DevicePlan:
    """Check the plan arrays and put them on the device (see :class:`DevicePlan`).

    ``global_idx``: integer ``[G]``, strictly increasing, in ``[0, T)``. ``is_global_query_mask``: bool
    ``[T]``, True exactly at ``global_idx`` (only checked: the device mask is built from ``global_idx``,
    or is the given device mask when ``global_idx`` is on the device). Shapes and dtypes are always checked;
    ``validate`` checks the contents too.

    Costs: host ``global_idx`` (numpy, list, CPU tensor) is checked on the host (no device synchronisation)
    and its device arrays come from a content-keyed cache (uploaded on first use, without a host
    synchronisation); a device mask next to it is checked on the device once (one synchronisation), and not again for
    the same unmodified torch tensor. Device ``global_idx`` (CuPy, CUDA tensor) is used in place (cast to
    int32 if needed); ``validate`` checks it with one kernel and one synchronisation, ``validate=False``
    costs no synchronisation. To reuse a plan across calls and layers, build it once and pass ``plan=``.
    """
    rt = RUNTIME.get()
    xp = rt.xp
    T = check_int("T", T, 1)
    W = min(check_int("local_window", local_window, 0), T)
    where, gi, _ = _locate(global_idx, "global_idx", rt)
    _check_index_meta(gi, T)
    gm_where, gm, gm_owner = (None, None, None) if is_global_query_mask is None else _locate(
        is_global_query_mask, "is_global_query_mask", rt, lazy=True)
    if gm is not None:
        _check_mask_meta(gm, T)
        if isinstance(gm, _TorchMeta) and (where == "device" or (validate and not _torch_mask_checked(
                gm_owner, np.ascontiguousarray(gi, dtype=np.int32), T))):
            gm = _torch_view(gm_owner, rt)  # needed: the device index's mask, or a check
    G = int(gi.size)
    if where == "host":
        if validate and G:
            lo, hi = int(gi.min()), int(gi.max())
            if lo < 0 or hi >= T:
                _raise_range(T, lo, hi)
        gi = np.ascontiguousarray(gi, dtype=np.int32)
        if validate and G > 1 and not bool((gi[1:] > gi[:-1]).all()):
            raise ValueError(_SORTED)
        if validate and gm is not None:
            if gm_where == "host":
                m = gm.view(np.uint8) if gm.dtype == np.bool_ else gm
                if int(np.count_nonzero(m)) != G or (G and not bool(m[gi].all())):
                    raise ValueError(_EXACT + (" (global_idx is empty)" if G == 0 else ""))
            elif not isinstance(gm, _TorchMeta):  # a device mask not checked before
                dp = _host_plan_cached(gi, W, T, rt)
                _check_on_device(dp._gidx_arg, G, T, xp.ascontiguousarray(gm).view(np.uint8), None, True)
                _remember_torch_mask(gm_owner, gi, T)
                return dp
        return _host_plan_cached(gi, W, T, rt)
    gi = xp.ascontiguousarray(gi, dtype=np.int32)
    if gm is None:
        out = xp.zeros(T, dtype=np.uint8)
        _check_on_device(gi, G, T, None, out, validate)
        return DevicePlan(gi, out, T, W, G)
    if gm_where == "host":
        gm = xp.asarray(np.ascontiguousarray(gm).view(np.uint8))
    gm = xp.ascontiguousarray(gm).view(np.uint8)
    if validate:
        _check_on_device(gi, G, T, gm, None, True)
    return DevicePlan(gi, gm, T, W, G)


def plan_on_device(plan: Any) -> DevicePlan:
    """The device arrays of a :class:`hpczeco.daaf.Plan`, built once per plan and device (kept while the
    plan lives). A Plan is valid by construction: nothing is checked or read back; the first call uploads
    (no host synchronisation), later calls cost a dictionary lookup. Any object with a Plan's ``T``,
    ``global_mask``, ``local_window``, ``policy``, ``reason``, ``threshold`` and ``regions`` is taken for one
    (this layer does not import :mod:`hpczeco.daaf`)."""
    if not all(hasattr(plan, name) for name in _PLAN_FIELDS):
        raise TypeError(f"plan must be a hpczeco.daaf.Plan or a DevicePlan, got {type(plan).__name__}")
    rt = RUNTIME.get()
    key = (id(rt.xp), _device_id(rt))
    per = _PLAN_PLANS.get(plan)
    if per is None:
        per = _PLAN_PLANS[plan] = {}
    dp = per.get(key)
    if dp is None:
        gi = np.flatnonzero(plan.global_mask).astype(np.int32)
        info = {"policy": plan.policy, "reason": plan.reason, "threshold": plan.threshold, "regions": plan.regions,
                "n_regions": len(plan.regions)}
        dp = copy.copy(_host_plan_cached(gi, min(plan.local_window, plan.T), plan.T, rt))
        dp.info = info
        per[key] = dp
    return dp


# --------------------------------------------------------------------------- launches


def _elem_of(x: Any, storage: str | None) -> str:
    dt = str(x.dtype)
    if dt == "float32":
        return "f32"
    if dt == "float16":
        return "f16"
    if dt == "bfloat16":
        return "bf16"
    if dt in ("uint16", "int16"):
        if storage not in _STORAGE:
            raise TypeError(f"16-bit integer arrays need storage='bfloat16' or 'float16' (raw bits), got {storage!r}")
        return "bf16" if storage == "bfloat16" else "f16"
    raise TypeError(f"q, k, v must be float32, float16 or bfloat16 (or raw 16-bit bits with storage=...), got {dt}"
                    " (float64: use the CPU path hpczeco.daaf.attention)")


def prepare(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
            is_global_query_mask: Any = None, *, impl: str = "auto", storage: str | None = None,
            validate: bool = True, out=None, reverse: bool = True, plan: Any = None,
            sched: int | None = None) -> Prepared:
    """Check everything once and return a :class:`Prepared` launch (for repeated calls and timing).

    ``reverse`` schedules the last query tiles (the longest rows) first. ``plan``: a :class:`DevicePlan`
    (e.g. from :func:`device_plan` or :func:`hpczeco.daaf.device_planner.plan`) or a :class:`hpczeco.daaf.Plan`
    (its device arrays cached, :func:`plan_on_device`); then ``global_idx``, ``local_window`` and
    ``is_global_query_mask`` are ignored. ``sched``: the Hopper kernels' schedule bits (0..3; default
    :data:`AUTO_SCHED`, or 2 when ``reverse`` is False); ignored by the other kernels. The result's ``impl``
    and ``sched`` say what ``"auto"`` chose. Nothing here reads the device: the only synchronisations are
    those :func:`device_plan` documents (none for ``plan=``, none for a host ``global_idx``); the launch
    parameters come from the plan's host fields. A plan uploaded from the host on another stream is ordered before
    the current stream here (an event wait on the device); launching the result on yet another stream before that
    upload has finished needs the caller's ordering, as for any array made on one stream.
    """
    rt = RUNTIME.get()
    cupy = rt.xp
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not rt.is_native(x):
            raise TypeError(f"{name} must be a CuPy array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, T, H, D], got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k has shape {list(k.shape)}, expected q's shape {list(q.shape)} [B, T, H, D]")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v has shape {list(v.shape)}, expected [B, T, H, Dv] with [B, T, H] = {list(q.shape[:3])}")
    B, T, H, D = (int(s) for s in q.shape)
    Dv = int(v.shape[3])
    if min(B, T, H, D, Dv) < 1:
        raise ValueError(f"empty input: q {tuple(q.shape)}, v {tuple(v.shape)}")
    if T >= 2**31 - TC_BLOCK_Q or H > 65535 or B > 65535:
        raise ValueError(f"shape out of range for the kernels: B={B} (<= 65535), T={T}, H={H} (<= 65535)")
    elem = _elem_of(q, storage)
    hopper = impl not in IMPLS and _hvar(impl) is not None
    cc = compute_capability(rt) if (hopper or impl == "auto") else None
    if impl != "auto":
        kind = resolve_impl(impl, elem, D, Dv, cc=cc if cc is not None else "unknown")
    if sched is not None and (check_int("sched", sched, 0) > 3):
        raise ValueError(f"sched must be in [0, 3], got {sched}")
    scale = check_scale(scale, D)
    if plan is None:
        plan = device_plan(global_idx, local_window, T, is_global_query_mask, validate=validate)
    elif not isinstance(plan, DevicePlan):
        plan = plan_on_device(plan)
    if plan.T != T:
        raise ValueError(f"plan covers T={plan.T} tokens, q has T={T}")
    cuda = getattr(cupy, "cuda", None)
    if cuda is not None:  # a plan uploaded on another stream: this one waits for it (on the device)
        daaf_launch.order_plan(plan, int(getattr(cuda.get_current_stream(), "ptr", 0)), cupy)
    auto_sched = None
    if impl == "auto":
        kind, auto_sched = auto_choice(elem, D, Dv, plan, cc)
        if kind not in IMPLS and not _hopper_usable(_hmod(kind).kernel_name(kind, elem, D), _hmod(kind)):
            kind, auto_sched = (AUTO_WINDOW if D in TC_DIMS else "simple"), None

    def prep(x):
        if not x.flags.c_contiguous:
            x = cupy.ascontiguousarray(x)
        if rt.ptr(x) % 16:
            x = x.copy()
        return x

    q, k, v = prep(q), prep(k), prep(v)
    if out is None:
        out = cupy.empty((B, T, H, Dv), dtype=v.dtype)
    elif not (rt.is_native(out) and out.shape == (B, T, H, Dv) and out.dtype == v.dtype
              and out.flags.c_contiguous and rt.ptr(out) % 16 == 0):
        raise ValueError(f"out must be a C-contiguous CuPy array of shape {(B, T, H, Dv)} and dtype {v.dtype}")
    if kind not in IMPLS:  # a Hopper kernel (daaf_hopper.py launches it)
        hs = sched if sched is not None else auto_sched if auto_sched is not None else (
            AUTO_SCHED if reverse else AUTO_SCHED & ~1)
        p = _hmod(kind).prepare(q, k, v, plan, scale, impl=kind, storage=storage, out=out, sched=hs)
        p.sched = hs
        return p
    if kind == "simple":
        name = f"daaf_simple_{elem}"
        rows = B * T * H
        grid = ((rows + SIMPLE_ROWS_PER_BLOCK - 1) // SIMPLE_ROWS_PER_BLOCK,)
        args = (q, k, v, out, plan._gidx_arg, plan.gmask, np.int32(B), np.int32(T), np.int32(H), np.int32(D),
                np.int32(Dv), np.int32(plan.n_global), np.int32(plan.local_window), np.float32(scale))
        block = (32 * SIMPLE_ROWS_PER_BLOCK,)
        return daaf_launch.record(Prepared(rt.bind(name, grid, block, args), out, kind, name), rt, name, grid, block,
                                  args)
    name = f"daaf_{kind}_{elem}_d{D}"
    rows_per_block = TC_BLOCK_Q * TC_MTILES[kind]
    grid = ((T + rows_per_block - 1) // rows_per_block, H, B)
    args = (q, k, v, out, plan._gidx_arg, plan.gmask, np.int32(T), np.int32(H), np.int32(plan.n_global),
            np.int32(plan.local_window), np.float32(scale * math.log2(math.e)), np.int32(1 if reverse else 0))
    smem = tc_smem_bytes(D, TC_MTILES[kind])
    return daaf_launch.record(Prepared(rt.bind(name, grid, (TC_THREADS,), args, smem), out, kind, name), rt, name,
                              grid, (TC_THREADS,), args, smem)


def attention(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
              is_global_query_mask: Any = None, *, impl: str = "auto", storage: str | None = None,
              validate: bool = True, out=None, plan: Any = None):
    """DAAF causal attention on the GPU (CuPy arrays). See the module docstring for the rule and shapes.

    ``global_idx``: sorted key-region positions ``[G]`` (numpy/CuPy ints); ``is_global_query_mask``:
    bool ``[T]``, True exactly there (built from ``global_idx`` when None); ``scale`` defaults to
    ``D ** -0.5``; ``plan``: a :class:`DevicePlan` or :class:`hpczeco.daaf.Plan` instead of the index
    arrays (see :func:`prepare`). Runs on the current CuPy stream; returns ``o`` ``[B, T, H, Dv]``.

    Per call: after the first call of a (shape, dtype, plan, window, scale, kernel) the launch comes from a cache
    and a host index unchanged since its plan was made is not checked again (:mod:`hpczeco.gpu.daaf_launch`).
    """
    o = daaf_launch.call_cupy(sys.modules[__name__], q, k, v, global_idx, local_window, scale, is_global_query_mask,
                              impl, storage, validate, out, plan)
    if o is not None:
        return o
    return prepare(q, k, v, global_idx, local_window, scale, is_global_query_mask, impl=impl,
                   storage=storage, validate=validate, out=out, plan=plan)()


# --------------------------------------------------------------------------- PyTorch tensors (DLPack)


def _torch_views(q, k, v):
    import torch  # noqa: PLC0415

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor")
    dt = q.dtype
    if dt == torch.bfloat16:
        storage, bits = "bfloat16", torch.int16
    elif dt == torch.float16:
        storage, bits = "float16", torch.int16
    elif dt == torch.float32:
        storage, bits = None, None
    else:
        raise TypeError(f"q, k, v must be bfloat16, float16 or float32 tensors, got {dt}")
    return storage, bits


class _TorchPrepared:
    def __init__(self, prepared: Prepared, out_t, stream_ptr: int, device: int, keep):
        self.prepared, self.out_t, self.stream_ptr, self.device, self._keep = prepared, out_t, stream_ptr, device, keep
        self.impl, self.name, self.sched = prepared.impl, prepared.name, prepared.sched

    def __call__(self):
        cupy = RUNTIME.get().xp
        with cupy.cuda.Device(self.device), cupy.cuda.ExternalStream(self.stream_ptr):
            self.prepared()
        return self.out_t


def prepare_torch(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
                  is_global_query_mask: Any = None, *, impl: str = "auto", validate: bool = True,
                  reverse: bool = True, plan: Any = None, sched: int | None = None):
    """:func:`prepare` for PyTorch CUDA tensors ``[B, T, H, D]`` (zero-copy DLPack views; launches on
    torch's current stream). Calling the result returns the output tensor (the same tensor each call).
    ``plan``: a :class:`DevicePlan` to reuse (e.g. across layers); ``sched``: as :func:`prepare`."""
    import torch  # noqa: PLC0415

    cupy = RUNTIME.get().xp
    storage, bits = _torch_views(q, k, v)
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out_t = torch.empty(q.shape[:3] + (v.shape[3],), dtype=v.dtype, device=v.device)
    stream_ptr = torch.cuda.current_stream(q.device).cuda_stream

    def view(x):
        return cupy.from_dlpack(x.view(bits) if bits is not None else x)

    with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(stream_ptr):
        cq, ck, cv, co = view(q), view(k), view(v), view(out_t)
        p = prepare(cq, ck, cv, global_idx, local_window, scale, is_global_query_mask, impl=impl,
                    storage=storage, validate=validate, out=co, reverse=reverse, plan=plan, sched=sched)
    return _TorchPrepared(p, out_t, stream_ptr, dev, (q, k, v))


def attention_torch(q, k, v, global_idx: Any, local_window: int, scale: float | None = None,
                    is_global_query_mask: Any = None, *, impl: str = "auto", validate: bool = True,
                    plan: Any = None):
    """DAAF attention for PyTorch CUDA tensors (bf16/fp16/fp32) ``[B, T, H, D]`` -> ``[B, T, H, Dv]``.

    Per call: a lookup and one driver launch on torch's current stream once the (shape, dtype, plan, window, scale,
    kernel) has been seen; a host ``global_idx`` (and mask) unchanged since its plan was made is not checked or
    uploaded again; nothing synchronises (:mod:`hpczeco.gpu.daaf_launch`). A plan is reused across layers and heads
    without the caller holding a prepared object."""
    o = daaf_launch.call_torch(sys.modules[__name__], q, k, v, global_idx, local_window, scale, is_global_query_mask,
                               impl, validate, plan)
    if o is not None:
        return o
    return prepare_torch(q, k, v, global_idx, local_window, scale, is_global_query_mask, impl=impl,
                         validate=validate, plan=plan)()
