"""`hpczeco prefill FILE`: DAAF prefill of a text file with a small random-weight model.

Prints the plan summary (key regions, global fraction, attention work saved, the policy used and
why) and the time to first token (TTFT = tokenize + plan + prefill + first-token logits). Run it
under ``mpiexec -n P`` to split the prefill over ranks: ``--ranks sequence`` (the token sequence,
with halo exchange and a key-region allgather) or ``--ranks heads`` (tensor parallel heads/MLP).
``--dense`` uses exact causal attention instead of DAAF (the baseline).

Before any work it estimates the cost (tokens, key-region share, attention pairs, flop, memory per
rank: :meth:`hpczeco.drivers.daaf_demo.PrefillModel.estimate`) and refuses, with that estimate, a text above
``--max-tokens`` or a run above ``--max-memory`` (0 lifts a limit). The text is tokenized on rank 0
(a chunk at a time, stopping at the token limit) and only the ids are broadcast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from .options import float_range, int_range

#: default limits (raise them with --max-tokens / --max-memory; 0 = no limit)
DEFAULT_MAX_TOKENS = 1 << 17
DEFAULT_MAX_MEMORY = "4G"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """``'4G'`` -> 4 GiB (suffixes K, M, G, T, optional ``B``/``iB``; plain numbers are bytes); 0 = no limit."""
    t = str(text).strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix):
            t = t[: -len(suffix)]
            break
    unit = t[-1] if t and t[-1] in "KMGT" else ""
    number = t[:-1] if unit else t
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4G, 512M, 0 for no limit)") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(value * _UNITS[unit])


def logits_checksum(logits) -> str:
    """A short fingerprint of the last position's logits ``[vocab]``: their float64 sum and L2 norm, rounded
    to 6 significant digits (equal up to rounding for the same text, weights and attention path)."""
    import numpy as np

    x = np.asarray(logits, np.float64)
    return f"sum {x.sum():.6g}, norm {np.linalg.norm(x):.6g}"


def build_parser(prog: str) -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("file", help="UTF-8 text file to prefill ('-' for stdin)")
    ap.add_argument("--ranks", choices=["sequence", "heads"], default="sequence",
                    help="how to split the prefill over the MPI ranks (with more than one rank)")
    ap.add_argument("--dense", action="store_true", help="exact causal attention instead of DAAF")
    ap.add_argument("--tokenizer", choices=["word", "byte"], default="word",
                    help="word: GPT-2-like word pieces, hashed to ids; byte: the UTF-8 bytes")
    ap.add_argument("--window", type=int_range(1), default=512, help="entropy scan window (tokens)")
    ap.add_argument("--stride", type=int_range(1), default=None, help="scan stride (default: the window)")
    ap.add_argument("--threshold", type=float_range(0, 1), default=0.8,
                    help="normalised entropy threshold of a key window")
    ap.add_argument("--budget", type=float_range(0, 1, lo_open=True), default=None,
                    help="fraction of tokens allowed global (percentile rule; default: the threshold rule)")
    ap.add_argument("--local-window", type=int_range(0), default=128, help="local attention window W")
    ap.add_argument("--fallback", choices=["dense", "budget"], default="dense",
                    help="policy when entropy cannot separate the text")
    ap.add_argument("--layers", type=int_range(1), default=2, help="layers of the random-weight model")
    ap.add_argument("--d-model", type=int_range(1), default=128, help="model width")
    ap.add_argument("--heads", type=int_range(1), default=4, help="attention heads")
    ap.add_argument("--head-dim", type=int_range(1), default=32, help="dimension per head")
    ap.add_argument("--seed", type=int_range(0), default=0, help="model weight seed")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--max-tokens", type=int_range(0), default=DEFAULT_MAX_TOKENS,
                    help="refuse texts with more tokens than this (0: no limit)")
    ap.add_argument("--max-memory", type=parse_bytes, default=parse_bytes(DEFAULT_MAX_MEMORY),
                    help=f"refuse runs whose estimated memory per rank exceeds this (e.g. 16G; 0: no limit; "
                         f"default {DEFAULT_MAX_MEMORY})")
    return ap


def decode_text(data: bytes, name: str) -> str:
    """``data`` as UTF-8 text; a ``ValueError`` naming ``name`` and the first offending byte for anything else
    (invalid UTF-8, or NUL bytes, which text files do not hold: a binary file)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start:,} is "
                         f"invalid UTF-8): a binary file? prefill reads text files only") from None
    nul = text.find("\x00")
    if nul >= 0:
        raise ValueError(f"{name} is not text: it holds a NUL byte (at character {nul:,}), as binary files do; "
                         "prefill reads UTF-8 text files only")
    return text


def _read_text(path: str, limit: int) -> str:
    """The UTF-8 text of ``path`` ('-': stdin): a regular file (a FIFO, device or directory is refused unopened),
    at most ``limit`` bytes read (0: no limit; a larger file is refused unread), UTF-8 text (:func:`decode_text`)."""
    from .files import read_bounded

    data = read_bounded(path, limit, "the text", too_large=", more than --max-memory allows (the text alone would "
                        "exceed it); raise --max-memory (0: no limit)")
    return decode_text(data, "stdin" if path == "-" else path)


def main(argv: list[str] | None = None, prog: str = "hpczeco prefill") -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    import numpy as np
    from hpczeco.collectives import timed
    from hpczeco.collectives.context import get_context
    from mpi4py import MPI

    from hpczeco.daaf import dense_pairs, plan

    from .daaf_demo import ModelConfig, PrefillModel, TokenLimitError, tokenize
    from .mpienv import launcher_mismatch

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    mismatch = launcher_mismatch(size)
    if mismatch:  # refuse: each process would prefill the whole text alone, as rank 0 of its own world
        raise ValueError(mismatch)
    vocab = 256 if args.tokenizer == "byte" else 32768
    model = PrefillModel(ModelConfig(vocab_size=vocab, d_model=args.d_model, n_heads=args.heads,
                                     head_dim=args.head_dim, n_layers=args.layers, seed=args.seed))
    # the communicator's context first (collective, all ranks at once), so that the wait for rank 0's read below
    # is a timed library call that names its phase (not the context's creation)
    get_context(comm)  # cached on comm: the timed calls below find it
    text, err = None, None
    if rank == 0:
        try:
            text = _read_text(args.file, args.max_memory)
        except OSError as exc:
            err = f"{prog}: cannot read {args.file}: {exc.strerror or exc}"
        except ValueError as exc:
            err = f"{prog}: refusing to start: {exc}"
    timed.Barrier(comm, f"prefill: the other ranks wait while rank 0 reads {args.file}")
    t0 = time.perf_counter()
    # rank 0 tokenizes (stopping at --max-tokens) and broadcasts the ids, not the text
    tokens = None
    if rank == 0 and err is None:
        try:
            tokens = tokenize(text, mode=args.tokenizer, vocab_size=vocab, max_tokens=args.max_tokens or None)
        except TokenLimitError as exc:
            low = model.estimate(args.max_tokens, 0, 0, size, args.ranks, local_window=args.local_window)
            err = (f"{prog}: refusing to start: {exc} (--max-tokens {args.max_tokens:,}); at that many tokens alone "
                   f"the prefill needs ~{low.bytes_per_rank / 2**20:,.0f} MiB per rank and up to "
                   f"{dense_pairs(args.max_tokens):.3g} attention pairs; raise --max-tokens (0: no limit) to run it")
        except ValueError as exc:
            err = f"{prog}: {exc}"
        del text
    err, T = timed.bcast(comm, (err, 0 if tokens is None else int(tokens.size)), 0,
                         "prefill: the verdict on the text and its length (rank 0 tokenizes)")
    if err:
        if rank == 0:
            print(err, file=sys.stderr)
        return 2
    if rank != 0:
        tokens = np.empty(T, np.int32)
    timed.Bcast(comm, tokens, 0, "prefill: the token ids")
    try:
        t_tok = time.perf_counter()
        p = None
        if not args.dense:
            p = plan(tokens, window=args.window, threshold=args.threshold, local_window=args.local_window,
                     budget=args.budget, policy=args.fallback, stride=args.stride, vocab_size=vocab)
        t_plan = time.perf_counter()
        est = model.estimate(T, T if p is None else p.n_global, dense_pairs(T) if p is None else p.pairs, size,
                             args.ranks, local_window=args.local_window)
        if args.max_memory and est.bytes_per_rank > args.max_memory:
            if rank == 0:
                print(f"{prog}: refusing to start: estimated memory {est.bytes_per_rank / 2**20:,.0f} MiB per rank "
                      f"exceeds --max-memory {args.max_memory / 2**20:,.0f} MiB ({est.summary()}); raise "
                      "--max-memory (0: no limit) or use more ranks", file=sys.stderr)
            return 2
        res = model.prefill(tokens, "dense" if args.dense else "daaf", p, comm=comm if size > 1 else None,
                            mode=args.ranks)
    except (ValueError, TypeError) as exc:
        if rank == 0:
            print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    slowest = np.array([time.perf_counter() - t0])
    timed.Allreduce(comm, slowest, MPI.MAX, "prefill: the time to first token")
    ttft = float(slowest[0])
    if rank != 0:
        return 0
    out = {
        "file": args.file,
        "tokens": int(len(tokens)),
        "ranks": size,
        "mode": args.ranks if size > 1 else "single",
        "attention": "dense" if args.dense else "daaf",
        "ttft_s": ttft,
        "tokenize_s": t_tok - t0,
        "plan_s": t_plan - t_tok,
        "prefill_s": res.seconds,
        "attention_s": res.timings.get("attention"),
        "first_token": res.first_token,  # argmax of the last position's logits: random weights, no meaning
        "logits_checksum": logits_checksum(res.logits),
        "plan": None if p is None else p.to_dict(),
        "estimate": est.to_dict(),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    if p is not None:
        print(p.summary())
    else:
        print(f"T={len(tokens)}: dense causal attention (--dense), {len(tokens) * (len(tokens) + 1) // 2} pairs")
    print(f"ranks={size} mode={out['mode']} attention={out['attention']}")
    print(f"estimate: {est.summary()}")
    print(f"TTFT {ttft:.3f} s (tokenize {out['tokenize_s']:.3f} s, plan {out['plan_s']:.3f} s, "
          f"prefill {res.seconds:.3f} s of which attention {res.timings.get('attention', 0):.3f} s)")
    print(f"last-position logits checksum {out['logits_checksum']} (the weights are random, seed {args.seed}: "
          "not a prediction; a fingerprint: the same text, seed and attention path give it on any rank count, "
          "up to rounding)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
