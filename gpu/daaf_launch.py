"""Per-call DAAF attention without per-call host work: cached launches whose q, k, v, out pointers change per call.

:func:`hpczeco.gpu.daaf.attention_torch` and :func:`hpczeco.gpu.daaf.attention` take index arrays or a plan on every
call. Preparing a launch (checks, the plan's device arrays, the kernel choice, DLPack views, a bound CuPy launch)
costs 0.25-0.45 ms of host time; here it happens once per distinct (device, shape, dtype, plan, window, scale,
kernel), and every later call is a lookup and one driver launch:

* a host ``global_idx`` (numpy array, CPU tensor) is recognised by identity and a content comparison with the copy
  taken when its plan was made (numpy arrays can change in place: a changed array is a new plan); any other host
  index by content (:func:`hpczeco.gpu.daaf.device_plan`'s cache). Its checks (range, order, mask agreement) ran
  when the plan was made (with ``validate``) and are not repeated while the content is the same; a mask given
  beside it is recognised the same way (a CUDA tensor by identity, version and pointer);
* a plan (``plan=``: a :class:`~hpczeco.gpu.daaf.DevicePlan` or :class:`hpczeco.daaf.Plan`) by identity;
* the launch (:class:`Launcher`): the kernel's driver function with a prepared parameter block, in which only the
  four pointers (and the TMA tensor maps of :mod:`hpczeco.gpu.daaf_fa3`, derived from them) are rewritten per call;
  launched with ``cuLaunchKernel`` on torch's (or CuPy's) current stream. Under the CPU emulation (a runtime without
  CuPy's driver) the same arguments go through ``rt.launch``.

A call that is not one of these (a device index, inputs that are not contiguous or 16-byte aligned, tensors that
require grad, another device than the current one, a first call) takes the full path, which also makes the cache
entries for the next call. Caches are bounded (least recently used dropped): :data:`RECIPES_MAX` launches,
:data:`INDEX_MAX` host index arrays. Plans uploaded from the host are ready on their upload stream; a launch on
another stream first makes that stream wait for the upload's event (:func:`order_plan`, once per stream), so no
upload synchronises the host. Nothing here reads the device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["INDEX_MAX", "LaunchSpec", "Launcher", "RECIPES_MAX", "call_cupy", "call_torch", "clear", "mark_uploaded",
           "order_plan", "record", "stats"]

RECIPES_MAX = 64  # cached launches (device, shape, dtype, plan, window, scale, kernel)
INDEX_MAX = 32  # host index arrays recognised by identity


@dataclass(frozen=True)
class LaunchSpec:
    """A kernel launch as a wrapper binds it: ``args`` as ``rt.bind`` takes them, with q, k, v, out at ``io`` (their
    device pointers change per call); ``retarget(ptrs, stream) -> {position: value}`` gives the arguments that depend on
    those pointers or on the stream (the tensor maps and the tile queue of daaf_fa3; ctypes values of the
    arguments' sizes), None when none do; ``rt``: the runtime that launches it."""

    rt: Any
    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    smem: int
    args: tuple
    io: tuple[int, int, int, int] = (0, 1, 2, 3)
    retarget: Callable[[tuple[int, int, int, int], int], dict] | None = None


def record(prepared: Any, rt: Any, name: str, grid, block, args, smem: int = 0, io=(0, 1, 2, 3),
           retarget: Callable | None = None) -> Any:
    """Attach the :class:`LaunchSpec` of a bound launch to ``prepared`` (a :class:`hpczeco.gpu.runtime.Prepared`)."""
    prepared.spec = LaunchSpec(rt, name, tuple(int(x) for x in grid), tuple(int(x) for x in block), int(smem),
                               tuple(args), tuple(io), retarget)
    return prepared


def _ctype(rt: Any, a: Any) -> Any:
    """The kernel parameter ``a`` as a ctypes value of its size (a device array: its pointer)."""
    if a is None:
        return ctypes.c_uint64(0)
    if isinstance(a, (ctypes.Array, ctypes.Structure)):
        buf = type(a)()
        ctypes.memmove(ctypes.addressof(buf), ctypes.addressof(a), ctypes.sizeof(a))
        return buf
    if rt.is_native(a):
        return ctypes.c_uint64(rt.ptr(a))
    for t, c in ((np.int32, ctypes.c_int32), (np.uint32, ctypes.c_uint32), (np.float32, ctypes.c_float),
                 (np.uint64, ctypes.c_uint64), (np.int64, ctypes.c_int64), (np.float64, ctypes.c_double)):
        if isinstance(a, t):
            return c(a.item())
    raise TypeError(f"unsupported kernel argument {type(a).__name__}")


class Launcher:
    """One kernel launch with q, k, v, out pointers given per call: ``launcher((qp, kp, vp, op), stream_ptr)``.

    With CuPy (a runtime whose ``xp.cuda.driver`` launches): the driver function and a ctypes parameter block made
    once, the pointers written into it per call (under a lock: the block is shared) and ``cuLaunchKernel`` on
    ``stream_ptr``. Otherwise (the CPU emulation): ``rt.launch`` with the pointers as ``np.uint64`` arguments."""

    def __init__(self, spec: LaunchSpec):
        # the arrays at ``io`` (the first call's q, k, v, out) are not kept: only their places
        self.spec = dataclasses.replace(spec, args=tuple(None if i in spec.io else a for i, a in enumerate(spec.args)))
        rt = spec.rt
        fn = getattr(rt, "function", None)
        driver = getattr(getattr(getattr(rt, "xp", None), "cuda", None), "driver", None)
        self.direct = callable(fn) and hasattr(driver, "launchKernel")
        if self.direct:
            self._fptr = int(fn(spec.name, spec.smem).kernel.ptr)
            self._launch = driver.launchKernel
            self._vals = [_ctype(rt, a) for a in spec.args]
            self._params = (ctypes.c_void_p * max(1, len(self._vals)))(*[ctypes.addressof(x) for x in self._vals])
            self._addr = ctypes.addressof(self._params)
            g = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
            b = tuple(spec.block) + (1,) * (3 - len(spec.block))
            self._dims = (*g, *b)
            self._lock = threading.Lock()

    def __call__(self, ptrs: tuple[int, int, int, int], stream_ptr: int = 0) -> None:
        s = self.spec
        extra = s.retarget(ptrs, stream_ptr) if s.retarget is not None else {}
        if self.direct:
            with self._lock:
                vals = self._vals
                for pos, p in zip(s.io, ptrs):
                    vals[pos].value = p
                for pos, value in extra.items():
                    ctypes.memmove(ctypes.addressof(vals[pos]), ctypes.addressof(value), ctypes.sizeof(vals[pos]))
                self._launch(self._fptr, *self._dims, s.smem, stream_ptr, self._addr, 0)
            return
        args = list(s.args)
        for pos, p in zip(s.io, ptrs):
            args[pos] = np.uint64(p)
        for pos, value in extra.items():
            args[pos] = value
        s.rt.launch(s.name, s.grid, s.block, tuple(args), s.smem)


# --------------------------------------------------------------------------- plans uploaded without a host sync


def mark_uploaded(plan: Any, xp: Any) -> None:
    """Record that ``plan``'s device arrays were just copied on ``xp``'s current stream (an event after the copies):
    launches on other streams wait for it (:func:`order_plan`). No host synchronisation."""
    cuda = getattr(xp, "cuda", None)
    if cuda is None or not hasattr(cuda, "Event"):
        return
    stream = cuda.get_current_stream()
    ev = cuda.Event(disable_timing=True)
    ev.record(stream)
    plan._upload = (ev, {int(getattr(stream, "ptr", 0))})


def order_plan(plan: Any, stream_ptr: int, xp: Any) -> None:
    """Make the stream ``stream_ptr`` wait (on the device) for ``plan``'s upload, once per stream."""
    up = getattr(plan, "_upload", None)
    if up is None or stream_ptr in up[1]:
        return
    xp.cuda.ExternalStream(stream_ptr).wait_event(up[0])
    up[1].add(stream_ptr)


# --------------------------------------------------------------------------- caches


class _Recipe:
    __slots__ = ("launcher", "dplan", "keep", "impl", "name", "sched", "xp")

    def __init__(self, launcher: Launcher, dplan: Any, keep: Any, prepared: Any, xp: Any):
        self.launcher, self.dplan, self.keep, self.xp = launcher, dplan, keep, xp
        self.impl, self.name, self.sched = prepared.impl, prepared.name, getattr(prepared, "sched", None)


class _IndexEntry:
    __slots__ = ("ref", "snap", "T", "W", "validated", "plan", "mask")

    def __init__(self, ref, snap, T, W, validated, plan, mask):
        self.ref, self.snap, self.T, self.W, self.validated, self.plan, self.mask = (ref, snap, T, W, validated, plan,
                                                                                     mask)


_RECIPES: OrderedDict[tuple, _Recipe] = OrderedDict()
_INDEX: OrderedDict[int, _IndexEntry] = OrderedDict()
_STATS = {"hit": 0, "miss": 0, "full": 0}


def clear() -> None:
    """Drop every cached launch and index entry (tests; a changed runtime)."""
    _RECIPES.clear()
    _INDEX.clear()
    _STATS.update(hit=0, miss=0, full=0)


def stats() -> dict[str, int]:
    """Calls served from the cache (``hit``), that made a cache entry (``miss``), and that took the full path
    without one (``full``: not eligible)."""
    return dict(_STATS)


def _put(cache: OrderedDict, key, value, limit: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


def _mask_sig(mask: Any) -> Any:
    """What identifies a checked mask: None, ("torch", weakref, version, pointer) for a tensor, ("host", weakref,
    copy) for a numpy array; False when it cannot be recognised (the full path then checks it every call)."""
    if mask is None:
        return None
    mod = type(mask).__module__
    try:
        if mod.startswith("torch"):
            if not mask.is_cuda:
                return ("host", weakref.ref(mask), mask.numpy().copy())
            return ("torch", weakref.ref(mask), mask._version, mask.data_ptr())
        if isinstance(mask, np.ndarray) and not mod.startswith("cupy"):
            return ("host", weakref.ref(mask), mask.copy())
    except (TypeError, RuntimeError):
        pass
    return False


def _mask_same(sig: Any, mask: Any) -> bool:
    if sig is None or mask is None:
        return sig is None and mask is None
    if sig is False or sig[1]() is not mask:
        return False
    if sig[0] == "torch":
        return mask._version == sig[2] and mask.data_ptr() == sig[3]
    host = mask.numpy() if type(mask).__module__.startswith("torch") else mask
    return host.shape == sig[2].shape and np.array_equal(host, sig[2])


def _host_index(global_idx: Any, rt: Any) -> np.ndarray | None:
    """``global_idx`` as a numpy array when it lives on the host and can be recognised by identity (a numpy array,
    a CPU tensor's view), else None."""
    mod = type(global_idx).__module__
    if isinstance(global_idx, np.ndarray) and not rt.is_native(global_idx):
        return global_idx
    if mod.startswith("torch") and not global_idx.is_cuda and not global_idx.requires_grad:
        return global_idx.numpy()
    return None


def _plan_for(gd: Any, rt: Any, global_idx: Any, local_window: int, T: int, mask: Any, validate: bool) -> Any:
    """The device plan of a host index (and mask): from the identity cache when the array (and mask) are unchanged
    since their plan was made, else :func:`hpczeco.gpu.daaf.device_plan` (which checks them); None for a device
    index (the full path handles it)."""
    W = min(int(local_window), T)
    host = _host_index(global_idx, rt)
    if host is not None:
        key = id(global_idx)
        e = _INDEX.get(key)
        if (e is not None and e.ref() is global_idx and e.T == T and e.W == W and (e.validated or not validate)
                and host.shape == e.snap.shape and np.array_equal(host, e.snap) and _mask_same(e.mask, mask)):
            _INDEX.move_to_end(key)
            return e.plan
    elif rt.is_native(global_idx) or type(global_idx).__module__.startswith("torch"):
        return None  # a device index: used in place (and checked per call) by the full path
    plan = gd.device_plan(global_idx, local_window, T, mask, validate=validate)
    if host is not None:
        try:
            ref = weakref.ref(global_idx)
        except TypeError:
            return plan
        sig = _mask_sig(mask)
        if sig is not False:
            _put(_INDEX, id(global_idx), _IndexEntry(ref, host.copy(), T, W, bool(validate), plan, sig), INDEX_MAX)
    return plan


def _scale_key(scale: Any, D: int) -> float | None:
    if scale is None:
        return D**-0.5
    if type(scale) in (float, int) and math.isfinite(scale) and scale > 0:
        return float(scale)
    return None  # anything else: the full path checks (and reports) it


# --------------------------------------------------------------------------- the two per-call entries


def _torch_device(x: Any) -> int:
    """The CUDA device of a tensor (-1: CPU). A hook: the CPU tests let CPU tensors stand in for CUDA ones."""
    return x.get_device()


def _torch_current_device() -> int:
    import torch  # noqa: PLC0415

    return torch.cuda.current_device()


_RAW_STREAM: Any = None


def _torch_stream(device: int) -> int:
    """torch's current stream on ``device`` as an integer (``torch._C._cuda_getCurrentRawStream``: one C call)."""
    global _RAW_STREAM  # noqa: PLW0603 - looked up once
    if _RAW_STREAM is None:
        import torch  # noqa: PLC0415

        _RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda dev: int(torch.cuda.current_stream(dev).cuda_stream))
    return _RAW_STREAM(device)


def _resolve(gd: Any, rt: Any, global_idx: Any, local_window: Any, T: int, mask: Any, validate: bool,
             plan: Any) -> Any:
    """What identifies the call's plan: ``plan`` itself, or the device plan of a host index; None: full path."""
    if plan is not None:
        return plan
    if not isinstance(local_window, int) or isinstance(local_window, bool) or local_window < 0:
        return None
    return _plan_for(gd, rt, global_idx, local_window, T, mask, validate)


def _recipe(key: tuple, make: Callable[[], Any], plan: Any, gd: Any, xp: Any) -> _Recipe | None:
    """The cached launch of ``key``, or one made from the full path's :class:`Prepared` (``make()``); None when that
    launch has no :class:`LaunchSpec`."""
    rec = _RECIPES.get(key)
    if rec is not None:
        _RECIPES.move_to_end(key)
        _STATS["hit"] += 1
        return rec
    p = make()
    spec = getattr(p, "spec", None)
    if spec is None:
        return None
    dplan = plan if isinstance(plan, gd.DevicePlan) else gd.plan_on_device(plan)
    rec = _Recipe(Launcher(spec), dplan, plan, p, xp)
    _put(_RECIPES, key, rec, RECIPES_MAX)
    _STATS["miss"] += 1
    return rec


def call_torch(gd, q, k, v, global_idx, local_window, scale, mask, impl, validate, plan) -> Any:
    """:func:`hpczeco.gpu.daaf.attention_torch` from the caches (``gd``: that module, which this one does not
    import): the output tensor, or None when this call needs the full path (which the caller then takes)."""
    import torch  # noqa: PLC0415

    T_ = torch.Tensor
    if not (isinstance(q, T_) and isinstance(k, T_) and isinstance(v, T_)) or not isinstance(impl, str):
        return None
    dt = q.dtype
    if k.dtype != dt or v.dtype != dt or dt not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return None
    dev = _torch_device(q)
    if dev < 0 or _torch_device(k) != dev or _torch_device(v) != dev or _torch_current_device() != dev:
        return None
    if q.dim() != 4 or v.dim() != 4 or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if (ptrs[0] | ptrs[1] | ptrs[2]) & 15:
        return None
    shape = tuple(q.shape)
    if tuple(k.shape) != shape or tuple(v.shape[:3]) != shape[:3] or min(shape) < 1:
        return None
    sc = _scale_key(scale, shape[3])
    if sc is None:
        return None
    rt = gd.RUNTIME.get()
    p_ = _resolve(gd, rt, global_idx, local_window, shape[1], mask, validate, plan)
    if p_ is None:
        _STATS["full"] += 1
        return None
    key = ("torch", id(rt), dev, shape, int(v.shape[3]), dt, id(p_), sc, impl)

    def make():
        return gd.prepare_torch(q, k, v, None, local_window, scale, None, impl=impl, validate=validate,
                                plan=p_).prepared

    rec = _RECIPES.get(key)
    if rec is not None:
        _RECIPES.move_to_end(key)
        _STATS["hit"] += 1
    else:
        with rt.xp.cuda.Device(dev):
            rec = _recipe(key, make, p_, gd, rt.xp)
    if rec is None:
        _STATS["full"] += 1
        return None
    out = torch.empty_like(v)
    stream = _torch_stream(dev)
    order_plan(rec.dplan, stream, rec.xp)
    rec.launcher((*ptrs, out.data_ptr()), stream)
    return out


def call_cupy(gd, q, k, v, global_idx, local_window, scale, mask, impl, storage, validate, out, plan) -> Any:
    """:func:`hpczeco.gpu.daaf.attention` (CuPy arrays) from the caches (``gd``: that module): the output array, or
    None when this call needs the full path."""

    rt = gd.RUNTIME.get()
    if not (rt.is_native(q) and rt.is_native(k) and rt.is_native(v)) or not isinstance(impl, str):
        return None
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or not (q.dtype == k.dtype == v.dtype):
        return None
    if not (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous):
        return None
    ptrs = (rt.ptr(q), rt.ptr(k), rt.ptr(v))
    if (ptrs[0] | ptrs[1] | ptrs[2]) & 15:
        return None
    shape = tuple(q.shape)
    if tuple(k.shape) != shape or tuple(v.shape[:3]) != shape[:3] or min(shape) < 1:
        return None
    sc = _scale_key(scale, shape[3])
    if sc is None:
        return None
    Dv = int(v.shape[3])
    if out is not None and not (rt.is_native(out) and tuple(out.shape) == shape[:3] + (Dv,) and out.dtype == v.dtype
                                and out.flags.c_contiguous and rt.ptr(out) % 16 == 0):
        return None  # the full path reports it
    xp = rt.xp
    p_ = _resolve(gd, rt, global_idx, local_window, shape[1], mask, validate, plan)
    if p_ is None:
        _STATS["full"] += 1
        return None
    key = ("cupy", id(rt), gd._device_id(rt), shape, Dv, str(q.dtype), storage, id(p_), sc, impl)
    if out is None:
        out = xp.empty(shape[:3] + (Dv,), dtype=v.dtype)

    def make():
        return gd.prepare(q, k, v, None, local_window, scale, None, impl=impl, storage=storage, validate=validate,
                          out=out, plan=p_)

    rec = _recipe(key, make, p_, gd, xp)
    if rec is None:
        _STATS["full"] += 1
        return None
    cuda = getattr(xp, "cuda", None)
    stream = int(getattr(cuda.get_current_stream(), "ptr", 0)) if cuda is not None else 0
    order_plan(rec.dplan, stream, xp)
    rec.launcher((*ptrs, rt.ptr(out)), stream)
    return out
