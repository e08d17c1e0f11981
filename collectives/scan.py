"""Exclusive scans over ranks of the pair operator used by ZeCO: the public entry (:func:`scan`, :func:`scan_start`).

Each rank ``p`` holds a pair ``(a_p, S_p)``: decays ``a [..., K]`` and a state ``S [..., K, V]``
(any leading dims, e.g. ``[B, H]``; ``a``'s shape equals ``S.shape[:-1]``). The operator

    (a1, S1) o (a2, S2) = (a1 * a2,  a2[..., None] * S1 + S2)

is associative, not commutative, with identity ``(1, 0)`` (reference: :mod:`.kernels`). :func:`scan`
returns this rank's **exclusive** state ``S_in^(p)``: the fold of the pairs of the ranks before ``p``
in scan order (rank order, or reverse rank order with ``reverse=True``), starting from ``initial``
(zeros when not given)::

    X = initial or 0;  for q before p: X = a_q * X + S_q;   S_in^(p) = X

The first rank in scan order gets ``initial`` (a copy) or zeros. ``initial`` ``[..., K, V]`` is
supplied by that rank only; every other rank passes ``None``.

Topologies (:data:`~.names.TOPOLOGIES`; all give the same result up to rounding): ``"ring"`` (the
paper's pipelined All-Scan in ``blocks`` pieces) and ``"serial"`` (LASP-1, the ring with one block):
:mod:`.ring`; ``"tree"`` (recursive doubling): :mod:`.tree`; ``"allgather"`` (LASP-2) and ``"exscan"``
(``MPI_Iexscan`` with a user op): :mod:`.baselines`; ``"ptree"`` (the doubly pipelined in-order binary
tree in ``blocks`` pieces): :mod:`.pipetree`; ``"auto"``: the cost model's pick (:func:`.costmodel.choose`) for
this ``P``, state size and ``K`` under the default link parameters (:func:`.costmodel.default_params`), which
also picks the piece count of the ring and of ``ptree`` when ``blocks`` is None.

Validation is collective and happens before the first message: shapes, dtypes, options, which
ranks pass ``initial``, NaN/Inf, decays outside [0, 1] -- every rank raises the same
:class:`~hpczeco.collectives.agree.CollectiveInputError` (a ``ValueError``; the type flavour is a
``TypeError`` too). The all-good case costs one ``Allreduce`` of three integers (a digest of the
agreed values, :func:`~.agree.agree_fast`); only on a mismatch or error do the ranks run
:func:`~.agree.collective_check` to build the message.

:func:`scan_start` posts the first messages and returns a :class:`~.handle.ScanHandle` (progress by
``test()``/``wait()`` or a helper thread: :mod:`.handle`). Pieces land directly in the result buffer
(``out=`` if given, else a new array); scratch buffers come from a per-communicator pool.

Tags: every collective operation gets its own tag from a per-communicator counter (every rank
calls collectives in the same order), and all traffic goes over a private duplicate of ``comm``
(:mod:`.context`), so several scans in flight on one communicator cannot mix.

Buffers: ``a`` and ``S`` (and ``initial``) must stay unmodified until ``wait()`` returns.
Arithmetic uses the array module of the buffers (numpy or CuPy); communication goes through the
:class:`~hpczeco.collectives.transport.Transport` interface only (:mod:`.selection` picks it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hpczeco.base.backend import get_array_module, is_device_array
from mpi4py import MPI

from . import costmodel
from .agree import agree_fast
from .baselines import AllgatherHandle, ExscanHandle
from .context import get_context
from .handle import DoneHandle, ScanHandle, ScanPlan, scan_stats
from .kernels import combine, fold_reference, value_summary
from .names import TOPOLOGIES, check_blocks, check_progress, check_topology
from .pipetree import ScheduleHandle
from .ring import RingHandle
from .schedule import ptree_programs
from .selection import check_transport, transport_for, transport_name
from .transport import Transport
from .tree import TreeHandle
from .watchdog import TIMEOUT_ENV, resolve_timeout

__all__ = [
    "TOPOLOGIES",
    "ScanHandle",
    "scan",
    "scan_start",
    "combine",
    "fold_reference",
    "TIMEOUT_ENV",
    "resolve_timeout",
    "scan_stats",
]


# --------------------------------------------------------------------------- input checks


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


def _check_inputs(a: Any, S: Any, initial: Any, topology: str, blocks: int | None, reverse: bool, first: bool,
                  progress: str, check_values: bool = True) -> None:
    """Local checks (raise ValueError/TypeError naming the argument); ``check_values`` adds the NaN/range
    scans of the data (each a reduction, and a device synchronisation for CuPy arrays)."""
    check_topology(topology)
    check_progress(progress)
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
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
    check_blocks(blocks, K)
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
    fast = value_summary(a, S)  # one fused pass on host arrays; the reductions below name what is wrong
    if fast is not None and fast[2]:
        amin, amax = fast[0], fast[1]
        if not (amin >= 0.0 and amax <= 1.0):
            raise ValueError(f"a holds decays outside [0, 1] (min {amin:g}, max {amax:g})")
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


# --------------------------------------------------------------------------- topology


def _resolve(topology: str, blocks: int | None, P: int, nbytes: int, K: int, memory: str) -> tuple[str, int | None]:
    """Topology and ring blocks actually used (the cost model decides "auto" and ``blocks=None``)."""
    if topology in ("ring", "auto") and (topology == "auto" or blocks is None):
        params = costmodel.default_params(memory)
        if topology == "auto":
            topo, kb = costmodel.choose(P, nbytes, K, params)
            return topo, (blocks if (topo in ("ring", "ptree") and blocks is not None) else kb)
        return "ring", costmodel.best_blocks(P, nbytes, K, params)
    if topology == "serial":
        return "serial", 1
    if topology == "ptree":
        if blocks is None:
            blocks = costmodel.best_blocks_ptree(P, nbytes, K, costmodel.default_params(memory))
        return "ptree", blocks
    return topology, blocks if topology == "ring" else None


# --------------------------------------------------------------------------- public API


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
    page-faulting) a new state per call. See the module docstring and :mod:`.handle` (progress).

    ``timeout`` (seconds; None = ``$HPCZECO_COLLECTIVE_TIMEOUT`` as agreed over the ranks when the
    communicator's context was made: by default 600 s, ``0``/``off`` = wait forever; the same on every rank): a
    rank that waits
    longer than that -- for the other ranks to arrive at the validation, or in ``wait()`` for the
    scan's messages -- prints to stderr the operation and the rank(s) it waits for (ring/serial: the
    previous rank in scan order; tree: the partners of the pending round; ptree: the tree neighbour whose
    piece has not arrived; allgather/exscan: "some rank did not arrive") and calls ``MPI_Abort`` on
    ``MPI_COMM_WORLD``; a rank that left the job before this scan (its process ended: :mod:`.lifeline`) ends the
    wait at once. With a
    timeout the validation exchanges ``P - 1`` small messages each way instead of one Allreduce,
    and ``wait()`` polls (2 ms back to back, then sleeping at most 1 ms between polls: :func:`.watchdog.poll_until`)
    instead of blocking.

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
        tmo = ctx.timeout if timeout is None else resolve_timeout(timeout)
        _check_inputs(a, S, initial, topology, blocks, reverse, pos == 0, progress, check_values)
        if out is not None:
            _check_out(out, a, S, initial)
        check_transport(transport, S, P, rank)
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
        "transport": transport_name(transport),
    }
    if agreed:
        if error is not None:
            raise error
    else:
        agree_fast(comm, "scan", error, agree, tmo)
    tag = ctx.next_tag()
    xp = get_array_module(S)
    if P == 1:
        res = xp.empty(S.shape, dtype=S.dtype) if out is None else out
        if initial is not None:
            res[...] = initial
        else:
            res.fill(0)
        return DoneHandle(topo, nblocks, res)
    R, V = int(a.size), int(S.shape[-1])
    a2 = xp.ascontiguousarray(a).reshape(R)
    S2 = xp.ascontiguousarray(S).reshape(R, V)
    init2 = None if initial is None else xp.ascontiguousarray(initial).reshape(R, V)
    tr = transport_for(ctx, transport, S) if topo != "exscan" else None
    out2 = None if out is None else out.reshape(R, V)
    plan = ScanPlan(tr, xp, a2, S2, init2, tuple(S.shape), pos, P, bool(reverse), tag, ctx.pool, out2)
    if topo in ("ring", "serial"):
        h: ScanHandle = RingHandle(plan, nblocks, topo)
    elif topo == "tree":
        h = TreeHandle(plan)
    elif topo == "ptree":
        h = ScheduleHandle(plan, ptree_programs(P, nblocks), nblocks, "ptree")
    elif topo == "allgather":
        h = AllgatherHandle(plan)
    elif topo == "exscan":
        h = ExscanHandle(plan, ctx)
    else:  # pragma: no cover - _resolve returns a concrete topology
        raise AssertionError(topo)
    h._out = out
    h._timeout, h._comm = tmo, ctx.pcomm
    h._watch = ctx.watch(ctx.begin(), f"scan({topo})")
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
    ``None`` = the cost model's choice), "tree", "allgather", "serial", "exscan", "ptree" (the pipelined in-order
    binary tree, ``blocks`` pieces) or "auto".
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
