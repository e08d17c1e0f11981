"""The executor of message schedules (:mod:`.schedule`) on real buffers, and through it the pipelined tree ``ptree``.

:class:`ScheduleHandle` runs one position's :class:`~.schedule.Program` through the
:class:`~.transport.Transport`: every receive is posted at the start, straight into its piece of the result or
of a pooled scratch buffer; each stream of ops then advances in order as far as its inputs have arrived,
inside ``test()`` / ``wait()`` (or a progress thread), like the ring. ``topology="ptree"`` is
:func:`~.schedule.ptree_programs`, Sanders & Traeff's doubly pipelined in-order binary tree, cut into
``blocks`` pieces along the state's rows: ``O(log P + k)`` message stages, at most three state pieces in and
three out per position and piece (the ring: one and one).

:func:`run_local` interprets the programs of all positions in one process (messages handed over in order),
for checking a schedule without MPI. Knows nothing about attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .handle import ScanHandle, ScanPlan
from .kernels import axpy_rows, row_kernel
from .schedule import Program, piece_bounds

__all__ = ["ScheduleHandle", "run_local"]


class ScheduleHandle(ScanHandle):
    """One position's program of a piecewise schedule (``ptree``), executed on the plan's buffers.

    Ops whose inputs are ready run in stream order; a receive completes its piece's readiness. Scratch buffers
    come from the pool and go back when every request is complete."""

    def __init__(self, plan: ScanPlan, programs: Sequence[Program], k: int, topology: str):
        super().__init__(topology, k)
        self.p = plan
        prog = programs[plan.pos]
        self.prog = prog
        R, V = plan.R, plan.V
        self.k = k
        self.b = piece_bounds(R, k)
        xp, tr = plan.xp, plan.tr
        S = plan.S2
        if plan.pos == 0 and plan.init2 is not None:  # initial folded into the first pair
            S = axpy_rows(plan.init2, plan.a2, plan.S2, plan.acquire((R, V)))
        self.bufs: dict[str, Any] = {"S": S, "a": plan.a2}
        if prog.result == "out" or any(op[1] == "out" for op in prog.recvs):
            self.bufs["out"] = plan.result()
        for name in prog.states:
            self.bufs[name] = plan.acquire((R, V))
        for name in prog.decays:
            self.bufs[name] = plan.acquire((R,))
        if prog.pairs:
            raise ValueError(f"{topology}: whole-pair programs run in their own handles, not here")
        self.ready: dict[tuple[str, int], Any] = {}
        for name in prog.inputs:
            for j in range(-1, k):
                self.ready[(name, j)] = True
        self.source: dict[tuple[str, int], int] = {}
        self.recvs: list = []  # every receive (a piece may land straight in the result, with no op after it)
        for _, buf, j, src in prog.recvs:
            req = self.ready[(buf, j)] = tr.irecv(self._view(buf, j), plan.rank_of(src), plan.tag)
            self.source[(buf, j)] = src
            self.recvs.append(((buf, j), req))
        self.sends: list = []
        self.streams = [[self._compile(op) for op in ops] for ops in prog.streams]
        self.heads = [0] * len(self.streams)
        self.xp = xp

    # ---------------------------------------------------------------- ops
    def _view(self, name: str, j: int) -> Any:
        buf = self.bufs[name]
        return buf if j < 0 else buf[self.b[j] : self.b[j + 1]]

    def _compile(self, op: tuple) -> tuple[tuple, Callable[[], None], tuple[str, int] | None]:
        """``(deps, action, produced key)`` of one op."""
        kind = op[0]
        p = self.p
        if kind == "send":
            _, buf, j, dst = op
            view, rank, isend, sends = self._view(buf, j), p.rank_of(dst), p.tr.isend, self.sends

            def send() -> None:
                sends.append(isend(view, rank, p.tag))

            return ((buf, j),), send, None
        if kind == "axpy":
            _, out, X, a, S, j = op
            r0, r1 = self.b[j], self.b[j + 1]
            args = (self._view(X, j), self.bufs[a][r0:r1], self._view(S, j), self._view(out, j))
            kern = row_kernel(*args)

            def axpy() -> None:
                kern(*args)

            return ((X, j), (a, -1), (S, j)), axpy, (out, j)
        if kind == "mul":
            _, out, x, y = op
            xs, ys, os_, multiply = self.bufs[x], self.bufs[y], self.bufs[out], self.p.xp.multiply

            def mul() -> None:
                multiply(xs, ys, out=os_)

            return ((x, -1), (y, -1)), mul, (out, -1)
        raise ValueError(f"op {kind!r} is not run by the piecewise executor")

    def _deps_ready(self, deps: tuple) -> bool:
        ready = self.ready
        for key in deps:
            r = ready.get(key)
            if r is True:
                continue
            if r is None or not r.test():
                return False
            ready[key] = True
        return True

    def _advance(self) -> bool:
        moved = False
        ready = self.ready
        for si, ops in enumerate(self.streams):
            h = self.heads[si]
            n = len(ops)
            while h < n:
                deps, act, made = ops[h]
                if not self._deps_ready(deps):
                    break
                act()
                if made is not None:
                    ready[made] = True
                h += 1
                moved = True
            self.heads[si] = h
        return moved

    def _streams_done(self) -> bool:
        return all(h == len(ops) for h, ops in zip(self.heads, self.streams))

    def _blocking_request(self) -> tuple[tuple[str, int], Any] | None:
        """A receive some stream's next op waits for (key, request), else the first receive not yet complete,
        else None."""
        for h, ops in zip(self.heads, self.streams):
            if h < len(ops):
                for key in ops[h][0]:
                    r = self.ready.get(key)
                    if r is not True and r is not None:
                        return key, r
        for key, _ in self.recvs:
            r = self.ready[key]
            if r is not True:
                return key, r
        return None

    def _recvs_done(self) -> bool:
        ready = self.ready
        for key, req in self.recvs:
            if ready[key] is not True:
                if not req.test():
                    return False
                ready[key] = True
        return True

    # ---------------------------------------------------------------- ScanHandle
    def _waiting_for(self) -> str:
        hit = self._blocking_request()
        if hit is not None:
            (buf, j), _ = hit
            src = self.source[(buf, j)]
            what = "decays" if j < 0 else f"piece {j} of {self.k}"
            return f"rank {self.p.rank_of(src)} (position {src} in scan order; {what} of {buf!r} not received)"
        if not self._streams_done():
            return "a receive (no op can run)"
        return "the ranks this rank sends to (its sends have not completed)"

    def _progress(self) -> bool:
        while self._advance():
            pass
        if not (self._streams_done() and self._recvs_done()):
            return False
        return all(s.test() for s in self.sends)

    def _complete(self) -> None:
        while True:
            while self._advance():
                pass
            hit = self._blocking_request()
            if self._streams_done() and hit is None:
                break
            if hit is None:  # pragma: no cover - a schedule whose streams wait on each other
                raise RuntimeError(f"{self.topology}: position {self.p.pos}'s program cannot progress")
            key, req = hit
            req.wait()
            self.ready[key] = True
        for s in self.sends:
            s.wait()

    def _finish(self) -> Any:
        p = self.p
        if self.prog.result == "first":
            p.release_all()
            return p.first_result()
        out = self.bufs["out"]
        p.release_all()
        return out.reshape(p.shape)


def run_local(programs: Sequence[Program], a: Sequence[Any], S: Sequence[Any], k: int,
              initial: Any = None) -> list[Any]:
    """Run the piecewise programs of every position in this process on ``a[p] [R]``, ``S[p] [R, V]`` (numpy) and
    return every position's ``S_in``; messages go from each send to the matching receive in order. For tests of
    the schedules themselves (the MPI path is :class:`ScheduleHandle`)."""
    import numpy as np

    P = len(programs)
    R, V = S[0].shape
    b = piece_bounds(R, k)
    bufs: list[dict[str, Any]] = []
    for p, prog in enumerate(programs):
        Sp = S[p] if not (p == 0 and initial is not None) else axpy_rows(initial, a[p], S[p], np.empty((R, V)))
        d = {"S": Sp, "a": a[p], "out": np.zeros((R, V), dtype=S[p].dtype)}
        d.update({n: np.full((R, V), np.nan, dtype=S[p].dtype) for n in prog.states})
        d.update({n: np.full(R, np.nan, dtype=S[p].dtype) for n in prog.decays})
        bufs.append(d)

    def view(p: int, name: str, j: int) -> Any:
        return bufs[p][name] if j < 0 else bufs[p][name][b[j] : b[j + 1]]

    ready = [{(n, j) for n in prog.inputs for j in range(-1, k)} for prog in programs]
    inbox: dict[tuple[int, int], list[Any]] = {}  # (src, dst) -> sent pieces in order
    pending = [list(prog.recvs) for prog in programs]
    heads = [[0] * len(prog.streams) for prog in programs]
    moved = True
    while moved:
        moved = False
        for p, prog in enumerate(programs):
            while pending[p]:  # deliver what has arrived, in the order the receives were posted
                _, buf, j, src = pending[p][0]
                q = inbox.get((src, p))
                if not q:
                    break
                view(p, buf, j)[...] = q.pop(0)
                ready[p].add((buf, j))
                pending[p].pop(0)
                moved = True
            for si, ops in enumerate(prog.streams):
                h = heads[p][si]
                while h < len(ops):
                    op = ops[h]
                    kind = op[0]
                    if kind == "send":
                        _, buf, j, dst = op
                        if (buf, j) not in ready[p]:
                            break
                        inbox.setdefault((p, dst), []).append(view(p, buf, j).copy())
                    elif kind == "axpy":
                        _, out, X, av, Sv, j = op
                        if not {(X, j), (av, -1), (Sv, j)} <= ready[p]:
                            break
                        axpy_rows(view(p, X, j), bufs[p][av][b[j] : b[j + 1]], view(p, Sv, j), view(p, out, j))
                        ready[p].add((out, j))
                    elif kind == "mul":
                        _, out, x, y = op
                        if not {(x, -1), (y, -1)} <= ready[p]:
                            break
                        np.multiply(bufs[p][x], bufs[p][y], out=bufs[p][out])
                        ready[p].add((out, -1))
                    else:
                        raise ValueError(f"op {kind!r} is not run by the piecewise executor")
                    h += 1
                    moved = True
                heads[p][si] = h
    stuck = [p for p in range(P) if pending[p] or any(h < len(s) for h, s in zip(heads[p], programs[p].streams))]
    if stuck or any(inbox.values()):
        raise RuntimeError(f"schedule did not complete: positions {stuck} stuck, "
                           f"{sum(len(v) for v in inbox.values())} messages never received")
    res = []
    for p, prog in enumerate(programs):
        if prog.result == "first":
            res.append(np.zeros((R, V)) if initial is None else initial.copy())
        else:
            res.append(bufs[p]["out"])
    return res
