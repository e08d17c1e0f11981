"""A numpy-backed stand-in for CuPy, for dry runs of GPU driver code on a machine without a GPU: put this
folder first on ``sys.path`` (in a subprocess of its own: it shadows CuPy) and an
``hpczeco.gpu.emu.EmuRuntime`` with ``xp`` set to this module in the wrappers' runtime slots. Arrays are
numpy arrays with ``.get()``, ``.data.ptr`` and a host ``__cuda_array_interface__``; streams and events
are no-ops; pinned memory is a bytearray. Not a CuPy."""

import ctypes
import time
import types

import numpy as np

__version__ = "fake-numpy"


class ndarray(np.ndarray):  # noqa: N801 - mirrors cupy.ndarray
    def get(self, *a, **k):
        return np.asarray(self).copy()

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def __cuda_array_interface__(self):
        strides = None if self.flags.c_contiguous else self.strides
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ctypes.data, False),
            "version": 3,
            "strides": strides,
        }


def _wrap(x):
    if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
        return x.view(ndarray)
    return x


def __getattr__(name):
    obj = getattr(np, name)
    if callable(obj) and not isinstance(obj, type):

        def f(*a, **k):
            r = obj(*a, **k)
            return tuple(_wrap(x) for x in r) if isinstance(r, tuple) else _wrap(r)

        return f
    return obj


def asnumpy(x):
    return np.asarray(x)


class _Event:
    def __init__(self, *a, **k):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    @property
    def done(self):
        return True


class _Stream:
    ptr = 0

    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def wait_event(self, e):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Device:
    id = 0
    attributes = {"MultiProcessorCount": 132}

    def __init__(self, i=0):
        pass

    def use(self):
        pass

    def synchronize(self):
        pass


class _Runtime:
    @staticmethod
    def getDeviceCount():  # noqa: N802
        return 1

    @staticmethod
    def getDevice():  # noqa: N802
        return 0

    @staticmethod
    def getDeviceProperties(i):  # noqa: N802
        return {"name": b"FakeGPU (numpy)", "l2CacheSize": 0, "sharedMemPerBlockOptin": 232448}

    @staticmethod
    def memcpyAsync(dst, src, n, kind, stream):  # noqa: N802
        ctypes.memmove(dst, src, n)


cuda = types.SimpleNamespace(
    Event=_Event,
    Stream=_Stream,
    Device=_Device,
    runtime=_Runtime,
    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    get_current_stream=lambda: _Stream(),
    alloc_pinned_memory=lambda n: bytearray(n),
)
