"""The MPI launch environment: settings for oversubscribed runs as root, the ``srun --mpi`` plugin that
fits the library mpi4py loaded, whether that library is the one ``mpicc`` builds against, and a
launcher/library mismatch (the launcher started N processes, MPI sees 1), whether the ranks
oversubscribe the cores of their node (:func:`core_oversubscription`), and whether other work runs on the ranks'
cores (:func:`core_sharing`).

Used by the Makefile, ``tests/run_suite.py``, ``hpczeco report`` (its short bench), ``hpczeco info``,
``hpczeco train`` and ``jobs/lib.sh``. Command line::

    python -m hpczeco.drivers.mpienv run -- CMD ...   run CMD with OVERSUBSCRIBE_ENV added (values already set win)
    python -m hpczeco.drivers.mpienv srun-mpi         print the srun --mpi plugin for this mpi4py (exit 1: none fits)
    python -m hpczeco.drivers.mpienv check-mpicc [--mpicc PATH]
                                                      exit 1 with the reason unless mpi4py's library is mpicc's

Nothing here initialises MPI unless it was already initialised (``MPI_Get_library_version`` may be
called before ``MPI_Init``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "OVERSUBSCRIBE_ENV",
    "launch_env",
    "mpi_family",
    "library_version",
    "srun_mpi_types",
    "srun_mpi_plugin",
    "mpicc_mismatch",
    "launcher_mismatch",
    "launched_size",
    "CoreOversubscription",
    "CoreSharing",
    "core_sharing",
    "spin_gaps",
    "core_oversubscription",
]

#: Settings that let one node start more ranks than it has cores, as root, without ssh. Meant for
#: single-node runs (tests, ``make run``, the report's short bench); batch jobs do not use them.
OVERSUBSCRIBE_ENV: dict[str, str] = {
    # MPICH (Hydra): start ranks by fork, and let a waiting rank yield its core (mpi4py's CI settings)
    "HYDRA_LAUNCHER": "fork",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
    # Open MPI 4.x and 5.x refuse to run as root without both of these
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # more ranks than cores ("not enough slots available" otherwise): Open MPI 4.x ...
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    # ... and Open MPI 5.x (PRRTE)
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
}

_MPICH_LIKE = ("mpich", "intel", "mvapich")


def launch_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) with :data:`OVERSUBSCRIBE_ENV` added where unset."""
    env = dict(os.environ if base is None else base)
    for key, value in OVERSUBSCRIBE_ENV.items():
        env.setdefault(key, value)
    return env


def mpi_family(version: str) -> str:
    """``openmpi``, ``mpich``, ``intel``, ``mvapich``, ``cray`` or ``unknown`` from a library/compiler
    version string (``MPI_Get_library_version()``, ``mpicc -v``, ``mpicc --showme:version``)."""
    v = version.lower()
    if "open mpi" in v or "openmpi" in v:
        return "openmpi"
    if "intel(r) mpi" in v or "intel mpi" in v:
        return "intel"
    if "mvapich" in v:
        return "mvapich"
    if "cray" in v:
        return "cray"
    if "mpich" in v:
        return "mpich"
    return "unknown"


def _version_number(version: str) -> str | None:
    """``4.1.4`` from 'Open MPI v4.1.4, ...' or 'MPICH Version: 4.0.2' / 'mpicc for MPICH version 4.0.2'."""
    m = re.search(r"(?:open mpi v?|mpich version:?\s*|mvapich2? version:?\s*|library )(\d+(?:\.\d+)+)",
                  version, re.IGNORECASE)
    return m.group(1) if m else None


def library_version() -> str:
    """``MPI_Get_library_version()`` of the library mpi4py loaded, first line, without initialising MPI."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    text = MPI.Get_library_version().replace("\x00", "").strip()
    return " ".join(text.splitlines()[0].split()) if text else "?"


def cpu_affinity() -> list[int] | None:
    """The CPUs this process may run on (its binding, e.g. from ``srun --cpu-bind``); ``None`` where unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def mpi_library_path() -> str | None:
    """Path of the MPI library mpi4py is using (what ``python -m mpi4py --mpi-library`` prints)."""
    from mpi4py import MPI

    if os.name != "posix":
        return None

    class DLInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        libc = ctypes.CDLL(None)
        dladdr = libc.dladdr
        dladdr.restype = ctypes.c_int
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DLInfo)]
        symbol = ctypes.CDLL(MPI.__file__).MPI_Init
        info = DLInfo()
        if not dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)):
            return None
        return os.fsdecode(info.dli_fname)
    except Exception:  # noqa: BLE001
        return None


def library_path() -> str | None:
    """Path of the MPI library mpi4py loaded (as ``python -m mpi4py --mpi-library`` prints)."""
    library_version()  # loads mpi4py.MPI without initialising MPI
    return mpi_library_path()


# ------------------------------------------------------------------------------------------- srun


def srun_mpi_types(srun: str = "srun") -> list[str] | None:
    """The plugins ``srun --mpi=list`` offers (e.g. ``['pmix', 'none', 'pmi2', 'pmix_v4']``); ``None``
    without srun or when it cannot reach a Slurm configuration."""
    exe = shutil.which(srun)
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    types: list[str] = []
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        s = line.strip()
        if s.startswith("srun:"):
            s = s[len("srun:"):].strip()
        if ":" in s and "available" in s:  # 'specific pmix plugin versions available: pmix_v4'
            types += [t for t in re.split(r"[,\s]+", s.split(":", 1)[1]) if t]
        elif re.fullmatch(r"[A-Za-z0-9_]+", s):
            types.append(s)
    return types


def srun_mpi_plugin(family: str, types: list[str] | None) -> tuple[str | None, str]:
    """``(plugin, why)``: the ``srun --mpi=`` plugin for an MPI of ``family`` given the ``types`` srun
    offers; ``plugin`` is ``None`` when none fits, and ``why`` says so."""
    if types is None:
        return None, "srun is not available here (or cannot reach a Slurm configuration)"
    offered = ", ".join(types) or "nothing"
    if family == "openmpi":
        if any(t == "pmix" or t.startswith("pmix_") for t in types):
            return "pmix", "Open MPI starts under srun through PMIx"
        return None, (f"Open MPI needs srun --mpi=pmix, but this srun offers {offered}; "
                      "launch with Open MPI's mpiexec instead")
    if family in _MPICH_LIKE:
        if "pmi2" in types:
            return "pmi2", f"{family} starts under srun through PMI-2"
        return None, f"{family} needs srun --mpi=pmi2, but this srun offers {offered}; launch with mpiexec instead"
    if family == "cray":
        if "cray_shasta" in types:
            return "cray_shasta", "Cray MPICH starts under srun through cray_shasta"
        return None, f"Cray MPICH needs srun --mpi=cray_shasta, but this srun offers {offered}"
    return None, f"unknown MPI library family; pick HPCZECO_SRUN_MPI from srun --mpi=list ({offered})"


# ------------------------------------------------------------------------------------------- mpicc


def _run_text(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"<{' '.join(cmd)} failed: {exc}>"
    return (out.stdout + "\n" + out.stderr).strip()


def mpicc_info(mpicc: str) -> dict[str, str | None]:
    """What ``mpicc`` builds against: ``family``, ``version``, ``library`` (the real path of the
    ``-l`` library found in its ``-L`` folders, ``None`` if not found), ``show`` (its link line)."""
    show = _run_text([mpicc, "-show"])
    family, version = "unknown", None
    if "-lmpich" in show or "mpich" in show.lower():
        text = _run_text([mpicc, "-v"])  # 'mpicc for MPICH version 4.0.2', then the compiler's own -v
        family = mpi_family(text) if mpi_family(text) != "unknown" else "mpich"
        version = _version_number(text)
    elif re.search(r"(^|\s)-lmpi(\s|$)", show):
        text = _run_text([mpicc, "--showme:version"])
        family = mpi_family(text)
        if family == "unknown":  # Intel MPI's mpicc also links -lmpi
            text = _run_text([mpicc, "-v"])
            family = mpi_family(text)
        version = _version_number(text)
    library = None
    libs = re.findall(r"(?:^|\s)-l(mpi(?:ch)?)(?=\s|$)", show)
    dirs = re.findall(r"(?:^|\s)-L(\S+)", show)
    for d in dirs:
        for name in libs:
            cand = Path(d) / f"lib{name}.so"
            if cand.exists():
                library = os.path.realpath(cand)
                break
        if library:
            break
    return {"family": family, "version": version, "library": library, "show": show}


def mpicc_mismatch(mpicc: str | None = None) -> str | None:
    """``None`` when mpi4py's MPI library is the one ``mpicc`` (default: ``$MPICC``, else ``mpicc`` on
    PATH) links, else one line saying what differs (family, version, or the library file)."""
    mpicc = mpicc or os.environ.get("MPICC") or "mpicc"
    exe = shutil.which(mpicc)
    if exe is None:
        return f"no {mpicc} on PATH: cannot check which MPI mpi4py was built against"
    lib_v = library_version()
    lib_path = library_path()
    lib_family, lib_num = mpi_family(lib_v), _version_number(lib_v)
    cc = mpicc_info(exe)
    what = f"mpi4py loads {lib_v!r} ({lib_path}) but {exe} builds against"
    fix = ("rebuild it without a cached wheel: pip install --no-cache-dir --force-reinstall --no-binary=mpi4py "
           "mpi4py (with that mpicc on PATH or MPICC set)")
    if cc["family"] == "unknown":
        return f"cannot tell which MPI {exe} belongs to (-show: {cc['show']!r})"
    if lib_family != cc["family"]:
        return f"{what} {cc['family']} {cc['version'] or ''} ({cc['show']}): {fix}"
    if lib_num and cc["version"] and lib_num != cc["version"]:
        return f"{what} {cc['family']} {cc['version']}: {fix}"
    if lib_path and cc["library"] and os.path.realpath(lib_path) != cc["library"]:
        return f"{what} {cc['library']} (same family, another installation): {fix}"
    return None


# ------------------------------------------------------------------------------------------- mismatch

#: environment variables through which launchers tell a process how many processes they started
_LAUNCHER_SIZE_VARS = (
    ("PMI_SIZE", "a PMI launcher (MPICH's mpiexec or srun --mpi=pmi2)"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpiexec/mpirun"),
)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def launched_size(environ: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher started (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``SLURM_STEP_NUM_TASKS``),
    read from the environment without starting MPI; 1 when no launcher says."""
    env = os.environ if environ is None else environ
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        n = _int(env.get(var))
        if n is not None and n > 0:
            return n
    return 1


def launcher_mismatch(comm_size: int, environ: Mapping[str, str] | None = None) -> str | None:
    """One line when the launcher started several processes but MPI sees a world of ``comm_size`` == 1
    (mpi4py built against another MPI than the launcher's, or srun without the right ``--mpi``);
    ``None`` otherwise. Only the size-1 case is judged: a launcher never starts fewer processes than
    the world has."""
    if comm_size != 1:
        return None
    env = os.environ if environ is None else environ
    try:
        lib = f"{library_version().split(',')[0]} ({library_path()})"
    except Exception:  # noqa: BLE001 - the message is still useful without it
        lib = "another MPI library"
    tail = (f"mpi4py uses {lib}. Launch with that MPI's mpiexec (srun: --mpi=pmi2 for MPICH, pmix for Open MPI), "
            "or rebuild mpi4py for the launcher's MPI: pip install --no-cache-dir --force-reinstall "
            "--no-binary=mpi4py mpi4py")
    for var, who in _LAUNCHER_SIZE_VARS:
        n = _int(env.get(var))
        if n is not None:
            if n > 1:
                return (f"launcher/library mismatch: {who} started {n} processes ({var}={n}) but MPI_COMM_WORLD "
                        f"has size 1: {tail}")
            return None  # the launcher itself says 1
    rank = _int(env.get("PMIX_RANK"))
    if rank is not None and rank > 0:
        return (f"launcher/library mismatch: a PMIx launcher started this process as rank {rank} "
                f"(PMIX_RANK={rank}) but MPI_COMM_WORLD has size 1: {tail}")
    n = _int(env.get("SLURM_STEP_NUM_TASKS"))
    if n is not None and n > 1 and rank is None:
        return (f"launcher/library mismatch: srun started {n} tasks (SLURM_STEP_NUM_TASKS={n}) with no MPI "
                f"plugin this library understands, so each is a world of size 1: {tail}")
    return None


# ------------------------------------------------------------------------------------------- oversubscription


@dataclass(frozen=True)
class CoreOversubscription:
    """``ranks`` processes of one job on ``host`` may run on only ``cores`` CPUs (``ranks > cores``)."""

    host: str
    ranks: int
    cores: int
    nodes: int  # how many of the job's nodes are oversubscribed

    def describe(self) -> str:
        more = f" (and {self.nodes - 1} more node(s))" if self.nodes > 1 else ""
        return (f"{self.ranks} ranks share {self.cores} usable core(s) on {self.host}{more}: the ranks are "
                "oversubscribed, so they wait for a core and timings measure that scheduling more than the code")


def core_oversubscription(comm) -> CoreOversubscription | None:
    """Whether more ranks of ``comm`` run on some node than that node offers them cores (collective; the
    same answer on every rank). A node's usable cores are the union of its ranks' CPU affinities
    (:func:`cpu_affinity`, so ``taskset``, ``srun --cpu-bind`` and cgroup cpusets
    count), else ``os.cpu_count()``. ``None`` when no node is oversubscribed."""
    import socket

    from hpczeco.collectives import timed
    from hpczeco.collectives.lifeline import guard
    from mpi4py import MPI

    with guard(comm, "the ranks of each node (MPI_Comm_split_type)"):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cpus = cpu_affinity()
        every = timed.allgather(node, cpus, "the CPU affinities of a node's ranks")
        if all(c is not None for c in every):
            usable = len(set().union(*every))
        else:
            usable = os.cpu_count() or node.Get_size()
        mine = (socket.gethostname(), node.Get_size(), usable) if node.Get_rank() == 0 else None
    finally:
        node.Free()
    nodes = timed.allgather(comm, mine, "the ranks and cores of every node")
    over = [n for n in nodes if n is not None and n[1] > n[2]]
    if not over:
        return None
    host, ranks, cores = max(over, key=lambda n: n[1] / max(1, n[2]))
    return CoreOversubscription(host, ranks, cores, len(over))


@dataclass(frozen=True)
class CoreSharing:
    """Ranks of ``comm`` that lost a share ``lost`` (the worst) of a ``probe_s`` spin to other work on their cores,
    in gaps of ``gap_ms`` (the median gap: the kernel's time slice of the other work)."""

    ranks: tuple[int, ...]
    lost: float
    gap_ms: float
    probe_s: float

    def describe(self) -> str:
        more = f" and {len(self.ranks) - 8} more" if len(self.ranks) > 8 else ""
        shown = ", ".join(map(str, self.ranks[:8])) + more
        return (f"rank(s) {shown} lost up to {self.lost:.0%} of a {self.probe_s * 1e3:.0f} ms spin to other work on "
                f"their cores, in gaps of {self.gap_ms:.1f} ms: another job or process runs on the same cores (two "
                "`mpirun --bind-to core` jobs on one node both bind to cores 0, 1, ...), so every wait for a rank "
                "that is off its core lasts until the kernel switches back, and small scans cost multiples of "
                "that gap (on a VM, the hypervisor taking the CPU looks the same)")


def spin_gaps(seconds: float, floor: float) -> list[float]:
    """Spin ``seconds``; the gaps longer than ``floor`` seconds in which this process did not run."""
    import time

    gaps: list[float] = []
    t0 = last = time.perf_counter()
    while last - t0 < seconds:
        t = time.perf_counter()
        if t - last > floor:
            gaps.append(t - last)
        last = t
    return gaps


def core_sharing(comm, seconds: float = 0.05, floor: float = 5e-4, threshold: float = 0.05) -> CoreSharing | None:
    """Collective (the same answer on every rank): every rank of ``comm`` spins ``seconds`` at once and sums the
    gaps longer than ``floor`` in which it did not run; a :class:`CoreSharing` naming the ranks that lost more
    than ``threshold`` of the spin, ``None`` when none did. A bound rank whose core also runs other busy work
    alternates with it in the kernel's time slices (4 ms on the machines measured, docs/benchmarks/network.md)."""
    if not (seconds > 0 and floor > 0 and 0 < threshold < 1):
        raise ValueError(f"core_sharing needs seconds > 0, floor > 0 and 0 < threshold < 1, got {seconds}, {floor}, "
                         f"{threshold}")
    from hpczeco.collectives import timed

    timed.Barrier(comm, "the start of the core-sharing probe")
    gaps = spin_gaps(seconds, floor)
    every = timed.allgather(comm, (sum(gaps) / seconds, sorted(gaps)[len(gaps) // 2] if gaps else 0.0),
                            "the core-sharing probe")
    hit = [r for r, (lost, _) in enumerate(every) if lost > threshold]
    if not hit:
        return None
    worst = max(every[r][0] for r in hit)
    gap = sorted(every[r][1] for r in hit)[len(hit) // 2]
    return CoreSharing(tuple(hit), min(1.0, worst), gap * 1e3, seconds)


# ------------------------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpczeco.drivers.mpienv", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command with OVERSUBSCRIBE_ENV added")
    r.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    s = sub.add_parser("srun-mpi", help="print the srun --mpi plugin for this mpi4py's library")
    s.add_argument("--srun", default="srun")
    c = sub.add_parser("check-mpicc", help="check that mpi4py's library is the one mpicc links")
    c.add_argument("--mpicc", default=None, help="default: $MPICC, else mpicc on PATH")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not cmd:
            ap.error("run: no command given")
        try:
            os.execvpe(cmd[0], cmd, launch_env())
        except OSError as exc:
            print(f"mpienv run: cannot run {cmd[0]}: {exc}", file=sys.stderr)
            return 127
    if args.cmd == "srun-mpi":
        plugin, why = srun_mpi_plugin(mpi_family(library_version()), srun_mpi_types(args.srun))
        if plugin is None:
            print(f"mpienv srun-mpi: {why}", file=sys.stderr)
            return 1
        print(plugin)
        return 0
    mpicc = args.mpicc or os.environ.get("MPICC") or "mpicc"
    bad = mpicc_mismatch(mpicc)
    if bad:
        print(f"mpi4py/mpicc mismatch: {bad}", file=sys.stderr)
        return 1
    print(f"mpi4py uses {library_version()} ({library_path()}): the MPI of {shutil.which(mpicc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
