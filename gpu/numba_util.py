"""What the Numba CUDA wrappers in ``gpu/`` (:mod:`hpczeco.gpu.gla_numba`) need: ``numba.cuda`` imported after
the numpy shim (:mod:`hpczeco.gpu._numba_shim`), whether the CUDA simulator runs, and how CuPy arrays reach
Numba kernels (device views, CuPy's current stream). Nothing here talks MPI."""

from __future__ import annotations

import importlib
import os
from typing import Any

from . import _numba_shim

_numba_shim.apply()  # before the first import of numba.cuda (see _numba_shim)
cuda = importlib.import_module("numba.cuda")

__all__ = ["SIMULATOR", "cuda", "dev", "is_cupy", "stream"]

#: kernels run under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, read when this module is imported; it is
#: how the tests run the kernels without a GPU)
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def stream(*arrays: Any):
    """CuPy's current stream as a Numba stream when an argument is a CuPy array (and no simulator), else 0."""
    if any(is_cupy(a) for a in arrays) and not SIMULATOR:
        import cupy  # noqa: PLC0415

        return cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    return 0


def dev(x: Any):
    """A Numba device view of a CuPy array (no synchronisation: the kernels run on CuPy's current stream, after
    the work that produced it); anything else unchanged (Numba copies numpy arrays; under the simulator every
    array is a host array, the tests' numpy stand-in for CuPy included)."""
    return cuda.as_cuda_array(x, sync=False) if is_cupy(x) and not SIMULATOR else x
