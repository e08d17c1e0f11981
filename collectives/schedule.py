"""Message schedules of the scans as data: what every position sends, receives and combines, piece by piece.

A schedule is built once (pure arithmetic: no MPI, no arrays) and consumed twice: by the MPI executor
(:class:`.pipetree.ScheduleHandle`, which runs ``ptree`` on real buffers through the transport) and by the
simulator (``hpczeco simulate``, which runs the same programs on a SimGrid platform). For ``ring``,
``serial``, ``tree`` and ``allgather`` the MPI code has its own handles (:mod:`.ring`, :mod:`.tree`,
:mod:`.baselines`); their programs here send the same messages in the same order (checked by
``tests/test_pipetree.py`` against a transport that records what the handles send).

A :class:`Program` is one position's part (positions are ranks in scan order). Buffers are named:
``"S"`` (this position's state ``[R, V]``, with ``initial`` folded in at position 0), ``"a"`` (its decays
``[R]``), ``"out"`` (the result ``S_in``), and scratch states or decay vectors. A state buffer is cut into the
schedule's ``k`` pieces of rows (:func:`piece_bounds`); piece ``-1`` is a whole decay vector. Ops (tuples):

* ``("recv", buf, j, src)``: piece ``j`` of ``buf`` arrives from position ``src`` (every receive of a program is
  posted at the start, in the order of :attr:`Program.recvs`);
* ``("send", buf, j, dst)``: send piece ``j`` of ``buf`` to position ``dst`` once it is ready;
* ``("axpy", out, X, a, S, j)``: ``out[j] = a[j] * X[j] + S[j]`` (the operator's state part on piece ``j``);
* ``("mul", out, x, y)``: decays ``out = x * y``;
* ``("copy", out, x, j)``: ``out[j] = x[j]``;
* ``("sync",)``: wait until every send this position posted so far has completed (a round boundary).

:attr:`Program.streams` are op lists that each run in order, every op as soon as its inputs are ready (a
received piece, or one computed earlier in any stream of the position); streams advance independently, which
is what lets the pipelined tree's up-sweep and down-sweep overlap ("doubly pipelined"). Every directed pair of
positions carries one stream of messages in one order, so messages match their receives by order alone (one
tag per scan).

``ptree`` (:func:`ptree_programs`) is Sanders & Traeff's doubly pipelined in-order binary tree scan for the
non-commutative operator: positions are the nodes of a balanced binary tree in in-order (node ``v``'s subtree
is the range ``[lo, hi)`` with ``lo <= v < hi``, so every subtree is a contiguous range of positions). Up-sweep:
``v`` receives its left subtree's aggregate ``A_L`` and its right subtree's ``A_R``, forms
``U = A_L o x_v`` and sends ``U o A_R`` to its parent. Down-sweep: ``v`` receives ``X``, the fold of the
positions before ``lo``, forwards it to its left child, keeps ``X o A_L`` (its exclusive result) and sends
``X o U`` to its right child. The decays of the aggregates travel once per edge as one small message ahead of
the state pieces; the state pieces (``m / k`` bytes each) flow through both sweeps as they do through the ring.
Messages nobody needs are not sent: the right spine (``hi = P``) sends nothing up, the left spine
(``lo = 0``) receives nothing down (its ``X`` is the identity). Knows nothing about attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "Program",
    "Tree",
    "inorder_tree",
    "piece_bounds",
    "ptree_programs",
    "ring_programs",
    "tree_programs",
    "allgather_programs",
    "programs",
    "SCHEDULED",
    "message_counts",
]

#: topologies this module has programs for (the simulator runs these)
SCHEDULED = ("ring", "serial", "tree", "ptree", "allgather")


@dataclass(frozen=True)
class Program:
    """One position's part of a schedule.

    ``recvs``: the receive ops, posted at the start in this order. ``streams``: op lists, each run in order as
    inputs become ready. ``states`` / ``decays``: the scratch buffers the program uses besides ``"S"``, ``"a"``
    and ``"out"`` (``[R, V]`` states and ``[R]`` decay vectors; ``"pair"`` buffers of ``[a | S]``, ``R (V + 1)``
    elements, are whole-message buffers of ``tree``/``allgather``). ``result``: ``"out"``, or ``"first"`` (the
    first position: ``initial`` or zeros). ``inputs``: the buffers ready at the start (every piece)."""

    pos: int
    recvs: tuple[tuple, ...]
    streams: tuple[tuple[tuple, ...], ...]
    states: tuple[str, ...] = ()
    decays: tuple[str, ...] = ()
    pairs: tuple[str, ...] = ()
    result: str = "out"
    inputs: tuple[str, ...] = ("S", "a")

    def sends(self) -> list[tuple]:
        """The send ops in the order the streams list them (each stream's own order is the order they go out)."""
        return [op for s in self.streams for op in s if op[0] == "send"]


def piece_bounds(rows: int, k: int) -> list[int]:
    """Row bounds of ``k`` contiguous pieces of ``rows`` rows (the ring's split): piece ``j`` is rows
    ``[b[j], b[j + 1])``."""
    return [(j * rows) // k for j in range(k + 1)]


@dataclass(frozen=True)
class Tree:
    """A binary tree on positions ``0..P-1`` in in-order: ``parent``, ``left``, ``right`` (-1: none), the range
    ``[lo, hi)`` of each node's subtree, ``depth`` (root 0) and the ``root``."""

    P: int
    root: int
    parent: tuple[int, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    depth: tuple[int, ...]


@lru_cache(maxsize=256)
def inorder_tree(P: int) -> Tree:
    """The balanced in-order binary tree on ``P`` positions: the root of ``[lo, hi)`` is ``(lo + hi) // 2``."""
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    parent, left, right = [-1] * P, [-1] * P, [-1] * P
    lo, hi, depth = [0] * P, [0] * P, [0] * P
    root = P // 2
    todo = [(0, P, -1, 0)]
    while todo:
        a, b, par, d = todo.pop()
        v = (a + b) // 2
        parent[v], lo[v], hi[v], depth[v] = par, a, b, d
        if par >= 0:
            if v < par:
                left[par] = v
            else:
                right[par] = v
        if a < v:
            todo.append((a, v, v, d + 1))
        if v + 1 < b:
            todo.append((v + 1, b, v, d + 1))
    return Tree(P, root, tuple(parent), tuple(left), tuple(right), tuple(lo), tuple(hi), tuple(depth))


def _ptree_decay_senders(t: Tree) -> list[bool]:
    """Which nodes send their subtree's decays up: those whose parent needs them (top-down)."""
    sends = [False] * t.P
    order = sorted(range(t.P), key=lambda v: t.depth[v])
    for v in order:
        l, r, lo = t.left[v], t.right[v], t.lo[v]
        need_aU = sends[v] or (r >= 0 and lo > 0)
        if l >= 0:
            sends[l] = lo > 0 or need_aU  # result X o A_L needs aL; aU = aL * a needs it
        if r >= 0:
            sends[r] = t.parent[v] >= 0 and t.hi[v] < t.P  # v sends U o A_R up: its state part needs aR
    return sends


@lru_cache(maxsize=64)
def ptree_programs(P: int, k: int) -> tuple[Program, ...]:
    """The doubly pipelined in-order binary tree scan (module docstring) in ``k`` pieces, one program per position."""
    _check(P, k)
    t = inorder_tree(P)
    dsend = _ptree_decay_senders(t)
    progs = []
    J = range(k)
    for v in range(P):
        l, r, par, lo, hi = t.left[v], t.right[v], t.parent[v], t.lo[v], t.hi[v]
        up_send = par >= 0 and hi < P
        need_aU = dsend[v] or (r >= 0 and lo > 0)
        need_U = l >= 0 and (up_send or r >= 0)
        Lbuf = "out" if lo == 0 else "L"  # X = identity on the left spine: the result is A_L itself
        Xbuf = "X" if l >= 0 else "out"  # no left subtree: the result is X itself
        aU = "aU" if l >= 0 else "a"
        aUp = "aUp" if r >= 0 else aU
        Ubuf = "U" if l >= 0 else "S"
        states, decays = set(), set()
        recvs: list[tuple] = []
        if l >= 0:
            if dsend[l]:
                recvs.append(("recv", "aL", -1, l))
                decays.add("aL")
            recvs += [("recv", Lbuf, j, l) for j in J]
            if Lbuf != "out":
                states.add(Lbuf)
        if r >= 0 and up_send:
            if dsend[r]:
                recvs.append(("recv", "aR", -1, r))
                decays.add("aR")
            recvs += [("recv", "R", j, r) for j in J]
            states.add("R")
        if lo > 0:
            recvs += [("recv", Xbuf, j, par) for j in J]
            if Xbuf != "out":
                states.add(Xbuf)
        up: list[tuple] = []
        if l >= 0 and need_aU:
            up.append(("mul", "aU", "aL", "a"))
            decays.add("aU")
        if dsend[v]:
            if r >= 0:
                up.append(("mul", "aUp", aU, "aR"))
                decays.add("aUp")
            up.append(("send", aUp, -1, par))
        for j in J:
            if need_U:
                up.append(("axpy", "U", Lbuf, "a", "S", j))  # U = A_L o x_v
                states.add("U")
            if up_send:
                if r >= 0:
                    up += [("axpy", "R", Ubuf, "aR", "R", j), ("send", "R", j, par)]  # U o A_R
                else:
                    up.append(("send", Ubuf, j, par))
        down: list[tuple] = []
        for j in J:
            if lo > 0:  # what the subtrees wait for first, this position's own result last
                if l >= 0:
                    down.append(("send", "X", j, l))
                if r >= 0:
                    down += [("axpy", "D", Xbuf, aU, Ubuf, j), ("send", "D", j, r)]  # X o U
                    states.add("D")
                if l >= 0:
                    down.append(("axpy", "out", "X", "aL", "L", j))  # result X o A_L
            elif r >= 0:
                down.append(("send", Ubuf, j, r))  # X = identity: X o U = U
        streams = tuple(s for s in (tuple(up), tuple(down)) if s)
        progs.append(Program(v, tuple(recvs), streams, tuple(sorted(states)), tuple(sorted(decays)),
                             result="first" if v == 0 else "out"))
    return tuple(progs)


@lru_cache(maxsize=64)
def ring_programs(P: int, k: int) -> tuple[Program, ...]:
    """The pipelined ring (:mod:`.ring`) in ``k`` pieces: piece ``j`` lands in ``out``, ``F[j] = a * out[j] + S[j]``
    goes on (``serial`` is ``k = 1``)."""
    _check(P, k)
    progs = []
    for p in range(P):
        recvs = tuple(("recv", "out", j, p - 1) for j in range(k)) if p > 0 else ()
        if p == 0:
            stream = tuple(("send", "S", j, 1) for j in range(k)) if P > 1 else ()
            progs.append(Program(p, recvs, (stream,) if stream else (), result="first"))
        elif p < P - 1:
            ops: list[tuple] = []
            for j in range(k):
                ops += [("axpy", "F", "out", "a", "S", j), ("send", "F", j, p + 1)]
            progs.append(Program(p, recvs, (tuple(ops),), states=("F",)))
        else:
            progs.append(Program(p, recvs, ()))
    return tuple(progs)


@lru_cache(maxsize=64)
def tree_programs(P: int) -> tuple[Program, ...]:
    """Recursive doubling (:mod:`.tree`) on packed pairs ``[a | S]`` (one whole message per round): round ``d``
    sends the window aggregate to ``pos + 2^d``, receives from ``pos - 2^d``, and folds what it received into the
    window (when that is sent again) and into the result; a round starts when the previous one's messages
    completed. Its ops act on whole pairs (piece 0): a program for the message order and the costs (the data
    path is :class:`.tree.TreeHandle`)."""
    _check(P, 1)
    rounds = (P - 1).bit_length()
    progs = []
    for p in range(P):
        recvs: list[tuple] = []
        ops: list[tuple] = []
        pairs = ["W0", "out"]  # the result keeps its decays too (its own, never sent)
        win, got = "W0", False
        for d in range(rounds):
            s = 1 << d
            if p - s >= 0:
                recvs.append(("recv", f"T{d}", 0, p - s))
                pairs.append(f"T{d}")
            if p + s < P:
                ops.append(("send", win, 0, p + s))
            if p - s >= 0:
                if p + 2 * s < P:  # the window is sent again: W <- T o W
                    ops.append(("axpy", f"W{d + 1}", f"T{d}", win, win, 0))
                    win = f"W{d + 1}"
                    pairs.append(win)
                ops.append(("axpy", "out", f"T{d}", "out", "out", 0) if got else ("copy", "out", f"T{d}", 0))
                got = True
            ops.append(("sync",))
        progs.append(Program(p, tuple(recvs), (tuple(ops),), pairs=tuple(pairs), result="out" if got else "first",
                             inputs=("W0",)))
    return tuple(progs)


@lru_cache(maxsize=64)
def allgather_programs(P: int) -> tuple[Program, ...]:
    """LASP-2: a ring allgather of packed pairs (the MPI libraries' algorithm for large messages: ``P - 1`` steps,
    each forwarding the block received in the step before), then the local fold of the blocks before this
    position (``pos - 1`` combines and a copy)."""
    _check(P, 1)
    progs = []
    for p in range(P):
        recvs, ops = [], []
        for s in range(P - 1):
            blk_send = (p - s) % P
            blk_recv = (p - s - 1) % P
            recvs.append(("recv", f"B{blk_recv}", 0, (p - 1) % P))
            ops.append(("send", f"B{blk_send}", 0, (p + 1) % P))
        if p > 0:
            ops.append(("copy", "out", "B0", 0))
            for q in range(1, p):
                ops.append(("axpy", "out", "out", f"B{q}", f"B{q}", 0))
        pairs = tuple(f"B{q}" for q in range(P))
        progs.append(Program(p, tuple(recvs), (tuple(ops),), pairs=pairs, result="out" if p > 0 else "first",
                             inputs=(f"B{p}",)))
    return tuple(progs)


def programs(topology: str, P: int, k: int = 1) -> tuple[Program, ...]:
    """The programs of ``topology`` (one of :data:`SCHEDULED`) at ``P`` positions, ``k`` pieces (ring, ptree)."""
    if topology == "ring":
        return ring_programs(P, k)
    if topology == "serial":
        return ring_programs(P, 1)
    if topology == "ptree":
        return ptree_programs(P, k)
    if topology == "tree":
        return tree_programs(P)
    if topology == "allgather":
        return allgather_programs(P)
    raise ValueError(f"no schedule for topology {topology!r} (scheduled: {SCHEDULED})")


def message_counts(progs: Sequence[Program]) -> dict[str, int]:
    """``{"messages": ..., "max_in": ..., "max_out": ...}``: sends in all, and the most state-piece messages
    one position receives / sends (decay messages not counted)."""
    sends = [sum(1 for op in p.sends() if op[2] >= 0) for p in progs]
    recvs = [sum(1 for op in p.recvs if op[2] >= 0) for p in progs]
    return {"messages": sum(len(p.sends()) for p in progs), "max_in": max(recvs), "max_out": max(sends)}


def _check(P: int, k: int) -> None:
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
