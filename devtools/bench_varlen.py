"""Benchmark of packed sequences on the CPU: ``chunk_gla`` / ``chunk_gla_bwd`` with ``cu_seqlens`` against the plain
path on the same T tokens as one sequence (the same work without the document resets), and against a loop of plain
calls, one per document (what the bucketing replaces). Median over ``--repeats`` after ``--warmup`` rounds, of wall
clock and of this process's CPU time (the fairer figure on a shared machine).

    PYTHONPATH=. python devtools/bench_varlen.py [--T 16384 --H 4 --K 64 --V 64 --threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def lengths_of(rng: np.random.Generator, kind: str, T: int) -> list[int]:
    """Document lengths summing to T: "equal4" (4 of T/4), "exp1024"/"exp128" (exponential with that mean, some
    empty), "short" (uniform 1..32)."""
    if kind == "equal4":
        return [T // 4] * 3 + [T - 3 * (T // 4)]
    mean = {"exp1024": 1024, "exp128": 128, "short": 16}[kind]
    out, left = [], T
    while left > 0:
        L = int(rng.integers(1, 33)) if kind == "short" else int(rng.exponential(mean))
        L = min(L, left)
        out.append(L)
        left -= L
    return out


def timed(fn, warmup: int, repeats: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return float(np.median(wall)), float(np.median(cpu))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default="equal4,exp1024,exp128,short")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ["HPCZECO_GLA_THREADS"] = str(args.threads)
    from hpczeco.gla import chunk_gla, chunk_gla_bwd  # noqa: PLC0415

    rng = np.random.default_rng(0)
    T, H, K, V = args.T, args.H, args.K, args.V
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v, do = f(1, T, H, K), f(1, T, H, K), f(1, T, H, V), f(1, T, H, V)
    g = -rng.uniform(0.0, 0.3, (1, T, H, K)).astype(np.float32)
    rows = []

    def add(name, kind, n_docs, fn_f, fn_b):
        tf, cf = timed(fn_f, args.warmup, args.repeats)
        tb, cb = timed(fn_b, args.warmup, args.repeats)
        rows.append(dict(name=name, kind=kind, documents=n_docs, fwd_s=tf, fwd_cpu_s=cf, bwd_s=tb, bwd_cpu_s=cb))

    add("plain (one sequence)", "-", 1, lambda: chunk_gla(q, k, v, g, output_final_state=True),
        lambda: chunk_gla_bwd(q, k, v, g, do))
    for kind in args.kinds.split(","):
        lengths = lengths_of(rng, kind, T)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        N = len(lengths)
        h0 = f(N, H, K, V)
        add("cu_seqlens", kind, N, lambda cu=cu, h0=h0: chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                                                                   cu_seqlens=cu),
            lambda cu=cu, h0=h0: chunk_gla_bwd(q, k, v, g, do, initial_state=h0, cu_seqlens=cu))  # fmt: skip

        def loop_f(cu=cu, h0=h0):
            for i in range(len(cu) - 1):
                a, b = cu[i], cu[i + 1]
                chunk_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=h0[i : i + 1],
                          output_final_state=True)  # fmt: skip

        def loop_b(cu=cu, h0=h0):
            for i in range(len(cu) - 1):
                a, b = cu[i], cu[i + 1]
                chunk_gla_bwd(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], do[:, a:b], initial_state=h0[i : i + 1])

        add("loop of plain calls", kind, N, loop_f, loop_b)
    base = rows[0]
    print(f"T={T} H={H} K={K} V={V} float32, {args.threads} thread(s); median of {args.repeats} after {args.warmup}")
    print(f"{'':22s} {'docs':>8s} {'docs':>5s} {'fwd ms':>8s} {'cpu ms':>8s} {'x plain':>7s} {'bwd ms':>8s} "
          f"{'cpu ms':>8s} {'x plain':>7s}")
    for r in rows:
        r["fwd_cpu_vs_plain"] = r["fwd_cpu_s"] / base["fwd_cpu_s"]
        r["bwd_cpu_vs_plain"] = r["bwd_cpu_s"] / base["bwd_cpu_s"]
        print(f"{r['name']:22s} {r['kind']:>8s} {r['documents']:5d} {r['fwd_s'] * 1e3:8.1f} "
              f"{r['fwd_cpu_s'] * 1e3:8.1f} {r['fwd_cpu_vs_plain']:7.2f} {r['bwd_s'] * 1e3:8.1f} "
              f"{r['bwd_cpu_s'] * 1e3:8.1f} {r['bwd_cpu_vs_plain']:7.2f}")
    print("x plain: CPU time over the plain path's on the same tokens as one sequence")
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
