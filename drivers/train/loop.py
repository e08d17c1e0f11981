"""The training loop of ``hpczeco train``, top to bottom: options, layout, data, model, optimizer, resume, steps,
checkpoints, summary. The pieces live beside it: :mod:`.options`, :mod:`.parallel`, :mod:`.model`,
:mod:`.checkpoint`, :mod:`.metrics`, :mod:`.memory`, :mod:`hpczeco.drivers.data`.

One step on every rank: read its rows (DP group) and columns (SP slice) of the global batch, forward (bf16
autocast on GPUs) to its share of the mean loss, backward (the ZeCO layers exchange their states with the other
ranks of the sequence), sum the flat gradient buffer over all ranks (with the loss and the stop flag in it), read
loss and gradient norm (the step's one synchronisation), clip, AdamW; then log and maybe checkpoint.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checkpoint import load_latest
from ..data import WindowStream, corpus_id, load_corpus
from .faults import CHECKPOINT_SIGNAL, Faults, SignalFlag, soak_line
from .options import Outputs, on_for, open_outputs, parse

__all__ = ["run", "main", "TrainResult", "lr_at", "set_blas_threads"]


@dataclass
class TrainResult:
    """What a run produced (identical on every rank)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> loss, steps run by this invocation
    params: dict[str, np.ndarray] = field(default_factory=dict)  # with return_params only
    step: int = 0
    start_step: int = 0
    tokens_per_s: float = 0.0  # median over the steps after --warmup-steps, rank 0's clock
    wall_s: float = 0.0  # the whole loop, checkpoints included
    checkpoint: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    stopped_by: str | None = None  # "SIGUSR1" when CHECKPOINT_SIGNAL ended the run early (after a checkpoint)
    summary: dict[str, Any] = field(default_factory=dict)  # the benchmark figures (rank 0; empty elsewhere)


def lr_at(step: int, peak: float, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """Learning rate of step ``step`` (1-based): linear warm-up to ``peak`` over ``warmup`` steps, then cosine down
    to ``min_ratio * peak`` at ``decay_steps``, constant after."""
    if warmup and step <= warmup:
        return peak * step / warmup
    if decay_steps <= warmup:
        return peak
    t = min(1.0, (step - warmup) / (decay_steps - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _terminal_width() -> int:
    """Columns of the terminal on stdout; 0 when stdout is not a terminal (a log file, a pipe) or has no size."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (AttributeError, OSError, ValueError):
        return 0


def run(argv: list[str] | None, comm, prog: str = "hpczeco train", return_params: bool = False) -> TrainResult:
    """Parse ``argv`` and train on ``comm`` (collective). Returns the same :class:`TrainResult` on every rank
    (``return_params``: with a host copy of the final parameters, by name)."""
    ap, args = parse(argv, comm, prog)
    outputs = open_outputs(args, comm)  # collective, before any work; holds the --ckpt-dir lock until the run ends
    try:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ValueError("hpczeco train needs PyTorch: pip install torch (or hpczeco[torch])") from None
        return _train(ap, args, comm, outputs, argv, return_params)
    finally:
        outputs.close()


def _train(ap: argparse.ArgumentParser, args: argparse.Namespace, comm, outputs: Outputs, argv: list[str] | None,
           return_params: bool) -> TrainResult:
    import torch
    from hpczeco.base.checks import GPU_MAX_CHUNK
    from hpczeco.collectives import timed
    from hpczeco.collectives.agree import collective_check

    from . import memory
    from .checkpoint import (
        Saver,
        expected_arrays,
        init_optimizer_state,
        make_validate,
        restore,
        rng_attrs,
        state_tensors,
    )
    from .metrics import StepTimer, bench_row, mfu, peak_memory, plot_losses, summarise, write_json
    from .model import GLALM, make_mixer
    from .parallel import GradReducer, make_layout, resolve_grad_comm

    rank, P = comm.Get_rank(), comm.Get_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 and not args.quiet else (lambda *a: None)
    cfg = args.model

    # ---- the layout: SP groups (ZeCO communicators) x DP groups, one device per rank -------------------------
    torch.manual_seed(args.seed)  # the same generators on every rank (the model draws from its own, seeded too)
    if args.blas_threads > 0:
        torch.set_num_threads(args.blas_threads)
        set_blas_threads(args.blas_threads)
    device = args.device
    if device == "auto":  # gpu when every rank sees one (and the dtype is not float64)
        seen = timed.allgather(comm, torch.cuda.is_available(), "hpczeco train --device auto")
        device = "gpu" if all(seen) and args.dtype != "float64" else "cpu"
    layout = make_layout(comm, args.sp, device)
    dev = layout.device
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")
    err = None
    if dtype_name == "float64" and dev.type == "cuda":
        err = ValueError("--dtype float64 runs on the CPU only (hpczeco's GPU GLA kernels have no float64)")
    elif dev.type == "cuda" and layout.sp > 1 and args.chunk_size > GPU_MAX_CHUNK:
        err = ValueError(f"--chunk-size {args.chunk_size}: the GPU GLA kernels take at most {GPU_MAX_CHUNK}")
    collective_check(comm, "hpczeco train (precision)", err)
    autocast = dtype_name == "bfloat16"
    param_dtype = torch.float64 if dtype_name == "float64" else torch.float32
    compute_dtype = torch.bfloat16 if autocast else param_dtype
    rows, cols = layout.rows(args.batch), layout.cols(args.seq)

    # ---- memory: refuse a configuration that cannot fit, the same on every rank -------------------------------
    est = memory.estimate(cfg, tokens=-(-args.batch // layout.dp) * -(-args.seq // layout.sp),
                          param_bytes=8 if param_dtype == torch.float64 else 4,
                          compute_bytes={torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}[compute_dtype],
                          autocast=autocast, act_ckpt=args.act_ckpt)
    sharing = layout.gpu_ids.count(layout.gpu_ids[rank]) if layout.gpu_ids else layout.local_size
    limit, what = memory.limit_bytes(dev.type, dev.index, sharing)
    limits = timed.allgather(comm, (limit, what), "hpczeco train (memory limits)")
    low = min(range(P), key=lambda r: limits[r][0])
    if not args.no_mem_check and est["total"] > limits[low][0]:
        parts = ", ".join(f"{k} {memory.gib(v)}" for k, v in est.items() if k != "total")
        raise ValueError(f"estimated memory per rank {memory.gib(est['total'])} ({parts}) exceeds the limit "
                         f"{memory.gib(limits[low][0])} ({limits[low][1]}, rank {low}); use --act-ckpt, a shorter "
                         "--seq, a smaller --batch, more --sp ranks, or --no-mem-check")

    # ---- data: the global stream of windows, each rank its rows and columns -----------------------------------
    corpus, desc = load_corpus(comm, args.text, args.corpus_bytes)
    collective_check(comm, "hpczeco train (data)",
                     ValueError(f"the corpus has {corpus.size} tokens, fewer than --seq + 1 = {args.seq + 1}")
                     if corpus.size < args.seq + 1 else None)
    stream = WindowStream(corpus.size, args.seq, seed=args.seed + 1)
    n_tokens = args.batch * args.seq  # targets of the global batch: the loss is their mean

    config = {
        "model": cfg.to_dict(), "seq": args.seq, "batch": args.batch, "dtype": str(param_dtype).removeprefix("torch."),
        "seed": args.seed, "lr": args.lr, "lr_warmup": args.lr_warmup, "decay_steps": args.decay_steps,
        "min_lr": args.min_lr, "beta1": args.beta1, "beta2": args.beta2, "eps": args.eps,
        "weight_decay": args.weight_decay, "clip": args.clip, "corpus": corpus_id(corpus),
        "corpus_tokens": int(corpus.size),
    }  # fmt: skip

    # ---- model, optimizer, gradient buffer --------------------------------------------------------------------
    with torch.device("meta"):
        model = GLALM(cfg, lambda: make_mixer(layout.sp_comm, args.topology, args.blocks, args.chunk_size),
                      act_ckpt=args.act_ckpt, compute_dtype=compute_dtype if autocast else None)
    model = model.to_empty(device=dev).to(param_dtype)
    model.init_weights(args.seed)
    model.train()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                            weight_decay=args.weight_decay,
                            **({"fused": True} if dev.type == "cuda" else {"foreach": False}))
    init_optimizer_state(opt)
    tensors = state_tensors(model, opt)
    grad_comm = args.grad_comm
    try:
        grad_comm = resolve_grad_comm(layout, grad_comm)
        err = None
    except ValueError as exc:
        err = exc
    collective_check(comm, "hpczeco train --grad-comm", err)
    reducer = GradReducer(params, layout, grad_comm, bucket_bytes=args.bucket_mb << 20)
    step_model = model
    compiled = on_for(args.compile, dev.type)
    if compiled:
        for blk in model.blocks:
            blk.compile()

    # ---- resume -----------------------------------------------------------------------------------------------
    step0, data_pos, adam_t = 0, 0, 0
    if args.resume:
        found = load_latest(args.ckpt_dir, comm, expect_config=config, expect_arrays=expected_arrays(tensors),
                            validate=make_validate(stream.n_windows))
        if found is None:
            say(f"resume: no checkpoint in {args.ckpt_dir}; starting from step 0")
        else:
            step0, arrays, attrs = found
            restore(tensors, opt, arrays, attrs, dev)
            data_pos, adam_t = int(attrs["data_pos"]), int(attrs["adam_t"])
            was = attrs.get("layout") or {}
            wrote = was.get("world", attrs.get("nranks"))
            say(f"resume: step {step0} from {args.ckpt_dir} (written by {wrote} rank(s), now {P}; SP x DP "
                f"{was.get('sp', '?')} x {was.get('dp', '?')} -> {layout.sp} x {layout.dp})")
            del arrays
    ckpt_async = on_for(args.ckpt_async, dev.type)
    saver = (Saver(args.ckpt_dir, comm, tensors, args.keep, ckpt_async, dev, writer=outputs.ckpt_holder)
             if args.ckpt_dir else None)

    # ---- what the run prints and logs -------------------------------------------------------------------------
    n_gpus = layout.n_gpus
    peak = args.peak_tflops * 1e12
    where = f"{dev.type}" + (f", {layout.gpu} on rank 0, {n_gpus} GPU(s)" if dev.type == "cuda" else "")
    say(f"hpczeco train: {layout.describe()}, {n_params:,} parameters ({args.config}: d_model {cfg.d_model}, "
        f"{cfg.n_layers} layers, {cfg.n_heads} heads of {cfg.head_dim}, vocab {cfg.vocab}), {dtype_name} on {where}")
    say(f"  data: seq {args.seq} x batch {args.batch} = {n_tokens:,} tokens per step; {desc}")
    say(f"  GLA: {'ZeCO ' + args.topology + ' over ' + str(layout.sp) + ' ranks' if layout.sp > 1 else 'chunk_gla'}; "
        f"gradients: {grad_comm}; torch.compile {'on' if compiled else 'off'}; "
        f"memory estimate {memory.gib(est['total'])} per rank (limit "
        f"{memory.gib(limits[low][0])})")
    if args.log:
        say(f"  log: {os.path.abspath(args.log)}")
    if args.ckpt_dir:
        when = f"every {args.ckpt_every} steps and at the end" if args.ckpt_every else "at the end"
        say(f"  checkpoints: {os.path.abspath(args.ckpt_dir)} ({when})")
    from ..console import compile_notice, warn_oversubscribed

    warn_oversubscribed(comm, ap.prog, say)  # collective
    emit = outputs.log.write if outputs.log is not None else (lambda rec: None)
    emit({"event": "start", "step": step0, "ranks": P, "layout": layout.to_dict(), "config": config,
          "n_params": n_params, "device": dev.type, "dtype": dtype_name, "grad_comm": grad_comm,
          "memory_estimate": est, "argv": list(argv or [])})
    if args.steps > step0 and dev.type == "cpu" and not args.quiet:
        compile_notice(rank, say)

    # ---- the steps --------------------------------------------------------------------------------------------
    bar = None
    if rank == 0 and not args.no_progress and not args.quiet and args.steps > step0 and _terminal_width() > 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=step0, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    result = TrainResult(start_step=step0, step=step0, config=config)
    timer = StepTimer(dev)
    faults = Faults()
    stop_flag = SignalFlag(CHECKPOINT_SIGNAL) if saver is not None else None
    records: list[dict[str, Any]] = []
    ckpt_events: list[dict[str, Any]] = []
    loss = float("nan")
    last_saved = step0 if args.resume else -1
    t_run = t_prev = time.perf_counter()

    def save(step: int) -> float:
        attrs = {"config": config, "adam_t": adam_t, "data_pos": data_pos, "tokens_seen": data_pos * args.seq,
                 "loss": loss, "layout": layout.to_dict(), **rng_attrs(dev),
                 "run": {"topology": args.topology, "blocks": args.blocks, "chunk_size": args.chunk_size,
                         "grad_comm": grad_comm, "dtype": dtype_name}}  # fmt: skip
        return saver.save(step, attrs)

    try:
        for step in range(step0 + 1, args.steps + 1):
            timer.start(measure=bool(args.timing_every) and step % args.timing_every == 0)
            tok = torch.from_numpy(stream.tokens(corpus, data_pos, rows, cols))
            tok = tok.to(dev, non_blocking=True)
            x, y = tok[:, :-1], tok[:, 1:]
            reducer.zero()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                share = step_model(x, y, n_tokens)
            timer.mark("forward")
            share.backward()
            timer.mark("backward")
            faults.here(rank, step)
            log_failed = outputs.log is not None and outputs.log.error is not None  # rank 0's log: a write failed
            reducer.allreduce(share, stop_flag is not None and stop_flag.raised, log_failed)
            timer.mark("allreduce")
            loss_t, stop_t, failed_t = reducer.loss_and_flags()
            gnorm_t = reducer.flat[:reducer.n].norm()
            loss, gnorm, stop, failed = (float(v) for v in torch.stack([loss_t, gnorm_t, stop_t, failed_t]).tolist())
            t_sync = time.perf_counter()  # (the sync above: the step's one)
            if failed > 0:
                raise _output_failed(comm, outputs, step - 1)
            if not math.isfinite(loss) or not math.isfinite(gnorm):
                raise FloatingPointError(f"loss is {loss} (gradient norm {gnorm}) at step {step}; lower --lr")
            if args.clip and gnorm > args.clip:
                reducer.flat[:reducer.n].mul_(args.clip / (gnorm + 1e-6))
            adam_t += 1
            lr = lr_at(adam_t, args.lr, args.lr_warmup, args.decay_steps, args.min_lr)
            for group in opt.param_groups:
                group["lr"] = lr
            if saver is not None:
                saver.wait_for_copies()
            opt.step()
            timer.mark("optimizer")
            data_pos += args.batch
            step_s = t_sync - t_prev
            t_prev = t_sync
            ckpt_s = None
            due = args.ckpt_every and step % args.ckpt_every == 0
            if saver is not None and (due or stop > 0):
                ckpt_s = save(step)
                last_saved = step
                timer.mark("checkpoint")
            rate = n_tokens / step_s if step_s > 0 else float("inf")
            per_gpu = rate / (n_gpus or P)
            rec = {"event": "step", "step": step, "loss": loss, "grad_norm": gnorm, "lr": lr, "tokens": n_tokens,
                   "tokens_seen": data_pos * args.seq, "step_s": step_s, "tokens_per_s": rate,
                   "tokens_per_s_per_gpu": per_gpu,
                   "mfu": mfu(n_params, n_tokens, step_s, n_gpus, peak) if dev.type == "cuda" else None,
                   "peak_memory_bytes": peak_memory(dev), "split": timer.split(), "checkpoint_s": ckpt_s,
                   "ranks": P}  # fmt: skip
            records.append(rec)
            emit(rec)
            if saver is not None:
                for ev in saver.events:
                    emit(ev)
                ckpt_events.extend(saver.events)
                saver.events.clear()
            result.losses[step] = loss
            result.step = step
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s_gpu=f"{per_gpu:,.0f}", refresh=False)
                bar.update(1)
            elif args.print_every and (step % args.print_every == 0 or step in (step0 + 1, args.steps)):
                say(_progress(rec, args.steps))
            if faults.soak_at and (step == faults.soak_at or step == args.steps):
                sys.stderr.write(soak_line(layout.sp_comm if layout.sp > 1 else comm, rank, step))
                sys.stderr.flush()
            if stop > 0:
                result.stopped_by = signal.Signals(CHECKPOINT_SIGNAL).name
                say(f"hpczeco train: {result.stopped_by} received: checkpoint at step {step}, then stop "
                    "(continue with --resume)")
                break
        result.wall_s = time.perf_counter() - t_run
        if saver is not None:
            if last_saved != result.step:
                save(result.step)
            result.checkpoint = saver.finish()
            for ev in saver.events:
                emit(ev)
            ckpt_events.extend(saver.events)
            saver.events.clear()
    finally:
        if stop_flag is not None:
            stop_flag.restore()
        if bar is not None:
            bar.close()
        reducer.close()
    steady = records[args.warmup_steps:] if len(records) > args.warmup_steps else records
    result.tokens_per_s = float(np.median([r["tokens_per_s"] for r in steady])) if steady else 0.0
    if return_params:
        result.params = {n: p.detach().to("cpu").numpy().copy() for n, p in model.named_parameters()}
    layout.free()

    # ---- the end: summary line, JSON log, loss curve, benchmark row (rank 0), then its verdict on every rank -----
    emit({"event": "end", "step": result.step, "loss": loss, "tokens_per_s": result.tokens_per_s,
          "wall_s": result.wall_s, "checkpoint": result.checkpoint, "stopped_by": result.stopped_by})
    errors: list[str] = []
    if outputs.log is not None:
        outputs.log.close()
        if outputs.log.error:
            errors.append(outputs.log.error)
    if rank == 0 and not result.losses:
        print(f"hpczeco train: already at step {step0} (--steps {args.steps}); nothing to do", flush=True)
    elif rank == 0:
        result.summary = summarise(records, args.warmup_steps, ckpt_events)
        plot = args.plot or (os.path.splitext(args.log)[0] + ".png" if args.log else None)
        if plot:
            title = f"hpczeco train {args.config}, {layout.describe()}, {dtype_name}"
            made: list[str | None] = []
            err = _written("--plot", plot,
                           lambda: made.append(plot_losses(_logged_steps(args.log, records), plot, title)))
            if err:
                errors.append(err)
            elif made and made[0] and not args.quiet:
                print(f"  loss curve: {os.path.abspath(plot)}", flush=True)
        if args.bench_json:
            bench = {"config": args.config, "n_params": n_params, "layout": layout.to_dict(), "n_gpus": n_gpus,
                     "device": dev.type, "dtype": dtype_name, "seq": args.seq, "batch": args.batch,
                     "tokens_per_step": n_tokens, "grad_comm": grad_comm, "act_ckpt": args.act_ckpt,
                     "compile": compiled, "topology": args.topology, "peak_flops": peak,
                     "memory_estimate_bytes": est["total"], "argv": list(argv or []), **result.summary,
                     "losses": [r["loss"] for r in records]}  # fmt: skip
            err = _written("--bench-json", args.bench_json, lambda: write_json(args.bench_json, bench))
            if err:
                errors.append(err)
            else:
                print(bench_row(f"{args.config} {layout.describe()} seq {args.seq}", result.summary), flush=True)
        first, last = result.losses[min(result.losses)], result.losses[max(result.losses)]
        ckpt = f", checkpoint {result.checkpoint}" if result.checkpoint else ""
        extra = ""
        if dev.type == "cuda" and result.summary.get("mfu_median") is not None:
            s = result.summary
            extra = (f", {s['tokens_per_s_per_gpu_median']:,.0f} tokens/s/GPU, MFU {100 * s['mfu_median']:.1f} %, "
                     f"peak {memory.gib(s['peak_memory_bytes'] or 0)}")
        print(f"hpczeco train: steps {step0 + 1}..{result.step} on {P} rank(s): loss {first:.4f} -> {last:.4f}, "
              f"{result.tokens_per_s:,.0f} tokens/s (median step){extra}, {result.wall_s:.1f} s{ckpt}", flush=True)
    error = "; ".join(errors) or None
    if P > 1:  # the others wait while rank 0 writes its outputs, then end alike
        error = timed.bcast(comm, error, 0, "hpczeco train: rank 0 writes the log, the loss curve and --bench-json")
    if error:
        raise ValueError(error)
    return result


def _written(opt: str, path: str, write: Callable[[], Any]) -> str | None:
    """Run ``write`` (rank 0's output to ``path``); its error as one message naming ``opt`` and the path."""
    try:
        write()
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        return f"{opt} {path}: cannot write it ({why})"
    return None


def _output_failed(comm, outputs: Outputs, step: int) -> ValueError:
    """Every rank's error after rank 0 could not write its log (collective: its message, broadcast)."""
    from hpczeco.collectives import timed

    msg = outputs.log.error if outputs.log is not None and outputs.log.error else None
    if comm.Get_size() > 1:
        msg = timed.bcast(comm, msg, 0, "hpczeco train: rank 0's output error")
    return ValueError(f"{msg or 'rank 0 could not write its output'}; training stopped after step {step}")


def _logged_steps(log_path: str | None, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every step of the log file (earlier runs resumed from included; a step run twice: its last record), else
    this run's records."""
    if not log_path:
        return records
    by_step: dict[int, dict[str, Any]] = {}
    try:
        with open(log_path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("event") == "step":
                    by_step[int(rec["step"])] = rec
    except OSError:
        return records
    return [by_step[s] for s in sorted(by_step)] or records


def _progress(rec: dict[str, Any], steps: int) -> str:
    line = (f"  step {rec['step']:6d}/{steps}  loss {rec['loss']:.4f}  grad norm {rec['grad_norm']:.3g}  "
            f"{rec['tokens_per_s']:,.0f} tokens/s")
    if rec.get("mfu") is not None:
        line += f" ({rec['tokens_per_s_per_gpu']:,.0f}/GPU, MFU {100 * rec['mfu']:.1f} %)"
    if rec.get("peak_memory_bytes"):
        line += f"  mem {rec['peak_memory_bytes'] / 2**30:.1f} GiB"
    if rec.get("split"):
        line += "  [" + " ".join(f"{k[:4]} {v * 1e3:.0f}" for k, v in rec["split"].items()) + " ms]"
    return line


def set_blas_threads(n: int) -> str:
    """Limit the BLAS behind numpy to ``n`` threads (``threadpoolctl`` if installed, else OpenBLAS's own
    ``*_set_num_threads`` through ctypes). Several ranks per node each spawning a thread per core
    oversubscribes the cores: small matmuls then run 10-100x slower. Returns what was done."""
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415

        threadpool_limits(n, user_api="blas")
        return f"threadpoolctl: {n}"
    except ImportError:
        pass
    libdirs = [os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs"), os.path.dirname(np.__file__)]
    for path in sorted(p for d in libdirs for p in glob.glob(os.path.join(d, "*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn(int(n))
                return f"{os.path.basename(path)}: {n}"
    return "unchanged (no OpenBLAS found; set OMP_NUM_THREADS/OPENBLAS_NUM_THREADS)"


def main(argv: list[str] | None = None, prog: str = "hpczeco train") -> int:
    from mpi4py import MPI

    from ..checkpoint import CheckpointError
    from ..mpienv import launcher_mismatch

    mismatch = launcher_mismatch(MPI.COMM_WORLD.Get_size())
    if mismatch:  # refuse: each process would train alone on the whole sequence
        print(f"{prog}: error: {mismatch}", file=sys.stderr, flush=True)
        return 2
    try:
        run(argv, MPI.COMM_WORLD, prog=prog)
    except (CheckpointError, ValueError, FloatingPointError) as exc:  # raised on every rank alike
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
