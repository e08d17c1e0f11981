"""Calibration of the cost model on the running machine: link ``alpha``/``beta`` and combine ``gamma``/``delta``.

:func:`calibrate` measures ``alpha``/``beta`` by a cyclic shift (every rank sends to the next and
receives from the previous at once: the ring's steady state) or by ping-pong between rank pairs
(all pairs at once), medians of repeats; ``gamma``/``delta`` by timing the scans' combine kernel
(:func:`measure_combine`) on every rank at once; ``overhead`` (the fixed cost of one scan call) as
what a tiny serial scan costs beyond the model's hops (:func:`measure_overhead`); ``piece`` (the
ring's cost per piece above the eager size) and ``ring_beta`` (the ring's cost per byte of a stage) by
fitting the ring's own times at three piece counts (:func:`measure_ring`; :func:`measure_piece` is the
per-piece term alone, from two), and ``ring_beta_big`` (the same on a state too large for the caches) from
the ring at two piece counts on a 16 MiB state (:func:`measure_ring_big`); ``beta_big`` / ``gamma_big`` from the
shift and the combine at 16 MiB (:func:`measure_big`), ``ptree_beta`` from ``ptree`` itself at two piece counts
(:func:`measure_ptree`). The messages run
on a private duplicate of the communicator. Knows nothing about attention.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from mpi4py import MPI

from . import timed
from .costmodel import (
    EAGER_DEFAULT,
    RING_BIG,
    RING_BYTES,
    LinkParams,
    piece_from_times,
    ptree_from_times,
    ring_beta_from_times,
    ring_from_times,
)
from .kernels import axpy_rows
from .lifeline import guard

__all__ = ["calibrate", "eager_bytes", "measure_combine", "measure_overhead", "measure_piece", "measure_ring",
           "measure_ring_big", "check_ring_big", "ring_times", "ptree_times", "measure_ptree", "measure_big"]

#: tags of the ping-pong and cyclic-shift messages (on the private duplicate)
_PINGPONG_TAG, _SHIFT_TAG = 7, 9


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _pingpong(comm: MPI.Comm, peer: int, lead: bool, nbytes: int, repeats: int, dtype: Any) -> list[float]:
    buf = np.zeros(max(1, nbytes // np.dtype(dtype).itemsize), dtype=dtype)
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        if lead:
            comm.Send(buf, dest=peer, tag=_PINGPONG_TAG)
            comm.Recv(buf, source=peer, tag=_PINGPONG_TAG)
        else:
            comm.Recv(buf, source=peer, tag=_PINGPONG_TAG)
            comm.Send(buf, dest=peer, tag=_PINGPONG_TAG)
        if r:  # the first round trip is warm-up
            times.append((time.perf_counter() - t0) / 2)
    return times


def measure_combine(nbytes: int, repeats: int = 20, dtype: Any = "float32", V: int = 128) -> float:
    """Median seconds of one combine ``f = a * X + S`` on ``nbytes`` of state, with the kernel the scans
    use (:func:`.kernels.axpy_rows`: fused Numba loop on the host)."""
    n = max(1, nbytes // np.dtype(dtype).itemsize)
    V = min(V, n)
    rows = max(1, n // V)
    X = np.ones((rows, V), dtype=dtype)
    S = np.ones_like(X)
    f = np.empty_like(X)
    a = np.full(rows, 0.5, dtype=dtype)
    axpy_rows(X, a, S, f)  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        axpy_rows(X, a, S, f)
        times.append(time.perf_counter() - t0)
    return _median(times)


def _sleep_barrier(comm: MPI.Comm) -> None:
    """A barrier that yields the CPU while waiting (oversubscribed ranks do not steal the pingers' cores), bounded
    by the collective timeout (:func:`.timed.Barrier`)."""
    timed.Barrier(comm, "calibration (a barrier between measurements)")


def _shift(comm: MPI.Comm, nbytes: int, repeats: int, dtype: Any) -> list[float]:
    """Every rank at once sends to rank+1 and receives from rank-1 (cyclic): seconds per step."""
    n = max(1, nbytes // np.dtype(dtype).itemsize)
    sbuf = np.ones(n, dtype=dtype)
    rbuf = np.zeros(n, dtype=dtype)
    P, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % P, (rank - 1) % P
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        comm.Sendrecv(sbuf, right, _SHIFT_TAG, rbuf, left, _SHIFT_TAG)
        if r:
            times.append(time.perf_counter() - t0)
    return times


def _timed_max(comm: MPI.Comm, fn, repeats: int) -> float:
    """Median over repeats of the slowest rank's seconds of ``fn()`` from a barrier (as the benchmark times)."""
    buf = np.zeros(1)
    times = []
    for r in range(repeats + 2):
        with guard(comm, "calibration (the barrier before a timed repeat)"):  # blocking, as the benchmark times
            comm.Barrier()
        t0 = time.perf_counter()
        fn()
        buf[0] = time.perf_counter() - t0
        with guard(comm, "calibration (the slowest rank's time)"):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        if r >= 2:  # two warm-up calls
            times.append(float(buf[0]))
    return _median(times)


def measure_overhead(comm: MPI.Comm, params: LinkParams, repeats: int = 30, dtype: Any = "float32") -> float:
    """Seconds of one scan call beyond its messages and combines: a serial scan of a one-row state
    (``[1, 1, 8]``) timed like the benchmark, minus :func:`.costmodel.serial_time` under ``params``
    (clamped at 0). It holds the collective validation (local checks and one ``Allreduce``), the plan,
    and the Python cost of posting and completing the requests. Collective."""
    from .costmodel import serial_time
    from .scan import scan_start

    a = np.full((1, 1), 0.5, dtype=dtype)
    S = np.ones((1, 1, 8), dtype=dtype)
    out = np.empty_like(S)
    t = _timed_max(comm, lambda: scan_start(a, S, comm, topology="serial", out=out).wait(), repeats)
    return max(0.0, t - serial_time(comm.Get_size(), S.nbytes, params))


def _ring_state_bytes(nbytes: int, blocks: Sequence[int], dtype: Any) -> int:
    """Bytes of :func:`ring_times`' ``[1, R, 128]`` state for about ``nbytes`` (at least one row per piece)."""
    row = np.dtype(dtype).itemsize * 128
    return max(max(blocks), int(nbytes) // row) * row


def ring_times(comm: MPI.Comm, nbytes: int, blocks: Sequence[int], repeats: int = 15,
               dtype: Any = "float32") -> tuple[int, list[float]]:
    """``(state bytes, seconds per k)``: the ring on a ``[1, R, 128]`` state of about ``nbytes`` (at least one row
    per piece) timed like the benchmark (:func:`_timed_max`) at each piece count of ``blocks``. Collective."""
    from .scan import scan_start

    V = 128
    R = _ring_state_bytes(nbytes, blocks, dtype) // (np.dtype(dtype).itemsize * V)
    a = np.full((1, R), 0.5, dtype=dtype)
    S = np.ones((1, R, V), dtype=dtype)
    out = np.empty_like(S)
    t = [_timed_max(comm, lambda k=k: scan_start(a, S, comm, topology="ring", blocks=k, out=out).wait(), repeats)
         for k in blocks]
    return S.nbytes, t


def ptree_times(comm: MPI.Comm, nbytes: int, blocks: Sequence[int], repeats: int = 15,
                dtype: Any = "float32") -> tuple[int, list[float]]:
    """``(state bytes, seconds per k)``: ``ptree`` on a ``[1, R, 128]`` state of about ``nbytes`` timed like the
    benchmark at each piece count of ``blocks`` (:func:`ring_times` for the pipelined tree). Collective."""
    from .scan import scan_start

    V = 128
    R = _ring_state_bytes(nbytes, blocks, dtype) // (np.dtype(dtype).itemsize * V)
    a = np.full((1, R), 0.5, dtype=dtype)
    S = np.ones((1, R, V), dtype=dtype)
    out = np.empty_like(S)
    t = [_timed_max(comm, lambda k=k: scan_start(a, S, comm, topology="ptree", blocks=k, out=out).wait(), repeats)
         for k in blocks]
    return S.nbytes, t


#: the piece counts :func:`measure_ptree` times ``ptree`` at, on a state of ``RING_STATE_BYTES``
PTREE_BLOCKS = (8, 32)


def measure_ptree(comm: MPI.Comm, params: LinkParams, repeats: int = 15, dtype: Any = "float32",
                  blocks: tuple[int, ...] = PTREE_BLOCKS) -> float:
    """``ptree_beta``: ``ptree`` on a ``[1, R, 128]`` state of ``RING_STATE_BYTES`` timed at the piece counts
    ``blocks``, fitted by :func:`~.costmodel.ptree_from_times` with ``params``' other terms: the per-byte cost of
    one pipeline stage of the busiest position (three pieces in, three out, four combines inside the tree), as
    the ring's ``ring_beta`` is its stage's. Collective; 0 below three ranks (where ptree is the ring's hop)."""
    P = comm.Get_size()
    if P < 3:
        return 0.0
    m, t = ptree_times(comm, RING_STATE_BYTES, blocks, repeats, dtype)
    return ptree_from_times(P, m, list(blocks), t, params)


def measure_big(comm: MPI.Comm, nbytes: int, alpha: float, delta: float, repeats: int = 5,
                dtype: Any = "float32") -> tuple[float, float]:
    """``(beta_big, gamma_big)``: the cyclic shift of ``nbytes`` (every rank sends and receives at once, as the
    tree's rounds, the allgather's steps and MPI_Exscan's relay do) and the combine of ``nbytes`` on every rank at
    once, per byte beyond ``alpha`` / ``delta``: the cost once the ranks' buffers outgrow the caches and every copy
    and combine runs at the memory bandwidth all ranks share. Medians over repeats, then over ranks. Collective;
    ``(0, gamma_big)`` for one rank."""
    c = comm.Dup()
    try:
        beta_big = 0.0
        if c.Get_size() >= 2:
            _sleep_barrier(c)
            t = _median(_shift(c, nbytes, repeats, dtype))
            _sleep_barrier(c)
            beta_big = max(0.0, (_median(c.allgather(t)) - alpha) / nbytes)
        _sleep_barrier(c)
        g = measure_combine(nbytes, repeats, dtype)
        gamma_big = max(0.0, (_median(c.allgather(g)) - delta) / nbytes)
        return c.bcast((beta_big, gamma_big), root=0)
    finally:
        c.Free()


#: the piece counts :func:`measure_piece` times the ring at, on a state of ``PIECE_STATE_EAGERS * eager`` bytes
#: (pieces of 4 and 4/3 times the eager size: both above it, and many enough that the difference is mostly
#: pieces rather than pipelining)
PIECE_BLOCKS = (16, 48)
PIECE_STATE_EAGERS = 64


def measure_piece(comm: MPI.Comm, params: LinkParams, repeats: int = 15, dtype: Any = "float32",
                  blocks: tuple[int, int] = PIECE_BLOCKS) -> float:
    """Seconds a ring piece above ``params.eager`` bytes costs per pipeline stage beyond ``alpha``: the ring
    on a ``[1, R, 128]`` state of ``PIECE_STATE_EAGERS * eager`` bytes timed like the benchmark at the two
    piece counts ``blocks``, through :func:`piece_from_times` under ``params``. Holds the rendezvous
    handshake of every such message and the per-request work of the ring's Python loop. Collective;
    0 for one rank."""
    P = comm.Get_size()
    if P < 2:
        return 0.0
    m, t = ring_times(comm, int(PIECE_STATE_EAGERS * params.eager), blocks, repeats, dtype)
    return piece_from_times(P, m, blocks[0], t[0], blocks[1], t[1], params)


#: the piece counts :func:`measure_ring` times the ring at, on a state of ``RING_STATE_BYTES`` (pieces of 256,
#: 128 and 43 KiB: above every eager size below, and enough of them that both terms show)
RING_BLOCKS = (8, 16, 48)
RING_STATE_BYTES = RING_BYTES
#: the piece counts :func:`measure_ring_big` times the ring at on a state of ``RING_BIG`` bytes (pieces of 1 MiB
#: and 341 KiB), and its repeats (each ring there takes milliseconds to tens of milliseconds)
RING_BIG_BLOCKS = (16, 48)
RING_BIG_REPEATS = 7


_OMPI_EAGER_VARS = ("OMPI_MCA_btl_vader_eager_limit", "OMPI_MCA_btl_sm_eager_limit")


def eager_bytes(comm: MPI.Comm) -> float:
    """The size above which a ring piece leaves the library's eager protocol for a handshake (an assumption about
    the library, not a measurement). Under Open MPI with every rank of ``comm`` on one node (shared memory):
    ``btl_vader_eager_limit`` / ``btl_sm_eager_limit`` from the environment, else their default, 4 KiB. Anything
    else (MPICH, ranks on several nodes, whose links have their own thresholds): :data:`~.costmodel.EAGER_DEFAULT`.
    Collective (a shared-memory split of ``comm``); the same on every rank."""
    with guard(comm, "calibration (the ranks of each node: MPI_Comm_split_type)"):
        shm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        one_node = shm.Get_size() == comm.Get_size()
    finally:
        shm.Free()
    eager = float(EAGER_DEFAULT)
    if one_node and "Open MPI" in MPI.Get_library_version():
        eager = 4096.0
        for var in _OMPI_EAGER_VARS:
            try:
                eager = float(os.environ[var])
                break
            except (KeyError, ValueError):
                continue
    return timed.bcast(comm, eager, 0, "calibration (the eager size)")


def measure_ring(comm: MPI.Comm, params: LinkParams, repeats: int = 15, dtype: Any = "float32",
                 blocks: tuple[int, ...] = RING_BLOCKS) -> tuple[float, float]:
    """``(piece, ring_beta)``: the ring on a ``[1, R, 128]`` state of ``RING_STATE_BYTES`` timed like the
    benchmark at the piece counts ``blocks`` (all above ``params.eager``), fitted by
    :func:`~.costmodel.ring_from_times`: the per-stage cost beyond ``alpha`` and the per-byte cost of a stage
    as the ring itself pays them. Collective; ``(0, 0)`` for one rank."""
    P = comm.Get_size()
    if P < 2:
        return 0.0, 0.0
    m, t = ring_times(comm, RING_STATE_BYTES, blocks, repeats, dtype)
    return ring_from_times(P, m, list(blocks), t, params)


def check_ring_big(ring_big: int, dtype: Any = "float32") -> None:
    """Raise ``ValueError`` unless ``ring_big`` is 0 or a state larger than :func:`measure_ring`'s by at least one
    ``[., 128]`` row of ``dtype`` (pure: the same verdict on every rank)."""
    if ring_big and (_ring_state_bytes(ring_big, RING_BIG_BLOCKS, dtype)
                     <= _ring_state_bytes(RING_STATE_BYTES, RING_BLOCKS, dtype)):
        raise ValueError(f"ring_big must be 0 or more than {RING_STATE_BYTES} bytes (2 MiB, by at least one state "
                         f"row), got {ring_big}")


def measure_ring_big(comm: MPI.Comm, params: LinkParams, nbytes: int = RING_BIG, repeats: int = RING_BIG_REPEATS,
                     dtype: Any = "float32", blocks: tuple[int, ...] = RING_BIG_BLOCKS) -> tuple[float, float]:
    """``(ring_beta_big, state bytes)``: the ring on a ``[1, R, 128]`` state of about ``nbytes`` timed like the
    benchmark at the piece counts ``blocks``, fitted by :func:`~.costmodel.ring_beta_from_times` with
    ``params``' other terms (``piece`` from :func:`measure_ring` first): the per-byte stage cost once the
    ranks' states no longer fit the caches. Collective; ``(0, nbytes)`` for one rank."""
    P = comm.Get_size()
    if P < 2:
        return 0.0, float(nbytes)
    m, t = ring_times(comm, nbytes, blocks, repeats, dtype)
    return ring_beta_from_times(P, m, list(blocks), t, params), float(m)


def calibrate(
    comm: MPI.Comm,
    sizes: tuple[int, ...] = (8, 4096, 1 << 20, 4 << 20),
    repeats: int = 15,
    dtype: Any = "float32",
    method: str = "shift",
    piece: bool = True,
    ring_big: int = RING_BIG,
) -> LinkParams:
    """Measure ``LinkParams`` on the running machine (collective over ``comm``; same result on every rank).

    ``method="shift"`` (default): every rank at once sends ``s`` bytes to the next rank and receives
    from the previous (a cyclic ``Sendrecv``) -- the steady state of the pipelined ring, where each
    rank receives one piece while it sends the previous one, and of the tree's and allgather's
    rounds. ``method="pingpong"``: ranks paired (0,1), (2,3), ... ping-pong all at once, half the
    round trip (a rank without partner waits in a sleeping barrier). On shared memory without a
    single-copy mechanism the shift step costs about twice the ping-pong one (each rank copies
    in and out), and it is the shift that predicts the ring.

    ``alpha``: the step time of the smallest size; ``beta``: the median over the sizes of 64 KiB and
    more (else all larger ones) of ``(t - alpha) / size``; medians over repeats, then over ranks.
    ``gamma``/``delta``: every rank times the scans' combine kernel at the largest and at a tiny
    size at the same time (memory bandwidth is shared); medians over ranks. ``overhead``:
    :func:`measure_overhead` on the user's communicator (``comm`` itself: the scans' contexts live
    there). ``eager``: :func:`eager_bytes`. ``piece`` and ``ring_beta`` (unless ``piece=False``):
    :func:`measure_ring`, after the others (``ring_k_min``: its fewest pieces); then ``ring_beta_big``
    (unless ``piece=False`` or ``ring_big=0``): :func:`measure_ring_big` on a state of ``ring_big`` bytes (more
    than ``RING_STATE_BYTES``; its ``P`` states and buffers must fit in memory). Rank 0's numbers are
    broadcast. One rank alone measures ``alpha = beta = 0`` (no link). With ``piece`` and ``ring_big`` (larger
    than the largest of ``sizes``) also ``beta_big`` / ``gamma_big`` (:func:`measure_big`: the shift and the
    combine on ``ring_big`` bytes, which the tree, allgather, exscan and serial relay pay on big states), and with
    ``piece`` at three ranks or more ``ptree_beta`` (:func:`measure_ptree`).
    """
    if method not in ("shift", "pingpong"):
        raise ValueError(f"method must be 'shift' or 'pingpong', got {method!r}")
    check_ring_big(ring_big, dtype)
    sizes = tuple(sorted(int(s) for s in sizes))
    if len(sizes) < 2 or sizes[0] <= 0:
        raise ValueError(f"sizes needs at least two positive sizes, got {sizes}")
    with guard(comm, "calibration (MPI_Comm_dup)"):
        c = comm.Dup()
    try:
        P, rank = c.Get_size(), c.Get_rank()
        alpha = beta = 0.0
        if P >= 2:
            peer = rank ^ 1
            active = method == "shift" or peer < P
            res: dict[int, float] = {}
            for s in sizes:
                _sleep_barrier(comm)
                with guard(comm, f"calibration ({method} of {s} bytes)"):  # blocking messages, as timed
                    if method == "shift":
                        res[s] = _median(_shift(c, s, repeats, dtype))
                    elif active:
                        res[s] = _median(_pingpong(c, peer, rank % 2 == 0, s, repeats, dtype))
            _sleep_barrier(comm)
            everyone = [r for r in timed.allgather(comm, res if active else None, "calibration (the link times)")
                        if r is not None]
            med = {s: _median([r[s] for r in everyone]) for s in sizes}
            alpha = med[sizes[0]]
            big = [s for s in sizes[1:] if s >= 64 * 1024] or list(sizes[1:])
            beta = max(0.0, _median([(med[s] - alpha) / (s - sizes[0]) for s in big]))
        _sleep_barrier(comm)
        g_big = measure_combine(sizes[-1], repeats, dtype)
        delta = measure_combine(64, repeats, dtype)
        comb = timed.allgather(comm, (g_big, delta), "calibration (the combine times)")
        g_big, delta = _median([x[0] for x in comb]), _median([x[1] for x in comb])
        gamma = max(0.0, (g_big - delta) / sizes[-1])
        vals = timed.bcast(comm, (alpha, beta, gamma, delta) if rank == 0 else None, 0, "calibration (the result)")
    finally:
        c.Free()
    eager = eager_bytes(comm)
    link = LinkParams(*vals, eager=eager, name=f"calibrated ({method})")
    if P >= 2:
        over = measure_overhead(comm, link)
        link = LinkParams(*vals, overhead=timed.bcast(comm, over, 0, "calibration (the overhead)"), eager=eager,
                          name=link.name)
        if piece:
            pc, rb = timed.bcast(comm, measure_ring(comm, link, repeats, dtype), 0, "calibration (the ring)")
            link = LinkParams(*vals, overhead=link.overhead, piece=pc, eager=eager, ring_beta=rb,
                              ring_k_min=float(min(RING_BLOCKS)) if rb > 0 else 0.0, name=link.name)
            if ring_big and rb > 0:
                small = float(_ring_state_bytes(RING_STATE_BYTES, RING_BLOCKS, dtype))
                rbb, big = timed.bcast(comm, measure_ring_big(comm, link, ring_big, dtype=dtype), 0,
                                       "calibration (the large ring)")
                if rbb > 0 and big > small:
                    link = replace(link, ring_beta_big=rbb, ring_bytes=small, ring_big=big)
            if ring_big and ring_big > sizes[-1]:  # the big-state shift and combine (tree, allgather, exscan)
                bb, gb = measure_big(comm, int(ring_big), link.alpha, link.delta, dtype=dtype)
                link = replace(link, beta_big=bb, gamma_big=gb, shift_bytes=float(sizes[-1]),
                               big_bytes=float(ring_big))
            link = replace(link, ptree_beta=comm.bcast(measure_ptree(comm, link, repeats, dtype), root=0))
    return link
