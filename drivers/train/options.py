"""The options of ``hpczeco train``: the parser, their checks (collective: a bad option on one rank ends every rank
with the same error) and the output paths (checked by rank 0 before the first collective of the run)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from hpczeco.collectives.names import TOPOLOGIES  # the scan's one list of names

from ..options import float_range, int_range, size_bytes
from .config import CONFIGS, make_config

__all__ = ["TOPOLOGIES", "build_parser", "check_args", "parse", "Outputs", "open_outputs", "DESCRIPTION"]


#: upper bounds of the shape options: far beyond any model one trains, low enough that the memory estimate stays a
#: float (a width of 1e200 would overflow it) -- the estimate is what refuses a shape that does not fit
MAX_WIDTH, MAX_LAYERS, MAX_VOCAB, MAX_TOKENS = 1 << 20, 1 << 14, 1 << 24, 10**12
MAX_SEED = (1 << 63) - 2  # numpy's and torch's generators take it (the data order uses seed + 1)
MAX_THREADS = 1024  # torch.set_num_threads takes a million and then tries to start them
PLOT_SUFFIXES = (".png", ".pdf", ".svg")

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


def on_for(value: str, device_type: str) -> bool:
    """An ``auto|on|off`` option (``--compile``, ``--ckpt-async``) resolved: ``auto`` is on for GPUs."""
    return value == "on" or (value == "auto" and device_type == "cuda")


def build_parser(prog: str = "hpczeco train") -> argparse.ArgumentParser:
    from ..helpfmt import HelpFormatter

    ap = _Parser(prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter)
    d = ap.add_argument_group("data")
    d.add_argument("--text", default=None,
                   help="training text: a file, - (standard input, read by rank 0), or a folder (its regular files in "
                   "name order); at most --corpus-bytes are read; default: this Python's stdlib *.py sources "
                   "(offline). Byte-level: token ids are the bytes")
    d.add_argument("--corpus-bytes", type=size_bytes(), default=8 << 20,
                   help="read at most this many bytes: 4096, 64K, 8M, 1G (default 8 MiB)")
    d.add_argument("--seq", type=int_range(1, MAX_TOKENS), default=1024,
                   help="tokens per sequence, split over the --sp ranks (default 1024)")
    d.add_argument("--batch", type=int_range(0, MAX_TOKENS), default=0,
                   help="sequences per step over all ranks, split over the DP groups (default 0: one per DP group)")
    m = ap.add_argument_group("model")
    m.add_argument("--config", choices=list(CONFIGS), default="tiny",
                   help="named shape (default tiny: d_model 64, 2 layers, 2 heads, vocab 256; 125m, 340m, 1.3b: "
                   "vocab 32000, heads of 128)")
    m.add_argument("--d-model", type=int_range(1, MAX_WIDTH), default=None, help="width (default: the config's)")
    m.add_argument("--layers", type=int_range(1, MAX_LAYERS), default=None, help="blocks (default: the config's)")
    m.add_argument("--heads", type=int_range(1, MAX_WIDTH), default=None,
                   help="GLA heads, K = V = d_model / heads (default: the config's)")
    m.add_argument("--d-ff", type=int_range(1, MAX_WIDTH), default=None,
                   help="SwiGLU width (default: fla's rule from d_model)")
    m.add_argument("--vocab", type=int_range(1, MAX_VOCAB), default=None,
                   help="vocabulary, >= 256 (default: the config's)")
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
    m.add_argument("--compile", type=_tri, nargs="?", const="on", default="auto",
                   help="torch.compile the blocks (the GLA mixer stays eager): on (also a bare --compile), off, or "
                   "auto: on for GPUs, where it fused the elementwise work into 1.20x the tokens/s of eager and 15 %% "
                   "less peak memory (340m, one H100); off on CPUs (default auto)")
    o = ap.add_argument_group("optimiser")
    o.add_argument("--steps", type=int_range(0), default=20, help="train up to this step (default 20)")
    o.add_argument("--lr", type=float_range(0, lo_open=True), default=3e-3,
                   help="peak AdamW learning rate (default 0.003)")
    o.add_argument("--lr-warmup", type=int_range(0), default=0, help="linear learning-rate warm-up steps (default 0)")
    o.add_argument("--decay-steps", type=int_range(0), default=10000,
                   help="cosine decay from the peak to --min-lr over steps --lr-warmup..N, constant after (default "
                   "10000; independent of --steps, so a resumed run follows the same schedule)")
    o.add_argument("--min-lr", type=float_range(0, 1), default=0.1,
                   help="final learning rate as a fraction of --lr (default 0.1)")
    o.add_argument("--beta1", type=float_range(0, 1, hi_open=True), default=0.9,
                   help="AdamW first-moment decay (default 0.9)")
    o.add_argument("--beta2", type=float_range(0, 1, hi_open=True), default=0.99,
                   help="AdamW second-moment decay (default 0.99)")
    o.add_argument("--eps", type=float_range(0, lo_open=True), default=1e-8, help="AdamW epsilon (default 1e-08)")
    o.add_argument("--weight-decay", type=float_range(0), default=0.0,
                   help="AdamW decoupled weight decay (default 0.0)")
    o.add_argument("--clip", type=float_range(0), default=1.0,
                   help="clip the global gradient norm (0: off; default 1.0)")
    o.add_argument("--seed", type=int_range(0, MAX_SEED), default=0,
                   help="seed of the initial weights and the data order (default 0)")
    p = ap.add_argument_group("parallelism")
    p.add_argument("--sp", type=int_range(0), default=0,
                   help="ranks per sequence (ZeCO sequence parallelism); must divide the rank count; the rest is "
                   "data parallel (default 0: all ranks on one sequence group)")
    p.add_argument("--topology", choices=TOPOLOGIES, default="ring",
                   help="ZeCO state scan between the --sp ranks (default ring: the All-Scan)")
    p.add_argument("--blocks", type=int_range(1), default=None,
                   help="ring pipeline blocks (default: the cost model's)")
    p.add_argument("--chunk-size", type=int_range(1), default=64,
                   help="GLA chunk length of the ZeCO layer, at most 64 on GPUs (default 64)")
    p.add_argument("--grad-comm", choices=("auto", "nccl", "ipc", "mpi"), default="auto",
                   help="gradient all-reduce: nccl (one GPU per rank), ipc (all ranks on one GPU), mpi (host or "
                   "CUDA-aware); auto picks in that order (default auto)")
    p.add_argument("--bucket-mb", type=int_range(1, 1 << 20), default=256,
                   help="gradient all-reduce bucket size in MiB (default 256)")
    p.add_argument("--blas-threads", type=int_range(0, MAX_THREADS), default=1,
                   help="CPU threads per rank for PyTorch and BLAS (default 1: ranks already fill the cores; 0: "
                   "leave as is)")
    c = ap.add_argument_group("output")
    c.add_argument("--log", default=None, help="JSON-lines log file (rank 0)")
    c.add_argument("--plot", default=None,
                   help="loss-curve image at the end, .png, .pdf or .svg (default: beside --log, .png)")
    c.add_argument("--ckpt-dir", default=None, help="checkpoint folder (none: no checkpoints)")
    c.add_argument("--ckpt-every", type=int_range(0), default=0,
                   help="checkpoint every N steps (default 0: only at the end); with --ckpt-dir there is always one "
                   "at the end")
    c.add_argument("--ckpt-async", type=_tri, default="auto",
                   help="on: rank 0 snapshots to host memory and a background thread writes the file; off: every "
                   "rank writes collectively; auto: on for GPUs (default auto)")
    c.add_argument("--keep", type=int_range(1), default=3, help="checkpoints to keep (default 3)")
    c.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --ckpt-dir")
    c.add_argument("--no-progress", action="store_true",
                   help="no progress bar (batch jobs; the bar is shown only when stdout is a terminal)")
    c.add_argument("--print-every", type=int_range(0), default=10,
                   help="without a progress bar, print a line every N steps (0: never; default 10)")
    c.add_argument("--quiet", action="store_true", help="print only the summary")
    c.add_argument("--timing-every", type=int_range(0), default=0,
                   help="synchronise the GPU between the phases of every N-th step to time forward / backward / "
                   "all-reduce / optimizer (0: never; the CPU is always timed; default 0)")
    c.add_argument("--warmup-steps", type=int_range(0), default=2,
                   help="steps left out of the summary figures (compilation, autotuning; default 2)")
    c.add_argument("--bench-json", default=None,
                   help="benchmark mode: write the summary (tokens/s/GPU, MFU, memory, step split) here and print "
                   "one table row (rank 0)")
    c.add_argument("--peak-tflops", type=float_range(0, lo_open=True), default=790.0,
                   help="dense bf16 TFLOP/s of one GPU for MFU (default 790: H200)")
    c.add_argument("--no-mem-check", action="store_true",
                   help="skip the memory estimate check before training")
    return ap


def check_args(args: argparse.Namespace, ranks: int) -> None:
    """``ValueError`` naming the first bad combination of options (the same on every rank for the same options).
    Each number was checked where it entered (its type: :mod:`hpczeco.drivers.options`)."""
    if args.resume and not args.ckpt_dir:
        raise ValueError("--resume needs --ckpt-dir")
    if args.vocab is not None and args.vocab < 256:
        raise ValueError(f"--vocab {args.vocab}: the data are bytes, the vocabulary needs at least 256 entries")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in PLOT_SUFFIXES:
        raise ValueError(f"--plot {args.plot}: name a {', '.join(PLOT_SUFFIXES)} file (the loss curve's format)")
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


@dataclass
class Outputs:
    """What :func:`open_outputs` opened: the log (rank 0, with ``--log``) and the checkpoint writer that holds the
    ``--ckpt-dir`` lock (rank 0, with ``--ckpt-dir``; kept for the whole run)."""

    log: Log | None = None
    ckpt_holder: Any = None

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        self.ckpt_holder = None  # the last reference: the folder lock goes with it


class Log:
    """The JSON-lines log (rank 0): a write error is kept (``error``, naming the path) and ends the logging, so the
    run can end every rank with it at its next collective."""

    def __init__(self, path: str):
        self.path = path
        self.error: str | None = None
        self._fh: Any = open(path, "a")  # noqa: SIM115 - closed by close()

    def write(self, rec: dict[str, Any]) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps(rec) + "\n")
            self._fh.flush()
        except OSError as exc:
            self.error = f"--log {self.path}: cannot write the log ({exc.strerror or exc})"
            self.close()

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError as exc:
                self.error = self.error or f"--log {self.path}: cannot write the log ({exc.strerror or exc})"
            self._fh = None


def open_outputs(args: argparse.Namespace, comm) -> Outputs:
    """Check ``--text`` and every output path before any work and take the checkpoint folder (collective over
    ``comm``): the same error on every rank when one is unusable -- a ``ValueError`` for a path (a ``--text`` that is
    a device or a FIFO, :func:`hpczeco.drivers.data.check_text`; a missing folder, a folder as ``--log``, a file as
    ``--ckpt-dir``, an unwritable place: :func:`hpczeco.drivers.files.check_output_file` / ``check_output_dir``), a
    ``CheckpointError`` when another live job holds ``--ckpt-dir``.

    Only rank 0 writes the log, the plot, ``--bench-json`` and (with asynchronous saves) the checkpoint files, so
    rank 0 checks them, opens ``--log`` for appending and makes a :class:`~hpczeco.drivers.checkpoint.CheckpointWriter`
    of ``--ckpt-dir`` (which locks the folder for as long as it lives), and broadcasts its verdict (honouring the
    collective timeout)."""
    from ..checkpoint import CheckpointError, CheckpointWriter
    from ..data import check_text
    from ..files import check_output_dir, check_output_file

    rank, size = comm.Get_rank(), comm.Get_size()
    out, err = Outputs(), None
    if rank == 0:
        try:
            if args.text is not None:
                check_text(args.text)  # by what it is, unopened (rank 0 reads it later, with a bound)
            plot = args.plot or (os.path.splitext(args.log)[0] + ".png" if args.log else None)
            for opt, path in (("--log", args.log), ("--plot", plot), ("--bench-json", args.bench_json)):
                if path:
                    check_output_file(path, opt if opt != "--plot" or args.plot else "--plot (beside --log)")
            if args.ckpt_dir:
                check_output_dir(args.ckpt_dir, "--ckpt-dir")
                out.ckpt_holder = CheckpointWriter(args.ckpt_dir, None, keep=args.keep)
            if args.log:
                out.log = Log(args.log)
        except ValueError as exc:
            err = ("ValueError", str(exc))
        except CheckpointError as exc:
            err = ("CheckpointError", str(exc))
        except OSError as exc:
            err = ("ValueError", f"cannot use {exc.filename or 'an output path'}: {exc.strerror or exc}")
    if size > 1:
        from hpczeco.collectives import timed

        err = timed.bcast(comm, err, 0, "hpczeco train (output paths and the checkpoint folder)")
    if err:
        out.close()
        raise (CheckpointError if err[0] == "CheckpointError" else ValueError)(err[1])
    return out
