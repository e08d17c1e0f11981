"""A numpy stand-in for CuPy that counts host synchronisations and host-to-device uploads (tests only).

:func:`make` returns a fresh module object to put in ``sys.modules["cupy"]`` and in an emulator runtime's
``xp``. Its arrays (:class:`ndarray`, a numpy subclass whose ``type(x).__module__`` is ``"cupy"``) count every
way CuPy reads the device from the host: ``get``, ``asnumpy``, ``item``, ``tolist``, ``bool``/``int``/``float``/
``index`` conversions (reductions and scalar indexing return 0-d arrays, as CuPy's do), ``Stream``/``Event``
``synchronize``. ``asarray``/``array`` of host data count as uploads (from pageable memory: a copy that may
synchronise). With ``strict = True`` a synchronisation raises instead (to find where it happens).
(``np.asarray`` of one of these arrays cannot be intercepted; real CuPy refuses it with a TypeError.)
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import numpy as np


def make() -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.__version__ = "counting-numpy"
    counts = {"sync": 0, "upload": 0}
    state = {"strict": False, "where": []}

    def sync(what: str) -> None:
        counts["sync"] += 1
        state["where"].append(what)
        if state["strict"]:
            raise AssertionError(f"host synchronisation: {what}")

    class ndarray(np.ndarray):  # noqa: N801 - mirrors cupy.ndarray
        def get(self, *a, **k):
            sync("get")
            return np.asarray(self).copy()

        def __bool__(self):
            sync("bool")
            return bool(np.asarray(self))

        def __int__(self):
            sync("int")
            return int(np.asarray(self))

        def __float__(self):
            sync("float")
            return float(np.asarray(self))

        def __index__(self):
            sync("index")
            return int(np.asarray(self))

        def item(self, *a):
            sync("item")
            return np.asarray(self).item(*a)

        def tolist(self):
            sync("tolist")
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

    for name in ("min", "max", "sum", "any", "all", "argmax", "argmin", "mean"):
        def reduce(self, *a, _name=name, **k):
            return _wrap(getattr(np.ndarray, _name)(self, *a, **k))

        setattr(ndarray, name, reduce)
    ndarray.__module__ = "cupy"

    def _wrap(x):
        if isinstance(x, ndarray):
            return x
        if isinstance(x, np.ndarray):
            return x.view(ndarray)
        if isinstance(x, np.generic):
            return np.asarray(x).view(ndarray)
        return x

    def asarray(x, dtype=None, *a, **k):
        if isinstance(x, ndarray):
            return _wrap(np.asarray(x, dtype=dtype))
        counts["upload"] += 1
        return _wrap(np.array(x, dtype=dtype))

    def asnumpy(x):
        sync("asnumpy")
        return np.asarray(x).copy()

    def ascontiguousarray(x, dtype=None):
        if not isinstance(x, ndarray):
            counts["upload"] += 1
        return _wrap(np.ascontiguousarray(x, dtype=dtype))

    class Stream:
        ptr = 0

        def __init__(self, *a, **k):
            pass

        def synchronize(self):
            sync("stream.synchronize")

        def wait_event(self, e):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Event:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            sync("event.synchronize")

    class Runtime:
        @staticmethod
        def getDevice():  # noqa: N802
            return 0

        @staticmethod
        def deviceGetStreamPriorityRange():  # noqa: N802
            return (0, -5)

    mod.cuda = types.SimpleNamespace(Stream=Stream, Event=Event, ExternalStream=lambda ptr, *a: Stream(),
                                     Device=lambda i=0: contextlib.nullcontext(), runtime=Runtime,
                                     get_current_stream=lambda: Stream())
    mod.ndarray = ndarray
    mod.asarray = asarray
    mod.array = asarray
    mod.asnumpy = asnumpy
    mod.ascontiguousarray = ascontiguousarray
    mod.counts = counts
    mod.state = state
    mod.from_dlpack = lambda x: _wrap(np.from_dlpack(x))

    def __getattr__(name: str) -> Any:
        obj = getattr(np, name)
        if callable(obj) and not isinstance(obj, type):
            def f(*a, **k):
                r = obj(*a, **k)
                return tuple(_wrap(x) for x in r) if isinstance(r, tuple) else _wrap(r)

            return f
        return obj

    mod.__getattr__ = __getattr__
    mod.reset = lambda: (counts.update(sync=0, upload=0), state["where"].clear())
    return mod
