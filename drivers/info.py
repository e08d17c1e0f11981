"""`hpczeco info`: what this installation runs on — MPI library, ranks, CUDA-awareness, GPUs,
transports, HDF5 mode, package versions.

Run it under the launcher the jobs use (``mpiexec -n 4 hpczeco info`` or ``srun hpczeco info``) to
see every rank's host; rank 0 prints. Nothing here needs CuPy: without it the GPU lines say 'none'.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import socket
import sys
from typing import Any

from hpczeco.drivers.mpienv import core_oversubscription, cpu_affinity, launcher_mismatch, mpi_library_path

CUDA_AWARE_ENV = "HPCZECO_CUDA_AWARE"
# MPI settings that decide GPU-buffer support, shown when set
_GPU_ENV = ("MPIR_CVAR_ENABLE_GPU", "MPIR_CVAR_CH4_GPU_SUPPORT", "UCX_TLS", "UCX_MEMTYPE_CACHE",
            "OMPI_MCA_opal_cuda_support", "OMPI_MCA_pml", "MPICH_GPU_SUPPORT_ENABLED", "CUDA_VISIBLE_DEVICES")
_THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED", "MPI_THREAD_MULTIPLE")


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", None) or getattr(getattr(mod, "version", None), "version", "?"))
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return f"not importable ({type(exc).__name__})"


def mpix_cuda_support(libpath: str | None) -> dict[str, Any]:
    """Ask the MPI library itself: ``MPIX_Query_cuda_support()`` (Open MPI, MPICH) and
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH >= 4). ``None`` where absent."""
    out: dict[str, Any] = {"MPIX_Query_cuda_support": None, "MPIX_GPU_query_support(CUDA)": None}
    if not libpath:
        return out
    try:
        lib = ctypes.CDLL(libpath)
    except OSError:
        return out
    fn = getattr(lib, "MPIX_Query_cuda_support", None)
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = []
        out["MPIX_Query_cuda_support"] = bool(fn())
    fn = getattr(lib, "MPIX_GPU_query_support", None)
    if fn is not None:
        flag = ctypes.c_int(0)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        if fn(0, ctypes.byref(flag)) == 0:  # MPIX_GPU_SUPPORT_CUDA == 0
            out["MPIX_GPU_query_support(CUDA)"] = bool(flag.value)
    return out


def env_flag(name: str) -> bool | None:
    """``True``/``False`` for 1/true/yes/on and 0/false/no/off; ``None`` when unset; ``ValueError`` for anything
    else (:func:`hpczeco.collectives.settings.parse_flag`)."""
    from hpczeco.collectives.settings import parse_flag

    return parse_flag(name)(os.environ.get(name, ""))


def format_cpus(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'``."""
    parts: list[str] = []
    start = prev = None
    for c in [*cpus, None]:
        if c is not None and prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = c
    return ",".join(parts)


def gpu_info() -> dict[str, Any]:
    """This rank's CUDA devices through CuPy; ``{'count': 0, 'why': ...}`` without CuPy or GPUs."""
    try:
        import cupy  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        return {"count": 0, "names": [], "why": f"CuPy not importable ({type(exc).__name__})"}
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
        names = []
        for d in range(n):
            props = cupy.cuda.runtime.getDeviceProperties(d)
            name = props.get("name", b"?")
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return {"count": n, "names": names, "cupy": cupy.__version__, "why": "" if n else "no CUDA device"}
    except Exception as exc:  # noqa: BLE001
        return {"count": 0, "names": [], "why": f"CUDA unavailable ({type(exc).__name__}: {exc})"}


def transports(gpus: int, cuda_aware: bool) -> dict[str, str]:
    """Which send/recv transports can be used here: name -> 'yes ...' or 'no (why)'.

    Uses ``hpczeco.collectives.device`` (``cuda_aware_known``, ``nccl_available``) when it imports
    (it imports CuPy only when a transport is built); device transports need a GPU seen by CuPy."""
    out = {"host": "yes"}
    try:
        from hpczeco.collectives import device  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        device = None
        why_dev = f"hpczeco.collectives.device not importable ({type(exc).__name__}: {exc})"
    else:
        why_dev = ""
        cuda_aware = bool(getattr(device, "cuda_aware_known", lambda: cuda_aware)())
    if gpus == 0 or why_dev:
        why = why_dev or "no GPU seen"
        return {**out, "cuda-aware": f"no ({why})", "staged": f"no ({why})", "nccl": f"no ({why})", "auto": "host"}
    out["cuda-aware"] = (
        "yes" if cuda_aware else f"no (MPI not known to be CUDA-aware; set {CUDA_AWARE_ENV}=1 to opt in)"
    )
    out["staged"] = "yes"
    has_nccl = bool(getattr(device, "nccl_available", lambda: False)())
    out["nccl"] = "yes" if has_nccl else "no (cupy.cuda.nccl not usable)"
    out["auto"] = "cuda-aware" if cuda_aware else "nccl" if has_nccl else "staged"
    return out


def checkpoint_mode() -> tuple[str, bool]:
    """``(how checkpoints are written, parallel HDF5?)``; without h5py (the ``drivers`` extra) a line saying
    how to install it."""
    try:
        from hpczeco.drivers.checkpoint import hdf5_mode, parallel_hdf5
    except ImportError as exc:
        why = "h5py is not installed" if getattr(exc, "name", None) == "h5py" else f"h5py is not importable ({exc})"
        return f"none: {why}; checkpoints need it: pip install 'hpczeco[drivers]'", False
    return hdf5_mode(), parallel_hdf5()


def collect(comm=None) -> dict[str, Any]:
    """Everything ``hpczeco info`` reports (collective over ``comm``: gathers every rank's host/GPUs)."""
    import mpi4py
    from hpczeco.collectives import timed
    from mpi4py import MPI

    import hpczeco

    comm = comm or MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    libpath = mpi_library_path()
    gpus = gpu_info()
    mine = {"rank": rank, "host": socket.gethostname(), "processor": MPI.Get_processor_name(),
            "pid": os.getpid(), "gpus": gpus["count"], "cpus": cpu_affinity(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS")}
    # the first collective: the library's HPCZECO_* settings are checked and agreed here (a bad or differing value
    # is the same error on every rank)
    ranks = timed.gather(comm, mine, 0, "info: every rank's host")
    mpix = mpix_cuda_support(libpath)
    opt_in = env_flag(CUDA_AWARE_ENV)
    detected = any(v for v in mpix.values())
    cuda_aware = bool(opt_in) if opt_in is not None else detected
    thread = MPI.Query_thread()
    try:
        import h5py

        h5 = {"h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version}
    except Exception as exc:  # noqa: BLE001
        h5 = {"h5py": f"not importable ({type(exc).__name__})", "hdf5": "?"}
    lib_version = MPI.Get_library_version().replace("\x00", "").strip()
    mismatch = launcher_mismatch(size)
    over = core_oversubscription(comm)
    mode, parallel = checkpoint_mode()
    info = {
        "hpczeco": hpczeco.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "mpi": {
            "library": " ".join(lib_version.splitlines()[0].split()) if lib_version else "?",
            "library_version": lib_version,
            "library_path": libpath,
            "vendor": "{} {}".format(MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
            "standard": "{}.{}".format(*MPI.Get_version()),
            "mpi4py": mpi4py.__version__,
            "thread_level": _THREAD_LEVELS[thread] if 0 <= thread < 4 else str(thread),
        },
        "ranks": {"size": size, "hosts": sorted({r["host"] for r in ranks}) if ranks else None, "per_rank": ranks},
        "launcher_mismatch": mismatch,
        "oversubscription": None if over is None else over.describe(),
        "cuda_aware": {
            "effective": cuda_aware,
            "detected": detected,
            "query": mpix,
            CUDA_AWARE_ENV: os.environ.get(CUDA_AWARE_ENV),
            "HPCZECO_TRANSPORT": os.environ.get("HPCZECO_TRANSPORT"),
            "env": {k: os.environ[k] for k in _GPU_ENV if k in os.environ},
        },
        "gpus": gpus,
        "transports": transports(gpus["count"], cuda_aware),
        "versions": {"numpy": _version("numpy"), "numba": _version("numba"), **h5, "tqdm": _version("tqdm")},
        "hdf5_mode": mode,
        "hdf5_parallel": parallel,
    }
    return info


def render(info: dict[str, Any]) -> str:
    m, r, c, g = info["mpi"], info["ranks"], info["cuda_aware"], info["gpus"]
    lines = [
        f"hpczeco {info['hpczeco']}   python {info['python']}",
        f"platform        {info['platform']}",
        f"MPI library     {m['library']}",
        f"  vendor        {m['vendor']} (MPI standard {m['standard']})",
        f"  library path  {m['library_path']}",
        f"  mpi4py        {m['mpi4py']}   thread level {m['thread_level']}",
        f"ranks           {r['size']} on {len(r['hosts'] or [])} host(s): {', '.join(r['hosts'] or [])}",
    ]
    if info.get("launcher_mismatch"):
        lines.append(f"  WARNING       {info['launcher_mismatch']}")
    if info.get("oversubscription"):
        lines.append(f"  WARNING       {info['oversubscription']}")
    for pr in r["per_rank"] or []:
        cpus = pr.get("cpus")
        bound = f"cpus {format_cpus(cpus)} ({len(cpus)})" if cpus else "cpus ?"
        lines.append(f"  rank {pr['rank']:<4d}     {pr['host']} pid {pr['pid']} {bound} "
                     f"OMP_NUM_THREADS={pr.get('omp_threads') or '-'} gpus {pr['gpus']}")
    q = ", ".join(f"{k}={'n/a' if v is None else v}" for k, v in c["query"].items())
    src = f"{CUDA_AWARE_ENV}={c[CUDA_AWARE_ENV]}" if c[CUDA_AWARE_ENV] is not None else "detection"
    lines.append(f"CUDA-aware MPI  {'yes' if c['effective'] else 'no'} (from {src}; {q})")
    gpu_line = f"{g['count']}: {', '.join(g['names'])}" if g["count"] else f"none ({g['why']})"
    lines.append(f"GPUs (rank 0)   {gpu_line}")
    lines.append("transports      " + "; ".join(f"{k}: {v}" for k, v in info["transports"].items()))
    if c["HPCZECO_TRANSPORT"]:
        lines.append(f"  HPCZECO_TRANSPORT={c['HPCZECO_TRANSPORT']}")
    for k, val in c["env"].items():
        lines.append(f"  {k}={val}")
    v = info["versions"]
    lines.append(f"versions        numpy {v['numpy']}, numba {v['numba']}, h5py {v['h5py']} (HDF5 {v['hdf5']}), "
                 f"tqdm {v['tqdm']}")
    lines.append(f"HDF5 mode       {info['hdf5_mode']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "hpczeco info") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    from mpi4py import MPI

    info = collect(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(info, indent=2, sort_keys=True) if args.json else render(info), flush=True)
    if info["launcher_mismatch"]:  # every process of a mismatched launch is a rank 0 of its own world
        if args.json:  # (the text output has it already)
            print(f"{prog}: {info['launcher_mismatch']}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
