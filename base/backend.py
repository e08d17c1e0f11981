"""Array backend: numpy on the host (the default), CuPy on the device.

The module is picked from the arrays themselves, as ``cupy.get_array_module`` does, without
importing CuPy unless an argument already is a CuPy array. Nothing here talks MPI.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np


def is_device_array(x: Any) -> bool:
    """True for CuPy arrays (checked without importing CuPy)."""
    mod = type(x).__module__
    return mod.startswith("cupy") and hasattr(x, "__cuda_array_interface__")


def get_array_module(*arrays: Any) -> ModuleType:
    """``cupy`` if any argument is a CuPy array, else ``numpy``. ``None`` arguments are ignored."""
    for a in arrays:
        if a is not None and is_device_array(a):
            return sys.modules["cupy"]  # already imported: the array exists
    return np


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (imports CuPy lazily)."""
    try:
        import cupy  # noqa: PLC0415

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def to_numpy(x: Any) -> np.ndarray:
    """Host copy of ``x`` (no copy for numpy arrays)."""
    if x is None:
        return None
    if is_device_array(x):
        return x.get()
    return np.asarray(x)


def asarray_like(x: Any, like: Any):
    """``x`` as an array of the same module (numpy/cupy) as ``like``."""
    xp = get_array_module(like)
    return xp.asarray(x)
