"""The tree scan: recursive doubling (Hillis-Steele) on packed pairs, any number of ranks.

``ceil(log2 P)`` rounds; in round ``d`` position ``i`` sends its window aggregate ``(a, S)``
(packed ``[a | S]``) to ``i + d`` and folds the one from ``i - d`` in on the left (order preserved).
Sends ``m (1 + 1/V)`` bytes per round. Knows nothing about attention.
"""

from __future__ import annotations

from typing import Any

from .handle import ScanHandle, ScanPlan, pair_views
from .kernels import axpy_rows

__all__ = ["TreeHandle"]


class TreeHandle(ScanHandle):
    """Recursive doubling on packed ``[a | S]`` window aggregates, ``ceil(log2 P)`` rounds.

    The exclusive result is kept unpacked: its state in the result buffer, its decay apart; it is
    never sent, so it starts as the identity ``(1, 0)`` and folds each received window in.
    """

    def __init__(self, plan: ScanPlan):
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
        ta, tS = pair_views(T, R, V)
        if p.pos + 2 * d < p.P:  # the partial is sent again: partial <- T o partial
            new = self._packed_buffer("spare")
            na, nS = pair_views(new, R, V)
            pa, pS = pair_views(self.partial, R, V)
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
