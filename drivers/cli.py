"""The ``hpczeco`` command line (also ``python -m hpczeco``): one subcommand per driver.

Each subcommand lives in a module of ``hpczeco.drivers`` that exposes ``main(argv, prog) -> int`` with
its own ``argparse`` parser, so ``hpczeco SUB --help`` is that driver's help. The modules are imported
only when their subcommand runs, so ``hpczeco --help`` stays fast and never imports CuPy or PyTorch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (driver module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("hpczeco.drivers.info", "MPI library, CUDA-awareness, GPUs, transports, HDF5 mode, ranks"),
    "demo": ("hpczeco.drivers.demo", "short multi-rank demo of ZeCO GLA (run it under mpiexec)"),
    "train": ("hpczeco.drivers.train", "train a small GLA language model with ZeCO sequence parallelism"),
    "prefill": ("hpczeco.drivers.prefill", "DAAF prefill of a text file: plan summary and time to first token"),
    "model": ("hpczeco.drivers.model", "cost model: All-Scan vs tree vs allgather time for any P and link"),
    "report": ("hpczeco.drivers.report", "Markdown report with plots of ring vs tree vs baselines"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "gla": ("hpczeco.drivers.bench_gla", "chunked GLA forward/backward throughput vs the matmul rate"),
    "scan": ("hpczeco.drivers.bench_scan", "All-Scan ring vs tree vs allgather/serial/exscan (under mpiexec)"),
    "zeco": ("hpczeco.drivers.bench_zeco", "ZeCO layer weak scaling against the ideal (under mpiexec)"),
    "daaf": ("hpczeco.drivers.bench_daaf", "DAAF time to first token, work saved, quality, scheduling"),
    "gpu-gla": ("hpczeco.drivers.bench_gpu_gla", "GLA GPU kernels vs flash-linear-attention (one GPU)"),
    "gpu-daaf": ("hpczeco.drivers.bench_gpu_daaf", "DAAF GPU kernels vs FlexAttention, time to first token"),
    "gpu-multi": ("hpczeco.drivers.bench_gpu_multi", "device transports, scans and ZeCO on GPUs (under mpirun)"),
}


def _run_module(module: str, argv: list[str], prog: str) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            print(f"{prog}: not available in this build ({module} is missing)", file=sys.stderr)
            return 2
        raise
    return int(mod.main(argv, prog=prog) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpczeco",
        description="ZeCO sequence parallelism and DAAF attention over MPI. "
        "Run multi-rank commands under mpiexec/srun, e.g. `mpiexec -n 4 hpczeco bench scan`.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES), add_help=False)
    bench.add_argument("which", nargs="?", choices=list(BENCHES))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        print("\nbenchmarks (hpczeco bench NAME --help):")
        width = max(len(name) for name in BENCHES)
        for name, (_, help_) in BENCHES.items():
            print(f"  {name:{width}s} {help_}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print("usage: hpczeco bench {" + ",".join(BENCHES) + "} [--help]", file=sys.stderr)
            return 0 if rest and rest[0] in ("-h", "--help") else 2
        module, _ = BENCHES[rest[0]]
        return _run_module(module, rest[1:], f"hpczeco bench {rest[0]}")
    if cmd not in COMMANDS:
        parser.error(f"unknown command {cmd!r} (choose from {', '.join(list(COMMANDS) + ['bench'])})")
    return _run_module(COMMANDS[cmd][0], rest, f"hpczeco {cmd}")


if __name__ == "__main__":
    sys.exit(main())
