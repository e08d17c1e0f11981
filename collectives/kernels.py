"""The scan operator: its float reference and its one arithmetic kernel.

The operator on pairs ``(a [..., K], S [..., K, V])`` is ``(a1, S1) o (a2, S2) = (a1 a2, a2[..., None] S1 + S2)``
(associative, not commutative, identity ``(1, 0)``). :func:`combine` and :func:`fold_reference` are its
plain array form (the reference the tests check the scans against); the scans apply it as
:func:`axpy_rows`, ``out[r, :] = a[r] * X[r, :] + S[r, :]`` on ``[R, V]`` rows.

Host (numpy) arrays use a fused Numba loop (one pass, no temporary, releases the GIL) when Numba
is importable and the arrays are C-contiguous float32/float64 of one dtype; ``out`` may be ``X``
or ``S`` (element-wise, each element is read before it is written). Anything else -- CuPy arrays,
strided views, no Numba -- uses the arrays' own module (``xp.multiply``/``xp.add``), never numpy
on device arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hpczeco.base.backend import get_array_module

__all__ = ["combine", "fold_reference", "axpy_rows", "row_kernel", "numba_available", "value_summary"]


def combine(x: tuple[Any, Any], y: tuple[Any, Any]) -> tuple[Any, Any]:
    """``x o y`` for pairs ``(a [..., K], S [..., K, V])``: ``(a_x a_y, a_y[..., None] S_x + S_y)`` (new arrays)."""
    ax, sx = x
    ay, sy = y
    return ax * ay, ay[..., None] * sx + sy


def fold_reference(pairs: list[tuple[Any, Any]], initial: Any = None) -> list[Any]:
    """Sequential exclusive scan of ``pairs`` in list order: ``[S_in^(0), S_in^(1), ...]`` (for tests)."""
    out = []
    S0 = pairs[0][1]
    xp = get_array_module(S0)
    X = xp.zeros_like(S0) if initial is None else initial.copy()
    for a, S in pairs:
        out.append(X.copy())
        X = a[..., None] * X + S
    return out


_FUSED: Any = None  # None: not tried yet; False: unavailable
_SUMMARY: Any = None


def _load() -> Any:
    global _FUSED
    if _FUSED is None:
        try:
            import numba  # noqa: PLC0415 - imported on first use (slow import)

            @numba.njit(cache=True, nogil=True, boundscheck=False)
            def fused(X, a, S, out):  # pragma: no cover - compiled
                R, V = X.shape
                for r in range(R):
                    ar = a[r]
                    for v in range(V):
                        out[r, v] = ar * X[r, v] + S[r, v]

            @numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
            def summary(a, S):  # pragma: no cover - compiled
                amin = a[0]
                amax = a[0]
                abad = a[0] * 0
                for i in range(a.size):
                    x = a[i]
                    abad += x * 0  # NaN once any x is NaN or +-Inf
                    if x < amin:
                        amin = x
                    if x > amax:
                        amax = x
                sbad = S[0] * 0
                for i in range(S.size):  # reassoc: a vectorised sum of S * 0
                    sbad += S[i] * 0
                return amin, amax, abad, sbad

            _FUSED = fused
            global _SUMMARY
            _SUMMARY = summary
        except Exception:  # numba missing or broken: numpy fallback
            _FUSED = False
    return _FUSED


def value_summary(a: Any, S: Any) -> tuple[float, float, bool] | None:
    """``(min(a), max(a), every value of a and S finite)`` in one fused pass, for C-contiguous host float32/64
    arrays of one dtype with Numba; None otherwise (the caller then uses array reductions). Min and max
    are meaningful only when the flag is True."""
    if not (_fusable(a, S) and a.size and S.size and _load()):
        return None
    amin, amax, abad, sbad = _SUMMARY(a.reshape(-1), S.reshape(-1))
    return float(amin), float(amax), bool(abad == 0 and sbad == 0)


def numba_available() -> bool:
    """True when the fused host kernel is used."""
    return bool(_load())


def _fusable(*arrays: np.ndarray) -> bool:
    dt = arrays[0].dtype
    for x in arrays:
        if type(x) is not np.ndarray or x.dtype != dt or not x.flags.c_contiguous:
            return False
    return dt == np.float32 or dt == np.float64


def axpy_rows(X: Any, a: Any, S: Any, out: Any) -> Any:
    """``out = a[:, None] * X + S`` for ``X, S, out [R, V]`` and ``a [R]``; returns ``out``.

    ``out`` may be the same array as ``X`` or ``S``.
    """
    if X.ndim == 2 and a.ndim == 1 and _fusable(X, S, out) and type(a) is np.ndarray and a.dtype == X.dtype:
        fused = _load()
        if fused:
            fused(X, a, S, out)
            return out
    xp = get_array_module(X, S, out)
    if out is S or (xp is np and np.shares_memory(out, S)):
        tmp = xp.multiply(X, a[:, None])
        xp.add(tmp, S, out=out)
    else:
        xp.multiply(X, a[:, None], out=out)
        xp.add(out, S, out=out)
    return out


def row_kernel(X: Any, a: Any, S: Any, out: Any):
    """A function ``k(X, a, S, out)`` equal to :func:`axpy_rows` for arrays like these, with the
    checks done once: the compiled loop itself when they qualify (a ring calls it once per piece)."""
    if X.ndim == 2 and a.ndim == 1 and _fusable(X, S, out) and type(a) is np.ndarray and a.dtype == X.dtype:
        fused = _load()
        if fused:
            return fused
    return axpy_rows
