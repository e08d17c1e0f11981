"""The options of ``hpczeco train``: the parser, their checks (collective: a bad option on one rank ends every rank
with the same error) and the output paths (checked by rank 0 before the first collective of the run)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from .config import CONFIGS, make_config

__all__ = ["TOPOLOGIES", "build_parser", "check_args", "parse", "open_outputs", "DESCRIPTION"]

TOPOLOGIES = ("ring", "tree", "allgather", "serial", "exscan", "auto")

DESCRIPTION = """\
Train a GLA language model (flash-linear-attention's architecture, PyTorch) on byte-level text with ZeCO
sequence parallelism x data parallelism over the MPI ranks, checkpointed to HDF5.

`--sp S` consecutive ranks hold each sequence (a contiguous slice each; the GLA layers pass their states along
with the ZeCO All-Scan); the P / S groups of them split the global batch (`--batch` sequences of `--seq`
tokens). Every rank reads its part of the same global stream, so P ranks compute what one process would.
Gradients are summed over all ranks once per step (NCCL, CUDA IPC or MPI: --grad-comm); AdamW with warm-up
and cosine decay, gradient clipping; bf16 autocast with float32 master weights and optimizer states on GPUs.

  mpiexec -n 4 hpczeco train --steps 20                                 CPU, tiny model, SP = 4
  mpiexec -n 4 hpczeco train --sp 2 --batch 2 --dtype float64           SP 2 x DP 2
  srun -n 8 --gpus-per-task=1 hpczeco train --config 1.3b --seq 65536 --sp 2 --batch 4 --ckpt-dir ck
  hpczeco train --config 1.3b --seq 32768 --steps 40 --warmup-steps 10 --bench-json runs/b.json

Rank 0 prints a progress line (loss, grad norm, tokens/s per GPU, MFU, peak memory) and writes the JSON-lines
log (--log), the loss curve (--plot) and checkpoints (--ckpt-dir; --resume continues from the newest valid
one, on any rank count and layout).
"""


class _Parser(argparse.ArgumentParser):
    """Parse errors raise instead of exiting, so that they are agreed over the ranks first."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _OptionError(message)


class _OptionError(ValueError):
    pass


def _tri(value: str) -> str:
    if value not in ("auto", "on", "off"):
        raise argparse.ArgumentTypeError(f"choose auto, on or off, not {value!r}")
    return value


def build_parser(prog: str = "hpczeco train") -> argparse.ArgumentParser:
    from ..helpfmt import HelpFormatter

    ap = _Parser(prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter)
    d = ap.add_argument_group("data")
    d.add_argument("--text", default=None,
                   help="training text: a file, or a folder (its files in name order); default: this Python's "
                   "stdlib *.py sources (offline). Byte-level: token ids are the bytes")
    d.add_argument("--corpus-bytes", type=int, default=8 << 20, help="read at most this many bytes (default 8 MiB)")
    d.add_argument("--seq", type=int, default=1024,
                   help="tokens per sequence, split over the --sp ranks (default 1024)")
    d.add_argument("--batch", type=int, default=0,
                   help="sequences per step over all ranks, split over the DP groups (default 0: one per DP group)")
    m = ap.add_argument_group("model")
    m.add_argument("--config", choices=list(CONFIGS), default="tiny",
                   help="named shape (default tiny: d_model 64, 2 layers, 2 heads, vocab 256; 125m, 340m, 1.3b: "
                   "vocab 32000, heads of 128)")
    m.add_argument("--d-model", type=int, default=None, help="width (default: the config's)")
    m.add_argument("--layers", type=int, default=None, help="blocks (default: the config's)")
    m.add_argument("--heads", type=int, default=None, help="GLA heads, K = V = d_model / heads (default: the config's)")
    m.add_argument("--d-ff", type=int, default=None, help="SwiGLU width (default: fla's rule from d_model)")
    m.add_argument("--vocab", type=int, default=None, help="vocabulary, >= 256 (default: the config's)")
    m.add_argument("--tie-embeddings", action="store_true", help="output head = the embedding (default: untied)")
    m.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: gpu if PyTorch sees CUDA on every rank (and --dtype is not float64), else cpu. gpu: "
                   "one rank per GPU by local rank (several ranks may share one GPU) (default auto)")
    m.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float64"), default="auto",
                   help="auto: bfloat16 on GPUs, float32 on CPUs. bfloat16: autocast with float32 weights, gradients "
                   "and AdamW states; float32/float64: everything in that dtype (float64: CPU only)")
    m.add_argument("--act-ckpt", action="store_true",
                   help="activation checkpointing: recompute projections, gates and MLP in the backward (not the "
                   "GLA mixer)")
    m.add_argument("--compile", action="store_true", help="torch.compile the blocks (the GLA mixer stays eager)")
    o = ap.add_argument_group("optimiser")
    o.add_argument("--steps", type=int, default=20, help="train up to this step (default 20)")
    o.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 0.003)")
    o.add_argument("--lr-warmup", type=int, default=0, help="linear learning-rate warm-up steps (default 0)")
    o.add_argument("--decay-steps", type=int, default=10000,
                   help="cosine decay from the peak to --min-lr over steps --lr-warmup..N, constant after (default "
                   "10000; independent of --steps, so a resumed run follows the same schedule)")
    o.add_argument("--min-lr", type=float, default=0.1, help="final learning rate as a fraction of --lr (default 0.1)")
    o.add_argument("--beta1", type=float, default=0.9, help="AdamW first-moment decay (default 0.9)")
    o.add_argument("--beta2", type=float, default=0.99, help="AdamW second-moment decay (default 0.99)")
    o.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon (default 1e-08)")
    o.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decoupled weight decay (default 0.0)")
    o.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off; default 1.0)")
    o.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order (default 0)")
    p = ap.add_argument_group("parallelism")
    p.add_argument("--sp", type=int, default=0,
                   help="ranks per sequence (ZeCO sequence parallelism); must divide the rank count; the rest is "
                   "data parallel (default 0: all ranks on one sequence group)")
    p.add_argument("--topology", choices=TOPOLOGIES, default="ring",
                   help="ZeCO state scan between the --sp ranks (default ring: the All-Scan)")
    p.add_argument("--blocks", type=int, default=None, help="ring pipeline blocks (default: the cost model's)")
    p.add_argument("--chunk-size", type=int, default=64, help="GLA chunk length of the ZeCO layer (default 64)")
    p.add_argument("--grad-comm", choices=("auto", "nccl", "ipc", "mpi"), default="auto",
                   help="gradient all-reduce: nccl (one GPU per rank), ipc (all ranks on one GPU), mpi (host or "
                   "CUDA-aware); auto picks in that order (default auto)")
    p.add_argument("--bucket-mb", type=int, default=256, help="gradient all-reduce bucket size in MiB (default 256)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="CPU threads per rank for PyTorch and BLAS (default 1: ranks already fill the cores; 0: "
                   "leave as is)")
    c = ap.add_argument_group("output")
    c.add_argument("--log", default=None, help="JSON-lines log file (rank 0)")
    c.add_argument("--plot", default=None, help="loss-curve PNG at the end (default: beside --log, .png)")
    c.add_argument("--ckpt-dir", default=None, help="checkpoint folder (none: no checkpoints)")
    c.add_argument("--ckpt-every", type=int, default=0,
                   help="checkpoint every N steps (default 0: only at the end); with --ckpt-dir there is always one "
                   "at the end")
    c.add_argument("--ckpt-async", type=_tri, default="auto",
                   help="on: rank 0 snapshots to host memory and a background thread writes the file; off: every "
                   "rank writes collectively; auto: on for GPUs (default auto)")
    c.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    c.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --ckpt-dir")
    c.add_argument("--no-progress", action="store_true",
                   help="no progress bar (batch jobs; the bar is shown only when stdout is a terminal)")
    c.add_argument("--print-every", type=int, default=10,
                   help="without a progress bar, print a line every N steps (0: never; default 10)")
    c.add_argument("--quiet", action="store_true", help="print only the summary")
    c.add_argument("--timing-every", type=int, default=0,
                   help="synchronise the GPU between the phases of every N-th step to time forward / backward / "
                   "all-reduce / optimizer (0: never; the CPU is always timed; default 0)")
    c.add_argument("--warmup-steps", type=int, default=2,
                   help="steps left out of the summary figures (compilation, autotuning; default 2)")
    c.add_argument("--bench-json", default=None,
                   help="benchmark mode: write the summary (tokens/s/GPU, MFU, memory, step split) here and print "
                   "one table row (rank 0)")
    c.add_argument("--peak-tflops", type=float, default=790.0,
                   help="dense bf16 TFLOP/s of one GPU for MFU (default 790: H200)")
    c.add_argument("--no-mem-check", action="store_true",
                   help="skip the memory estimate check before training")
    return ap


def check_args(args: argparse.Namespace, ranks: int) -> None:
    """``ValueError`` naming the first bad option (the same on every rank for the same options)."""
    for name in ("seq", "layers", "heads", "d_model", "vocab", "chunk_size", "keep", "bucket_mb"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")
    for name in ("steps", "lr_warmup", "decay_steps", "ckpt_every", "batch", "sp", "print_every", "timing_every",
                 "warmup_steps", "blas_threads"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "clip", "min_lr", "peak_tflops"):
        if not math.isfinite(getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(args, name)}")
    if args.lr <= 0 or not 0 <= args.beta1 < 1 or not 0 <= args.beta2 < 1 or args.eps <= 0 or args.clip < 0:
        raise ValueError("need --lr > 0, 0 <= --beta1, --beta2 < 1, --eps > 0, --clip >= 0")
    if args.weight_decay < 0 or not 0 <= args.min_lr <= 1 or args.peak_tflops <= 0:
        raise ValueError("need --weight-decay >= 0, 0 <= --min-lr <= 1, --peak-tflops > 0")
    if args.resume and not args.ckpt_dir:
        raise ValueError("--resume needs --ckpt-dir")
    if args.vocab is not None and args.vocab < 256:
        raise ValueError(f"--vocab {args.vocab}: the data are bytes, the vocabulary needs at least 256 entries")
    cfg = make_config(args.config, args.d_model, args.layers, args.heads, args.d_ff, args.vocab,
                      True if args.tie_embeddings else None)
    sp = args.sp or ranks
    if ranks % sp:
        raise ValueError(f"--sp {sp} does not divide the {ranks} ranks")
    dp = ranks // sp
    batch = args.batch or dp
    if batch < dp:
        raise ValueError(f"--batch {batch} is smaller than the {dp} data-parallel groups (each needs a sequence)")
    if args.seq < sp:
        raise ValueError(f"--seq {args.seq} is shorter than the {sp} ranks of a sequence (--sp)")
    if args.blocks is not None and args.blocks < 1:
        raise ValueError(f"--blocks must be positive, got {args.blocks}")
    if args.corpus_bytes < args.seq + 1:
        raise ValueError(f"--corpus-bytes {args.corpus_bytes} holds no window of --seq {args.seq} + 1 tokens")
    if args.dtype == "float64" and args.device == "gpu":
        raise ValueError("--dtype float64 runs on the CPU only (hpczeco's GPU GLA kernels have no float64)")
    args.sp, args.batch, args.model = sp, batch, cfg


def parse(argv: list[str] | None, world: Any, prog: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse and check ``argv`` on every rank of ``world`` (collective). A bad option on any rank, or options that
    differ between ranks, end every rank: rank 0 prints the usage and ``prog: error: ...``, all exit with status 2.
    ``--help`` is printed by rank 0 only."""
    from hpczeco.collectives.agree import collective_check
    from hpczeco.collectives.errors import CollectiveInputError

    rank = world.Get_rank()
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser(prog)
    if rank != 0 and any(a in ("-h", "--help") for a in argv):
        raise SystemExit(0)
    err: BaseException | None = None
    args = argparse.Namespace()
    try:
        args = ap.parse_args(argv)
        check_args(args, world.Get_size())
    except ValueError as exc:
        err = ValueError(str(exc))
    try:
        collective_check(world, "option check", err, agree={"argv": argv})
    except CollectiveInputError as exc:
        if rank == 0:
            ap.print_usage(sys.stderr)
        ap.exit(2, f"{prog}: error: {exc}\n" if rank == 0 else None)
    return ap, args


def open_outputs(args: argparse.Namespace, comm) -> Any:
    """Check every output path before the first collective of the run and open the log: the same ``ValueError`` on
    every rank when one is unusable (a missing folder, a directory as ``--log``, a file as ``--ckpt-dir``).

    Only rank 0 writes the log, the plot and (with asynchronous saves) the checkpoint files, so rank 0 checks them --
    it opens ``--log`` for appending and creates ``--ckpt-dir`` -- and broadcasts its verdict (collective over
    ``comm``, honouring the collective timeout). Returns the open log on rank 0 (None elsewhere or without
    ``--log``)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    log, err = None, None
    if rank == 0:
        try:
            for opt, path in (("--log", args.log), ("--plot", args.plot), ("--bench-json", args.bench_json)):
                if not path:
                    continue
                if os.path.isdir(path):
                    raise ValueError(f"{opt} {path} is a directory; give a file name")
                parent = os.path.dirname(os.path.abspath(path))
                if not os.path.isdir(parent):
                    raise ValueError(f"{opt} {path}: the folder {parent} does not exist")
            if args.log:
                log = open(args.log, "a")  # noqa: SIM115 - closed by run()
            if args.ckpt_dir:
                if os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
                    raise ValueError(f"--ckpt-dir {args.ckpt_dir} exists and is not a folder")
                os.makedirs(args.ckpt_dir, exist_ok=True)
                if not os.access(args.ckpt_dir, os.W_OK | os.X_OK):
                    raise ValueError(f"--ckpt-dir {args.ckpt_dir} is not writable")
        except ValueError as exc:
            err = str(exc)
        except OSError as exc:
            err = f"cannot use {exc.filename or 'an output path'}: {exc.strerror or exc}"
    if size > 1:
        from hpczeco.collectives import timed

        err = timed.bcast(comm, err, 0, "hpczeco train (output paths)")
    if err:
        if log is not None:
            log.close()
        raise ValueError(err)
    return log
