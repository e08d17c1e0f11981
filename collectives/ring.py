"""The pipelined ring All-Scan (the paper's), its unpipelined form ``serial`` (LASP-1), and the whole-state relay.

Ring: the state, viewed as ``[R, V]`` rows with ``R = prod(a.shape)`` (rows of ``K`` for each
leading index; decay ``a`` lines up with the rows), is cut into ``blocks`` contiguous row pieces.
For piece ``j`` a rank posts ``Irecv`` from the previous rank in scan order, combines
``a_j * S_in_j + S_j`` as soon as piece ``j`` lands and ``Isend``\\ s it to the next rank while
piece ``j+1`` is still in flight. The first rank only sends, the last only receives. Only the state
travels (``m`` bytes): ``(P + k - 2)`` message steps of ``m/k``. ``serial`` is the ring with one block.
Pieces land straight in the result buffer; the combined pieces go out of a pooled buffer.

:func:`relay_send` / :func:`relay_recv` move one whole state to the next / from the previous rank
in scan order (blocking): a point-to-point building block for code that runs a relay itself (the ZeCO
layer's LASP-1 baseline is the ``serial`` topology of the scan, not these).
Knows nothing about attention.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from hpczeco.base.checks import check_array
from mpi4py import MPI

from .context import RELAY_TAGS, CommContext, get_context
from .handle import ScanHandle, ScanPlan
from .kernels import axpy_rows, row_kernel
from .selection import check_transport, transport_for
from .transport import Transport
from .watchdog import abort_stalled, poll_until, resolve_timeout

__all__ = ["RingHandle", "relay_recv", "relay_send"]


def _piece_bounds(rows: int, n: int) -> list[int]:
    return [(j * rows) // n for j in range(n + 1)]


class RingHandle(ScanHandle):
    """Pipelined ring (``blocks`` pieces); ``serial`` is the same with one piece.

    Pieces land straight in the result buffer; the combined pieces go out of a pooled buffer.
    """

    def __init__(self, plan: ScanPlan, n: int, topology: str):
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


def _relay_setup(
    buf: Any, comm: MPI.Comm, reverse: bool, transport: Transport | str | None
) -> tuple[CommContext, int, Transport, int]:
    check_array("buf", buf, float_only=False)
    if not buf.flags.c_contiguous:
        raise ValueError("buf must be C-contiguous")
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    ctx = get_context(comm)
    check_transport(transport, buf, ctx.size, ctx.rank)
    pos = ctx.size - 1 - ctx.rank if reverse else ctx.rank
    tr = transport_for(ctx, transport, buf)
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
    ``timeout`` (seconds; None = ``$HPCZECO_COLLECTIVE_TIMEOUT``: by default 600 s, ``0``/``off`` = forever): past
    it, print the sender's rank and call ``MPI_Abort``. None reads the communicator's agreed timeout
    (:mod:`.context`). A sender that left the job before the last library operation this rank began ends the wait
    at once (:mod:`.lifeline`).
    """
    ctx, pos, tr, step = _relay_setup(buf, comm, reverse, transport)
    tmo = ctx.timeout if timeout is None else resolve_timeout(timeout)
    if pos == 0:
        return False
    src = ctx.rank - step
    if tmo is None:
        tr.recv(buf, src, RELAY_TAGS[bool(reverse)])
        return True
    req = tr.irecv(buf, src, RELAY_TAGS[bool(reverse)])
    if not poll_until(req.test, time.monotonic() + tmo, ctx.watch(ctx.ops - 1, "relay_recv")):
        abort_stalled(ctx.pcomm, "relay_recv", f"rank {src} (the previous rank in scan order)", tmo)
    return True


def relay_send(
    buf: Any, comm: MPI.Comm, *, reverse: bool = False, transport: Transport | str | None = None,
    timeout: float | None = None,
) -> None:
    """Send the whole state ``buf`` to the next rank in scan order (blocking); no-op on the last rank.

    ``timeout`` as in :func:`relay_recv` (a large state waits for the receiver to post its receive)."""
    ctx, pos, tr, step = _relay_setup(buf, comm, reverse, transport)
    if pos == ctx.size - 1:
        return
    tmo = ctx.timeout if timeout is None else resolve_timeout(timeout)
    dst = ctx.rank + step
    if tmo is None:
        tr.send(buf, dst, RELAY_TAGS[bool(reverse)])
        return
    req = tr.isend(buf, dst, RELAY_TAGS[bool(reverse)])
    if not poll_until(req.test, time.monotonic() + tmo, ctx.watch(ctx.ops - 1, "relay_send")):
        abort_stalled(ctx.pcomm, "relay_send", f"rank {dst} (the next rank in scan order) to receive", tmo)
