"""`hpczeco bench gpu-multi`: device transports, the scans over them and the ZeCO layer on several GPUs.

Run under ``mpirun -n 2`` (one rank per GPU, by local rank). For every device transport (host-staged,
NCCL, CUDA-aware MPI when declared or detected): one raw message of 1 MiB and 16 MiB beside the
All-Scan's data movement alone (per-block receive, combine, send: "transport-ring", 1 and 4 blocks)
and ``scan()`` end to end (ring with 1, 4 and automatic blocks, tree; and the lean form without value
checks). Then the ZeCO layer (``hpczeco.ZeCOGLA``, ring scan) at ``--T`` tokens per GPU, H=16,
K=V=128, bf16: its forward+backward time over one GPU's on the same tokens (default value checks and
``check_values=False``), each phase in profile mode, and the single-GPU pieces. Wall clock after a
device synchronisation and a barrier, per repetition the slowest rank, median.

The correctness of the same transports, scans and layer is checked by
``mpirun -n 2 pytest -m mpi tests/test_gpu_transport.py tests/test_gpu_zeco.py``. Results (rank 0):
``--out``/gpu_multi.json and gpu_multi_timings.csv, rewritten after every row.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from . import benchkit
from .options import int_range

STEM = "gpu_multi"


def build_parser(prog: str) -> argparse.ArgumentParser:
    from hpczeco.collectives.names import DEVICE_TRANSPORT_KINDS

    from .helpfmt import HelpFormatter

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--out", default="runs/gpu_multi", help="folder for the JSON/CSV results")
    p.add_argument("--seed", type=int_range(0), default=None, help="random seed (default: from the clock, printed)")
    p.add_argument("--repeats", type=int_range(1), default=20,
                   help="timed repetitions of the transport and scan timings")
    p.add_argument("--T", type=int_range(1), default=32768, help="tokens per GPU of the ZeCO step")
    p.add_argument("--zeco-repeats", type=int_range(1), default=10, help="timed repetitions of the ZeCO step")
    p.add_argument("--zeco-only", action="store_true", help="only the ZeCO layer step")
    p.add_argument("--zeco-transport", default="auto", choices=DEVICE_TRANSPORT_KINDS,
                   help="device transport of the ZeCO step")
    return p


def main(argv: list[str] | None = None, prog: str = "hpczeco bench gpu-multi") -> int:
    args = build_parser(prog).parse_args(argv)
    reason = benchkit.gpu_missing()
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    from mpi4py import MPI  # noqa: PLC0415

    from .files import check_output_dir, rank0_verdict

    rank0_verdict(MPI.COMM_WORLD, lambda: check_output_dir(args.out, "--out"), f"{prog}: checking --out")
    return run(args)


def _transport_ring(cp, tr, a, S, nb: int, rank: int, P: int) -> None:
    """The All-Scan's data movement alone: per row block receive from rank-1, combine, send to rank+1."""
    R = a.size
    a1, S2 = a.reshape(R), S.reshape(R, S.size // R)
    cuts = [R * j // nb for j in range(nb + 1)]
    inbox, outbox = cp.empty_like(S2), cp.empty_like(S2)
    recvs = [tr.irecv(inbox[cuts[j] : cuts[j + 1]], rank - 1, 200 + j) for j in range(nb)] if rank > 0 else []
    sends = []
    for j in range(nb):
        lo, hi = cuts[j], cuts[j + 1]
        if rank > 0:
            recvs[j].wait()
            if rank < P - 1:
                outbox[lo:hi] = a1[lo:hi, None] * inbox[lo:hi] + S2[lo:hi]
        if rank < P - 1:
            sends.append(tr.isend(outbox[lo:hi] if rank > 0 else S2[lo:hi], rank + 1, 200 + j))
    for q in sends:
        q.wait()


def run(args) -> int:
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    import cupy as cp  # noqa: PLC0415

    lr = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", rank)))
    ndev = cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(lr % ndev).use()
    from hpczeco.collectives import device as D  # noqa: PLC0415
    from hpczeco.collectives import timed  # noqa: PLC0415

    out = Path(args.out)
    seed = timed.bcast(comm, int(args.seed if args.seed is not None else time.time_ns() % 2**31), 0,
                       "bench gpu-multi: the seed")
    rng = np.random.default_rng(seed)
    rec = benchkit.Recorder(out, STEM, rank, info=benchkit.environment(("numpy", "cupy", "mpi4py"), gpu=True))
    rec.info.update(
        seed=seed, ranks=P, devices=timed.gather(comm, lr % ndev, 0, "bench gpu-multi: the devices"),
        mpi=MPI.Get_library_version()[:80],
        mpix_cuda_support=D.mpi_cuda_support(), cuda_aware_env=os.environ.get(D.CUDA_AWARE_ENV),
        cuda_aware_known=D.cuda_aware_known(), nccl=D.nccl_available(),
    )
    rec.say(f"bench gpu-multi: seed {seed} {rec.info}")
    sync = lambda: cp.cuda.Device().synchronize()
    wall = lambda fn, reps=args.repeats, warmup=3: benchkit.host_time(fn, reps, warmup, sync, comm)["median_ms"]

    # every device transport kind but "auto" (which stands for one of them); CUDA-aware MPI where declared or detected
    kinds = [k for k in D.TRANSPORT_KINDS if k != "auto" and (k != "cuda-aware" or D.cuda_aware_known())]
    transports = {}
    for kind in kinds:
        try:
            tr = D.get_device_transport(comm, kind)
            err = None
        except Exception as exc:  # noqa: BLE001
            tr, err = None, f"{type(exc).__name__}: {exc}"
        errs = timed.allgather(comm, err, "bench gpu-multi: the transports")  # used only where every rank has it
        if any(errs):
            rec.say(f"transport {kind}: not available ({[e for e in errs if e][0]})")
        else:
            transports[kind] = tr
    rec.info["transports"] = list(transports)
    rec.info["auto_kind"] = D.resolve_kind(comm, "auto")
    if not args.zeco_only:
        _scan_timings(rec, cp, rng, transports, comm, wall)
    _zeco_timings(rec, cp, args, seed, transports, comm, sync)
    if rank == 0:
        rec.finish()
    timed.Barrier(comm, "bench gpu-multi: rank 0 writes the results")
    return 0


def _scan_timings(rec, cp, rng, transports: dict, comm, wall) -> None:
    """All-Scan ring vs one raw message of the same bytes, per transport, 1 and 16 MiB fp32 states."""
    from hpczeco.collectives.scan import scan  # noqa: PLC0415

    rank, P = comm.Get_rank(), comm.Get_size()
    for mib in (1, 16):
        lead = mib * (1 << 20) // 4 // (128 * 128)
        Sx = cp.asarray(rng.standard_normal((lead, 128, 128)).astype(np.float32))
        ax = cp.asarray(rng.uniform(0.5, 1.0, (lead, 128)).astype(np.float32))
        for kind, tr in transports.items():
            try:
                buf = cp.empty_like(Sx)

                def raw_msg(tr=tr, buf=buf, Sx=Sx):
                    if rank == 0:
                        tr.isend(Sx, 1, 99).wait()
                    elif rank == 1:
                        tr.irecv(buf, 0, 99).wait()

                t_raw = wall(raw_msg)
                res = {}
                for nb in (1, 4):
                    res[("transport-ring", nb)] = wall(
                        lambda tr=tr, nb=nb, ax=ax, Sx=Sx: _transport_ring(cp, tr, ax, Sx, nb, rank, P))
                for topo, blocks in (("ring", 1), ("ring", 4), ("ring", None), ("tree", None), ("ptree", None)):
                    res[(topo, blocks)] = wall(lambda tr=tr, topo=topo, blocks=blocks, ax=ax, Sx=Sx: scan(
                        ax, Sx, comm, topology=topo, blocks=blocks, transport=tr))
                for topo, blocks in (("ring", 1), ("ring", None), ("tree", None)):
                    res[(topo + " lean", blocks)] = wall(lambda tr=tr, topo=topo, blocks=blocks, ax=ax, Sx=Sx: scan(
                        ax, Sx, comm, topology=topo, blocks=blocks, transport=tr, check_values=False, agreed=True))
                rec.timing(f"raw message {mib} MiB [{kind}]", t_raw, GBps=round(mib * 1.048576 / t_raw, 1))
                for (topo, blocks), ms in res.items():
                    rec.timing(f"scan {topo} blocks={blocks} {mib} MiB [{kind}]", ms, x_raw=round(ms / t_raw, 2))
            except Exception as exc:  # noqa: BLE001
                rec.failed(f"scan timings {mib} MiB [{kind}]", exc)


def _zeco_timings(rec, cp, args, seed: int, transports: dict, comm, sync) -> None:
    """The ZeCO layer's forward+backward on P GPUs over one GPU's on the same tokens, and its phases."""
    from hpczeco.collectives import timed  # noqa: PLC0415
    from hpczeco.collectives.lifeline import guard  # noqa: PLC0415
    from hpczeco.gpu import gla as G  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    import hpczeco  # noqa: PLC0415

    rank, P = comm.Get_rank(), comm.Get_size()
    L, H, K, V = args.T, 16, 128, 128
    try:
        cp.zeros(2, dtype="bfloat16")
        zdt, note = "bfloat16", ""
    except Exception:  # noqa: BLE001
        zdt, note = "float16", " (CuPy has no bfloat16 dtype here: ml_dtypes missing)"
    rec.info["zeco_dtype"] = zdt + note
    kind = rec.info["auto_kind"] if args.zeco_transport == "auto" else args.zeco_transport
    wall = lambda fn, warmup=2: benchkit.host_time(fn, args.zeco_repeats, warmup, sync, comm)["median_ms"]
    try:
        r = np.random.default_rng(seed + 1)
        f = lambda *s: cp.asarray(r.standard_normal(s).astype(np.float32)[:, rank * L : (rank + 1) * L]).astype(zdt)
        mine = dict(q=f(1, P * L, H, K), k=f(1, P * L, H, K), v=f(1, P * L, H, V), do=f(1, P * L, H, V))
        g = np.log(1.0 / (1.0 + np.exp(-r.standard_normal((1, P * L, H, K)) - 2.0))).astype(np.float32)
        mine["g"] = cp.asarray(g[:, rank * L : (rank + 1) * L]).astype(zdt)
        del g
        mine = {n: cp.ascontiguousarray(a) for n, a in mine.items()}
        q, k, v, g_, do = (mine[n] for n in ("q", "k", "v", "g", "do"))
        layer = hpczeco.ZeCOGLA(comm, topology="ring", chunk_size=64, transport=transports.get(kind, kind))
        lean = hpczeco.ZeCOGLA(comm, topology="ring", chunk_size=64, transport=transports.get(kind, kind),
                               check_values=False)

        def step(lay):
            lay.forward(q, k, v, g_)
            lay.backward(do)

        def single_step():
            G.chunk_gla(q, k, v, g_)
            G.chunk_gla_bwd(q, k, v, g_, do)

        t_zeco, t_one = wall(lambda: step(layer)), wall(single_step)
        rec.timing(f"ZeCO fwd+bwd {P} GPUs x {L} tokens ({zdt}, {kind})", t_zeco, ratio=round(t_zeco / t_one, 3),
                   target="<=1.05")
        rec.timing(f"one GPU fwd+bwd {L} tokens ({zdt})", t_one)
        t_lean, t_one2 = wall(lambda: step(lean)), wall(single_step)
        rec.timing(f"ZeCO fwd+bwd {P} GPUs, check_values=False ({zdt}, {kind})", t_lean,
                   ratio=round(t_lean / t_one2, 3), one_gpu_ms=round(t_one2, 3), target="<=1.05")
        # where the ZeCO time goes: device-synchronised phases (profile mode), slowest rank per phase
        layer.profile = True
        phases: dict[str, list[float]] = {}
        for _ in range(5):
            sync()
            with guard(comm, "bench gpu-multi: the barrier before a profiled step"):
                comm.Barrier()
            step(layer)
            for d, tm in (("fwd", layer.timings.fwd), ("bwd", layer.timings.bwd)):
                for key, sec in tm.items():
                    phases.setdefault(f"{d}.{key}", []).append(sec * 1e3)
        layer.profile = False
        for key in sorted(phases):
            worst = np.array([np.median(phases[key])])
            timed.Allreduce(comm, worst, MPI.MAX, "bench gpu-multi: the slowest rank's phase")
            rec.timing(f"ZeCO phase {key} (profile mode, slowest rank)", float(worst[0]))
        for name, fn in (("one GPU fwd prepare", lambda: G.chunk_gla_prepare(q, k, v, g_)),
                         ("one GPU fwd", lambda: G.chunk_gla(q, k, v, g_)),
                         ("one GPU bwd", lambda: G.chunk_gla_bwd(q, k, v, g_, do))):
            rec.timing(name + f" {L} tokens", wall(fn, warmup=1))
    except Exception as exc:  # noqa: BLE001
        rec.failed("ZeCO layer step", exc)
