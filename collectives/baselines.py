"""The baseline scans: ``allgather`` (LASP-2) and ``exscan`` (``MPI_Iexscan`` with a user-defined operator).

* ``allgather``: allgather every rank's packed ``[a | S]`` (``MPI_Iallgather``, progressed by the MPI
  library inside ``test``/``wait``; a device transport without a nonblocking allgather completes it
  at start), then fold the prefix before this rank locally.
* ``exscan``: ``MPI_Iexscan`` with a non-commutative op on one packed pair (one contiguous derived
  datatype, so the op sees whole pairs); reverse order runs on the context's rank-reversed
  communicator. The op runs on host memory: device arrays are staged through the host.

Knows nothing about attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hpczeco.base.backend import to_numpy
from mpi4py import MPI

from .context import CommContext
from .handle import ScanHandle, ScanPlan, pair_views
from .kernels import axpy_rows

__all__ = ["AllgatherHandle", "ExscanHandle"]


class AllgatherHandle(ScanHandle):
    """LASP-2 style: allgather packed pairs, fold the prefix before this rank locally."""

    def __init__(self, plan: ScanPlan):
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
        out[...] = pair_views(self.recv[p.rank_of(0)], p.R, p.V)[1]
        for q in range(1, p.pos):
            qa, qS = pair_views(self.recv[p.rank_of(q)], p.R, p.V)
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
            xa, xS = pair_views(xs, R, V)
            ya, yS = pair_views(ys, R, V)
            axpy_rows(xS, ya, yS, yS)  # y <- x o y = (xa ya, ya xS + yS)
            np.multiply(ya, xa, out=ya)

    base = MPI.DOUBLE if dt == np.float64 else MPI.FLOAT
    datatype = base.Create_contiguous(R * (V + 1)).Commit()
    op = MPI.Op.Create(fn, commute=False)
    _EXSCAN_OPS[key] = (op, datatype)
    return op, datatype


class ExscanHandle(ScanHandle):
    """``MPI_Iexscan`` with a user-defined non-commutative op (host memory; device arrays staged)."""

    def __init__(self, plan: ScanPlan, ctx: CommContext):
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
            S = pair_views(self.recv, p.R, p.V)[1]
            res[...] = S if p.xp is np else p.xp.asarray(S)
            res = res.reshape(p.shape)
        p.pool.release(np, self.recv)
        p.release_all()
        return res
