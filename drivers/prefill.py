"""`hpczeco prefill FILE`: DAAF prefill of a text file with a small random-weight model.

Prints the plan summary (key regions, global fraction, attention work saved, the policy used and
why) and the time to first token (TTFT = tokenize + plan + prefill + first-token logits). Run it
under ``mpiexec -n P`` to split the prefill over ranks: ``--ranks sequence`` (the token sequence,
with halo exchange and a key-region allgather) or ``--ranks heads`` (tensor parallel heads/MLP).
``--dense`` uses exact causal attention instead of DAAF (the baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("file", help="UTF-8 text file to prefill ('-' for stdin)")
    ap.add_argument("--ranks", choices=["sequence", "heads"], default="sequence",
                    help="how to split the prefill over the MPI ranks (with more than one rank)")
    ap.add_argument("--dense", action="store_true", help="exact causal attention instead of DAAF")
    ap.add_argument("--tokenizer", choices=["word", "byte"], default="word")
    ap.add_argument("--window", type=int, default=512, help="entropy scan window (tokens)")
    ap.add_argument("--stride", type=int, default=None, help="scan stride (default: the window)")
    ap.add_argument("--threshold", type=float, default=0.8, help="normalised entropy threshold of a key window")
    ap.add_argument("--budget", type=float, default=None, help="fraction of tokens allowed global (percentile rule)")
    ap.add_argument("--local-window", type=int, default=128, help="local attention window W")
    ap.add_argument("--fallback", choices=["dense", "budget"], default="dense",
                    help="policy when entropy cannot separate the text")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="model weight seed")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return ap


def main(argv: list[str] | None = None, prog: str = "hpczeco prefill") -> int:
    args = build_parser(prog).parse_args(argv)
    from mpi4py import MPI

    from hpczeco.daaf import ModelConfig, PrefillModel, plan, tokenize

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    text, err = None, None
    if rank == 0:
        try:
            if args.file == "-":
                text = sys.stdin.read()
            else:
                with open(args.file, encoding="utf-8", errors="replace") as f:
                    text = f.read()
        except OSError as exc:
            err = f"{prog}: cannot read {args.file}: {exc}"
    text, err = comm.bcast((text, err), root=0)
    if err:
        if rank == 0:
            print(err, file=sys.stderr)
        return 2
    vocab = 256 if args.tokenizer == "byte" else 32768
    model = PrefillModel(ModelConfig(vocab_size=vocab, d_model=args.d_model, n_heads=args.heads,
                                     head_dim=args.head_dim, n_layers=args.layers, seed=args.seed))
    comm.Barrier()
    t0 = time.perf_counter()
    try:
        tokens = tokenize(text, mode=args.tokenizer, vocab_size=vocab)
        t_tok = time.perf_counter()
        p = None
        if not args.dense:
            p = plan(tokens, window=args.window, threshold=args.threshold, local_window=args.local_window,
                     budget=args.budget, policy=args.fallback, stride=args.stride, vocab_size=vocab)
        t_plan = time.perf_counter()
        res = model.prefill(tokens, "dense" if args.dense else "daaf", p, comm=comm if size > 1 else None,
                            mode=args.ranks)
    except (ValueError, TypeError) as exc:
        if rank == 0:
            print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    ttft = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
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
        "first_token": res.first_token,
        "plan": None if p is None else p.to_dict(),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    if p is not None:
        print(p.summary())
    else:
        print(f"T={len(tokens)}: dense causal attention (--dense), {len(tokens) * (len(tokens) + 1) // 2} pairs")
    print(f"ranks={size} mode={out['mode']} attention={out['attention']}")
    print(f"TTFT {ttft:.3f} s (tokenize {out['tokenize_s']:.3f} s, plan {out['plan_s']:.3f} s, "
          f"prefill {res.seconds:.3f} s of which attention {res.timings.get('attention', 0):.3f} s); "
          f"first token id {res.first_token}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
