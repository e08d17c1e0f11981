"""The message schedules (hpczeco.collectives.schedule) and the pipelined tree ``ptree`` (hpczeco.collectives.pipetree).

* The programs of ptree and the ring, run in one process (:func:`run_local`), equal the float64 fold on fresh
  random inputs at every P from 1 to 40 and a few larger ones, every piece count, with and without ``initial``;
  so does the MPI executor itself (:class:`ScheduleHandle`) with every rank in one process over a loopback
  transport, forward and reverse, with the fused kernel and the array fallback.
* Their structure: one ordered stream of messages per directed pair, at most three state pieces in and out per
  position and piece, the tree's depth.
* Under MPI (n = 2..5): the ring, tree and ptree handles send exactly the messages (destination, bytes, order)
  their schedules list, so the simulator (``hpczeco simulate``) runs the library's own message order.
* At 7 and 8 ranks (a subprocess mpiexec): every topology equals the fold (tests/scan_many_ranks.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hpczeco.collectives import scan, schedule
from hpczeco.collectives.kernels import fold_reference
from hpczeco.collectives.pipetree import run_local
from hpczeco.collectives.transport import HostTransport, Transport

HERE = Path(__file__).resolve().parent


def _pairs(rng, P, R, V):
    a = [rng.uniform(0.0, 1.0, R) for _ in range(P)]
    for x in a:
        x[0] = 1.0  # an exact one and an exact zero among the decays
        x[-1] = 0.0 if R > 1 else x[-1]
    S = [rng.standard_normal((R, V)) for _ in range(P)]
    return a, S


@pytest.mark.parametrize("topology", ["ptree", "ring"])
def test_programs_equal_the_fold(rng, topology):
    for P in list(range(1, 41)) + [63, 64, 65, 100, 257]:
        R, V = 7, 2
        a, S = _pairs(rng, P, R, V)
        init = rng.standard_normal((R, V))
        ks = sorted({1, 2, R, int(rng.integers(1, R + 1))}) if P <= 40 else [1, 3]
        for k in ks:
            for initial in (None, init):
                want = fold_reference(list(zip(a, S)), initial)
                got = run_local(schedule.programs(topology, P, k), a, S, k, initial)
                for p in range(P):
                    np.testing.assert_allclose(got[p], want[p], rtol=1e-12, atol=1e-12,
                                               err_msg=f"{topology} P={P} k={k} pos={p} init={initial is not None}")


def test_ptree_structure():
    for P in list(range(1, 70)) + [128, 255, 256, 1000, 1024]:
        t = schedule.inorder_tree(P)
        seen, stack, v = [], [], t.root  # in-order traversal: left subtree, node, right subtree
        while stack or v >= 0:
            while v >= 0:
                stack.append(v)
                v = t.left[v]
            v = stack.pop()
            seen.append(v)
            v = t.right[v]
        assert seen == list(range(P)), P
        assert max(t.depth) == (P.bit_length() - 1), P  # balanced: depth floor(log2 P)
        for v in range(P):
            assert t.lo[v] <= v < t.hi[v]
            for c in (t.left[v], t.right[v]):
                if c >= 0:
                    assert t.parent[c] == v and t.lo[v] <= t.lo[c] and t.hi[c] <= t.hi[v]
        progs = schedule.ptree_programs(P, 3)
        counts = schedule.message_counts(progs)
        assert counts["max_in"] <= 9 and counts["max_out"] <= 9  # three pieces (of three) each way at most
        # every directed pair: the receiver posts exactly what the sender sends, in the same order
        sent: dict[tuple[int, int], list] = {}
        for prog in progs:
            for op in prog.sends():
                sent.setdefault((prog.pos, op[3]), []).append(op[2])
        posted: dict[tuple[int, int], list] = {}
        for prog in progs:
            for op in prog.recvs:
                posted.setdefault((op[3], prog.pos), []).append(op[2])
        assert sent == posted, P
    # two positions: ptree is the ring's one hop
    assert [p.sends() for p in schedule.ptree_programs(2, 4)] == [p.sends() for p in schedule.ring_programs(2, 4)]


class _Req:
    def __init__(self, done: bool = False):
        self.done = done

    def test(self) -> bool:
        return self.done

    def wait(self) -> None:
        assert self.done, "a loopback receive never matched (the schedule waits on a message nobody sends)"


class LoopbackTransport(Transport):
    """``P`` ranks in one process: a send is copied into the receive posted first for its (source, destination,
    tag), or kept until one is posted (messages of one channel match in order, as in MPI)."""

    name = "loopback"

    def __init__(self, net: dict, rank: int, size: int):  # no communicator
        self.comm, self.rank, self.size, self.net = None, rank, size, net

    @property
    def xp(self):
        return np

    def isend(self, buf, dest, tag):
        key = (self.rank, dest, tag)
        waiting = self.net.setdefault(("recv",) + key, [])
        if waiting:
            target, req = waiting.pop(0)
            target[...] = buf
            req.done = True
        else:
            self.net.setdefault(("sent",) + key, []).append(np.array(buf, copy=True))
        return _Req(True)

    def irecv(self, buf, source, tag):
        key = (source, self.rank, tag)
        sent = self.net.setdefault(("sent",) + key, [])
        if sent:
            buf[...] = sent.pop(0)
            return _Req(True)
        req = _Req()
        self.net.setdefault(("recv",) + key, []).append((buf, req))
        return req

    def allgather(self, sendbuf, recvbuf):  # pragma: no cover - not used by ptree
        raise NotImplementedError


@pytest.mark.parametrize("fused", [True, False])
def test_executor_in_one_process(rng, monkeypatch, fused):
    """The MPI executor itself (ScheduleHandle: its compiled ops, readiness, progress) at P = 1..40 and a few larger,
    every rank in this process over a loopback transport, forward and reverse, with and without initial, with the
    fused kernel and with the array fallback (what CuPy arrays take)."""
    from hpczeco.collectives import kernels
    from hpczeco.collectives.context import BufferPool
    from hpczeco.collectives.handle import ScanPlan
    from hpczeco.collectives.pipetree import ScheduleHandle

    if not fused:
        monkeypatch.setattr(kernels, "_FUSED", False)
    pool = BufferPool(1 << 26)
    for P in list(range(2, 41)) + [64, 100]:
        R, V = 6, 3
        a, S = _pairs(rng, P, R, V)
        init = rng.standard_normal((R, V))
        for k in sorted({1, R, int(rng.integers(1, R + 1))}):
            for reverse in (False, True):
                for initial in (None, init):
                    order = list(range(P))[::-1] if reverse else list(range(P))
                    want = fold_reference([(a[q], S[q]) for q in order], initial)
                    net: dict = {}
                    progs = schedule.ptree_programs(P, k)
                    handles = []
                    for rank in range(P):
                        pos = P - 1 - rank if reverse else rank
                        tr = LoopbackTransport(net, rank, P)
                        plan = ScanPlan(tr, np, a[rank], S[rank], initial if pos == 0 else None, (R, V), pos, P,
                                        reverse, 16, pool, None)
                        handles.append(ScheduleHandle(plan, progs, k, "ptree"))
                    for _ in range(10 * P * k + 10):
                        if all([h.test() for h in handles]):
                            break
                    for rank, h in enumerate(handles):
                        pos = P - 1 - rank if reverse else rank
                        np.testing.assert_allclose(h.wait(), want[pos], rtol=1e-12, atol=1e-12,
                                                   err_msg=f"P={P} k={k} reverse={reverse} rank={rank} "
                                                           f"init={initial is not None} fused={fused}")
                    assert not any(v for v in net.values()), "messages left unmatched"


class RecordingTransport(HostTransport):
    """A host transport that records every send: ``(destination rank, bytes)`` in order."""

    name = "host"

    def __init__(self, comm):
        super().__init__(comm)
        self.sent: list[tuple[int, int]] = []

    def isend(self, buf, dest, tag):
        self.sent.append((int(dest), int(buf.nbytes)))
        return super().isend(buf, dest, tag)


def _schedule_sends(progs, pos, R, V, k, itemsize, rank_of):
    b = schedule.piece_bounds(R, k)
    out = []
    for op in progs[pos].sends():
        _, buf, j, dst = op
        if buf in progs[pos].pairs or buf.startswith(("W", "B")):
            n = R * (V + 1)
        elif j < 0:
            n = R
        else:
            n = (b[j + 1] - b[j]) * V
        out.append((rank_of(dst), n * itemsize))
    return out


@pytest.mark.mpi
def test_handles_send_what_the_schedules_say(comm, rng):
    P, rank = comm.Get_size(), comm.Get_rank()
    R, V = 6, 4
    a = rng.uniform(0.1, 1.0, (1, R))
    S = rng.standard_normal((1, R, V))
    for reverse in (False, True):
        pos = P - 1 - rank if reverse else rank

        def rank_of(q, reverse=reverse):
            return P - 1 - q if reverse else q

        for topo, k in (("ring", 1), ("ring", 4), ("ptree", 1), ("ptree", 3), ("ptree", 6), ("tree", 1),
                        ("serial", 1)):
            tr = RecordingTransport(comm)
            scan(a, S, comm, topology=topo, blocks=k if topo in ("ring", "ptree") else None, reverse=reverse,
                 transport=tr)
            want = _schedule_sends(schedule.programs(topo, P, k), pos, R, V, k, 8, rank_of)
            assert tr.sent == want, f"{topo} k={k} reverse={reverse}: sent {tr.sent}, schedule {want}"


def _mpiexec() -> str | None:
    if os.environ.get("MPIEXEC"):
        return os.environ["MPIEXEC"]
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [7, 8])
def test_every_topology_at_more_ranks(n, rng):
    exe = _mpiexec()
    if exe is None:
        pytest.skip("no mpiexec on PATH (set MPIEXEC)")
    from hpczeco.drivers.mpienv import launch_env

    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [env.get("PYTHONPATH")])])
    seed = int(rng.integers(0, 2**31))
    proc = subprocess.run([exe, "-n", str(n), sys.executable, str(HERE / "scan_many_ranks.py"), str(seed)],
                          env=env, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0 and "scan_many_ranks: ok" in proc.stdout, (
        f"seed {seed}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
