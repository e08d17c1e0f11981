"""Keep BLAS single-threaded inside the GLA worker threads.

The chunked GLA runs many small matrix products from its own worker threads. If OpenBLAS also
splits one of them over its thread pool (it does above a size threshold, e.g. 128 x 192 x 64),
the pools fight the workers for the cores (measured in docs/benchmarks/gla.md).
OpenBLAS >= 0.3.27 has a per-thread setting, ``openblas_set_num_threads_local``, that changes only the
calling thread; it is found in the loaded libraries with ctypes. Without it this is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

_SYMBOLS = ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local")
_setter = None
_searched = False


def _find_setter():
    global _setter, _searched
    if _searched:
        return _setter
    _searched = True
    try:
        import numpy  # noqa: F401  (make sure numpy's BLAS is loaded)

        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "blas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SYMBOLS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn.restype = ctypes.c_int
                _setter = fn
                return fn
    return None


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS calls from the current thread use one thread inside the block (other threads unaffected)."""
    fn = _find_setter()
    if fn is None:
        yield
        return
    prev = fn(1)
    try:
        yield
    finally:
        fn(prev if prev > 0 else 0)
