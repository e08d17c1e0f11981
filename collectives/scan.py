"""Exclusive scans over ranks of the pair operator used by ZeCO: ring All-Scan, tree, and baselines.

Each rank ``p`` holds a pair ``(a_p, S_p)``: decays ``a [..., K]`` and a state ``S [..., K, V]``
(any leading dims, e.g. ``[B, H]``; ``a``'s shape equals ``S.shape[:-1]``). The operator

    (a1, S1) o (a2, S2) = (a1 * a2,  a2[..., None] * S1 + S2)

is associative, not commutative, with identity ``(1, 0)``. :func:`scan` returns this rank's
**exclusive** state ``S_in^(p)``: the fold of the pairs of the ranks before ``p`` in scan order
(rank order, or reverse rank order with ``reverse=True``), starting from ``initial`` (zeros when
not given)::

    X = initial or 0;  for q before p: X = a_q * X + S_q;   S_in^(p) = X

The first rank in scan order gets ``initial`` (a copy) or zeros. ``initial`` ``[..., K, V]`` is
supplied by that rank only; every other rank passes ``None``.

Topologies (all give the same result up to rounding):

* ``"ring"``: the paper's pipelined All-Scan. The state, viewed as ``[R, V]`` rows with
  ``R = prod(a.shape)`` (rows of ``K`` for each leading index; decay ``a`` lines up with the
  rows), is cut into ``blocks`` contiguous row pieces. For piece ``j`` a rank posts ``Irecv`` from
  the previous rank, combines ``a_j * S_in_j + S_j`` as soon as piece ``j`` lands and ``Isend``\\ s
  it to the next rank while piece ``j+1`` is still in flight. The first rank only sends, the last
  only receives. Only the state travels (``m`` bytes). ``(P + k - 2)`` message steps of ``m/k``.
* ``"tree"``: recursive doubling (Hillis-Steele): ``ceil(log2 P)`` rounds; in round ``d`` position
  ``i`` sends its window aggregate ``(a, S)`` to ``i + d`` and folds the one from ``i - d`` in on
  the left (order preserved; any ``P``). Sends ``m (1 + 1/V)`` bytes per round.
* ``"allgather"`` (LASP-2): allgather every rank's packed ``[a | S]``, fold the prefix locally.
* ``"serial"`` (LASP-1): the unpipelined relay: receive the whole state, combine, send it whole.
  (It is the ring with one block.)
* ``"exscan"``: ``MPI_Iexscan`` with a user-defined non-commutative op on a packed ``[a | S]``
  buffer (one contiguous derived datatype, so the op sees whole pairs); reverse order runs on a
  cached rank-reversed communicator. The op runs on host memory: device arrays are staged
  through the host (a device->host copy before, host->device after).
* ``"auto"``: the cost model's pick (:func:`hpczeco.costmodel.choose`) for this ``P``, state size
  and ``K`` under the default link parameters (:func:`hpczeco.costmodel.default_params`).

Validation is collective and happens before the first message: shapes, dtypes, options, which
ranks pass ``initial``, NaN/Inf, decays outside [0, 1] -- every rank raises the same
:class:`~hpczeco.collectives.agree.CollectiveInputError` (a ``ValueError``; the type flavour is a
``TypeError`` too). The all-good case costs one ``Allreduce`` of three integers (a digest of the
agreed values); only on a mismatch or error do the ranks run
:func:`~hpczeco.collectives.agree.collective_check` to build the message.

Progress. :func:`scan_start` posts the first messages and returns a :class:`ScanHandle`. The
ring's per-piece combine-and-forward, and the tree's rounds, happen inside ``handle.test()``
(non-blocking: does whatever has become possible) and ``handle.wait()``. A rank that never polls
between start and wait forwards nothing until it calls ``wait()``: the ranks after it in scan
order then wait for it (the result is still correct, the overlap is lost). ``progress="thread"``
instead drives the handle from a helper thread that blocks in ``MPI_Wait`` (mpi4py initialises MPI
with ``MPI_THREAD_MULTIPLE``); ``wait()`` joins it. Measured (``hpczeco bench scan --overlap-ms``,
32 ranks on 32 cores, 4 MiB state, 5 ms of numpy work per rank): the thread made it slower
(93 ms vs 38 ms polling only in ``wait()``): with a rank on every core the helper thread competes
with the compute for the core, so it pays only where ranks leave cores free. The allgather and
exscan baselines use ``MPI_Iallgather``/``MPI_Iexscan`` (progressed by the MPI library inside
``test``/``wait``; a device transport without a nonblocking allgather completes it in
``scan_start``).

Buffers. Pieces land directly in the result buffer (``out=`` if given, else a new array);
scratch buffers (the ring's forwarded pieces, the tree's packed pairs, the allgather buffer) come
from a per-communicator pool and are reused across calls: a fresh large allocation costs a page
fault per 4 KiB on first touch, which on virtual machines is of the order of the transfer.

Tags: every collective operation gets its own tag from a per-communicator counter (every rank
calls collectives in the same order), and all traffic goes over a private duplicate of ``comm``
(:mod:`.context`), so several scans in flight on one communicator cannot mix.

Buffers: ``a`` and ``S`` (and ``initial``) must stay unmodified until ``wait()`` returns.
Arithmetic uses the array module of the buffers (numpy or CuPy); communication goes through the
:class:`~hpczeco.collectives.transport.Transport` interface only.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from typing import Any

import numpy as np
from hpczeco.base.backend import get_array_module, is_device_array, to_numpy
from mpi4py import MPI

from .agree import collective_check
from .context import RELAY_TAGS, CommContext, get_context
from .kernels import axpy_rows, row_kernel
from .transport import Transport

__all__ = [
    "TOPOLOGIES",
    "ScanHandle",
    "scan",
    "scan_start",
    "relay_recv",
    "relay_send",
    "combine",
    "fold_reference",
    "TIMEOUT_ENV",
    "resolve_timeout",
    "scan_stats",
]

#: accepted values of ``topology``
TOPOLOGIES = ("ring", "tree", "allgather", "serial", "exscan", "auto")
_DTYPES = ("float32", "float64")
_PROGRESS = ("poll", "thread")

#: environment variable: seconds a collective wait may take before the job is aborted (unset = forever)
TIMEOUT_ENV = "HPCZECO_COLLECTIVE_TIMEOUT"
#: tag of the timeout-mode arrival/agreement messages (on the private communicator; below SCAN_TAG_BASE)
_AGREE_TAG = 7
_STATS = {"inflight": 0, "started": 0}


def resolve_timeout(timeout: float | None) -> float | None:
    """``timeout`` (checked: positive, finite) or, when None, ``$HPCZECO_COLLECTIVE_TIMEOUT`` (None if unset)."""
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip()
        if not env:
            return None
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"${TIMEOUT_ENV} must be a number of seconds, got {env!r}") from None
        what = f"${TIMEOUT_ENV}"
    else:
        what = "timeout"
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number of seconds or None, got {type(timeout).__name__}")
    if not (timeout > 0 and timeout < float("inf")):
        raise ValueError(f"{what} must be a positive finite number of seconds, got {timeout}")
    return float(timeout)


def _abort_stalled(comm: MPI.Comm, op: str, waiting_for: str, timeout: float) -> None:
    """Print why this rank gives up and abort the whole job (never returns)."""
    rank = comm.Get_rank()
    print(f"hpczeco: rank {rank}: {op} exceeded the collective timeout of {timeout:g} s; still waiting for "
          f"{waiting_for}; aborting the job (MPI_Abort)", file=sys.stderr, flush=True)
    comm.Abort(3)


def _poll_until(done, deadline: float) -> bool:
    """Call ``done()`` with a growing sleep (50 us .. 10 ms) until it returns True or ``deadline`` passes."""
    pause = 5e-5
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def scan_stats(comm: MPI.Comm | None = None) -> dict[str, int]:
    """Counters for leak checks: ``inflight`` (scan handles started and not yet complete, this process),
    ``started`` (scans started), and with ``comm`` its context's pool: ``pooled`` (buffers kept for reuse)
    and ``pooled_bytes``. Local (no communication); ``comm``'s context must already exist to report a pool."""
    out = dict(_STATS)
    if comm is not None:
        pool = get_context(comm).pool
        with pool._lock:
            out["pooled"] = sum(len(v) for v in pool._free.values())
            out["pooled_bytes"] = int(pool.held)
    return out


# --------------------------------------------------------------------------- helpers


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


def _piece_bounds(rows: int, n: int) -> list[int]:
    return [(j * rows) // n for j in range(n + 1)]


def _memory(x: Any) -> str:
    return "host" if type(x) is np.ndarray else ("device" if is_device_array(x) else "host")


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_device_array(x)


_DT_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


def _dtype_name(x: Any) -> str:
    dt = getattr(x, "dtype", None)
    if dt is None:
        return type(x).__name__
    return _DT_NAMES.get(dt) or str(dt)


def _check_out(out: Any, a: Any, S: Any, initial: Any) -> None:
    if not _is_array(out):
        raise TypeError(f"out must be a numpy or cupy array or None, got {type(out).__name__}")
    if out.dtype != S.dtype or _memory(out) != _memory(S):
        raise TypeError(f"out must be a {_memory(S)} {S.dtype} array like S, got a {_memory(out)} {out.dtype} array")
    if out.shape != S.shape:
        raise ValueError(f"out has shape {list(out.shape)}, expected S's shape {list(S.shape)}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if type(out) is np.ndarray:
        for name, x in (("a", a), ("S", S), ("initial", initial)):
            if x is not None and np.may_share_memory(out, x):
                raise ValueError(f"out must not overlap {name}")


def _check_inputs(a, S, initial, topology, blocks, reverse, first: bool, progress: str,
                  check_values: bool = True) -> None:
    """Local checks (raise ValueError/TypeError naming the argument); ``check_values`` adds the NaN/range
    scans of the data (each a reduction, and a device synchronisation for CuPy arrays)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if progress not in _PROGRESS:
        raise ValueError(f"progress must be one of {_PROGRESS}, got {progress!r}")
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    if blocks is not None and (isinstance(blocks, (bool, np.bool_)) or not isinstance(blocks, (int, np.integer))):
        raise TypeError(f"blocks must be an int or None, got {type(blocks).__name__}")
    for name, x in (("a", a), ("S", S)):
        if not _is_array(x):
            raise TypeError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")
        if x.dtype not in _DT_NAMES:
            raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
    if a.dtype != S.dtype:
        raise TypeError(f"a and S must share one dtype, got a={a.dtype}, S={S.dtype}")
    mem = _memory(S)
    if _memory(a) != mem:
        raise TypeError(f"a and S must both be host (numpy) or both device (cupy) arrays, got a on {_memory(a)}, "
                        f"S on {mem}")
    if a.ndim < 1:
        raise ValueError(f"a must have shape [..., K], got a scalar of shape {list(a.shape)}")
    if S.ndim != a.ndim + 1 or S.shape[:-1] != a.shape:
        raise ValueError(f"S has shape {list(S.shape)}, expected {list(a.shape) + ['V']} (a's shape [..., K] plus V)")
    K = int(a.shape[-1])
    if a.size == 0 or S.shape[-1] == 0:
        raise ValueError(f"empty scan: a has shape {list(a.shape)}, S has shape {list(S.shape)}")
    if blocks is not None and not 1 <= int(blocks) <= K:
        raise ValueError(f"blocks must be in 1..K={K}, got {blocks}")
    if initial is not None:
        if not first:
            raise ValueError("initial must be None here: only the first rank in scan order supplies it")
        if not _is_array(initial):
            raise TypeError(f"initial must be a numpy or cupy array or None, got {type(initial).__name__}")
        if initial.dtype != S.dtype:
            raise TypeError(f"initial must have S's dtype {S.dtype}, got {initial.dtype}")
        if _memory(initial) != mem:
            raise TypeError(f"initial must live where S does ({mem}), got a {_memory(initial)} array")
        if initial.shape != S.shape:
            raise ValueError(f"initial has shape {list(initial.shape)}, expected S's shape {list(S.shape)}")
        if check_values:
            _check_finite("initial", initial)
    if not check_values:
        return
    # min/max propagate NaN: two reductions instead of an isfinite() temporary
    amin, amax = float(a.min()), float(a.max())
    if amin != amin or amax != amax:
        raise ValueError("a contains NaN")
    if not (amin >= 0.0 and amax <= 1.0):
        raise ValueError(f"a holds decays outside [0, 1] (min {amin:g}, max {amax:g})")
    _check_finite("S", S)


_INF = float("inf")


def _check_finite(name: str, x: Any) -> None:
    lo, hi = float(x.min()), float(x.max())
    if not (-_INF < lo and hi < _INF):  # False for NaN too
        raise ValueError(f"{name} contains NaN or Inf")


def _digest(values: dict[str, Any]) -> int:
    text = repr(sorted(values.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def agree_fast(
    comm: MPI.Comm, op: str, error: BaseException | None, agree: dict[str, Any], timeout: float | None = None
) -> None:
    """:func:`collective_check` with a cheap all-good path: one ``Allreduce`` of a digest.

    Same errors on every rank as :func:`collective_check` (which runs when anything is wrong).
    With ``timeout`` (seconds) the digests are exchanged point to point instead (``P - 1`` small
    messages each way), so that a rank that does not arrive within ``timeout`` is named before the
    job is aborted (see :func:`scan_start`).
    """
    if comm.Get_size() == 1:
        collective_check(None, op, error, agree)
        return
    h = _digest(agree)
    buf = np.array([1 if error is not None else 0, h, -h], dtype=np.int64)
    if timeout is None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    else:
        _agree_p2p(comm, op, buf, timeout)
    if buf[0] != 0 or buf[1] != -buf[2]:
        collective_check(comm, op, error, agree)
        raise AssertionError(f"{op}: ranks disagree but collective_check found no difference")  # pragma: no cover


def _agree_p2p(comm: MPI.Comm, op: str, buf: np.ndarray, timeout: float) -> None:
    """``buf <- max over ranks`` by point-to-point messages, aborting (naming the absent ranks) after ``timeout``."""
    P, rank = comm.Get_size(), comm.Get_rank()
    others = [r for r in range(P) if r != rank]
    got = np.empty((len(others), buf.size), dtype=buf.dtype)
    rreqs = [comm.Irecv(got[i], source=r, tag=_AGREE_TAG) for i, r in enumerate(others)]
    sreqs = [comm.Isend(buf, dest=r, tag=_AGREE_TAG) for r in others]
    arrived = [False] * len(others)

    def done() -> bool:
        for i, req in enumerate(rreqs):
            if not arrived[i]:
                arrived[i] = bool(req.Test())
        return all(arrived)

    if not _poll_until(done, time.monotonic() + timeout):
        missing = [others[i] for i, ok in enumerate(arrived) if not ok]
        _abort_stalled(comm, f"{op} (arrival/validation)", f"rank(s) {missing}, which did not call {op}", timeout)
    MPI.Request.Waitall(sreqs)
    np.maximum(buf, got.max(axis=0), out=buf)


def _resolve(topology: str, blocks: int | None, P: int, nbytes: int, K: int, memory: str) -> tuple[str, int | None]:
    """Topology and ring blocks actually used (the cost model decides "auto" and ``blocks=None``)."""
    if topology in ("ring", "auto") and (topology == "auto" or blocks is None):
        from hpczeco import costmodel  # noqa: PLC0415 - hpczeco imports collectives, not the reverse at load

        params = costmodel.default_params(memory)
        if topology == "auto":
            topo, kb = costmodel.choose(P, nbytes, K, params)
            return topo, (blocks if (topo == "ring" and blocks is not None) else kb)
        return "ring", costmodel.best_blocks(P, nbytes, K, params)
    if topology == "serial":
        return "serial", 1
    return topology, blocks if topology == "ring" else None


# --------------------------------------------------------------------------- handles


class ScanHandle:
    """A scan in flight (from :func:`scan_start`).

    ``test()`` makes whatever progress is possible without blocking and returns True once the
    result is ready; ``wait()`` blocks until it is and returns ``S_in`` (``S``'s shape and dtype,
    same array module). ``topology`` and ``blocks`` say what actually runs.
    """

    topology: str
    blocks: int | None

    def __init__(self, topology: str, blocks: int | None):
        self.topology = topology
        self.blocks = blocks
        self._result: Any = None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._out: Any = None  # the caller's ``out``, returned as is
        self._timeout: float | None = None  # seconds; set by scan_start
        self._comm: MPI.Comm | None = None  # aborted on a timeout
        self._counted = False

    def _count(self) -> None:
        self._counted = True
        _STATS["inflight"] += 1
        _STATS["started"] += 1

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            _STATS["inflight"] -= 1

    def _waiting_for(self) -> str:
        """Who this rank is still waiting for (for the timeout message)."""
        return "a collective: some rank did not arrive"

    # subclasses: _progress() -> bool (all communication done), _complete() (block), _finish() -> S_in
    def _progress(self) -> bool:  # pragma: no cover - overridden
        return True

    def _complete(self) -> None:  # pragma: no cover - overridden
        return None

    def _finish(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def done(self) -> bool:
        """True once ``wait()`` would return without blocking on communication."""
        return self._result is not None

    def test(self) -> bool:
        """Make progress (combine/forward whatever has arrived); True when the result is ready."""
        if self._result is not None:
            return True
        if self._thread is not None:
            if self._thread.is_alive():
                return False
            self._join()
            self._uncount()
            return True
        if self._progress():
            self._result = self._deliver(self._finish())
            self._uncount()
            return True
        return False

    def wait(self) -> Any:
        """Block until done; return ``S_in`` (this rank's exclusive scan).

        With a timeout (``scan_start(timeout=...)`` or ``$HPCZECO_COLLECTIVE_TIMEOUT``) the handle is
        polled with a growing sleep instead; past the timeout the rank prints which rank(s) it still
        waits for and calls ``MPI_Abort`` on the communicator (ending the job)."""
        if self._result is None:
            if self._timeout is not None:
                self._wait_timeout()
            elif self._thread is not None:
                self._join()
            else:
                self._complete()
                self._result = self._deliver(self._finish())
        self._uncount()
        return self._result

    def _wait_timeout(self) -> None:
        assert self._timeout is not None
        deadline = time.monotonic() + self._timeout
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                _abort_stalled(self._comm, f"scan({self.topology}) wait", self._waiting_for(), self._timeout)
            self._join()
            return
        if not _poll_until(self.test, deadline):
            _abort_stalled(self._comm, f"scan({self.topology}) wait", self._waiting_for(), self._timeout)

    def _deliver(self, result: Any) -> Any:
        return result if self._out is None else self._out

    # progress thread --------------------------------------------------------
    def _start_thread(self) -> None:
        def run() -> None:
            try:
                self._complete()
                self._result_pending = self._finish()
            except BaseException as exc:  # noqa: BLE001 - re-raised in wait()
                self._thread_error = exc

        self._thread = threading.Thread(target=run, name=f"hpczeco-scan-{self.topology}", daemon=True)
        self._thread.start()

    def _join(self) -> Any:
        assert self._thread is not None
        self._thread.join()
        if self._thread_error is not None:
            raise self._thread_error
        self._result = self._deliver(self._result_pending)
        return self._result


class _DoneHandle(ScanHandle):
    def __init__(self, topology: str, blocks: int | None, result: Any):
        super().__init__(topology, blocks)
        self._result = result


class _Plan:
    """What every algorithm needs: flattened views, positions, transport, tag, buffers."""

    __slots__ = ("tr", "xp", "a2", "S2", "init2", "shape", "R", "V", "dtype", "pos", "P", "reverse", "tag",
                 "pool", "out", "_held")

    def __init__(self, tr, xp, a2, S2, init2, shape, pos, P, reverse, tag, pool, out):
        self.tr, self.xp, self.a2, self.S2, self.init2 = tr, xp, a2, S2, init2
        self.shape, self.pos, self.P, self.reverse, self.tag = shape, pos, P, reverse, tag
        self.R, self.V = S2.shape
        self.dtype = S2.dtype
        self.pool = pool
        self.out = out  # caller's result buffer viewed as [R, V], or None
        self._held: list = []

    def rank_of(self, pos: int) -> int:
        return self.P - 1 - pos if self.reverse else pos

    # buffers ---------------------------------------------------------------
    def acquire(self, shape: tuple[int, ...]) -> Any:
        """A scratch buffer from the context's pool (returned by :meth:`release_all`)."""
        buf = self.pool.acquire(self.xp, shape, self.dtype, self.tr)
        self._held.append(buf)
        return buf

    def release_all(self) -> None:
        """Give every scratch buffer back (call only when no request uses them any more)."""
        for buf in self._held:
            self.pool.release(self.xp, buf)
        self._held.clear()

    def result(self) -> Any:
        """The ``[R, V]`` buffer for S_in: the caller's ``out`` or a new array."""
        if self.out is None:
            empty = self.tr.empty if self.tr is not None else (lambda sh, dt: self.xp.empty(sh, dtype=dt))
            self.out = empty((self.R, self.V), self.dtype)
        return self.out

    def first_result(self) -> Any:
        """S_in of the first rank in scan order: initial (copied) or zeros."""
        out = self.result()
        if self.init2 is not None:
            out[...] = self.init2
        else:
            out.fill(0)
        return out.reshape(self.shape)

    def packed(self) -> Any:
        """A pooled buffer ``[a | S]`` (``R + R*V`` elements) holding this rank's pair (initial folded in)."""
        buf = self.acquire((self.R * (self.V + 1),))
        pa, pS = _views(buf, self.R, self.V)
        pa[...] = self.a2
        if self.pos == 0 and self.init2 is not None:
            axpy_rows(self.init2, self.a2, self.S2, pS)
        else:
            pS[...] = self.S2
        return buf


def _views(buf: Any, R: int, V: int) -> tuple[Any, Any]:
    return buf[:R], buf[R:].reshape(R, V)


class _RingHandle(ScanHandle):
    """Pipelined ring (``blocks`` pieces); ``serial`` is the same with one piece.

    Pieces land straight in the result buffer; the combined pieces go out of a pooled buffer.
    """

    def __init__(self, plan: _Plan, n: int, topology: str):
        super().__init__(topology, n)
        self.p = plan
        tr, R, V = plan.tr, plan.R, plan.V
        self.n = n
        self.bounds = b = _piece_bounds(R, n)
        self.first = plan.pos == 0
        self.last = plan.pos == plan.P - 1
        self.prev = plan.rank_of(plan.pos - 1)
        self.nxt = plan.rank_of(plan.pos + 1)
        self.recvs: list = []
        self.sends: list = []
        self.next = 0
        self.out = None
        self.fwd = None
        if self.first:
            if plan.init2 is not None:
                src = axpy_rows(plan.init2, plan.a2, plan.S2, plan.acquire((R, V)))
            else:
                src = plan.S2
            self.next = n
            for j in range(n):
                self.sends.append(tr.isend(src[b[j] : b[j + 1]], self.nxt, plan.tag))
        else:
            self.out = plan.result()
            for j in range(n):
                self.recvs.append(tr.irecv(self.out[b[j] : b[j + 1]], self.prev, plan.tag))
            if not self.last:
                self.fwd = plan.acquire((R, V))
                self.kern = row_kernel(self.out, plan.a2, plan.S2, self.fwd)
                self.isend = tr.isend

    def _waiting_for(self) -> str:
        if self.next < self.n:
            return f"rank {self.prev} (the previous rank in scan order; piece {self.next} of {self.n} not received)"
        return f"rank {self.nxt} (the next rank in scan order has not received this rank's pieces)"

    def _forward(self, j: int) -> None:
        if self.last:
            return
        p = self.p
        r0, r1 = self.bounds[j], self.bounds[j + 1]
        f = self.fwd[r0:r1]
        self.kern(self.out[r0:r1], p.a2[r0:r1], p.S2[r0:r1], f)
        self.sends.append(self.isend(f, self.nxt, p.tag))

    def _progress(self) -> bool:
        while self.next < self.n and self.recvs[self.next].test():
            self._forward(self.next)
            self.next += 1
        if self.next < self.n:
            return False
        for s in self.sends:
            if not s.test():
                return False
        return True

    def _complete(self) -> None:
        while self.next < self.n:
            self.recvs[self.next].wait()
            self._forward(self.next)
            self.next += 1
        for s in self.sends:
            s.wait()

    def _finish(self) -> Any:
        self.p.release_all()
        if self.first:
            return self.p.first_result()
        return self.out.reshape(self.p.shape)


class _TreeHandle(ScanHandle):
    """Recursive doubling on packed ``[a | S]`` window aggregates, ``ceil(log2 P)`` rounds.

    The exclusive result is kept unpacked: its state in the result buffer, its decay apart; it is
    never sent, so it starts as the identity ``(1, 0)`` and folds each received window in.
    """

    def __init__(self, plan: _Plan):
        super().__init__("tree", None)
        self.p = plan
        self.partial = plan.packed()  # aggregate of positions [lo, pos]
        self.ra = None  # decay of the result (positions [lo, pos - 1]); None until something arrived
        self.tmp = None
        self.spare = None
        self.nrounds = (plan.P - 1).bit_length()
        self.round = 0
        self.reqs: list = []
        self._post()

    def _packed_buffer(self, name: str) -> Any:
        buf = getattr(self, name)
        if buf is None:
            buf = self.p.acquire((self.p.R * (self.p.V + 1),))
        setattr(self, name, None)
        return buf

    def _waiting_for(self) -> str:
        p, d = self.p, 1 << self.round
        who = []
        if p.pos - d >= 0:
            who.append(f"rank {p.rank_of(p.pos - d)} (sender)")
        if p.pos + d < p.P:
            who.append(f"rank {p.rank_of(p.pos + d)} (receiver)")
        return f"the partner(s) of round {self.round} of {self.nrounds}: " + ", ".join(who)

    def _post(self) -> None:
        p, d = self.p, 1 << self.round
        self.reqs = []
        if p.pos - d >= 0:
            self.tmp = self._packed_buffer("tmp")
            self.reqs.append(p.tr.irecv(self.tmp, p.rank_of(p.pos - d), p.tag))
        if p.pos + d < p.P:
            self.reqs.append(p.tr.isend(self.partial, p.rank_of(p.pos + d), p.tag))

    def _end_round(self) -> None:
        p, xp, d = self.p, self.p.xp, 1 << self.round
        if p.pos - d < 0:
            return
        R, V = p.R, p.V
        T = self.tmp
        ta, tS = _views(T, R, V)
        if p.pos + 2 * d < p.P:  # the partial is sent again: partial <- T o partial
            new = self._packed_buffer("spare")
            na, nS = _views(new, R, V)
            pa, pS = _views(self.partial, R, V)
            axpy_rows(tS, pa, pS, nS)
            xp.multiply(ta, pa, out=na)
            self.spare, self.partial = self.partial, new
        rS = p.result()
        if self.ra is None:  # result <- T
            rS[...] = tS
            self.ra = p.acquire((R,))
            self.ra[...] = ta
        else:  # result <- T o result
            axpy_rows(tS, self.ra, rS, rS)
            xp.multiply(self.ra, ta, out=self.ra)

    def _progress(self) -> bool:
        while self.round < self.nrounds:
            for r in self.reqs:
                if not r.test():
                    return False
            self._end_round()
            self.round += 1
            if self.round < self.nrounds:
                self._post()
        return True

    def _complete(self) -> None:
        while self.round < self.nrounds:
            for r in self.reqs:
                r.wait()
            self._end_round()
            self.round += 1
            if self.round < self.nrounds:
                self._post()

    def _finish(self) -> Any:
        self.p.release_all()
        if self.ra is None:
            return self.p.first_result()
        return self.p.result().reshape(self.p.shape)


class _AllgatherHandle(ScanHandle):
    """LASP-2 style: allgather packed pairs, fold the prefix before this rank locally."""

    def __init__(self, plan: _Plan):
        super().__init__("allgather", None)
        self.p = plan
        self.send = plan.packed()
        self.recv = plan.acquire((plan.P, plan.R * (plan.V + 1)))
        self.req = plan.tr.iallgather(self.send, self.recv)

    def _progress(self) -> bool:
        return self.req.test()

    def _complete(self) -> None:
        self.req.wait()

    def _finish(self) -> Any:
        p = self.p
        if p.pos == 0:
            p.release_all()
            return p.first_result()
        out = p.result()
        out[...] = _views(self.recv[p.rank_of(0)], p.R, p.V)[1]
        for q in range(1, p.pos):
            qa, qS = _views(self.recv[p.rank_of(q)], p.R, p.V)
            axpy_rows(out, qa, qS, out)
        p.release_all()
        return out.reshape(p.shape)


_EXSCAN_OPS: dict[tuple[int, int, str], tuple[MPI.Op, MPI.Datatype]] = {}


def _exscan_op(R: int, V: int, dtype: np.dtype) -> tuple[MPI.Op, MPI.Datatype]:
    """A non-commutative MPI op on one packed pair ``[a | S]`` and the contiguous datatype it acts on.

    MPI calls ``fn(invec, inoutvec)`` meaning ``inoutvec = invec op inoutvec`` with ``invec`` from
    the lower ranks, so ``invec`` is the left operand of the scan operator.
    """
    key = (R, V, np.dtype(dtype).str)
    hit = _EXSCAN_OPS.get(key)
    if hit is not None:
        return hit
    dt = np.dtype(dtype)

    def fn(inbuf, inoutbuf, datatype) -> None:  # noqa: ARG001
        x = np.frombuffer(inbuf, dtype=dt)
        y = np.frombuffer(inoutbuf, dtype=dt)
        count = x.size // (R * (V + 1))
        for c in range(count):  # MPI may hand several elements at once
            xs = x[c * R * (V + 1) : (c + 1) * R * (V + 1)]
            ys = y[c * R * (V + 1) : (c + 1) * R * (V + 1)]
            xa, xS = _views(xs, R, V)
            ya, yS = _views(ys, R, V)
            axpy_rows(xS, ya, yS, yS)  # y <- x o y = (xa ya, ya xS + yS)
            np.multiply(ya, xa, out=ya)

    base = MPI.DOUBLE if dt == np.float64 else MPI.FLOAT
    datatype = base.Create_contiguous(R * (V + 1)).Commit()
    op = MPI.Op.Create(fn, commute=False)
    _EXSCAN_OPS[key] = (op, datatype)
    return op, datatype


class _ExscanHandle(ScanHandle):
    """``MPI_Iexscan`` with a user-defined non-commutative op (host memory; device arrays staged)."""

    def __init__(self, plan: _Plan, ctx: CommContext):
        super().__init__("exscan", None)
        self.p = plan
        packed = plan.packed()
        self.send = packed if plan.xp is np else to_numpy(packed)
        self.recv = plan.pool.acquire(np, self.send.shape, self.send.dtype, None)
        op, dt = _exscan_op(plan.R, plan.V, self.send.dtype)
        comm = ctx.reversed_comm() if plan.reverse else ctx.pcomm
        self.req = comm.Iexscan([self.send, 1, dt], [self.recv, 1, dt], op)

    def _progress(self) -> bool:
        return bool(self.req.Test())

    def _complete(self) -> None:
        self.req.Wait()

    def _finish(self) -> Any:
        p = self.p
        if p.pos == 0:
            res = p.first_result()
        else:
            res = p.result()
            S = _views(self.recv, p.R, p.V)[1]
            res[...] = S if p.xp is np else p.xp.asarray(S)
            res = res.reshape(p.shape)
        p.pool.release(np, self.recv)
        p.release_all()
        return res


# --------------------------------------------------------------------------- public API


#: transport names accepted in place of a Transport object (see :func:`.transport.get_transport`)
TRANSPORT_NAMES = ("host", "auto", "cuda-aware", "staged", "nccl")


def _check_transport(transport: Any, like: Any, P: int, rank: int) -> None:
    """Local checks of a ``transport`` argument: None, a name, or a Transport for this communicator."""
    if transport is None:
        return
    if isinstance(transport, str):
        if transport not in TRANSPORT_NAMES:
            raise ValueError(f"transport must be one of {TRANSPORT_NAMES}, a Transport or None, got {transport!r}")
        if transport not in ("host", "auto") and not is_device_array(like):
            raise ValueError(f"transport {transport!r} needs device (CuPy) arrays; these are host arrays")
        return
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a Transport, a transport name or None, got {type(transport).__name__}")
    if transport.size != P or transport.rank != rank:
        raise ValueError(f"transport is for rank {transport.rank} of {transport.size}, this is rank {rank} of {P}")
    if transport.xp is not get_array_module(like):
        raise TypeError(f"transport {transport.name!r} moves {transport.xp.__name__} arrays, these are not")


def _transport_name(transport: Any) -> str | None:
    return transport if (transport is None or isinstance(transport, str)) else transport.name


def _transport_for(ctx: CommContext, transport: Transport | str | None, like: Any) -> Transport:
    """``transport`` itself, or the context's cached transport for ``like`` (of kind ``transport`` if a name)."""
    if transport is None:
        return ctx.transport(like=like)
    if isinstance(transport, str):
        return ctx.transport(like=like, kind=None if transport == "auto" else transport)
    return transport


def scan_start(
    a: Any,
    S: Any,
    comm: MPI.Comm,
    *,
    topology: str = "ring",
    blocks: int | None = None,
    reverse: bool = False,
    initial: Any = None,
    transport: Transport | str | None = None,
    progress: str = "poll",
    out: Any = None,
    timeout: float | None = None,
    check_values: bool = True,
    agreed: bool = False,
) -> ScanHandle:
    """Start the exclusive scan of :func:`scan` and return a :class:`ScanHandle` (collective).

    Validation (collective) and the first messages happen here; the caller may compute before
    ``handle.wait()``, and should call ``handle.test()`` now and then so the ring keeps forwarding
    (``progress="thread"`` drives it from a helper thread instead). ``out`` (optional, like ``S``,
    C-contiguous, not overlapping the inputs) receives the result, which saves allocating (and
    page-faulting) a new state per call. See the module docstring.

    ``timeout`` (seconds; None = ``$HPCZECO_COLLECTIVE_TIMEOUT``, unset = wait forever; the same on
    every rank): a rank that waits longer than that -- for the other ranks to arrive at the
    validation, or in ``wait()`` for the scan's messages -- prints to stderr the operation and the
    rank(s) it waits for (ring/serial: the previous rank in scan order; tree: the partners of the
    pending round; allgather/exscan: "some rank did not arrive") and calls ``MPI_Abort``. With a
    timeout the validation exchanges ``P - 1`` small messages each way instead of one Allreduce,
    and ``wait()`` polls with a growing sleep (up to 10 ms) instead of blocking.

    ``agreed=True`` skips the validation exchange: the caller guarantees that every rank passes the same
    shapes, dtype, topology, blocks, direction and transport (a layer that agreed on them collectively
    already, like :class:`hpczeco.ZeCOGLA`). The local checks still run; one failing then raises on its
    rank only, so the others must rely on ``timeout`` to end.
    """
    ctx = get_context(comm)
    P, rank = ctx.size, ctx.rank
    pos = P - 1 - rank if (isinstance(reverse, (bool, np.bool_)) and reverse) else rank
    error: BaseException | None = None
    tmo: float | None = None
    try:
        tmo = resolve_timeout(timeout)
        _check_inputs(a, S, initial, topology, blocks, reverse, pos == 0, progress, check_values)
        if out is not None:
            _check_out(out, a, S, initial)
        _check_transport(transport, S, P, rank)
        topo, nblocks = _resolve(topology, blocks, P, int(S.nbytes), int(a.shape[-1]), _memory(S))
    except (ValueError, TypeError) as exc:
        error, topo, nblocks = exc, None, None
    agree = {
        "a.shape": tuple(getattr(a, "shape", ())),
        "S.shape": tuple(getattr(S, "shape", ())),
        "dtype": _dtype_name(S),
        "memory": _memory(S),
        "topology": topology,
        "blocks": None if blocks is None or isinstance(blocks, (bool, np.bool_)) else blocks,
        "reverse": reverse,
        "topology/blocks used": (topo, nblocks),
        "transport": _transport_name(transport),
    }
    if agreed:
        if error is not None:
            raise error
    else:
        agree_fast(ctx.pcomm, "scan", error, agree, tmo)
    tag = ctx.next_tag()
    xp = get_array_module(S)
    if P == 1:
        res = xp.empty(S.shape, dtype=S.dtype) if out is None else out
        if initial is not None:
            res[...] = initial
        else:
            res.fill(0)
        return _DoneHandle(topo, nblocks, res)
    R, V = int(a.size), int(S.shape[-1])
    a2 = xp.ascontiguousarray(a).reshape(R)
    S2 = xp.ascontiguousarray(S).reshape(R, V)
    init2 = None if initial is None else xp.ascontiguousarray(initial).reshape(R, V)
    tr = _transport_for(ctx, transport, S) if topo != "exscan" else None
    out2 = None if out is None else out.reshape(R, V)
    plan = _Plan(tr, xp, a2, S2, init2, tuple(S.shape), pos, P, bool(reverse), tag, ctx.pool, out2)
    if topo in ("ring", "serial"):
        h: ScanHandle = _RingHandle(plan, nblocks, topo)
    elif topo == "tree":
        h = _TreeHandle(plan)
    elif topo == "allgather":
        h = _AllgatherHandle(plan)
    elif topo == "exscan":
        h = _ExscanHandle(plan, ctx)
    else:  # pragma: no cover - _resolve returns a concrete topology
        raise AssertionError(topo)
    h._out = out
    h._timeout, h._comm = tmo, ctx.pcomm
    h._count()
    if progress == "thread":
        h._start_thread()
    return h


def scan(
    a: Any,
    S: Any,
    comm: MPI.Comm,
    *,
    topology: str = "ring",
    blocks: int | None = None,
    reverse: bool = False,
    initial: Any = None,
    transport: Transport | str | None = None,
    out: Any = None,
    timeout: float | None = None,
    check_values: bool = True,
    agreed: bool = False,
) -> Any:
    """This rank's exclusive scan ``S_in [..., K, V]`` of the pairs ``(a [..., K], S [..., K, V])`` (collective).

    ``S_in^(p)`` folds the pairs of the ranks before ``p`` in rank order (reverse rank order if
    ``reverse``) with ``X <- a_q * X + S_q``, starting from ``initial`` (given by the first rank
    in scan order only) or zeros. ``topology``: "ring" (pipelined All-Scan, ``blocks`` pieces,
    ``None`` = the cost model's choice), "tree", "allgather", "serial", "exscan" or "auto".
    Same result on any number of ranks; errors are raised on every rank before communicating.
    ``out`` (optional) is filled and returned instead of a new array. ``transport``: None (the
    arrays' transport: host, or a device transport by detection / ``$HPCZECO_TRANSPORT``, cached
    per communicator), a name ("host", "auto", "cuda-aware", "staged", "nccl"), or a
    :class:`~hpczeco.collectives.transport.Transport` (whose communicator then carries the messages).
    ``timeout``: see :func:`scan_start` (a stalled peer aborts the job with a message naming it).
    ``check_values=False`` skips the NaN/range scans of the data (for callers that validated it);
    ``agreed=True`` skips the validation exchange (see :func:`scan_start`).
    """
    return scan_start(
        a, S, comm, topology=topology, blocks=blocks, reverse=reverse, initial=initial, transport=transport, out=out,
        timeout=timeout, check_values=check_values, agreed=agreed,
    ).wait()


def _relay_setup(buf: Any, comm: MPI.Comm, reverse: bool, transport: Transport | str | None):
    if not _is_array(buf):
        raise TypeError(f"buf must be a numpy or cupy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError("buf must be C-contiguous")
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    ctx = get_context(comm)
    _check_transport(transport, buf, ctx.size, ctx.rank)
    pos = ctx.size - 1 - ctx.rank if reverse else ctx.rank
    tr = _transport_for(ctx, transport, buf)
    step = -1 if reverse else 1
    return ctx, pos, tr, step


def relay_recv(
    buf: Any, comm: MPI.Comm, *, reverse: bool = False, transport: Transport | str | None = None,
    timeout: float | None = None,
) -> bool:
    """Receive the whole state from the previous rank in scan order into ``buf`` (blocking).

    Returns False (receiving nothing) on the first rank in scan order. Pairs with
    :func:`relay_send` on the previous rank: the k-th ``relay_send`` of rank ``p-1`` feeds the k-th
    ``relay_recv`` of rank ``p`` (per direction; messages of one direction stay in order).
    Point-to-point, so only local checks: ``buf`` must match the sender's buffer in size and dtype.
    ``timeout`` (seconds; None = ``$HPCZECO_COLLECTIVE_TIMEOUT``, unset = forever): past it, print the
    sender's rank and call ``MPI_Abort``.
    """
    tmo = resolve_timeout(timeout)
    ctx, pos, tr, step = _relay_setup(buf, comm, reverse, transport)
    if pos == 0:
        return False
    src = ctx.rank - step
    if tmo is None:
        tr.recv(buf, src, RELAY_TAGS[bool(reverse)])
        return True
    req = tr.irecv(buf, src, RELAY_TAGS[bool(reverse)])
    if not _poll_until(req.test, time.monotonic() + tmo):
        _abort_stalled(ctx.pcomm, "relay_recv", f"rank {src} (the previous rank in scan order)", tmo)
    return True


def relay_send(
    buf: Any, comm: MPI.Comm, *, reverse: bool = False, transport: Transport | str | None = None
) -> None:
    """Send the whole state ``buf`` to the next rank in scan order (blocking); no-op on the last rank."""
    ctx, pos, tr, step = _relay_setup(buf, comm, reverse, transport)
    if pos == ctx.size - 1:
        return
    tr.send(buf, ctx.rank + step, RELAY_TAGS[bool(reverse)])
