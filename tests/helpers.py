"""Helpers shared by the test files: relative errors, random GLA/DAAF inputs, errors agreed over ranks,
the GPU and device transports of a rank, and the CPU emulation of the GLA CUDA kernels.

Test files import it as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "agree_on_error",
    "agreed_error",
    "daaf_inputs",
    "device_transport_kinds",
    "emulated_gla_runtime",
    "FAKE_CUPY_PATH",
    "fake_cupy",
    "gla_inputs",
    "install_numpy_cupy",
    "job_env",
    "log_gates",
    "mpiexec_command",
    "rel",
    "rel_max",
    "use_local_gpu",
]


# --------------------------------------------------------------------------------------------- errors


def rel(x: Any, ref: Any) -> float:
    """Relative norm error ``||x - ref|| / ||ref||`` in float64 (absolute when ``ref`` is zero).

    Non-finite values in ``x`` fail the calling test at once (AssertionError) rather than as a NaN
    comparison."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert np.isfinite(x).all(), "non-finite values in the result"
    den = np.linalg.norm(ref)
    err = np.linalg.norm(x - ref)
    return float(err / den) if den > 0 else float(err)


def rel_max(x: Any, ref: Any) -> float:
    """Relative max error ``max |x - ref| / max |ref|`` in float64 (``0`` for empty arrays)."""
    ref = np.asarray(ref, dtype=np.float64)
    err = float(np.max(np.abs(np.asarray(x, dtype=np.float64) - ref), initial=0.0))
    return err / max(float(np.max(np.abs(ref), initial=0.0)), 1e-30)


# --------------------------------------------------------------------------------------------- inputs


def log_gates(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Log forget gates (<= 0), float64: strong (~ -8 per token), weak (~ -1e-3), mixed per token, or
    logsigmoid(N(0, 1))."""
    if kind == "strong":
        return -8.0 * (0.5 + 0.5 * rng.random(shape))
    if kind == "weak":
        return -1e-3 * rng.random(shape)
    if kind == "mixed":
        return np.where(rng.random(shape) < 0.3, -8.0 * rng.random(shape), -1e-2 * rng.random(shape))
    if kind == "logsigmoid":
        return -np.logaddexp(0.0, -rng.standard_normal(shape))
    raise ValueError(kind)


def gla_inputs(rng: np.random.Generator, B: int, T: int, H: int, K: int, V: int, strong: bool = False,
               g_max: float = 0.4, gates: str = "uniform") -> tuple[np.ndarray, ...]:
    """float32 ``(q, k, v, g, do, h0, dht)``: ``q, k: [B, T, H, K]``, ``v, do: [B, T, H, V]`` ~ N(0, 1),
    ``h0, dht: [B, H, K, V]`` ~ N(0, 1); ``g ~ -U(0, g_max)`` (``gates="uniform"``) or
    ``log(sigmoid(N(0, 1) + 2))`` (``gates="logsigmoid"``), with ``strong`` -U(4, 8) on half the entries."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v, do = f(B, T, H, K), f(B, T, H, K), f(B, T, H, V), f(B, T, H, V)
    if gates == "uniform":
        g = -rng.uniform(0.0, g_max, (B, T, H, K))
    elif gates == "logsigmoid":
        g = -np.logaddexp(0.0, -(rng.standard_normal((B, T, H, K)) + 2.0))
    else:
        raise ValueError(gates)
    if strong:
        g = np.where(rng.uniform(size=g.shape) < 0.5, -rng.uniform(4.0, 8.0, g.shape), g)
    return q, k, v, g.astype(np.float32), do, f(B, H, K, V), f(B, H, K, V)


def daaf_inputs(rng: np.random.Generator, B: int, T: int, H: int, D: int,
                Dv: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 ``(q * 1.5, k, v)``: ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]`` ~ N(0, 1)."""
    q = rng.standard_normal((B, T, H, D)).astype(np.float32) * 1.5
    k = rng.standard_normal((B, T, H, D)).astype(np.float32)
    v = rng.standard_normal((B, T, H, Dv or D)).astype(np.float32)
    return q, k, v


# --------------------------------------------------------------------------------------------- ranks


def agreed_error(comm: Any, fn: Callable[[], Any], error: type[BaseException] | None = None) -> str | None:
    """Run ``fn`` on every rank; return its error message (``error``, default
    ``CollectiveInputError``), asserting that every rank got the same one (or none)."""
    if error is None:
        from hpczeco.collectives import CollectiveInputError as error  # noqa: PLC0415
    try:
        fn()
    except error as exc:
        msg = str(exc)
    else:
        msg = None
    everyone = comm.allgather(msg)
    assert all(m == everyone[0] for m in everyone), everyone
    return everyone[0]


def agree_on_error(comm: Any, err: BaseException | None) -> None:
    """Raise on every rank when any rank has an error (AssertionError naming each rank's error)."""
    errs = comm.allgather(None if err is None else f"rank {comm.Get_rank()}: {type(err).__name__}: {err}")
    bad = [e for e in errs if e]
    if bad:
        raise AssertionError("; ".join(bad))


# --------------------------------------------------------------------------------------------- devices


def use_local_gpu(comm: Any) -> Any:
    """Make GPU ``local rank % device count`` current for this rank; returns the cupy module."""
    import os  # noqa: PLC0415

    import cupy as cp  # noqa: PLC0415

    lr = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", comm.Get_rank())))
    cp.cuda.Device(lr % cp.cuda.runtime.getDeviceCount()).use()
    return cp


def device_transport_kinds(comm: Any) -> list[str]:
    """The device transports this job can use: host-staged always; NCCL with one GPU per rank; CUDA-aware
    MPI where the MPI is known to be CUDA-aware."""
    import cupy as cp  # noqa: PLC0415
    from hpczeco.collectives import device as D  # noqa: PLC0415

    kinds = ["staged"]
    if D.nccl_available() and comm.Get_size() <= cp.cuda.runtime.getDeviceCount():
        kinds.append("nccl")
    if D.cuda_aware_known():
        kinds.append("cuda-aware")
    return kinds


# --------------------------------------------------------------------------------------------- emulation

#: the folder to put first on ``sys.path`` (in a process of its own) for ``import cupy`` to be the stand-in
FAKE_CUPY_PATH = Path(__file__).resolve().parent / "fake_cupy"


def fake_cupy() -> types.ModuleType:
    """A fresh copy of the numpy stand-in for CuPy (``tests/fake_cupy/cupy``, with its own counters of host
    synchronisations and uploads), to put in ``sys.modules["cupy"]`` and an emulator runtime's ``xp``."""
    spec = importlib.util.spec_from_file_location("cupy", FAKE_CUPY_PATH / "cupy" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def emulated_gla_runtime() -> Iterator[Any]:
    """The GLA kernels (float and bf16; fp16 runs on GPUs only) in the CPU emulation of the CUDA model,
    installed as :mod:`hpczeco.gpu.gla`'s runtime for the block: its wrappers then take numpy arrays
    (bf16 as uint16 bit patterns). Raises RuntimeError without a C++ compiler."""
    from hpczeco.gpu import emu, gla  # noqa: PLC0415

    if emu.compiler() is None:
        raise RuntimeError("no C++ compiler (g++) for the CUDA emulation")
    names = [n for n in gla.kernel_names() if not re.search(r"(?<!b)f16", n)]
    rt = emu.EmuRuntime(gla.KERNELS.source(), names)
    old = gla.RUNTIME.set(rt)
    try:
        yield rt
    finally:
        gla.RUNTIME.set(old)


def install_numpy_cupy() -> Any:
    """Put the numpy stand-in for CuPy (:func:`fake_cupy`) in ``sys.modules["cupy"]`` for the rest of the
    process, with :mod:`hpczeco.gpu.checks`'s value flags computed by its host mirror (``value_flags_host``: the
    same words and formulas; the stand-in has no ``ReductionKernel``). For subprocesses that run the Numba CUDA
    kernels under the simulator (``NUMBA_ENABLE_CUDASIM=1``) on "CuPy" arrays. Returns the module."""
    import sys  # noqa: PLC0415

    from hpczeco.gpu import checks  # noqa: PLC0415

    cp = fake_cupy()
    sys.modules["cupy"] = cp

    class _Device(contextlib.nullcontext):
        id = 0

    cp.cuda.Device = lambda index=0: _Device()

    class _Flags:
        def __init__(self, flags: list[int]):
            self._flags = flags

        def result(self) -> list[int]:
            return self._flags

    def start_value_flags(arrays: list[tuple[Any, bool]], stream: Any = None) -> _Flags:
        return _Flags([checks.value_flags_host(np.asarray(x), gate) for x, gate in arrays])

    checks.start_value_flags = start_value_flags
    checks.value_flags = lambda arrays: start_value_flags(arrays).result()
    return cp


# --------------------------------------------------------------------------------------------- whole jobs


def mpiexec_command() -> str:
    """The launcher of the job tests: ``$HPCZECO_TEST_MPIEXEC``, ``$MPIEXEC`` (make's), the venv's, or ``mpiexec``."""
    for var in ("HPCZECO_TEST_MPIEXEC", "MPIEXEC"):
        if os.environ.get(var):
            return os.environ[var]
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def job_env(job_limit_s: float | None = None, keep_settings: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a job a test launches: the oversubscription / run-as-root settings of
    :func:`hpczeco.drivers.mpienv.launch_env`, one BLAS thread, ``MPIEXEC_TIMEOUT`` (the launcher ends a hung job)
    when ``job_limit_s`` is given, no ``HPCZECO_*`` setting of the caller's (the tests' own ``HPCZECO_TEST_*``
    stay; ``keep_settings`` keeps them all), the repository first on ``PYTHONPATH``, then ``extra``."""
    from hpczeco.drivers.mpienv import launch_env  # noqa: PLC0415

    env = launch_env()
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if job_limit_s is not None:
        env["MPIEXEC_TIMEOUT"] = str(int(job_limit_s))
    if not keep_settings:
        for k in [k for k in env if k.startswith("HPCZECO_") and not k.startswith("HPCZECO_TEST_")]:
            env.pop(k)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    env.update(extra)
    return env
