"""`hpczeco bench gla`: chunked GLA forward and forward+backward throughput on the CPU, beside the
machine's float32 matmul rate.

Times ``hpczeco.gla.chunk_gla`` (forward, with the final state) and ``chunk_gla`` + ``chunk_gla_bwd``
(forward+backward; the backward recomputes the chunk states) on random inputs ``q, k, v ~ N(0, 1)``,
``g = logsigmoid(N(0, 1))`` (``--gates``), and measures numpy matmul rates on the same machine:
a square ``1024 x 1024 x 1024`` product (reported as **peak**) and a batch of 1024 ``64 x 64 x 64``
products (the size of the chunk products). The four cases run interleaved, repeat by repeat (so load
from other processes hits them alike); median (and best) over ``--repeats`` after ``--warmup`` rounds.

FLOP count (nominal, dense chunk form, per (batch, head), ``T`` tokens, chunk ``C``)::

    forward  = 2 T (C K  +  C V  +  K V  +  K V)
               intra Q K^T   (A) V   inter Q S   state update K^T V
    backward = 2 T (3 C K  +  2 C V  +  5 K V)
               C K: A recomputed, dA K (dq), dA^T Q (dk);  C V: dA = dO V^T, A^T dO (dv);
               K V: state recompute K^T V, Q^T dO (state gradient), dO S^T (dq), V dH^T (dk), K dH (dv)

GFLOP/s = nominal FLOP / wall time; also reported per second of this process's CPU time (all its
threads), which other processes on a shared machine disturb much less. The implementation skips the
blocks above the diagonal of every chunk (sub-chunks of 16 tokens), so it executes fewer C-type FLOPs
than counted: the rate is "effective".
Writes ``gla.json``, ``gla.csv`` and ``gla.png`` (bar chart) into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import platform
from pathlib import Path

import numpy as np

from .benchkit import Stopwatch, cpu_model
from .options import int_range


def _parser(prog: str) -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--B", type=int_range(1), default=1, help="batch (default 1)")
    ap.add_argument("--T", type=int_range(1), default=16384, help="tokens (default 16384)")
    ap.add_argument("--H", type=int_range(1), default=4, help="heads (default 4)")
    ap.add_argument("--K", type=int_range(1), default=64, help="key dimension (default 64)")
    ap.add_argument("--V", type=int_range(1), default=64, help="value dimension (default 64)")
    ap.add_argument("--chunk-size", type=int_range(1), default=64, help="chunk size (default 64)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="element type")
    ap.add_argument("--gates", default="logsigmoid", choices=["logsigmoid", "strong", "weak"],
                    help="g = logsigmoid(N(0,1)) (default), strong (-8 per token) or weak (-1e-3)")  # fmt: skip
    ap.add_argument("--threads", type=int_range(1), default=None, help="GLA worker threads (sets HPCZECO_GLA_THREADS)")
    ap.add_argument("--repeats", type=int_range(1), default=5, help="timed runs (default 5)")
    ap.add_argument("--warmup", type=int_range(0), default=1, help="untimed runs first (default 1)")
    ap.add_argument("--out", default="runs/bench_gla", help="output folder (default runs/bench_gla)")
    ap.add_argument("--seed", type=int_range(0), default=0, help="input seed")
    return ap


def flops_forward(B: int, T: int, H: int, K: int, V: int, C: int) -> float:
    """Nominal forward FLOPs: 2 B H T (C K + C V + 2 K V)."""
    return 2.0 * B * H * T * (C * K + C * V + 2 * K * V)


def flops_backward(B: int, T: int, H: int, K: int, V: int, C: int) -> float:
    """Nominal backward FLOPs: 2 B H T (3 C K + 2 C V + 5 K V)."""
    return 2.0 * B * H * T * (3 * C * K + 2 * C * V + 5 * K * V)


def _gates(rng, shape, kind: str, dt) -> np.ndarray:
    if kind == "strong":
        return np.full(shape, -8.0, dtype=dt)
    if kind == "weak":
        return (-1e-3 * rng.random(shape)).astype(dt)
    return (-np.logaddexp(0.0, -rng.standard_normal(shape))).astype(dt)


def run(args) -> dict:
    if args.threads is not None:
        os.environ["HPCZECO_GLA_THREADS"] = str(args.threads)
    from hpczeco.gla import chunk_gla, chunk_gla_bwd
    from hpczeco.gla.chunk import num_threads as _num_threads

    B, T, H, K, V, C = args.B, args.T, args.H, args.K, args.V, args.chunk_size
    dt = np.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    q, k = (rng.standard_normal((B, T, H, K)).astype(dt) for _ in range(2))
    v, do = (rng.standard_normal((B, T, H, V)).astype(dt) for _ in range(2))
    g = _gates(rng, (B, T, H, K), args.gates, dt)
    load_before = os.getloadavg()

    a = rng.standard_normal((1024, 1024)).astype(dt)
    bm = rng.standard_normal((1024, 1024)).astype(dt)
    xa = rng.standard_normal((1024, 64, 64)).astype(dt)
    xb = rng.standard_normal((1024, 64, 64)).astype(dt)

    def fwd_bwd():
        chunk_gla(q, k, v, g, output_final_state=True, chunk_size=C)
        chunk_gla_bwd(q, k, v, g, do, chunk_size=C)

    cases = {
        "fwd": lambda: chunk_gla(q, k, v, g, output_final_state=True, chunk_size=C),
        "fb": fwd_bwd,
        "sq": lambda: a @ bm,
        "bt": lambda: np.matmul(xa, xb),
    }
    # interleaved repeat by repeat, so load from other processes hits every case alike
    times: dict[str, list[float]] = {n: [] for n in cases}
    cpu: dict[str, list[float]] = {n: [] for n in cases}
    for it in range(args.warmup + args.repeats):
        for name, fn in cases.items():
            with Stopwatch() as sw:
                fn()
            if it >= args.warmup:
                times[name].append(sw.wall)
                cpu[name].append(sw.cpu)
    load_after = os.getloadavg()

    ff = flops_forward(B, T, H, K, V, C)
    fbf = ff + flops_backward(B, T, H, K, V, C)
    tokens = B * T

    def row(name, key, flop, toks):
        ts, cs = times[key], cpu[key]
        med, best, cmed = float(np.median(ts)), float(min(ts)), float(np.median(cs))
        return {
            "name": name,
            "median_s": med,
            "best_s": best,
            "gflops_median": flop / med / 1e9,
            "gflops_best": flop / best / 1e9,
            "cpu_s_median": cmed,
            "gflop_per_cpu_s": flop / cmed / 1e9 if cmed > 0 else None,
            "tokens_per_s_median": (toks / med) if toks else None,
            "tokens_per_s_best": (toks / best) if toks else None,
            "flop": flop,
            "times_s": list(map(float, ts)),
            "cpu_times_s": list(map(float, cs)),
        }

    rows = [
        row("chunk_gla forward", "fwd", ff, tokens),
        row("chunk_gla forward+backward", "fb", fbf, tokens),
        row("matmul 1024x1024x1024 (peak)", "sq", 2.0 * 1024**3, None),
        row("matmul 1024 x (64x64x64)", "bt", 2.0 * 1024 * 64**3, None),
    ]
    peak = rows[2]["gflops_median"]
    peak_cpu = rows[2]["gflop_per_cpu_s"]
    for r in rows:
        r["fraction_of_peak_median"] = r["gflops_median"] / peak
        r["fraction_of_peak_per_cpu_s"] = (r["gflop_per_cpu_s"] / peak_cpu) if peak_cpu else None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "numpy": np.__version__, "load_before": load_before, "load_after": load_after},  # fmt: skip
        "config": {"B": B, "T": T, "H": H, "K": K, "V": V, "chunk_size": C, "dtype": str(dt), "gates": args.gates,
                   "threads": _num_threads(B * H), "repeats": args.repeats, "warmup": args.warmup},  # fmt: skip
        "flop_formula": {"forward": "2*B*H*T*(C*K + C*V + 2*K*V)", "backward": "2*B*H*T*(3*C*K + 2*C*V + 5*K*V)"},
        "rows": rows,
    }


def _write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gla.json").write_text(json.dumps(res, indent=2))
    keys = ["name", "median_s", "best_s", "gflops_median", "gflops_best", "fraction_of_peak_median",
            "cpu_s_median", "gflop_per_cpu_s", "fraction_of_peak_per_cpu_s", "tokens_per_s_median",
            "tokens_per_s_best"]  # fmt: skip
    with open(out / "gla.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in res["rows"]:
            w.writerow({k: r[k] for k in keys})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["GLA fwd", "GLA fwd+bwd", "matmul 1024^3\n(peak)", "matmul 1024 x 64^3"]
    vals = [r["gflops_median"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, vals, color=["tab:blue", "tab:orange", "tab:gray", "tab:gray"])
    for b_, v_ in zip(bars, vals):
        ax.annotate(f"{v_:.1f}", (b_.get_x() + b_.get_width() / 2, v_), ha="center", va="bottom")
    c = res["config"]
    ax.set_ylabel("GFLOP/s (median; GLA: nominal FLOP count)")
    ax.set_title(f"chunk_gla {c['dtype']} B={c['B']} T={c['T']} H={c['H']} K={c['K']} V={c['V']} C={c['chunk_size']}")
    fig.tight_layout()
    fig.savefig(out / "gla.png", dpi=120)
    plt.close(fig)


def _print(res: dict) -> None:
    c, m = res["config"], res["machine"]
    print(f"chunk_gla benchmark  {res['date_utc']} UTC  {m['cpu']} ({m['cores']} cores), "
          f"load {m['load_before'][0]:.1f} -> {m['load_after'][0]:.1f}")  # fmt: skip
    print(f"B={c['B']} T={c['T']} H={c['H']} K={c['K']} V={c['V']} chunk={c['chunk_size']} {c['dtype']} "
          f"gates={c['gates']} threads={c['threads']} repeats={c['repeats']}")  # fmt: skip
    hdr = (f"{'':30s} {'median ms':>9s} {'best ms':>8s} {'GFLOP/s':>8s} {'best':>6s} {'% peak':>7s} "
           f"{'cpu ms':>7s} {'GF/cpu-s':>8s} {'% peak':>7s} {'Mtok/s':>7s}")  # fmt: skip
    print(hdr)
    for r in res["rows"]:
        tok = f"{r['tokens_per_s_median'] / 1e6:7.3f}" if r["tokens_per_s_median"] else f"{'-':>7s}"
        gpc = r["gflop_per_cpu_s"] or 0.0
        fpc = 100 * (r["fraction_of_peak_per_cpu_s"] or 0.0)
        print(f"{r['name']:30s} {r['median_s'] * 1e3:9.2f} {r['best_s'] * 1e3:8.2f} {r['gflops_median']:8.1f} "
              f"{r['gflops_best']:6.1f} {100 * r['fraction_of_peak_median']:6.1f}% {r['cpu_s_median'] * 1e3:7.1f} "
              f"{gpc:8.1f} {fpc:6.1f}% {tok}")  # fmt: skip
    print("GFLOP/s: wall clock (median); GF/cpu-s: FLOP per second of this process's CPU time (all its threads),")
    print("less sensitive to other processes; % peak: against the 1024^3 matmul measured in the same rounds.")


def main(argv: list[str] | None = None, prog: str = "hpczeco bench gla") -> int:
    args = _parser(prog).parse_args(argv)  # every number checked by its type (drivers/options.py)
    from .files import check_output_dir

    check_output_dir(args.out, "--out")  # before the work
    res = run(args)
    _print(res)
    _write(res, Path(args.out))
    print(f"wrote {Path(args.out) / 'gla.json'}, gla.csv, gla.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
