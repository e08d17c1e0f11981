"""`hpczeco demo`: the main job of `make run` (run it under ``mpiexec -n 4``).

In one MPI job, on the default corpus (this Python's standard-library sources, present offline):

1. a ZeCO training run of a small GLA language model in PyTorch on the CPU (``hpczeco train``: the
   sequence split over the ranks, ring All-Scan), checkpointed to HDF5 (skipped, in one line, where PyTorch
   is not installed);
2. a second run that resumes from that checkpoint and carries on;
3. a short ring-vs-tree comparison of the scan topologies (with the baselines and the cost model);
4. a DAAF prefill of a text drawn from the same corpus (plan summary and time to first token).

It ends with a summary of what it did and where its files are (``--out``, default ``runs/main``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path


def _parser(prog: str) -> argparse.ArgumentParser:
    from hpczeco.collectives.names import TOPOLOGIES

    from .helpfmt import HelpFormatter
    from .options import int_range

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", default="runs/main", help="folder for logs, checkpoints, results (default runs/main)")
    ap.add_argument("--steps", type=int_range(1), default=6, help="steps of the first training run (default 6)")
    ap.add_argument("--resume-steps", type=int_range(1), default=4, help="steps the resumed run adds (default 4)")
    ap.add_argument("--seq", type=int_range(1), default=2048,
                    help="tokens per training sequence over all ranks (--quick: 512)")
    ap.add_argument("--topology", default="ring", choices=TOPOLOGIES,
                    help="scan topology of the training run (default ring)")
    ap.add_argument("--quick", action="store_true", help="smaller everything (for tests)")
    return ap


def _say(comm, msg: str) -> None:
    if comm.Get_rank() == 0:
        print(f"\n=== {msg}", flush=True)


def main(argv: list[str] | None = None, prog: str = "hpczeco demo") -> int:
    args = _parser(prog).parse_args(argv)
    from mpi4py import MPI

    from . import bench_scan, prefill, train
    from .console import warn_oversubscribed
    from .data import read_corpus

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    from .files import check_output_dir, rank0_verdict
    from .mpienv import launcher_mismatch

    mismatch = launcher_mismatch(P)
    if mismatch:  # each process would run the whole demo alone, as rank 0 of its own world
        raise ValueError(mismatch)
    rank0_verdict(comm, lambda: check_output_dir(args.out, "--out"), "demo: checking --out")
    over = warn_oversubscribed(comm, prog)  # collective; printed once for the whole demo
    out = Path(args.out)
    ckpt, log = out / "ckpt", out / "train.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for old in [log, *ckpt.glob("*.h5")] if ckpt.exists() else [log]:
            old.unlink(missing_ok=True)
    from hpczeco.collectives import timed

    timed.Barrier(comm, "demo: rank 0 prepares the output folder")
    t_start = time.perf_counter()
    seq = 512 if args.quick else args.seq
    common = ["--seq", str(seq), "--topology", args.topology, "--ckpt-dir", str(ckpt), "--log", str(log),
              "--corpus-bytes", str(1 << 20), "--device", "cpu"]
    if args.quick:
        common += ["--d-model", "32", "--layers", "1", "--heads", "2"]

    _say(comm, f"1/4 training on {P} ranks: {args.steps} steps, {seq} tokens per step split over the ranks "
               f"({args.topology} All-Scan), checkpoint every {max(1, args.steps // 2)} steps")
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:
        _say(comm, "training skipped: PyTorch is not installed (pip install torch; `make run` installs torch==2.13.0)")
    if have_torch:
        rc = train.main([*common, "--steps", str(args.steps), "--ckpt-every", str(max(1, args.steps // 2))])
        if rc:
            return rc
        total = args.steps + args.resume_steps
        _say(comm, f"2/4 resuming from the newest checkpoint in {ckpt} and training to step {total}")
        rc = train.main([*common, "--steps", str(total), "--ckpt-every", str(max(1, args.resume_steps)), "--resume"])
        if rc:
            return rc

    _say(comm, "3/4 ring vs tree (and allgather / serial / exscan) scans of 16 KiB and 1 MiB states")
    sizes = "16K" if args.quick else "16K,1M"
    rc = bench_scan.main(["--sizes", sizes, "--repeats", "5", "--warmup", "1", "--time-limit", "1",
                          "--blocks", "4", "--ring-big", "0", "--out", str(out / "scan")])
    if rc:
        return rc

    _say(comm, "4/4 DAAF prefill of a text from the same corpus")
    text_file = out / "prefill_text.txt"
    if rank == 0:
        data, source = read_corpus(None, max_bytes=(24 if args.quick else 96) * 1024)
        text_file.write_text(data.decode("utf-8", errors="replace"))
    timed.Barrier(comm, "demo: rank 0 writes the text to prefill")
    rc = prefill.main([str(text_file), "--layers", "1" if args.quick else "2"])
    if rc:
        return rc

    if rank == 0:
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        losses = [e["loss"] for e in events if e.get("event") == "step"]
        print("\n=== summary")
        print(f"ranks: {P}; wall time {time.perf_counter() - t_start:.1f} s"
              + (f" (oversubscribed: {over.ranks} ranks on {over.cores} core(s) of {over.host}: the timings and "
                 "the scan ranking show the sharing of cores)" if over else ""))
        if losses:
            print(f"training: {len(losses)} steps ({args.steps} + {args.resume_steps} resumed), "
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if log.exists():
            print(f"checkpoints: {', '.join(sorted(p.name for p in ckpt.glob('*.h5')))} in {ckpt}")
            print(f"training log: {log} (loss curve: {log.with_suffix('.png')})")
        print(f"scan comparison: {out / 'scan'} (table above; JSON/CSV/PNG there)")
        print(f"DAAF prefill text: {text_file}")
    return 0
