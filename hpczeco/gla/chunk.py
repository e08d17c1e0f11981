"""Chunked gated linear attention on the CPU: forward :func:`chunk_gla` and backward :func:`chunk_gla_bwd`
(flash-linear-attention's ``chunk_gla`` signatures, with ``cu_seqlens`` for packed documents). CuPy inputs go to
:mod:`hpczeco.gpu.gla` (same signatures); the float64 reference they are tested against is :mod:`hpczeco.gla.naive`.
Local: no communication.

Semantics and layout as :mod:`hpczeco.gla.naive` (``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``,
states ``[B, H, K, V]``).

Chunked form. The sequence is cut into chunks of ``C`` tokens, each chunk into ``ns`` sub-chunks of
``c <= 16`` tokens. With ``b`` the cumulative gate inside a chunk (inclusive), ``r_I = b`` at the
first token of sub-chunk ``I`` and ``e_J = b`` at its last token::

    Q' = q * exp(b - r_I)        K' = k * exp(e_J - b)             (both factors <= 1)
    F_IJ = exp(r_I - e_J)        (<= 1 for J < I; the diagonal F_II = exp(span_I) >= 1)
    A[I, J] = scale * Q'_I (K'_J * F_IJ)^T   for J <= I, lower triangle on the diagonal blocks
    O = A V + scale * (Q' * exp(r_I)) S_prev = [A | scale q exp(b)] @ [V ; S_prev]
    S_next = diag(exp(b_C)) S_prev + (K' * exp(b_C - e_J))^T V

Every exponent is <= 0 except the diagonal-block factor ``exp(span_I)`` (``span_I`` = minus the gate
summed over a sub-chunk after its first token). Where ``span_I`` exceeds the span limit
(:data:`SPAN_LIMIT`: 40 in float32, 300 in float64; strong decays such as g = -8 per token),
that diagonal block is computed in the exact pairwise form ``sum_k q_ik k_jk exp(b_ik - b_jk)`` (masked
exponents <= 0; :func:`hpczeco.gla.kernels.pairwise_A`) instead, so no factor ever overflows. Partial chunks and
sub-chunks are padded with no-op tokens (q = k = v = g = 0). Gate sums are taken inside sub-chunks (short
sums) and across sub-chunks from their totals.

Execution (streaming). Time runs in the outer loop, in groups of chunks (about 512 padded tokens, so
the scratch stays in cache), the (batch, head) sequences in the inner loop; sequences are split over
threads by :func:`run_units` (``HPCZECO_GLA_THREADS`` / ``OMP_NUM_THREADS`` / cores). Per group,
numba kernels (:mod:`hpczeco.gla.kernels`, GIL released) build the exponents and the matmul operands,
``np.exp`` exponentiates, BLAS does every product (``A`` row blocks, ``K^T V``, the fused
``[A | Qe] [V; S]``), and the ``[K, V]`` state is carried from group to group. The chunk geometry (:class:`Geom`), the
thread runner and the group steps here are shared with the phase-split form (:mod:`hpczeco.gla.split`).

Backward. Pass 1 (time forward) stores the state entering every chunk (``[N + 1, K, V]`` per
sequence, never per token); pass 2 (time backward) carries ``dH``, the gradient into the current
chunk's end state (``dH <- exp(b_C) dH + scale (q exp(b))^T dO``, starting from ``dht``; its final
value is ``dh0``), recomputes ``A`` and, with ``dA = dO V^T``::

    dv = A^T dO + K exp(b_C - b) dH                dq = scale exp(b) (dO S_prev^T) + [dA-weighted k-side]
    dk = exp(b_C - b) (V dH^T) + [dA^T-weighted q-side]
    dg_t = sum_v (diag(exp(g_t)) S_{t-1}) * dS_t
         = sum_{tau >= t} (q dq' - k dk_intra')_tau + sum_{j < t} (k dk_inter)_j + exp(b_C) sum_v(S_prev dH)

(sums inside the chunk; ``'`` = without the ``j == t`` terms, which cancel exactly). Unlike the plain
identity ``dg = revcumsum(q dq - k dk) + sum_v(S_T dht)``, this form subtracts no large terms, so dg
keeps its relative accuracy in float32 when the decays are strong and dg is tiny.

Packed documents (``cu_seqlens [N + 1]``, ``B == 1``, as flash-linear-attention's ``chunk_gla(...,
cu_seqlens=...)``): the state is reset at every document start, each document run alone with its own initial
state ``initial_state[i]`` and final state ``final[i]`` (states ``[N, H, K, V]``; ``dht`` and ``dh0`` likewise).
The documents are grouped into buckets of similar length (:mod:`hpczeco.base.packing`), each bucket one batched
call of the fused form on a padded copy ``[n, P, H, *]``; padding tokens ``q = k = v = g = 0`` leave the state
unchanged, so every document's results are exact. CuPy arrays go to :mod:`hpczeco.gpu.gla_varlen`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..base.backend import is_device_array
from ..base.checks import env_positive_int
from ..base.packing import packed_backward, packed_forward
from . import kernels as _kn
from .validate import check_gla_call, check_varlen_call

__all__ = ["chunk_gla", "chunk_gla_bwd"]


# ------------------------------------------------------------------------------------------------------ BLAS threads

# The chunked GLA runs many small matrix products from its own worker threads. If OpenBLAS also splits one of them
# over its thread pool (it does above a size threshold, e.g. 128 x 192 x 64), the pools fight the workers for the
# cores (measured in docs/benchmarks/gla.md). OpenBLAS >= 0.3.27 has a per-thread setting,
# ``openblas_set_num_threads_local``, that changes only the calling thread; it is found in the loaded libraries
# with ctypes. Without it single_threaded_blas is a no-op.

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

# ---------------------------------------------------------------------------------------------------------- geometry

SUB = 16  # sub-chunk size (tokens)
#: largest diagonal-block span exp(span) may take before that block is computed pairwise, per compute dtype
SPAN_LIMIT = {np.dtype(np.float32): 40.0, np.dtype(np.float64): 300.0}
GROUP_TOKENS = 512  # padded tokens per streaming group: the fused forward/backward, intra(), local(), finish()
GROUP_TOKENS_LIGHT = 1024  # ... in the light phases (the split constructors): little scratch per chunk


class Geom:
    """Chunk geometry of ``[B, T, H, *]`` sequences: ``N`` chunks of ``C`` tokens, each padded to
    ``Cp = ns * c`` rows (``ns`` sub-chunks of ``c`` tokens); ``Z = B H N`` chunks in all. ``T >= 1``."""

    def __init__(self, B: int, T: int, H: int, K: int, V: int, chunk_size: int):
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.C = C = max(1, min(chunk_size, T))
        self.N = -(-T // C)
        self.ns = -(-C // SUB)
        self.c = -(-C // self.ns)
        self.Cp = self.ns * self.c
        self.Z = B * H * self.N

    def group(self) -> int:
        """Chunks per streaming group: about ``GROUP_TOKENS`` padded tokens (at least 1, at most ``N``)."""
        return max(1, min(self.N, GROUP_TOKENS // self.Cp))

    def group_light(self) -> int:
        """Chunks per group in the light phases: about ``GROUP_TOKENS_LIGHT`` padded tokens."""
        return max(1, min(self.N, GROUP_TOKENS_LIGHT // self.Cp))

    def whole(self, n0: int, gc: int) -> bool:
        """Chunks ``n0 .. n0 + gc - 1`` are all whole and unpadded, so their token rows are a plain view."""
        return self.Cp == self.C and (n0 + gc) * self.C <= self.T

    def span_limit(self, dtype: np.dtype) -> float:
        """The span limit of the compute dtype (read at call time, so tests may lower it)."""
        return SPAN_LIMIT[np.dtype(dtype)]


def num_chunks(T: int, chunk_size: int) -> int:
    """``N``, the number of chunks of ``T`` tokens (0 for ``T = 0``)."""
    return Geom(1, T, 1, 1, 1, chunk_size).N if T else 0

# ----------------------------------------------------------------------------------------------------------- threads

POLL_S = 1e-3  # poll about every millisecond of work
UNIT_BLOCK = 8  # sequences whose token rows one kernel call walks together

Poll = Callable[[], Any] | None
Tick = Callable[[], None]


def num_threads(units: int) -> int:
    """Worker threads: ``HPCZECO_GLA_THREADS``, else ``OMP_NUM_THREADS``, else the usable cores; at most
    one per (batch, head) sequence. Under MPI with several ranks per node set one of them (e.g. 1)."""
    mine = env_positive_int("HPCZECO_GLA_THREADS", os.environ.get("HPCZECO_GLA_THREADS", ""))  # a bad value: error
    if mine is not None:
        return max(1, min(mine, units))
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return max(1, min(int(env), units))
    return max(1, min(len(os.sched_getaffinity(0)), units))


class _Ticker:
    """Calls ``poll`` when at least ``POLL_S`` has passed since the last call (single-thread runs)."""

    def __init__(self, poll: Poll):
        self.poll = poll
        self.last = time.perf_counter()

    def __call__(self) -> None:
        if self.poll is not None:
            now = time.perf_counter()
            if now - self.last >= POLL_S:
                self.poll()
                self.last = time.perf_counter()


def _no_tick() -> None:
    return None


def run_units(B: int, H: int, fn: Callable[[list[tuple[int, int]], Tick], None], poll: Poll = None) -> None:
    """Run ``fn(units, tick)`` over all ``(b, h)`` sequences, split into contiguous blocks over threads.

    Each ``fn`` walks time in its outer loop and its sequences inside, so the rows of ``[B, T, H, D]``
    inputs are read from memory once, not once per head; it calls ``tick()`` between chunk groups. With
    ``poll``: ``poll()`` once at the start, then about every ``POLL_S`` from this thread — through ``tick``
    when one thread computes, while waiting for the workers otherwise.
    """
    units = [(b, h) for b in range(B) for h in range(H)]
    nt = num_threads(len(units))
    if poll is not None:
        poll()
    if nt == 1:
        with single_threaded_blas():  # we parallelise; BLAS thread pools would fight the workers
            fn(units, _Ticker(poll) if poll is not None else _no_tick)
        return

    def work(part):
        with single_threaded_blas():
            fn(part, _no_tick)

    bounds = [len(units) * i // nt for i in range(nt + 1)]
    with ThreadPoolExecutor(nt) as ex:
        futs = [ex.submit(work, units[bounds[i] : bounds[i + 1]]) for i in range(nt)]
        if poll is not None:
            pending = set(futs)
            while pending:
                _, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                poll()
        for f in futs:
            f.result()


def unit_blocks(units: list[tuple[int, int]]) -> list[tuple[list[tuple[int, int]], np.ndarray, np.ndarray]]:
    """``units`` in blocks of at most ``UNIT_BLOCK`` sequences: ``(units, b indices, h indices)``. The
    token-row kernels walk tokens in the outer loop and a block's sequences inside, so the rows of
    ``[B, T, H, D]`` arrays are touched in memory order (a per-sequence walk strides over the heads)."""
    out = []
    for i in range(0, len(units), UNIT_BLOCK):
        part = units[i : i + UNIT_BLOCK]
        out.append((part, np.array([b for b, _ in part], np.int64), np.array([h for _, h in part], np.int64)))
    return out

# ------------------------------------------------------------------------------------------------------- group steps

class OperandBuffers:
    """Scratch of the full operand kernels for groups of up to ``G`` chunks: the exponent buffer
    ``X [G, LX, K]``, the flags ``bad [G, ns]``, ``Qp [G, Cp, K]``, ``KX [G, c ns(ns+1)/2, K]`` and, with
    ``qx``, ``QX`` (same shape as ``KX``)."""

    def __init__(self, geo: Geom, G: int, dt: np.dtype, qx: bool = False):
        ns, c, K = geo.ns, geo.c, geo.K
        nx = c * ns * (ns + 1) // 2
        self.X = np.empty((G, _kn.layout(ns, c)[4], K), dt)
        self.bad = np.empty((G, ns), np.bool_)
        self.Qp = np.empty((G, geo.Cp, K), dt)
        self.KX = np.empty((G, nx, K), dt)
        self.QX = np.empty((G, nx, K), dt) if qx else None


def exponents(g: np.ndarray, b: int, h: int, n0: int, gc: int, geo: Geom, X: np.ndarray, bad: np.ndarray) -> None:
    """``X[:gc]`` = exp of the exponents of the group, ``bad[:gc]`` = the sub-chunks past the span limit."""
    limit = geo.span_limit(X.dtype)
    _kn.prep_exponents(g, b, h, n0, gc, geo.T, geo.C, geo.ns, geo.c, limit, X, bad)
    np.exp(X[:gc], out=X[:gc])


def a_matrix(q, k, g, b: int, h: int, n0: int, gc: int, geo: Geom, s: Any, bad: np.ndarray, Qp: np.ndarray,
             KX: np.ndarray, L: np.ndarray):
    """The scaled lower-triangular intra-chunk attention ``A`` of the group into ``L[:gc, :Cp, :Cp]`` (blocks
    above the diagonal are never written: ``L`` starts zeroed): the row blocks ``Qp_I KX_I^T``, the masked
    diagonal, and the exact pairwise diagonal blocks where ``bad``. Returns the pairwise data (or None)."""
    ns, c = geo.ns, geo.c
    for i in range(ns):
        off = c * i * (i + 1) // 2
        np.matmul(
            Qp[:gc, i * c : (i + 1) * c],
            KX[:gc, off : off + (i + 1) * c].transpose(0, 2, 1),
            out=L[:gc, i * c : (i + 1) * c, : (i + 1) * c],
        )
    _kn.mask_diag(L, gc, ns, c)
    return _kn.pairwise_A(q, k, g, b, h, n0, bad[:gc], geo, float(s), L) if bad[:gc].any() else None


def rows(x: np.ndarray, b: int, h: int, n0: int, gc: int, geo: Geom, buf: np.ndarray) -> np.ndarray:
    """The group's token rows of ``x[b, :, h]`` as ``[gc, Cp, D]``: a strided view for whole chunks, else
    gathered into ``buf`` with zero rows for no-op tokens."""
    if geo.whole(n0, gc):
        return x[b, n0 * geo.C : (n0 + gc) * geo.C, h].reshape(gc, geo.C, x.shape[3])
    _kn.gather_rows(x, b, h, n0, gc, geo.T, geo.C, geo.Cp, buf)
    return buf[:gc]


def matmul_rows(lhs: np.ndarray, rhs: np.ndarray, out: np.ndarray, b: int, h: int, n0: int, gc: int, geo: Geom,
                buf: np.ndarray) -> None:
    """``out[b, t, h] = (lhs @ rhs)`` rows of the group's tokens (``lhs [gc, Cp, *]``, ``rhs [gc, *, D]``):
    BLAS writes the strided rows of ``out[b, :, h]`` directly for whole chunks, else through ``buf``."""
    C, V = geo.C, out.shape[3]
    if geo.whole(n0, gc):
        np.matmul(lhs, rhs, out=np.reshape(out[b, n0 * C : (n0 + gc) * C, h], (gc, C, V), copy=False))
    else:
        np.matmul(lhs, rhs, out=buf[:gc])
        _kn.write_rows(buf, out, b, h, n0, gc, geo.T, C)


def intra_grads(q, k, g, b: int, h: int, n0: int, gc: int, geo: Geom, s: Any, ob: OperandBuffers,
                vr: np.ndarray, dor: np.ndarray, S_prev: np.ndarray, LA: np.ndarray, dA: np.ndarray,
                dd: np.ndarray, DV: np.ndarray, M1: np.ndarray, DQ: np.ndarray, DK: np.ndarray,
                VdH: np.ndarray | None = None) -> None:
    """The dht-independent backward of a group, operands ready in ``ob`` (exponentiated ``X``, ``Qp``,
    ``KX``, ``QX``): ``A`` into ``LA [G, Cp, Cp]``, ``dA = dO V^T`` (strictly lower, unscaled) with its
    diagonal in ``dd [G, Cp]``, ``DV = A^T dO``, and ``DQ`` (dq less its diagonal term), ``DK`` (the intra
    part of dk less its diagonal term), ``[G, Cp, K]``; ``vr, dor [gc, Cp, V]`` are the group's rows of v and
    do, ``S_prev [gc, K, V]`` the states entering its chunks, ``M1 [G, Cp, K]`` scratch. ``VdH`` (the
    ``V dH^T`` rows, if given) is scaled in place into the inter part of dk."""
    ns, c = geo.ns, geo.c
    KX, QX = ob.KX, ob.QX
    pw = a_matrix(q, k, g, b, h, n0, gc, geo, s, ob.bad, ob.Qp, KX, LA)
    np.matmul(dor, vr.transpose(0, 2, 1), out=dA[:gc])  # dO V^T (unscaled)
    _kn.mask_dA(dA, dd, gc, ns, c)
    np.matmul(LA[:gc].transpose(0, 2, 1), dor, out=DV[:gc])
    np.matmul(dor, S_prev.transpose(0, 2, 1), out=M1[:gc])
    for i in range(ns):
        off = c * i * (i + 1) // 2
        np.matmul(
            dA[:gc, i * c : (i + 1) * c, : (i + 1) * c],
            KX[:gc, off : off + (i + 1) * c],
            out=DQ[:gc, i * c : (i + 1) * c],
        )
        oq = _kn.qx_offset(i, ns, c)
        np.matmul(
            dA[:gc, i * c :, i * c : (i + 1) * c].transpose(0, 2, 1),
            QX[:gc, oq : oq + (ns - i) * c],
            out=DK[:gc, i * c : (i + 1) * c],
        )
    _kn.combine(ob.X, gc, ns, c, s, M1, DQ, DK, VdH)
    if pw is not None:
        _kn.pairwise_dqdk(pw, c, float(s), dA, DQ, DK)

# ---------------------------------------------------------------------------------------- fused forward and backward

def _gpu_module():
    try:
        from ..gpu import gla as gpu_gla  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            "chunk_gla got CuPy arrays but the device implementation hpczeco.gpu.gla could not be imported "
            f"({exc}); install the 'gpu' extra or pass numpy arrays"
        ) from exc
    return gpu_gla


def _any_device(*arrays: Any) -> bool:
    return any(a is not None and is_device_array(a) for a in arrays)


# --------------------------------------------------------------------------------------------- forward


def fused_gla(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Any, Any]:
    """:func:`hpczeco.gla.chunk_gla` without ``cu_seqlens``: ``(o [B, T, H, V], final_state [B, H, K, V] or None)``
    (arguments, dtypes and the device dispatch as there)."""
    B, T, H, K, V, s, chunk_size, cdt = check_gla_call(q, k, v, g, scale, initial_state, chunk_size)
    if _any_device(q, k, v, g, initial_state):
        return _gpu_module().chunk_gla(
            q,
            k,
            v,
            g,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=chunk_size,
        )
    h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
    in_dtype = q.dtype
    if T == 0 or B * H == 0:
        o = np.zeros((B, T, H, V), dtype=q.dtype)
        final = np.zeros((B, H, K, V), dtype=cdt) if h0 is None else h0.copy()
        return o, (final if output_final_state else None)
    geo = Geom(B, T, H, K, V, chunk_size)
    q, k, v, g = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g))
    out = np.empty((B, T, H, V), dtype=cdt)
    final = np.empty((B, H, K, V), dtype=cdt)
    run_units(B, H, lambda units, tick: _fwd_units(units, q, k, v, g, s, h0, geo, out, final))
    if out.dtype != in_dtype:
        out = out.astype(in_dtype)
    return out, (final if output_final_state else None)


def _fwd_units(units, q, k, v, g, s, h0, geo: Geom, out, final) -> None:
    """Streaming forward of the sequences ``units``: groups of chunks in time order, state carried along."""
    K, V, C, T, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.ns, geo.c, geo.Cp
    G = geo.group()
    dt = q.dtype
    oA = _kn.layout(ns, c)[3]
    ob = OperandBuffers(geo, G, dt)
    L = np.zeros((G, Cp, Cp + K), dt)  # [A | scale q exp(b)]; blocks above the diagonal stay zero
    Kd = np.empty((G, Cp, K), dt)
    R = np.empty((G, Cp + K, V), dt)  # [V ; S_prev]
    U = np.empty((G, K, V), dt)
    Ot = np.empty((G, Cp, V), dt)
    S = np.empty((len(units), K, V), dt)
    for u, (b, h) in enumerate(units):
        S[u] = 0 if h0 is None else h0[b, h]
    for n0 in range(0, geo.N, G):
        gc = min(G, geo.N - n0)
        for u, (b, h) in enumerate(units):
            exponents(g, b, h, n0, gc, geo, ob.X, ob.bad)
            _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, ob.X, ob.bad, ob.Qp, ob.KX, L, Cp, None, Kd, None,
                              v, R, None, None)  # fmt: skip
            a_matrix(q, k, g, b, h, n0, gc, geo, s, ob.bad, ob.Qp, ob.KX, L)
            np.matmul(Kd[:gc].transpose(0, 2, 1), R[:gc, :Cp], out=U[:gc])
            _kn.state_fwd(U, ob.X, oA, gc, S[u], R, Cp)
            matmul_rows(L[:gc], R[:gc], out, b, h, n0, gc, geo, Ot)
    for u, (b, h) in enumerate(units):
        final[b, h] = S[u]


# --------------------------------------------------------------------------------------------- backward


def fused_gla_bwd(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    do: Any,
    scale: float | None = None,
    initial_state: Any = None,
    dht: Any = None,
    chunk_size: int = 64,
) -> tuple[Any, Any, Any, Any, Any]:
    """:func:`hpczeco.gla.chunk_gla_bwd` without ``cu_seqlens``: ``(dq, dk, dv, dg, dh0)`` (arguments, dtypes
    and the device dispatch as there)."""
    B, T, H, K, V, s, chunk_size, cdt = check_gla_call(q, k, v, g, scale, initial_state, chunk_size, do=do, dht=dht)
    if _any_device(q, k, v, g, do, initial_state, dht):
        return _gpu_module().chunk_gla_bwd(
            q, k, v, g, do, scale=scale, initial_state=initial_state, dht=dht, chunk_size=chunk_size
        )
    h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
    dh0_dtype = cdt if initial_state is None else initial_state.dtype
    in_dtype = q.dtype
    dH_last = np.zeros((B, H, K, V), dtype=cdt) if dht is None else np.asarray(dht, dtype=cdt)
    if T == 0 or B * H == 0:
        dq = np.zeros((B, T, H, K), dtype=q.dtype)
        return dq, dq.copy(), np.zeros((B, T, H, V), dtype=q.dtype), dq.copy(), dH_last.astype(dh0_dtype)
    geo = Geom(B, T, H, K, V, chunk_size)
    q, k, v, g, do = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g, do))
    dq, dk, dg = (np.empty((B, T, H, K), dtype=cdt) for _ in range(3))
    dv = np.empty((B, T, H, V), dtype=cdt)
    dh0 = np.empty((B, H, K, V), dtype=cdt)
    grads = (dq, dk, dv, dg)
    run_units(B, H, lambda units, tick: _bwd_units(units, q, k, v, g, do, s, h0, dH_last, geo, grads, dh0))
    return (
        dq.astype(in_dtype, copy=False),
        dk.astype(in_dtype, copy=False),
        dv.astype(in_dtype, copy=False),
        dg.astype(in_dtype, copy=False),
        dh0.astype(dh0_dtype, copy=False),
    )


def _bwd_units(units, q, k, v, g, do, s, h0, dH_last, geo: Geom, grads, dh0) -> None:
    """Streaming backward of the sequences ``units``: chunk-start states forward in time (stored per chunk,
    ``[N + 1, K, V]``), then the gradients group by group in reverse time order with ``dH`` carried along."""
    K, V, C, T, N, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.ns, geo.c, geo.Cp
    G = geo.group()
    dt = q.dtype
    oA = _kn.layout(ns, c)[3]
    ob = OperandBuffers(geo, G, dt, qx=True)
    X, bad = ob.X, ob.bad
    Qe, Kd, M1, DQ, DK, VdH = (np.empty((G, Cp, K), dt) for _ in range(6))
    R = np.empty((G, Cp + K, V), dt)
    Vb, dOb, DV, DV2 = (np.empty((G, Cp, V), dt) for _ in range(4))
    LA, dA = np.zeros((G, Cp, Cp), dt), np.empty((G, Cp, Cp), dt)  # LA: blocks above the diagonal stay zero
    dd = np.empty((G, Cp), dt)
    U, W, dHe = (np.empty((G, K, V), dt) for _ in range(3))
    nu = len(units)
    Sst = np.empty((nu, N + 1, K, V), dt)  # state entering every chunk (and the final state), per sequence
    dH = np.empty((nu, K, V), dt)
    # pass 1: the state entering every chunk (time outer, sequences inner: input rows read once)
    for u, (b, h) in enumerate(units):
        Sst[u, 0] = 0 if h0 is None else h0[b, h]
    for n0 in range(0, N, G):
        gc = min(G, N - n0)
        for u, (b, h) in enumerate(units):
            exponents(g, b, h, n0, gc, geo, X, bad)
            _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, X, bad, None, None, None, 0, None, Kd, None,
                              v, R, None, None)  # fmt: skip
            np.matmul(Kd[:gc].transpose(0, 2, 1), R[:gc, :Cp], out=U[:gc])
            _kn.state_chain(U, X, oA, gc, Sst[u], n0)
    # pass 2: reverse time, group by group
    for u, (b, h) in enumerate(units):
        dH[u] = dH_last[b, h]
    for n0 in range(((N - 1) // G) * G, -1, -G):
        gc = min(G, N - n0)
        for u, (b, h) in enumerate(units):
            exponents(g, b, h, n0, gc, geo, X, bad)
            _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, X, bad, ob.Qp, ob.KX, Qe, 0, ob.QX, Kd, None,
                              v, Vb, do, dOb)  # fmt: skip
            np.matmul(Qe[:gc].transpose(0, 2, 1), dOb[:gc], out=W[:gc])
            _kn.state_bwd(W, X, oA, gc, dH[u], dHe)
            np.matmul(Kd[:gc], dHe[:gc], out=DV2[:gc])
            np.matmul(Vb[:gc], dHe[:gc].transpose(0, 2, 1), out=VdH[:gc])
            intra_grads(q, k, g, b, h, n0, gc, geo, s, ob, Vb[:gc], dOb[:gc], Sst[u, n0 : n0 + gc], LA, dA, dd, DV,
                        M1, DQ, DK, VdH)  # fmt: skip
            _kn.bwd_finish(q, k, b, h, n0, gc, T, C, s, X, oA, DQ, DK, VdH, dd, DV, DV2, Sst[u], dHe, *grads)
    for u, (b, h) in enumerate(units):
        dh0[b, h] = dH[u]

# ------------------------------------------------------------------------------------------------------ public entry

def chunk_gla(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Any = None,
) -> tuple[Any, Any]:
    """Chunked GLA forward: ``(o [B, T, H, V], final_state [B, H, K, V] or None)``.

    ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g`` the log forget gate (<= 0),
    ``initial_state: [B, H, K, V]`` or None (zeros), ``scale`` > 0 (default ``K**-0.5``). float32/float64
    inputs are computed in their own precision; float16/bfloat16 in float32. ``o`` has the input dtype,
    the final state the compute dtype (float32 for half inputs). CuPy inputs run on the device
    (:func:`hpczeco.gpu.gla.chunk_gla`). Local: no communication. ``cu_seqlens [N + 1]`` (B == 1): packed
    documents, each run alone, ``initial_state`` and the final state ``[N, H, K, V]`` (module docstring).
    """
    if cu_seqlens is None:
        return fused_gla(q, k, v, g, scale, initial_state, output_final_state, chunk_size)
    cu = check_varlen_call(q, k, v, g, cu_seqlens, scale, chunk_size, initial_state)
    if is_device_array(q):
        return _gpu_varlen().chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state, chunk_size=chunk_size, cu_seqlens=cu)

    def run(q, k, v, g, h0, poll):  # every bucket scans its own values: every token and state row is in one
        return fused_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, chunk_size=chunk_size)

    o, final = packed_forward(run, q, k, v, g, cu, initial_state, chunk_size)
    return o, (final if output_final_state else None)


def chunk_gla_bwd(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    do: Any,
    scale: float | None = None,
    initial_state: Any = None,
    dht: Any = None,
    chunk_size: int = 64,
    cu_seqlens: Any = None,
) -> tuple[Any, Any, Any, Any, Any]:
    """Analytic backward of :func:`chunk_gla`: ``(dq, dk, dv, dg, dh0)``.

    Gradients of ``L = sum(o * do) + sum(S_T * dht)`` (``dht: [B, H, K, V]`` or None for zeros) with
    respect to ``q, k, v, g`` (``[B, T, H, K]``, ``[B, T, H, V]`` for dv, in the input dtype) and the
    initial state ``dh0 [B, H, K, V]`` — returned as an array even when ``initial_state`` is None (it is
    then the gradient with respect to a zero initial state), in the dtype of ``initial_state`` if given,
    else the compute dtype. The chunk states are recomputed (``[N, K, V]`` per head, never per token).
    CuPy inputs run on the device (:func:`hpczeco.gpu.gla.chunk_gla_bwd`). Local: no communication. With
    ``cu_seqlens`` (B == 1): packed documents, ``initial_state``, ``dht`` and ``dh0`` ``[N, H, K, V]``.
    """
    if cu_seqlens is None:
        return fused_gla_bwd(q, k, v, g, do, scale, initial_state, dht, chunk_size)
    cu = check_varlen_call(q, k, v, g, cu_seqlens, scale, chunk_size, initial_state, do=do, dht=dht)
    if is_device_array(q):
        return _gpu_varlen().chunk_gla_bwd(q, k, v, g, do, scale=scale, initial_state=initial_state, dht=dht,
                                           chunk_size=chunk_size, cu_seqlens=cu)

    def run(q, k, v, g, do, h0, dht, poll):
        return fused_gla_bwd(q, k, v, g, do, scale=scale, initial_state=h0, dht=dht, chunk_size=chunk_size)

    return packed_backward(run, q, k, v, g, do, cu, initial_state, dht, chunk_size)


def _gpu_varlen():
    from ..gpu import gla_varlen  # noqa: PLC0415

    return gla_varlen
