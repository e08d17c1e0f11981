"""The ``hpczeco`` command line (also ``python -m hpczeco``): one subcommand per driver.

Each subcommand lives in a module of ``hpczeco.drivers`` that exposes ``main(argv, prog) -> int`` with
its own ``argparse`` parser, so ``hpczeco SUB --help`` is that driver's help. The modules are imported
only when their subcommand runs, so ``hpczeco --help`` stays fast and never imports CuPy or PyTorch.

:func:`main` (the console script and ``python -m hpczeco``) runs the subcommand under
:func:`hpczeco.collectives.lifeline.abort_on_error`: a rank that fails prints its one-line error (and the
traceback, for internal errors only) and ends the whole job with ``MPI_Abort`` on ``MPI_COMM_WORLD``, so
no rank is left waiting in a collective for it; a rank that leaves with any exit status while others still
wait for it ends the job too (:func:`~hpczeco.collectives.lifeline.finish_rank`). :func:`dispatch` is the same
without the guard.

``model`` and ``report`` are single-process commands: launched on several ranks they run on rank 0 alone, which
prints and writes, and every rank ends with its exit status.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# subcommand -> (driver module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("hpczeco.drivers.info", "MPI library, CUDA-awareness, GPUs, transports, HDF5 mode, ranks"),
    "demo": ("hpczeco.drivers.demo", "short multi-rank demo of ZeCO GLA (run it under mpiexec)"),
    "train": ("hpczeco.drivers.train", "train a GLA language model (PyTorch) with ZeCO sequence x data parallelism"),
    "prefill": ("hpczeco.drivers.prefill", "DAAF prefill of a text file: plan summary and time to first token"),
    "model": ("hpczeco.drivers.model", "cost model: All-Scan vs tree vs allgather time for any P and link"),
    "report": ("hpczeco.drivers.report", "Markdown report with plots of ring vs tree vs baselines"),
    "simulate": ("hpczeco.drivers.simulate", "the scans' schedules on a simulated GPU fat tree (SimGrid) vs the model"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "gla": ("hpczeco.drivers.bench_gla", "chunked GLA forward/backward throughput vs the matmul rate"),
    "scan": ("hpczeco.drivers.bench_scan", "All-Scan ring vs tree vs allgather/serial/exscan (under mpiexec)"),
    "zeco": ("hpczeco.drivers.bench_zeco", "ZeCO layer weak scaling against the ideal (under mpiexec)"),
    "daaf": ("hpczeco.drivers.bench_daaf", "DAAF time to first token, work saved, quality, scheduling"),
    "gpu-gla": ("hpczeco.drivers.bench_gpu_gla", "GLA GPU kernels vs flash-linear-attention (one GPU)"),
    "gpu-daaf": ("hpczeco.drivers.bench_gpu_daaf", "DAAF GPU kernels vs FlexAttention, time to first token"),
    "daaf-quality": ("hpczeco.drivers.bench_daaf_quality", "DAAF on a trained LM: quality vs same-budget baselines"),
    "gpu-multi": ("hpczeco.drivers.bench_gpu_multi", "device transports, scans and ZeCO on GPUs (under mpirun)"),
    "torch": ("hpczeco.drivers.bench_torch", "PyTorch autograd glue vs the bare kernel calls (one GPU)"),
}


#: the modules of the ``drivers`` extra: the programs need them, the library (hpczeco, .collectives, .gpu, .base)
#: never imports them
DRIVERS_EXTRA = ("h5py", "tqdm", "matplotlib")
INSTALL_DRIVERS = "pip install 'hpczeco[drivers]'"
#: what of the extra a command always needs, checked before it starts; a command that needs one only with some
#: options (``model --out``, ``bench scan`` without ``--no-plot``) reports it when it imports it
NEEDS: dict[str, tuple[str, ...]] = {
    "demo": DRIVERS_EXTRA,
    "train": ("h5py", "tqdm"),
    "report": ("matplotlib",),
    "bench gla": ("matplotlib",),
    "bench zeco": ("matplotlib",),
    "bench daaf": ("matplotlib",),
    "bench gpu-daaf": ("matplotlib",),
}


#: commands that run on one process: under a launch of several ranks, rank 0 runs them and the others end with its
#: exit status (they would otherwise print, write and launch everything once per rank)
ONE_PROCESS = ("model", "report")


def _run_on_rank0(module: str, argv: list[str], prog: str, needs: tuple[str, ...]) -> int:
    """:func:`_run_module` on rank 0 of ``MPI_COMM_WORLD`` alone; the other ranks wait for its exit status (within
    the collective timeout) and return it. One process: just :func:`_run_module`."""
    from hpczeco.drivers.mpienv import launched_size  # noqa: PLC0415

    if launched_size() <= 1 or {"-h", "--help"} & set(argv):
        return _run_module(module, argv, prog, needs)
    from hpczeco.collectives import timed  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return _run_module(module, argv, prog, needs)
    code = 0
    if comm.Get_rank() == 0:
        try:
            code = _run_module(module, argv, prog, needs)
        except SystemExit as exc:
            code = _guard().exit_status(exc)
        except Exception as exc:  # noqa: BLE001 - a user error ends every rank alike; others abort (main)
            if not is_user_error(exc):
                raise
            _guard().report_error(exc, prog, None, is_user_error)
            code = 2
    return int(timed.bcast(comm, code, 0, f"{prog} (the other ranks wait for rank 0, which runs it)"))


class MissingExtraError(ImportError):
    """A command needs modules of the ``drivers`` extra that are not installed (a one-line user error)."""

    def __init__(self, missing: list[str]):
        verb = "is" if len(missing) == 1 else "are"
        super().__init__(f"{', '.join(missing)} {verb} not installed (the drivers extra): {INSTALL_DRIVERS}")
        self.missing = list(missing)


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The ones of ``names`` that cannot be imported (looked up, not imported)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent that fails, or sys.modules[name] = None
            found = False
        if not found:
            missing.append(name)
    return missing


def _extra_of(exc: ModuleNotFoundError) -> MissingExtraError | None:
    top = (exc.name or "").partition(".")[0]
    return MissingExtraError([top]) if top in DRIVERS_EXTRA else None


def _run_module(module: str, argv: list[str], prog: str, needs: tuple[str, ...] = ()) -> int:
    if not {"-h", "--help"} & set(argv):
        missing = missing_modules(needs)
        if missing:
            raise MissingExtraError(missing)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            print(f"{prog}: not available in this build ({module} is missing)", file=sys.stderr)
            return 2
        extra = _extra_of(exc)
        if extra is not None:
            raise extra from None
        raise
    try:
        return int(mod.main(argv, prog=prog) or 0)
    except ModuleNotFoundError as exc:
        extra = _extra_of(exc)
        if extra is not None:
            raise extra from None
        raise


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


def is_user_error(exc: BaseException) -> bool:
    """Errors whose message says what is wrong (bad options, inputs, files, checkpoints, the collective
    validation's errors): reported in one line; anything else -- a ``TypeError`` too, unless the collective
    validation raised it -- is an internal error and gets its traceback."""
    if isinstance(exc, (ValueError, OSError, FloatingPointError, MemoryError, KeyboardInterrupt, MissingExtraError)):
        return True
    ck = sys.modules.get("hpczeco.drivers.checkpoint")
    return ck is not None and isinstance(exc, ck.CheckpointError)


def _guard():
    """:mod:`hpczeco.collectives.lifeline` (leaving, failing ranks), imported without starting MPI when no subcommand
    did."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py  # noqa: PLC0415

        mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from hpczeco.collectives import lifeline  # noqa: PLC0415

    return lifeline


def _usage_errors_on_rank0_only() -> None:
    """Under a launch of several processes, ranks other than 0 exit on a usage error (status 2) without printing it:
    every rank parses the same command line, so rank 0 prints the one message. The rank is read from the
    launcher's environment (no MPI needed)."""
    import argparse  # noqa: PLC0415
    import os  # noqa: PLC0415

    from hpczeco.drivers.mpienv import launched_size  # noqa: PLC0415

    if launched_size() <= 1:
        return
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            if int(value) != 0:
                argparse.ArgumentParser.error = lambda self, message: sys.exit(2)  # type: ignore[method-assign]
            return


def main(argv: list[str] | None = None) -> int:
    """The ``hpczeco`` command: :func:`dispatch`, and if any rank fails, the end of the whole job.

    An exception on a rank of a multi-rank job: that rank prints its one-line error (with the traceback
    only for internal errors, :func:`is_user_error`) and calls ``MPI_Abort`` on ``MPI_COMM_WORLD``. A
    non-zero exit status: the ranks wait briefly for each other (they all fail alike when the error was
    collective) and abort the job if some rank does not; status 0 too, when the process ends
    (:mod:`hpczeco.collectives.lifeline`). One rank: the same message and exit status 2 (user error) or 1
    (internal)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    words = argv[:2] if argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-") else argv[:1]
    prog = " ".join(["hpczeco", *[w for w in words if not w.startswith("-")]])
    _usage_errors_on_rank0_only()
    try:
        code = dispatch(argv)
    except SystemExit as exc:
        if "mpi4py.MPI" in sys.modules:
            _guard().finish_rank(_guard().exit_status(exc), prog)
        raise
    except BaseException as exc:  # noqa: BLE001 - reported; with several ranks the job is aborted
        errors = sys.modules.get("hpczeco.collectives.errors")
        if errors is not None and isinstance(exc, errors.CollectiveInputError):
            # raised alike on every rank (the collective validation, the agreed settings): rank 0 says it once and
            # every rank ends with status 2, together
            world = _guard()._world()
            if world is None or world[0] == 0:
                _guard().report_error(exc, prog, None, is_user_error)
            return _guard().finish_rank(2, prog)
        return _guard().fail_rank(exc, prog, is_user_error)
    if code and "mpi4py.MPI" in sys.modules:
        return _guard().finish_rank(code, prog)
    return code  # status 0: the exit hooks end the job together (hpczeco.collectives.lifeline)


def dispatch(argv: list[str] | None = None) -> int:
    """Run the subcommand named by ``argv[0]`` and return its exit status (no guard: see :func:`main`)."""
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
        return _run_module(module, rest[1:], f"hpczeco bench {rest[0]}", NEEDS.get(f"bench {rest[0]}", ()))
    if cmd not in COMMANDS:
        parser.error(f"unknown command {cmd!r} (choose from {', '.join(list(COMMANDS) + ['bench'])})")
    run = _run_on_rank0 if cmd in ONE_PROCESS else _run_module
    return run(COMMANDS[cmd][0], rest, f"hpczeco {cmd}", NEEDS.get(cmd, ()))


if __name__ == "__main__":
    sys.exit(main())
