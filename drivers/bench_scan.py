"""`hpczeco bench scan`: ring All-Scan vs tree vs allgather / serial relay / MPI_Exscan, beside the cost model.

Run under MPI, e.g. ``mpiexec -n 8 python -m hpczeco bench scan --out runs/scan``. For every state
size (``--sizes``, default 4 KiB .. 64 MiB; state ``[H, K, V]`` with ``V=128``, ``K = min(128, rows)``,
so 1 MiB float32 is ``H=16, K=V=128``) and every topology (the ring with the cost model's blocks
and with a few fixed ``--blocks``, tree, allgather, serial, exscan) it times ``scan()``: every
repeat starts at a barrier and counts the slowest rank (max over ranks); the median over
``--repeats`` (after ``--warmup``) is reported next to the cost model's prediction from link
parameters calibrated in the same run (``--no-calibrate``: ``--link`` instead). Rank 0 prints a
table and writes ``scan_P{P}.json``, ``scan_P{P}.csv`` and ``scan_P{P}.png`` into ``--out``: one
file set per rank count, so runs at several P share a folder (``hpczeco report`` merges them).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import os
import platform
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"


def parse_size(text: str) -> int:
    """``"4K"``, ``"1M"``, ``"64MiB"``, ``"4096"`` -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        val = float(num) * mult
    except ValueError:
        val = float("nan")
    if not math.isfinite(val):
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 4K, 1M, 64M, 4096)")
    val = int(val)
    if val <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return val


def parse_size_or_zero(text: str) -> int:
    """:func:`parse_size`, and 0 for any form of zero (``0``, ``0M``)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B").rstrip("KMG")
    try:
        if float(t) == 0:
            return 0
    except ValueError:
        pass
    return parse_size(text)


def fmt_size(n: float) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def state_shape(nbytes: int, itemsize: int, V: int = 128, Kmax: int = 128) -> tuple[int, int, int]:
    """``(H, K, V)`` of about ``nbytes``: ``rows = nbytes / (V * itemsize)``, ``K = min(Kmax, rows)``."""
    rows = max(1, nbytes // (V * itemsize))
    K = min(Kmax, rows)
    H = max(1, rows // K)
    return H, K, V


def build_parser(prog: str) -> argparse.ArgumentParser:
    from hpczeco.collectives.names import ALGORITHMS, TOPOLOGIES

    from .helpfmt import HelpFormatter, split_doc, topology_list
    from .options import float_range, int_list, int_range, link_text, size_bytes, size_list

    description, epilog = split_doc(__doc__)
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, type=size_list(),
                    help="state sizes in bytes per rank (K/M suffixes)")
    ap.add_argument("--topologies", default=",".join(ALGORITHMS), type=topology_list,
                    help=f"comma list of {','.join(TOPOLOGIES)}")
    ap.add_argument("--blocks", default="4,16,64", type=int_list(1),
                    help="extra fixed piece counts of ring and ptree (each <= K; the model's choice always runs as "
                         "'ring' / 'ptree')")
    ap.add_argument("--repeats", type=int_range(1), default=15, help="timed repeats per point (median reported)")
    ap.add_argument("--warmup", type=int_range(0), default=3, help="untimed repeats before timing")
    ap.add_argument("--time-limit", type=float_range(0, lo_open=True), default=3.0,
                    help="stop repeating a point after this many seconds (at least 3 timed repeats)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="state element type")
    ap.add_argument("--V", type=int_range(1), default=128, help="state columns V (value head dim)")
    ap.add_argument("--K", type=int_range(1), default=128, help="largest key dim K (rows per head)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                    help="measure alpha/beta/gamma on this machine first; --no-calibrate: use --link instead")
    ap.add_argument("--calibrate-method", default="shift", choices=["shift", "pingpong"],
                    help="link measurement: cyclic shift (the ring's steady state) or pair ping-pong")
    ap.add_argument("--ring-big", default="16M", type=size_bytes(allow_zero=True),
                    help="state size of the calibration's second ring fit (the stage cost once states outgrow the "
                         "caches; more than 2M), 0: skip it (slow links: it moves 16 MiB per hop)")
    ap.add_argument("--link", default="shm", type=link_text,
                    help="link preset or 'alpha,beta[,gamma[,delta]]' without calibration")
    ap.add_argument("--max-gather-mib", type=float_range(0), default=1024.0,
                    help="skip allgather/exscan points whose P*state exceeds this per rank (memory)")
    ap.add_argument("--overlap-ms", type=float_range(0), default=0.0,
                    help="also measure overlap: ring scan_start, this much compute, wait; poll vs progress thread")
    ap.add_argument("--overlap-size", default="4M", type=size_bytes(), help="state size for --overlap-ms")
    ap.add_argument("--out", default="runs/bench_scan", help="output folder (one scan_P{P}.* set per rank count)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return ap


#: what Open MPI's launcher sets for its own processes (job ids, addresses, paths): not settings of the run
_LAUNCHER_MCA = tuple(f"OMPI_MCA_{k}" for k in ("orte_ess_", "orte_hnp_", "orte_local_daemon_", "orte_jobfam_",
                                                  "orte_top_session_", "orte_tmpdir_", "orte_launch",
                                                  "orte_app_num", "orte_num_nodes", "orte_precondition_",
                                                  "orte_bound_at_launch", "ess", "pmix", "initial_wdir",
                                                  "shmem_RUNTIME"))


def machine_info() -> dict[str, Any]:
    from mpi4py import MPI

    from .benchkit import cpu_model

    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mpi": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": [round(x, 2) for x in os.getloadavg()],
        "cpu": cpu_model(),
    }
    mca = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(("OMPI_MCA_", "MPIR_CVAR_")) and not k.startswith(_LAUNCHER_MCA)}
    if mca:  # the MPI library's settings from the environment (mpirun's --mca lands here too)
        info["mpi_env"] = mca
    if os.environ.get("NETNS_HOSTS"):  # inside tests/netns/netns.sh: one rank per namespace, TCP
        info["netns"] = {"hosts": os.environ["NETNS_HOSTS"], "mpi": os.environ.get("NETNS_MPI"),
                         "rate": os.environ.get("NETNS_RATE") or None, "delay": os.environ.get("NETNS_DELAY") or None}
    return info


#: Open MPI's shared-memory single-copy setting (environment form of ``--mca btl_vader_single_copy_mechanism``)
SINGLE_COPY_VARS = ("OMPI_MCA_btl_vader_single_copy_mechanism", "OMPI_MCA_btl_sm_single_copy_mechanism")


def transport_note() -> str | None:
    """A line for the user when Open MPI's shared memory copies every message twice (single copy off)."""
    for var in SINGLE_COPY_VARS:
        if os.environ.get(var, "").strip().lower() == "none":
            mca = var.removeprefix("OMPI_MCA_")
            return (f"note: {var}=none: on one node every message above the eager size is copied in and out "
                    f"of shared memory; where the kernel allows it, --mca {mca} cma "
                    "(one copy by the receiver) made the ring 2-3x faster at 1 MiB on 12 ranks "
                    "(docs/benchmarks/network.md)")
    return None


def exscan_algorithm() -> str:
    """How this MPI implements MPI_Exscan for the model: Open MPI's coll/basic is linear."""
    from mpi4py import MPI

    return "linear" if "Open MPI" in MPI.Get_library_version() else "recursive_doubling"


def time_point(comm, fn, repeats: int, warmup: int, limit: float, phases: list[float] | None = None) -> list[float]:
    """Max-over-ranks seconds of ``fn()`` per repeat (barrier-synchronised start). Collective.

    If ``fn`` returns a number (the seconds of its first phase, e.g. ``scan_start``), the max over ranks of
    that per repeat is appended to ``phases``. The barrier and the reduction block (as what they time does) under
    a guard of the collective timeout (:func:`hpczeco.collectives.lifeline.guard`)."""
    from hpczeco.collectives.lifeline import guard
    from mpi4py import MPI

    buf = np.zeros(2)
    times: list[float] = []
    spent = 0.0
    for i in range(warmup + repeats):
        with guard(comm, "bench scan: the barrier before a timed repeat"):  # blocking, as timed; bounded
            comm.Barrier()
        t0 = time.perf_counter()
        first = fn()
        buf[0] = time.perf_counter() - t0
        buf[1] = first if first is not None else 0.0
        with guard(comm, "bench scan: the slowest rank's time of a repeat"):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        spent += float(buf[0])  # the same on every rank: the stop decision is collective
        if i >= warmup:
            times.append(float(buf[0]))
            if phases is not None:
                phases.append(float(buf[1]))
            if len(times) >= 3 and spent > limit:
                break
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hpczeco.collectives import costmodel, scan_start
    from hpczeco.collectives.calibrate import calibrate
    from mpi4py import MPI

    from .console import warn_core_sharing, warn_oversubscribed

    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    over = warn_oversubscribed(comm, "hpczeco bench scan")  # collective; rank 0 warns once
    # collective; when not oversubscribed, other work on the ranks' cores (another job bound to them)
    shared = warn_core_sharing(comm, "hpczeco bench scan") if over is None else None
    dtype = np.dtype(args.dtype)
    sizes = list(args.sizes)
    topos = args.topologies
    fixed_blocks = list(args.blocks) if ("ring" in topos or "ptree" in topos) else []

    if args.calibrate:
        params = calibrate(comm, sizes=(8, 64 << 10, 1 << 20, 4 << 20), dtype=args.dtype,
                           method=args.calibrate_method, ring_big=args.ring_big)
    else:
        params = costmodel.parse_link(args.link)
    costmodel.set_default_params(params)  # blocks=None / "auto" use the same numbers as the predictions
    alg = exscan_algorithm()
    if rank == 0:
        print(f"bench scan: P={P} ranks, {args.dtype}, {params.describe()}, exscan modelled as {alg}", flush=True)
        note = transport_note()
        if note:
            print(note, flush=True)

    rng = np.random.default_rng(1234 + rank)
    results: list[dict[str, Any]] = []
    started = machine_info()  # date and load average at the start (the snapshot's are at the end)

    def snapshot(overlap: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "bench": "scan",
            "P": P,
            "dtype": args.dtype,
            "oversubscribed": over is not None,
            "oversubscription": None if over is None else {**asdict(over), "describe": over.describe()},
            "core_sharing": None if shared is None else {**asdict(shared), "describe": shared.describe()},
            "machine": machine_info(),
            "load_at_start": started["load"],
            "params": params.as_dict(),
            "calibrated": bool(args.calibrate),
            "exscan_algorithm": alg,
            "args": vars(args),
            "results": results,
            "overlap": overlap,
        }

    for size in sizes:
        H, K, V = state_shape(size, dtype.itemsize, args.V, args.K)
        nbytes = H * K * V * dtype.itemsize
        a = rng.uniform(0.5, 1.0, (H, K)).astype(dtype)
        S = rng.standard_normal((H, K, V)).astype(dtype)
        out = np.zeros_like(S)  # the result buffer, reused (as a training loop would)
        labels: list[tuple[str, str, int | None]] = []
        for t in topos:
            labels.append((t, t, None))
            if t in ("ring", "ptree"):  # the model's piece count, then fixed ones
                labels += [(f"{t}/k={b}", t, b) for b in fixed_blocks if b <= K]
        for label, topo, blocks in labels:
            if topo in ("allgather", "exscan") and P * nbytes > args.max_gather_mib * (1 << 20):
                if rank == 0:
                    print(f"  skip {label} at {fmt_size(nbytes)}: P*state > --max-gather-mib", flush=True)
                continue
            used: dict[str, Any] = {}

            def fn(topo=topo, blocks=blocks, used=used, a=a, S=S, out=out):
                t0 = time.perf_counter()
                h = scan_start(a, S, comm, topology=topo, blocks=blocks, out=out)
                t_start = time.perf_counter() - t0  # validation, agreement, plan, first messages
                h.wait()
                used["topology"], used["blocks"] = h.topology, h.blocks
                return t_start

            starts: list[float] = []
            times = time_point(comm, fn, args.repeats, args.warmup, args.time_limit, starts)
            t_topo, t_blocks = used["topology"], used["blocks"]
            model = costmodel.predict(t_topo, P, nbytes, params, blocks=t_blocks, K=K, V=V, exscan_algorithm=alg)
            row = {
                "P": P, "label": label, "topology": t_topo, "blocks": t_blocks, "nbytes": nbytes,
                "shape": [H, K, V], "median_s": float(np.median(times)), "min_s": float(np.min(times)),
                "mean_s": float(np.mean(times)), "repeats": len(times), "model_s": model,
                "times_s": [float(t) for t in times],
                "start_median_s": float(np.median(starts)),  # slowest rank's scan_start (validation + posting)
            }
            results.append(row)
            if rank == 0:
                print(f"  {fmt_size(nbytes):>8s} {label:12s} k={t_blocks!s:>4s} median {row['median_s'] * 1e3:9.3f} ms"
                      f" (min {row['min_s'] * 1e3:.3f}, scan_start {row['start_median_s'] * 1e3:.3f})"
                      f"  model {model * 1e3:9.3f} ms  ({len(times)} reps)", flush=True)
        if rank == 0 and args.out:  # partial results survive a job that is cut short
            write_outputs(snapshot(), Path(args.out), plot=False)
    overlap = overlap_experiment(comm, args, dtype) if args.overlap_ms > 0 else None
    return snapshot(overlap)


def _busy(x: np.ndarray, y: np.ndarray, iters: int) -> None:
    for _ in range(iters):
        np.sin(x, out=y)  # releases the GIL


def overlap_experiment(comm, args: argparse.Namespace, dtype: np.dtype) -> dict[str, Any]:
    """Ring scan overlapped with local compute: ``scan_start``, compute, ``wait``.

    Variants: "scan only", "compute only", "sequential" (scan, then compute), "poll" (start,
    compute without calling test(), wait), "poll+test" (compute in 8 slices, test() between), and
    "thread" (``progress="thread"``). Median of max-over-ranks times.
    """
    from hpczeco.collectives import scan_start, timed
    from mpi4py import MPI

    size = int(args.overlap_size)
    H, K, V = state_shape(size, dtype.itemsize, args.V, args.K)
    rng = np.random.default_rng(7)
    a = rng.uniform(0.5, 1.0, (H, K)).astype(dtype)
    S = rng.standard_normal((H, K, V)).astype(dtype)
    x = rng.standard_normal(1 << 16)
    y = np.empty_like(x)
    t0 = time.perf_counter()
    _busy(x, y, 20)
    per = (time.perf_counter() - t0) / 20
    iters = max(8, int(args.overlap_ms * 1e-3 / per))
    total = np.array([iters], np.int64)
    timed.Allreduce(comm, total, MPI.SUM, "bench scan: the overlap's compute iterations")
    iters = int(total[0] // comm.Get_size())
    blocks = min(K, 16)

    out = np.zeros_like(S)

    def scan_only():
        scan_start(a, S, comm, topology="ring", blocks=blocks, out=out).wait()

    def compute_only():
        _busy(x, y, iters)

    def sequential():
        scan_only()
        compute_only()

    def poll():
        h = scan_start(a, S, comm, topology="ring", blocks=blocks, out=out)
        _busy(x, y, iters)
        h.wait()

    def poll_test():
        h = scan_start(a, S, comm, topology="ring", blocks=blocks, out=out)
        for _ in range(8):
            _busy(x, y, iters // 8)
            h.test()
        h.wait()

    def thread():
        h = scan_start(a, S, comm, topology="ring", blocks=blocks, progress="thread", out=out)
        _busy(x, y, iters)
        h.wait()

    res: dict[str, Any] = {"nbytes": H * K * V * dtype.itemsize, "blocks": blocks, "compute_iters": iters}
    for name, fn in (("scan only", scan_only), ("compute only", compute_only), ("sequential", sequential),
                     ("poll", poll), ("poll+test", poll_test), ("thread", thread)):
        res[name] = float(np.median(time_point(comm, fn, args.repeats, args.warmup, args.time_limit)))
    if comm.Get_rank() == 0:
        print(f"\noverlap: ring k={blocks}, {fmt_size(res['nbytes'])} state, ~{args.overlap_ms} ms compute per rank")
        for k in ("scan only", "compute only", "sequential", "poll", "poll+test", "thread"):
            print(f"  {k:13s} {res[k] * 1e3:9.3f} ms")
    return res


def print_table(data: dict[str, Any]) -> None:
    res = data["results"]
    labels = list(dict.fromkeys(r["label"] for r in res))
    sizes = sorted({r["nbytes"] for r in res})
    by = {(r["label"], r["nbytes"]): r for r in res}
    over = ", OVERSUBSCRIBED" if data.get("oversubscribed") else (", CORES SHARED" if data.get("core_sharing") else "")
    print(f"\nscan time, P={data['P']} ({data['dtype']}{over}), median of max-over-ranks; ms measured / model")
    head = f"{'state':>9s} " + " ".join(f"{lab:>19s}" for lab in labels)
    print(head)
    for s in sizes:
        cells = []
        for lab in labels:
            r = by.get((lab, s))
            cells.append(f"{r['median_s'] * 1e3:9.3f} /{r['model_s'] * 1e3:8.3f}" if r else f"{'-':>19s}")
        print(f"{fmt_size(s):>9s} " + " ".join(cells))
    # best per size; an oversubscribed run ranks how the ranks share cores, not the algorithms
    if data.get("oversubscribed"):
        why = (data.get("oversubscription") or {}).get("describe") or "more ranks than cores"
        print(f"\noversubscribed run ({why}).")
        print("NOT a ranking of the algorithms; fastest per size here (oversubscribed): " + _fastest(res, sizes))
    else:
        print("\nfastest per size: " + _fastest(res, sizes))


def _fastest(res: list[dict[str, Any]], sizes: list[int]) -> str:
    return ", ".join(f"{fmt_size(s)}: {min((r for r in res if r['nbytes'] == s), key=lambda r: r['median_s'])['label']}"
                     for s in sizes)


def write_outputs(data: dict[str, Any], out: Path, plot: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    P = data["P"]
    paths = [out / f"scan_P{P}.json", out / f"scan_P{P}.csv"]
    paths[0].write_text(json.dumps(data, indent=1))
    keys = ["P", "label", "topology", "blocks", "nbytes", "median_s", "min_s", "mean_s", "repeats", "model_s"]
    with open(paths[1], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in data["results"]:
            w.writerow(r)
    if plot:
        png = out / f"scan_P{P}.png"
        plot_sizes(data, png)
        paths.append(png)
    return paths


def plot_sizes(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = data["results"]
    labels = list(dict.fromkeys(r["label"] for r in res))
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, lab in enumerate(labels):
        rows = sorted((r for r in res if r["label"] == lab), key=lambda r: r["nbytes"])
        x = [r["nbytes"] for r in rows]
        color = f"C{i % 10}"
        ax.plot(x, [r["median_s"] * 1e3 for r in rows], "o-", color=color, label=lab)
        ax.plot(x, [r["model_s"] * 1e3 for r in rows], "--", color=color, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("state bytes per rank")
    ax.set_ylabel("time per scan (ms)")
    over = " (oversubscribed)" if data.get("oversubscribed") else ""
    ax.set_title(f"exclusive scan over P={data['P']} ranks{over}; dashed: cost model")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, prog: str = "hpczeco bench scan") -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    from hpczeco.collectives.calibrate import check_ring_big

    try:
        check_ring_big(args.ring_big, args.dtype)
    except ValueError:
        ap.error(f"--ring-big must be 0 or more than 2 MiB, got {args.ring_big} bytes")
    from mpi4py import MPI

    from .files import check_output_dir, rank0_verdict
    from .mpienv import launcher_mismatch

    mismatch = launcher_mismatch(MPI.COMM_WORLD.Get_size())
    if mismatch:  # each process would benchmark alone, as rank 0 of its own world
        raise ValueError(mismatch)
    # the output folder, checked (made, written to) before the benchmark, not after it
    rank0_verdict(MPI.COMM_WORLD, lambda: check_output_dir(args.out, "--out"), "bench scan: checking --out")
    data = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print_table(data)
        paths = write_outputs(data, Path(args.out), plot=not args.no_plot)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
