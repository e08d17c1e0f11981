"""`hpczeco bench daaf`: DAAF time to first token, work saved, quality, needles and scheduling.

For each length (``--lengths``, default 8k and 32k tokens) a test text is built offline (segments of
Python stdlib source, high entropy, followed by repetitive log lines, low entropy). The same small
random-weight model prefills it with DAAF and with exact causal attention; reported:

* TTFT (tokenize + plan + prefill + first-token logits), median of ``--repeats`` runs after a warm-up,
  as wall time and as this process's CPU time (robust to other jobs on a shared machine; run with
  ``OPENBLAS_NUM_THREADS=1`` so that CPU time is the single-core work);
* the plan (policy, key regions, global fraction) and the attention work saved (exact pair counts);
* quality on ``--rows`` sampled query rows per layer: relative error of DAAF vs exact attention on the
  same q/k/v, and the exact attention mass on the keys DAAF keeps (recall); the relative error of the
  final hidden states and first-token agreement between the DAAF and the dense model;
* needle retrieval: a key/value planted at several depths inside key regions (and, as a control, in
  background regions) of layer 0's q/k/v, queried from the last position; retrieved when the
  attention output points at the planted value (cosine > 0.9 in every head).

Then 32 concurrent requests (``--requests``) with deadlines are served by ``--workers`` workers in a
discrete-event simulation with measured per-request prefill costs, priority (density / time to
deadline) vs FCFS: TTFT p50/p99, deadlines met, busy fraction; and a few rounds of the weight
controller. Under ``mpiexec -n P`` (P >= 2) the requests are instead served for real over MPI
(rank 0 dispatches, ranks 1..P-1 prefill). Prints a table; writes JSON and PNG into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from .benchkit import Stopwatch, cpu_model
from .console import Progress
from .options import float_range, int_range

#: what the columns of the printed tables mean (printed under them)
LEGEND = """\
legend:
  policy        how the plan chose global tokens (threshold: entropy above --threshold; fallback-*: entropy
                could not separate the text)
  global        share of tokens that get global attention (key regions); work saved: attention pairs skipped
  TTFT          time to first token in seconds (tokenize + plan + prefill + first-token logits), wall clock,
                median [min-max] over --repeats runs; speedup: dense / DAAF of the medians (wall, this
                process's CPU time, attention alone)
  verdict       "DAAF faster" / "dense faster" only when the two ranges do not overlap; otherwise the runs
                disagree and the difference is within the machine's noise (raise --repeats)
  L0 error      relative error of DAAF vs exact attention on layer 0, sampled query rows (--rows)
  L0 recall     exact attention mass on the keys DAAF keeps (1 = nothing lost)
  hidden error  relative error of the final hidden states (DAAF model vs dense model)
  same token    whether both models give the same first token (random weights: agreement, not quality)
  needles       planted key/value pairs retrieved from the last position: inside key regions / in the
                background (DAAF sees the background only through the local window)"""


def verdict(dense_s: list[float], daaf_s: list[float]) -> str:
    """Which path is faster, said only when every timed run agrees (the min-max ranges do not overlap)."""
    one = " (1 run each: no spread)" if min(len(dense_s), len(daaf_s)) < 2 else ""
    if max(daaf_s) < min(dense_s):
        return "DAAF faster" + one
    if max(dense_s) < min(daaf_s):
        return "dense faster" + one
    return "no clear winner (ranges overlap)"


def _spread(xs: list[float]) -> str:
    return f"{float(np.median(xs)):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def build_parser(prog: str) -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--lengths", default="8192,32768", help="comma-separated token counts (e.g. 8192,32768,131072)")
    ap.add_argument("--repeats", type=int_range(1), default=3, help="timed runs per length and path (median reported)")
    ap.add_argument("--source-share", type=float_range(0, 1), default=0.2,
                    help="share of each segment that is source code")
    ap.add_argument("--segment", type=int_range(1), default=4096, help="tokens per source+logs segment")
    ap.add_argument("--threshold", type=float_range(0, 1), default=0.65,
                    help="entropy threshold (word-level hashed tokens: stdlib windows score ~0.62-0.80, logs ~0.5)")
    ap.add_argument("--window", type=int_range(1), default=512, help="entropy scan window (tokens)")
    ap.add_argument("--local-window", type=int_range(0), default=128, help="local attention window W (tokens)")
    ap.add_argument("--layers", type=int_range(1), default=2, help="layers of the random-weight model")
    ap.add_argument("--d-model", type=int_range(1), default=128, help="model width")
    ap.add_argument("--heads", type=int_range(1), default=4, help="attention heads")
    ap.add_argument("--head-dim", type=int_range(1), default=32, help="dimension per head")
    ap.add_argument("--rows", type=int_range(1), default=64, help="sampled query rows for error/recall")
    ap.add_argument("--requests", type=int_range(1), default=32, help="concurrent requests of the serving part")
    ap.add_argument("--workers", type=int_range(1), default=4, help="workers (ranks/GPUs) of the scheduling simulation")
    ap.add_argument("--request-lengths", default="1024,2048,4096,8192",
                    help="token counts of the requests (cycled)")
    ap.add_argument("--skip-serve", action="store_true", help="skip the scheduling part")
    ap.add_argument("--seed", type=int_range(0), default=0, help="seed of the texts, the model and the sampled rows")
    ap.add_argument("--out", default="runs/daaf", help="output folder for daaf.json and daaf.png")
    return ap


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as exc:
        raise SystemExit(f"bad list of ints {s!r}: {exc}") from exc
    if not out or min(out) < 1:
        raise SystemExit(f"need positive ints, got {s!r}")
    return out


def _machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "cpu": cpu_model()}
    info["date_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    info["blas_threads_env"] = {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def _cos_all_heads(o: np.ndarray, v: np.ndarray) -> float:
    """min over heads of cos(o[h], v[h]); o, v: [H, Dv]."""
    num = np.sum(o * v, -1)
    den = np.linalg.norm(o, axis=-1) * np.linalg.norm(v, axis=-1) + 1e-30
    return float(np.min(num / den))


def needles(q, k, v, p, depths, rng) -> dict:
    """Plant key/value needles at ``depths`` (fractions of T) inside key regions and in background
    regions; query from the last non-key position. Returns per-needle results and rates."""
    from hpczeco.daaf.controller import daaf_rows, exact_rows

    T, H, D = q.shape[1], q.shape[2], q.shape[3]
    g, W = p.global_mask, p.local_window
    nonkey = np.flatnonzero(~g)
    qpos = int(nonkey[-1]) if len(nonkey) else T - 1
    key_pos, bg_pos = np.flatnonzero(g[: max(0, qpos - W)]), np.flatnonzero(~g[: max(0, qpos - W)])
    beta = np.sqrt(40.0 / D**-0.5)  # planted score 40 (logit units) above zero
    out = {"query_pos": qpos, "key_region": [], "background": []}
    for kind, cand in (("key_region", key_pos), ("background", bg_pos)):
        for d in depths:
            if len(cand) == 0:
                continue
            pos = int(cand[np.argmin(np.abs(cand - d * qpos))])
            u = rng.standard_normal(D)
            u /= np.linalg.norm(u)
            qq, kk, vv = q.copy(), k.copy(), v.copy()
            qq[0, qpos] = beta * u
            kk[0, pos] = beta * u
            vv[0, pos] = rng.standard_normal((H, v.shape[-1])) * 3
            r = np.array([qpos])
            od = daaf_rows(qq, kk, vv, p, r)[0, 0]
            oe = exact_rows(qq, kk, vv, r)[0, 0]
            out[kind].append({"depth": d, "pos": pos, "daaf_cos": _cos_all_heads(od, vv[0, pos]),
                              "exact_cos": _cos_all_heads(oe, vv[0, pos])})
    for kind in ("key_region", "background"):
        res = out[kind]
        out[f"{kind}_daaf_rate"] = float(np.mean([x["daaf_cos"] > 0.9 for x in res])) if res else None
        out[f"{kind}_exact_rate"] = float(np.mean([x["exact_cos"] > 0.9 for x in res])) if res else None
    return out


def bench_length(T: int, args, model, log) -> dict:
    from hpczeco.daaf import plan
    from hpczeco.daaf.controller import mass_recall, sample_rows, sampled_error

    from .daaf_demo import mixed_tokens, tokenize

    _, is_src, text = mixed_tokens(T, args.source_share, args.segment, args.seed)

    def ttft(dense: bool):
        with Stopwatch() as sw:
            tok = tokenize(text)
            p = None if dense else plan(tok, window=args.window, threshold=args.threshold,
                                        local_window=args.local_window)
            res = model.prefill(tok, "dense" if dense else "daaf", p, keep_hidden=True)
        return sw.wall, sw.cpu, res, p, tok

    runs = {"daaf": [], "dense": []}
    last = {}
    for i in range(args.repeats):
        for path in ("daaf", "dense"):
            secs, cpu, res, p, tok = ttft(path == "dense")
            runs[path].append({"wall": secs, "cpu": cpu, "attention_wall": res.timings["attention"]})
            last[path] = (res, p, tok)
            log(f"  T={T} run {i + 1}/{args.repeats} {path:5s} TTFT {secs:7.3f} s wall, {cpu:7.3f} s CPU "
                f"(attention {res.timings['attention']:.3f} s wall)")
    (rd, p, tok), (rx, _, _) = last["daaf"], last["dense"]
    med = {k: float(np.median([r["wall"] for r in v])) for k, v in runs.items()}
    med_cpu = {k: float(np.median([r["cpu"] for r in v])) for k, v in runs.items()}
    med_attn = {k: float(np.median([r["attention_wall"] for r in v])) for k, v in runs.items()}

    # quality: per layer on the DAAF model's own q/k/v, sampled rows
    log(f"  T={T} quality, needles: sampled rows, layer 0 background rows, planted needles ...")
    rows = sample_rows(len(tok), args.rows, seed=args.seed)
    qual = model.prefill(tok, "daaf", p, keep_qkv=True)
    layers = []
    for li, (q, k, v) in enumerate(qual.qkv):
        layers.append({"layer": li, "rel_error": sampled_error(q, k, v, p, rows),
                       "mass_recall": mass_recall(q, k, v, p, rows)})
    # rows far from the start, outside key regions (where DAAF differs from exact)
    bg_rows = np.flatnonzero(~p.global_mask)
    bg_rows = bg_rows[bg_rows > 4 * args.local_window]
    bg_rows = np.sort(np.random.default_rng(args.seed).choice(bg_rows, size=min(args.rows, len(bg_rows)),
                                                              replace=False)) if len(bg_rows) else bg_rows
    q0, k0, v0 = qual.qkv[0]
    bg = {"rel_error": sampled_error(q0, k0, v0, p, bg_rows) if len(bg_rows) else None,
          "mass_recall": mass_recall(q0, k0, v0, p, bg_rows) if len(bg_rows) else None}
    hid_err = float(np.linalg.norm(rd.hidden[rows] - rx.hidden[rows]) / np.linalg.norm(rx.hidden[rows]))
    nd = needles(q0, k0, v0, p, [0.1, 0.3, 0.5, 0.7, 0.9], np.random.default_rng(args.seed + T))
    src_recall = float((p.global_mask[: len(is_src)] & is_src[: len(p.global_mask)]).sum() / max(1, is_src.sum()))
    return {
        "T": int(len(tok)),
        "plan": {k: v for k, v in p.to_dict().items() if k != "weights"},
        "weights": [float(x) for x in p.weights],
        "window_starts": [int(x) for x in p.window_starts],
        "source_recall_of_key_regions": src_recall,
        "ttft_daaf_s": med["daaf"],
        "ttft_dense_s": med["dense"],
        "ttft_speedup": med["dense"] / med["daaf"],
        "ttft_daaf_range_s": [min(r["wall"] for r in runs["daaf"]), max(r["wall"] for r in runs["daaf"])],
        "ttft_dense_range_s": [min(r["wall"] for r in runs["dense"]), max(r["wall"] for r in runs["dense"])],
        "verdict": verdict([r["wall"] for r in runs["dense"]], [r["wall"] for r in runs["daaf"]]),
        "ttft_cpu_daaf_s": med_cpu["daaf"],
        "ttft_cpu_dense_s": med_cpu["dense"],
        "ttft_cpu_speedup": med_cpu["dense"] / med_cpu["daaf"],
        "attention_daaf_s": med_attn["daaf"],
        "attention_dense_s": med_attn["dense"],
        "attention_speedup": med_attn["dense"] / med_attn["daaf"],
        "runs": runs,
        "work_saved": p.work_saved,
        "global_fraction": p.global_fraction,
        "layers": layers,
        "background_rows_layer0": bg,
        "hidden_rel_error": hid_err,
        "first_token_daaf": rd.first_token,
        "first_token_dense": rx.first_token,
        "first_token_agrees": rd.first_token == rx.first_token,
        "needles": nd,
    }


def make_requests(args, rng, say=lambda s: None):
    from hpczeco.daaf import plan

    from .daaf_demo import mixed_tokens, tokenize

    lens = _ints(args.request_lengths)
    reqs = []
    progress = Progress("preparing requests (texts and plans)", args.requests, say)
    for i in range(args.requests):
        T = lens[i % len(lens)]
        share = float(rng.uniform(0.0, 0.5))
        _, _, text = mixed_tokens(T, share, min(args.segment, T), seed=args.seed + 1 + i)
        tok = tokenize(text)
        p = plan(tok, window=args.window, threshold=args.threshold, local_window=args.local_window,
                 policy="budget")
        reqs.append({"rid": i, "T": len(tok), "share": share, "text": text, "density": p.density,
                     "policy": p.policy, "work_saved": p.work_saved})
        progress.step()
    return reqs


def serve_sim(args, model, log) -> dict:
    from hpczeco.daaf import Request, metrics, plan

    from .daaf_demo import simulate, tokenize

    rng = np.random.default_rng(args.seed + 99)
    reqs = make_requests(args, rng, log)
    progress = Progress("measuring request costs (DAAF and dense prefill of each)", len(reqs), log)
    for r in reqs:  # measured prefill costs (one run each, after the warm-up): CPU seconds of this process,
        for path in ("daaf", "dense"):  # which other jobs on a shared machine inflate less than wall time
            with Stopwatch() as sw:
                tok = tokenize(r["text"])
                p = None if path == "dense" else plan(tok, window=args.window, threshold=args.threshold,
                                                      local_window=args.local_window, policy="budget")
                model.prefill(tok, path, p)
            r[f"wall_{path}"] = sw.wall
            r[f"cost_{path}"] = sw.cpu
        progress.step()
    log(f"  measured {len(reqs)} request costs: DAAF total {sum(r['cost_daaf'] for r in reqs):.2f} s, "
        f"dense total {sum(r['cost_dense'] for r in reqs):.2f} s")
    horizon = sum(r["cost_daaf"] for r in reqs) / args.workers
    slack = rng.uniform(0.25, 1.25, size=len(reqs)) * horizon
    out = {"workers": args.workers, "requests": [{k: v for k, v in r.items() if k != "text"} for r in reqs],
           "deadline_horizon_s": horizon, "results": {}}
    for path in ("daaf", "dense"):
        rq = [Request(r["rid"], 0.0, float(slack[i]), r["density"], r[f"cost_{path}"]) for i, r in enumerate(reqs)]
        for pol in ("priority", "fcfs"):
            res = simulate(rq, args.workers, pol)
            m = metrics(res)
            m["ttft_all"] = [s.ttft for s in res.served]
            out["results"][f"{path}/{pol}"] = m
    return out


def serve_real(args, comm, model, log) -> dict:
    """Serve the requests for real over MPI: rank 0 dispatches, ranks 1..P-1 prefill."""
    from hpczeco.collectives import timed

    from hpczeco.daaf import Request, metrics, plan, serve_mpi

    from .daaf_demo import tokenize

    rng = np.random.default_rng(args.seed + 99)
    reqs = make_requests(args, rng, log) if comm.Get_rank() == 0 else None
    reqs = timed.bcast(comm, reqs, 0, "bench daaf: the requests")
    # calibrate a cost model on rank 0: seconds per DAAF pair (one mid-size prefill)
    rate = None
    if comm.Get_rank() == 0:
        r = reqs[len(reqs) // 2]
        tok = tokenize(r["text"])
        p = plan(tok, window=args.window, threshold=args.threshold, local_window=args.local_window, policy="budget")
        t0 = time.perf_counter()
        model.prefill(tok, "daaf", p)
        rate = (time.perf_counter() - t0) / p.pairs
    rate = timed.bcast(comm, rate, 0, "bench daaf: the calibrated rate (rank 0 runs a prefill)")
    est = []
    progress = Progress("planning the requests", len(reqs), log)
    for r in reqs:
        progress.step()
        p = plan(tokenize(r["text"]), window=args.window, threshold=args.threshold,
                 local_window=args.local_window, policy="budget")
        est.append(p.pairs * rate)
    workers = max(1, comm.Get_size() - 1)
    horizon = sum(est) / workers
    slack = rng.uniform(0.25, 1.25, size=len(reqs)) * horizon

    def run(req):
        tok = tokenize(req.payload)
        p = plan(tok, window=args.window, threshold=args.threshold, local_window=args.local_window, policy="budget")
        model.prefill(tok, "daaf", p)

    rq = [Request(r["rid"], 0.0, float(slack[i]), r["density"], float(est[i]), r["text"]) for i, r in enumerate(reqs)]
    out = {"workers": workers, "mode": "mpi", "deadline_horizon_s": horizon, "results": {}}
    for pol in ("priority", "fcfs"):
        log(f"  real MPI serve {pol}: {len(rq)} requests on {workers} worker rank(s) ...")
        res = serve_mpi(rq, comm, run, pol)
        m = metrics(res)
        m["ttft_all"] = [s.ttft for s in res.served]
        out["results"][f"daaf/{pol}"] = m
        log(f"  real MPI serve {pol}: p50 {m['ttft_p50']:.2f} s p99 {m['ttft_p99']:.2f} s "
            f"met {m['deadlines_met']:.2f} busy {m['busy_fraction']:.2f}")
    return out


def controller_rounds(args, model, log) -> dict:
    from hpczeco.daaf import WeightController, attention, exact_attention, plan
    from hpczeco.daaf.controller import sample_rows, sampled_error

    from .daaf_demo import mixed_tokens, run_rounds, tokenize

    T = min(_ints(args.lengths)[0], 8192)
    _, _, text = mixed_tokens(T, args.source_share, args.segment, args.seed)
    tok = tokenize(text)
    dense_plan = plan(tok, window=args.window, threshold=args.threshold, local_window=args.local_window)
    q, k, v = model.prefill(tok, "daaf", dense_plan, keep_qkv=True).qkv[0]
    t0 = time.perf_counter()
    exact_attention(q, k, v)
    budget = 0.6 * (time.perf_counter() - t0)  # the round's time budget: 60% of dense attention time
    rows = sample_rows(len(tok), args.rows, seed=args.seed)

    def measure(p):
        a = time.perf_counter()
        o = attention(q, k, v, p)
        busy = time.perf_counter() - a
        return sampled_error(q, k, v, p, rows, o_daaf=o), min(1.0, busy / budget)

    c = WeightController(error_threshold=0.5)
    log(f"  controller at T={len(tok)}: 8 rounds of the weight controller ...")
    log_ = run_rounds(c, tok, 8, measure, window=args.window, local_window=args.local_window)
    log(f"  controller at T={len(tok)}: w = " + " -> ".join(f"{r['w']:.3f}" for r in log_) + f" -> {c.w:.3f}")
    return {"T": int(len(tok)), "error_threshold": 0.5, "time_budget_s": budget, "rounds": log_}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    L = result["lengths"]
    xs = np.arange(len(L))
    ax[0, 0].bar(xs - 0.2, [r["ttft_dense_s"] for r in L], 0.4, label="exact causal")
    ax[0, 0].bar(xs + 0.2, [r["ttft_daaf_s"] for r in L], 0.4, label="DAAF")
    ax[0, 0].set_xticks(xs, [f"{r['T']}\n{r['ttft_speedup']:.2f}x wall, {r['ttft_cpu_speedup']:.2f}x CPU" for r in L])
    ax[0, 0].set_ylabel("TTFT (s)")
    ax[0, 0].set_title("time to first token (median)")
    ax[0, 0].legend()
    big = L[-1]
    st = np.array(big["window_starts"])
    ax[0, 1].step(st, big["weights"], where="post", label="window entropy")
    thr = big["plan"]["threshold"]
    if thr is not None:
        ax[0, 1].axhline(thr, color="r", ls="--", label=f"threshold {thr:.2f}")
    for a, b in big["plan"]["regions"]:
        ax[0, 1].axvspan(a, b, color="orange", alpha=0.25)
    ax[0, 1].set_title(f"weight map, T={big['T']} (key regions shaded)")
    ax[0, 1].set_xlabel("token")
    ax[0, 1].legend()
    if result.get("serve"):
        for name, m in result["serve"]["results"].items():
            t = np.sort(m["ttft_all"])
            ax[1, 0].plot(t, np.arange(1, len(t) + 1) / len(t), label=f"{name} (met {m['deadlines_met']:.0%})")
        ax[1, 0].set_xlabel("TTFT (s)")
        ax[1, 0].set_ylabel("CDF")
        ax[1, 0].set_title(f"{len(t)} concurrent requests, {result['serve']['workers']} workers")
        ax[1, 0].legend(fontsize=8)
    if result.get("controller"):
        r = result["controller"]["rounds"]
        ax[1, 1].plot([x["w"] for x in r], "o-", label="weight w (work budget)")
        ax[1, 1].plot([x["work_fraction"] for x in r], "s--", label="plan work fraction")
        ax[1, 1].plot([x["error"] for x in r], "^:", label="sampled rel. error")
        ax[1, 1].set_xlabel("round")
        ax[1, 1].set_title("weight controller")
        ax[1, 1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, prog: str = "hpczeco bench daaf") -> int:
    args = build_parser(prog).parse_args(argv)
    from mpi4py import MPI

    from hpczeco.daaf import plan

    from .daaf_demo import ModelConfig, PrefillModel, mixed_tokens
    from .files import check_output_dir, rank0_verdict

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rank0_verdict(comm, lambda: check_output_dir(args.out, "--out"), f"{prog}: checking --out")  # before the work
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    out = Path(args.out)
    model = PrefillModel(ModelConfig(d_model=args.d_model, n_heads=args.heads, head_dim=args.head_dim,
                                     n_layers=args.layers, seed=args.seed))
    # warm-up (excluded): both paths on a short text
    log(f"{prog}: warm-up (both paths on a short text, not timed) ...")
    n_warm = min(2048, min(_ints(args.lengths)))
    tok_w, _, _ = mixed_tokens(n_warm, args.source_share, min(args.segment, n_warm), args.seed)
    pw = plan(tok_w, window=args.window, threshold=args.threshold, local_window=args.local_window)
    model.prefill(tok_w, "daaf", pw)
    model.prefill(tok_w, "dense")
    if comm.Get_size() > 1:
        log(f"{prog}: {comm.Get_size()} ranks: serving {args.requests} requests for real over MPI")
        res = {"machine": _machine(), "args": vars(args), "serve": serve_real(args, comm, model, log)}
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "daaf_serve_mpi.json").write_text(json.dumps(res, indent=1))
            log(f"wrote {out / 'daaf_serve_mpi.json'}")
        return 0

    result = {"machine": _machine(), "args": vars(args), "lengths": []}
    for T in _ints(args.lengths):
        log(f"T={T}:")
        result["lengths"].append(bench_length(T, args, model, log))
    share_sweep = []
    n_sweep = min(8192, max(_ints(args.lengths)))
    for share in (0.05, 0.1, 0.2, 0.4):
        tok, _, _ = mixed_tokens(n_sweep, share, args.segment, args.seed)
        p = plan(tok, window=args.window, threshold=args.threshold, local_window=args.local_window)
        share_sweep.append({"T": n_sweep, "source_share": share, "policy": p.policy,
                            "global_fraction": p.global_fraction, "work_saved": p.work_saved})
    result["share_sweep"] = share_sweep
    result["controller"] = controller_rounds(args, model, log)
    if not args.skip_serve:
        log("serving:")
        result["serve"] = serve_sim(args, model, log)

    # tables (the legend under them says what each column is)
    L = result["lengths"]
    print(f"\ntime to first token, seconds: median [min-max] of {args.repeats} run(s) per path")
    print(f"{'tokens':>7} {'policy':>14} {'global':>7} {'work saved':>10} {'dense TTFT':>21} {'DAAF TTFT':>21} "
          f"{'speedup wall/CPU/attn':>22}  verdict")
    for r in L:
        dense = [x["wall"] for x in r["runs"]["dense"]]
        daaf = [x["wall"] for x in r["runs"]["daaf"]]
        speed = f"{r['ttft_speedup']:.2f}x/{r['ttft_cpu_speedup']:.2f}x/{r['attention_speedup']:.2f}x"
        print(f"{r['T']:>7} {r['plan']['policy']:>14} {r['global_fraction']:>7.1%} {r['work_saved']:>10.1%} "
              f"{_spread(dense):>21} {_spread(daaf):>21} {speed:>22}  {r['verdict']}")
    print("\nquality of DAAF against exact attention (same random-weight model)")
    print(f"{'tokens':>7} {'L0 error':>9} {'L0 recall':>9} {'hidden error':>12} {'same token':>10} "
          f"{'needles in key regions':>22} {'needles in background':>21}")
    for r in L:
        nd = r["needles"]
        bg = nd["background_daaf_rate"]
        print(f"{r['T']:>7} {r['layers'][0]['rel_error']:>9.3f} {r['layers'][0]['mass_recall']:>9.3f} "
              f"{r['hidden_rel_error']:>12.3f} {'yes' if r['first_token_agrees'] else 'no':>10} "
              f"{nd['key_region_daaf_rate']:>22.0%} {'-' if bg is None else f'{bg:.0%}':>21}")
    if result.get("serve"):
        print(f"\n{args.requests} concurrent requests, {args.workers} workers (simulated, measured CPU-second costs):")
        print(f"{'path/policy':>15} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'deadlines met':>13} {'workers busy':>12}")
        for name, m in result["serve"]["results"].items():
            print(f"{name:>15} {m['ttft_p50']:>10.2f} {m['ttft_p99']:>10.2f} {m['deadlines_met']:>13.0%} "
                  f"{m['busy_fraction']:>12.1%}")
        print("  (priority: by density / time to deadline; fcfs: first come, first served)")
    print()
    print(LEGEND)
    out.mkdir(parents=True, exist_ok=True)
    (out / "daaf.json").write_text(json.dumps(result, indent=1, default=float))
    plot(result, out / "daaf.png")
    print(f"\nwrote {out / 'daaf.json'} and {out / 'daaf.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
