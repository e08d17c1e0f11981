"""DAAF attention over MPI: the sequence split across ranks, or the heads split across ranks.

Sequence mode (``mode="sequence"``): rank ``p`` holds tokens ``[s_p, s_p + n_p)`` of ``q, k, v``
(``[B, n_p, H, *]``, rank order, uneven or empty slices allowed; ``sum n_p = plan.T``). Every rank
holds the same plan. Steps:

1. collective validation (shapes, dtypes, NaN, plan and options equal on every rank);
2. halo exchange of the previous ``W = local_window`` keys/values (``collectives.halo.halo_exchange``,
   possibly from several earlier ranks);
3. one ``allgather_v`` of the key-region rows of ``[q | k | v]``;
4. non-key queries: local band from ``[halo | own]`` plus the gathered key-region keys before it;
5. key-region queries attend to every earlier key, which lives on many ranks: each rank computes
   the unnormalised online-softmax partial ``(m, l, acc)`` of every key-region query against its
   *own* keys, an ``allreduce(max)`` of ``m`` aligns them, and a ``reduce_scatter_v(sum)`` of
   ``[l | acc]`` hands each query's merged sum to the rank that owns it.

The result equals single-rank :func:`hpczeco.daaf.attention` up to summation order.

Heads mode (``mode="heads"``): every rank holds the whole sequence for its own heads
(``[B, T, H_p, *]``; see :func:`head_range`); attention is local after the collective validation.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..base.backend import is_device_array
from ..collectives.agree import collective_check, local_error
from ..collectives.halo import allgather_v, allreduce, gather_lengths, halo_exchange, reduce_scatter_v
from .attention import QUERY_BLOCK, attention, check_qkv, resolve_scale
from .kernels import causal_rows, finalize, local_rows
from .planner import Plan

__all__ = ["distributed_attention", "sequence_range", "head_range", "plan_fingerprint", "MODES"]

MODES = ("sequence", "heads")


def _split(n: int, size: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def sequence_range(T: int, comm) -> tuple[int, int]:
    """This rank's token range ``[start, end)`` of an even split of ``T`` tokens over ``comm``."""
    size, rank = (1, 0) if comm is None else (comm.Get_size(), comm.Get_rank())
    return _split(int(T), size, rank)


def head_range(H: int, comm) -> tuple[int, int]:
    """This rank's head range ``[start, end)`` of an even split of ``H`` heads (may be empty)."""
    size, rank = (1, 0) if comm is None else (comm.Get_size(), comm.Get_rank())
    return _split(int(H), size, rank)


def plan_fingerprint(plan: Plan) -> str:
    """A short digest of what the kernels use (``T``, ``local_window``, the key-region mask)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{plan.T}/{plan.local_window}/".encode())
    h.update(np.packbits(plan.global_mask).tobytes())
    return h.hexdigest()


def distributed_attention(q: Any, k: Any, v: Any, plan: Plan, comm, scale: float | None = None,
                          mode: str = "sequence") -> Any:
    """DAAF attention of a sequence distributed over ``comm`` (collective; see the module docstring).

    ``mode="sequence"``: ``q, k: [B, n_p, H, D]``, ``v: [B, n_p, H, Dv]`` this rank's token slice ->
    ``o: [B, n_p, H, Dv]``. ``mode="heads"``: ``[B, T, H_p, *]`` this rank's heads -> ``[B, T, H_p, Dv]``.
    Every rank raises the same ``ValueError``/``TypeError`` when any rank's input is bad.
    """

    def check() -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a hpczeco.daaf.Plan, got {type(plan).__name__}")
        check_qkv(q, k, v, plan.T if mode == "heads" else None)
        resolve_scale(scale, q.shape[-1])
        if mode == "sequence" and is_device_array(q):
            raise TypeError("sequence mode runs on the CPU (numpy arrays); use mode='heads' for CuPy arrays")

    err = local_error(check)
    agree: dict[str, Any] = {}
    if err is None:
        agree = {"mode": mode, "plan": plan_fingerprint(plan), "dtype": str(q.dtype), "B": q.shape[0],
                 "D": q.shape[-1], "Dv": v.shape[-1], "scale": scale}
        agree["H" if mode == "sequence" else "T"] = q.shape[2 if mode == "sequence" else 1]
    collective_check(comm, "distributed_attention", err, agree)
    if mode == "heads":
        return attention(q, k, v, plan, scale)

    lengths = gather_lengths(q.shape[1], comm)
    if sum(lengths) != plan.T:  # every rank has the same lengths: the same error everywhere
        raise ValueError(f"distributed_attention: the slices hold {sum(lengths)} tokens {lengths} "
                         f"but the plan covers T={plan.T}")
    return _sequence_attention(q, k, v, plan, comm, resolve_scale(scale, q.shape[-1]), lengths)


def _sequence_attention(q, k, v, plan: Plan, comm, scale: float, lengths: list[int]) -> np.ndarray:
    me = 0 if comm is None else comm.Get_rank()
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    s, e = int(starts[me]), int(starts[me + 1])
    B, n, H, D = q.shape
    Dv = v.shape[-1]
    W = plan.local_window
    dt = np.float64 if q.dtype == np.float64 else np.float32
    g = plan.global_mask

    # 2. halo of [k | v]: the W rows before my slice (from as many earlier ranks as needed)
    kv = np.concatenate([k, v], axis=-1).astype(dt, copy=False)
    halo = halo_exchange(kv, W, comm, axis=1)
    h = halo.shape[1]
    kv_loc = np.concatenate([halo, kv], axis=1)  # positions [s - h, e)
    kh = np.ascontiguousarray(kv_loc[..., :D].transpose(0, 2, 1, 3))
    vh = np.ascontiguousarray(kv_loc[..., D:].transpose(0, 2, 1, 3))

    # 3. key-region rows of [q | k | v] from every rank
    gpos = np.flatnonzero(g)
    mine = np.flatnonzero(g[s:e])
    qkv_g = allgather_v(np.concatenate([q[:, mine].astype(dt, copy=False), kv[:, mine]], axis=-1), comm, axis=1)
    qg = np.ascontiguousarray(qkv_g[..., :D].transpose(0, 2, 1, 3))
    kg = np.ascontiguousarray(qkv_g[..., D : 2 * D].transpose(0, 2, 1, 3))
    vg = np.ascontiguousarray(qkv_g[..., 2 * D :].transpose(0, 2, 1, 3))

    out = np.empty((B, H, n, Dv), dtype=dt)
    qh = np.ascontiguousarray(q.transpose(0, 2, 1, 3), dtype=dt)
    kglobal = g[s - h : e]
    # 4. non-key queries of my slice
    ng = np.flatnonzero(~g[s:e]) + s
    for b0 in range(s, e, QUERY_BLOCK):
        r = ng[np.searchsorted(ng, b0) : np.searchsorted(ng, b0 + QUERY_BLOCK)]
        if len(r):
            st = local_rows(qh[:, :, r - s], r, kh, vh, s - h, kglobal, kg, vg, gpos, W, scale)
            out[:, :, r - s] = finalize(st)

    # 5. key-region queries: partials against my own keys, merged on the owner
    G = len(gpos)
    m = np.full((B, H, G), -np.inf, dtype=dt)
    l = np.zeros((B, H, G), dtype=dt)
    acc = np.zeros((B, H, G, Dv), dtype=dt)
    first = int(np.searchsorted(gpos, s))  # queries before my slice see none of my keys
    for c in range(first, G, QUERY_BLOCK):
        rows = slice(c, min(G, c + QUERY_BLOCK))
        st = causal_rows(qg[:, :, rows], gpos[rows], kh[:, :, h:], vh[:, :, h:], s, scale)
        m[:, :, rows], l[:, :, rows], acc[:, :, rows] = st.m, st.l, st.acc
    if G:
        m_all = allreduce(m, comm, "max")  # finite: each query's owner holds its own key
        alpha = np.exp(m - m_all)  # 0 where this rank had no key for the query
        packed = np.concatenate([(l * alpha)[..., None], acc * alpha[..., None]], axis=-1)
        counts = [int(g[starts[p] : starts[p + 1]].sum()) for p in range(len(lengths))]
        merged = reduce_scatter_v(packed, counts, comm, axis=2)
        out[:, :, mine] = merged[..., 1:] / merged[..., :1]
    return out.transpose(0, 2, 1, 3).astype(q.dtype, copy=False)
