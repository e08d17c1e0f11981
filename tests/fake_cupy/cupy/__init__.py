"""A numpy stand-in for CuPy (tests only) that counts host synchronisations and host-to-device uploads.

Two uses:

- in a process of its own, with this folder's parent (``tests/fake_cupy``) first on ``sys.path``: ``import
  cupy`` is this module (it shadows CuPy), for dry runs of the GPU drivers with an
  ``hpczeco.gpu.emu.EmuRuntime`` (``xp`` set to this module) in the wrappers' runtime slots;
- in a test: :func:`helpers.fake_cupy` loads a fresh copy (fresh counters) to put in ``sys.modules["cupy"]``
  and in an emulator runtime's ``xp``.

Arrays (:class:`ndarray`, a numpy subclass whose ``type(x).__module__`` is ``"cupy"``) have ``.get()``,
``.data.ptr`` and a host ``__cuda_array_interface__``, and count every way CuPy reads the device from the host:
``get``, ``asnumpy``, ``item``, ``tolist``, ``bool``/``int``/``float``/``index`` conversions (reductions and scalar
indexing return 0-d arrays, as CuPy's do), ``Stream``/``Event``/``Device`` ``synchronize``. ``asarray``/``array``/
``ascontiguousarray`` of host data count as uploads. With ``state["strict"] = True`` a synchronisation raises
instead (to find where it happens); :func:`reset` zeroes the counters. Streams are no-ops, events record the host
clock, pinned memory is a bytearray, ``random.RandomState`` draws with numpy. (``np.asarray`` of one of these
arrays cannot be intercepted; real CuPy refuses it with a TypeError.) Not a CuPy.
"""

from __future__ import annotations

import ctypes
import time
import types
from typing import Any

import numpy as np

__version__ = "fake-numpy"

counts = {"sync": 0, "upload": 0}
state: dict[str, Any] = {"strict": False, "where": []}


def reset() -> None:
    """Zero the counters and forget where the synchronisations happened."""
    counts.update(sync=0, upload=0)
    state["where"].clear()


def _sync(what: str) -> None:
    counts["sync"] += 1
    state["where"].append(what)
    if state["strict"]:
        raise AssertionError(f"host synchronisation: {what}")


class ndarray(np.ndarray):  # noqa: N801 - mirrors cupy.ndarray
    def get(self, *a, **k):
        _sync("get")
        return np.asarray(self).copy()

    def __bool__(self):
        _sync("bool")
        return bool(np.asarray(self))

    def __int__(self):
        _sync("int")
        return int(np.asarray(self))

    def __float__(self):
        _sync("float")
        return float(np.asarray(self))

    def __index__(self):
        _sync("index")
        return int(np.asarray(self))

    def item(self, *a):
        _sync("item")
        return np.asarray(self).item(*a)

    def tolist(self):
        _sync("tolist")
        return np.asarray(self).tolist()

    def __getitem__(self, key):
        return _wrap(np.ndarray.__getitem__(self, key))

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False), "version": 3,
                "strides": None if self.flags.c_contiguous else self.strides}


def _reduction(name: str):
    def reduce(self, *a, **k):
        return _wrap(getattr(np.ndarray, name)(self, *a, **k))

    reduce.__name__ = name
    return reduce


for _name in ("min", "max", "sum", "any", "all", "argmax", "argmin", "mean"):
    setattr(ndarray, _name, _reduction(_name))
ndarray.__module__ = "cupy"


def _wrap(x):
    if isinstance(x, ndarray):
        return x
    if isinstance(x, np.ndarray):
        return x.view(ndarray)
    if isinstance(x, np.generic):
        return np.asarray(x).view(ndarray)
    return x


def __getattr__(name: str) -> Any:
    obj = getattr(np, name)
    if callable(obj) and not isinstance(obj, type):

        def f(*a, **k):
            r = obj(*a, **k)
            return tuple(_wrap(x) for x in r) if isinstance(r, tuple) else _wrap(r)

        return f
    return obj


def asarray(x, dtype=None, *a, **k):
    if isinstance(x, ndarray):
        return _wrap(np.asarray(x, dtype=dtype))
    counts["upload"] += 1
    return _wrap(np.array(x, dtype=dtype))


array = asarray


def ascontiguousarray(x, dtype=None):
    if not isinstance(x, ndarray):
        counts["upload"] += 1
    return _wrap(np.ascontiguousarray(x, dtype=dtype))


def asnumpy(x):
    _sync("asnumpy")
    return np.asarray(x).copy()


def from_dlpack(x):
    return _wrap(np.from_dlpack(x))


class _RandomState:
    """What the drivers call of ``cupy.random.RandomState`` (numpy's generator; arrays are this module's)."""

    def __init__(self, seed=None):
        self.g = np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=np.float64):
        return _wrap(np.asarray(self.g.standard_normal(size)).astype(dtype))

    def uniform(self, low=0.0, high=1.0, size=None, dtype=np.float64):
        return _wrap(np.asarray(self.g.uniform(low, high, size)).astype(dtype))


random = types.SimpleNamespace(RandomState=_RandomState)


class _Pool:
    def free_all_blocks(self):
        pass


def get_default_memory_pool():
    return _Pool()


class _Event:
    def __init__(self, *a, **k):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        _sync("event.synchronize")

    @property
    def done(self):
        return True


class _Stream:
    ptr = 0

    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        _sync("stream.synchronize")

    def wait_event(self, e):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Device:
    id = 0
    attributes = {"MultiProcessorCount": 132}

    def __init__(self, i=0):
        pass

    def use(self):
        pass

    def synchronize(self):
        _sync("device.synchronize")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Runtime:
    @staticmethod
    def getDeviceCount():  # noqa: N802
        return 1

    @staticmethod
    def getDevice():  # noqa: N802
        return 0

    @staticmethod
    def getDeviceProperties(i):  # noqa: N802
        return {"name": b"FakeGPU (numpy)", "multiProcessorCount": 132, "l2CacheSize": 0,
                "sharedMemPerBlockOptin": 232448}

    @staticmethod
    def deviceGetStreamPriorityRange():  # noqa: N802
        return (0, -5)

    @staticmethod
    def deviceSynchronize():  # noqa: N802
        _sync("deviceSynchronize")

    @staticmethod
    def memcpyAsync(dst, src, n, kind, stream):  # noqa: N802
        ctypes.memmove(dst, src, n)


cuda = types.SimpleNamespace(
    Event=_Event,
    Stream=_Stream,
    ExternalStream=lambda ptr, *a: _Stream(),
    Device=_Device,
    runtime=_Runtime,
    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    get_current_stream=lambda: _Stream(),
    alloc_pinned_memory=lambda n: bytearray(n),
)
