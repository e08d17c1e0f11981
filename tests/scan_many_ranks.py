"""Every scan topology against the float64 fold at the rank count it is launched with (``mpiexec -n 7/8 python
tests/scan_many_ranks.py SEED``), for rank counts beyond the suite's 1..5: ptree and the ring at every ``blocks`` in
1..K, the other topologies once, forward and reverse, float32 and float64, with and without ``initial``. Exit status
0 and ``scan_many_ranks: ok`` on rank 0 when every rank's every result matched (run by tests/test_pipetree.py)."""

from __future__ import annotations

import sys

import numpy as np
from hpczeco.collectives import scan
from hpczeco.collectives.kernels import fold_reference
from mpi4py import MPI


def main() -> int:
    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    K, V, lead = 5, 3, (2,)
    A = [rng.uniform(0.0, 1.0, lead + (K,)) for _ in range(P)]
    S = [rng.standard_normal(lead + (K, V)) for _ in range(P)]
    init = rng.standard_normal(lead + (K, V))
    bad = []
    checked = 0
    for reverse in (False, True):
        order = list(range(P))[::-1] if reverse else list(range(P))
        first = order[0] == rank
        for use_init in (False, True):
            ref = fold_reference([(A[q], S[q]) for q in order], init if use_init else None)[order.index(rank)]
            for dtype in (np.float64, np.float32):
                tol = 1e-12 if dtype == np.float64 else 2e-5 * P
                cases = [("ptree", k) for k in range(1, K + 1)] + [("ring", k) for k in range(1, K + 1)]
                cases += [(t, None) for t in ("tree", "allgather", "serial", "exscan", "ptree", "auto")]
                for topo, blocks in cases:
                    out = scan(A[rank].astype(dtype), S[rank].astype(dtype), comm, topology=topo, blocks=blocks,
                               reverse=reverse, initial=init.astype(dtype) if (use_init and first) else None)
                    checked += 1
                    if out.shape != S[rank].shape or out.dtype != dtype or not np.allclose(out, ref, rtol=tol,
                                                                                         atol=tol):
                        bad.append(f"{topo} blocks={blocks} reverse={reverse} initial={use_init} {dtype.__name__}")
    everyone = comm.gather((rank, checked, bad), root=0)
    if rank == 0:
        wrong = [(r, b) for r, _, bs in everyone for b in bs]
        if wrong:
            for r, b in wrong[:20]:
                print(f"scan_many_ranks: rank {r}: {b} differs from the fold", flush=True)
            return 1
        print(f"scan_many_ranks: ok ({P} ranks, {sum(c for _, c, _ in everyone)} results)", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    MPI.COMM_WORLD.Barrier()
    sys.exit(MPI.COMM_WORLD.allreduce(code, op=MPI.MAX))
