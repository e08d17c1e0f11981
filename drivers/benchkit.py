"""What the benchmark drivers share: a recorder of result rows, the timers, and the machine's description.

- :class:`Recorder`: rows in named tables (``"timings"``, ``"ttft"`` ...). Each row is printed as one line
  when it is recorded, and ``DIR/STEM.json`` plus one ``DIR/STEM_TABLE.csv`` per table are rewritten
  after every row, so a run cut by a time limit keeps what it measured. :meth:`Recorder.finish`
  prints a table (or the driver's own text) and writes the driver's PNG.
- :func:`cuda_event_time`: CUDA events around each call (or queued back to back), warm-up calls
  excluded, median/min/max of the repeats in milliseconds (CuPy or PyTorch events).
- :func:`host_time`: wall clock per repeat after an optional synchronisation and barrier, the slowest
  rank per repeat when a communicator is given; :class:`Stopwatch`: wall and CPU seconds of one block.
- :func:`cpu_model` (the one ``/proc/cpuinfo`` probe), :func:`environment` (machine, CPU, GPU, library
  versions, date) and :func:`gpu_missing` (why a GPU benchmark cannot run here, in one line).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "Recorder",
    "Stopwatch",
    "cpu_model",
    "cuda_event_time",
    "environment",
    "gpu_description",
    "gpu_missing",
    "host_time",
    "library_versions",
]

# --------------------------------------------------------------------------------------------- machine


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions(modules: Iterable[str]) -> dict[str, str]:
    """``{module: version}``, importing each; a module that does not import says why."""
    out = {}
    for name in modules:
        try:
            mod = __import__(name)
            out[name] = str(getattr(mod, "__version__", "?"))
        except Exception as exc:  # noqa: BLE001 - describe, never fail
            out[name] = f"unavailable ({type(exc).__name__})"
    return out


def gpu_description(device: int | None = None) -> dict[str, Any]:
    """Name, SMs, L2 bytes, opt-in shared memory, CUDA runtime and device count of CuPy's current GPU."""
    try:
        import cupy as cp  # noqa: PLC0415

        dev = cp.cuda.Device(device) if device is not None else cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"]
        return {
            "gpu": name.decode() if isinstance(name, bytes) else str(name),
            "sms": int(props["multiProcessorCount"]),
            "l2_bytes": props.get("l2CacheSize"),
            "smem_optin": props.get("sharedMemPerBlockOptin"),
            "cuda_runtime": int(cp.cuda.runtime.runtimeGetVersion()),
            "devices": int(cp.cuda.runtime.getDeviceCount()),
        }
    except Exception as exc:  # noqa: BLE001
        return {"gpu": f"unavailable ({type(exc).__name__}: {_first_line(exc)})"}


def environment(libraries: Iterable[str] = ("numpy",), gpu: bool = False) -> dict[str, Any]:
    """Where and when a benchmark ran: host, platform, CPU model and count, Python, library versions,
    the date (UTC), and with ``gpu`` the GPU (:func:`gpu_description`)."""
    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    env.update(library_versions(libraries))
    if gpu:
        env.update(gpu_description())
    return env


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def gpu_missing(needs: Iterable[str] = ()) -> str | None:
    """``None`` when CuPy sees a CUDA GPU (and the modules in ``needs`` import), else the reason in one line."""
    try:
        import cupy  # noqa: PLC0415

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return f"needs CuPy and a CUDA GPU ({type(exc).__name__}: {_first_line(exc)})"
    if n < 1:
        return "needs a CUDA GPU (CuPy sees none)"
    for name in needs:
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001
            return f"needs {name} ({type(exc).__name__}: {_first_line(exc)})"
    return None


# --------------------------------------------------------------------------------------------- timers


def _summary(times_ms: list[float]) -> dict[str, Any]:
    return {"median_ms": float(statistics.median(times_ms)), "min_ms": float(min(times_ms)),
            "max_ms": float(max(times_ms)), "reps": len(times_ms)}


def cuda_event_time(fn: Callable[[int], Any], repeats: int, warmup: int = 3, sets: int = 1, queued: bool = False,
                    events: str = "cupy") -> dict[str, Any]:
    """Milliseconds of ``fn(i % sets)`` (``i`` the call's index) on the GPU, by CUDA events.

    ``warmup`` calls first (not timed). Each of the ``repeats`` timed calls sits between two events
    and is synchronised on (``queued=False``), or the calls are queued back to back with an event
    between each two and one synchronisation at the end (``queued=True``: the GPU time of a call
    without the host's launch overhead while the GPU is busy). ``events``: ``"cupy"`` (CuPy's current
    stream) or ``"torch"`` (PyTorch's). Returns ``median_ms``, ``min_ms``, ``max_ms``, ``reps``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if events == "torch":
        import torch  # noqa: PLC0415

        make = lambda: torch.cuda.Event(enable_timing=True)
        sync = torch.cuda.synchronize
        elapsed = lambda a, b: a.elapsed_time(b)
    elif events == "cupy":
        import cupy as cp  # noqa: PLC0415

        make = cp.cuda.Event
        sync = lambda: cp.cuda.Device().synchronize()
        elapsed = cp.cuda.get_elapsed_time
    else:
        raise ValueError(f"events must be 'cupy' or 'torch', got {events!r}")
    for i in range(warmup):
        fn(i % sets)
    sync()
    if queued:
        ev = [make() for _ in range(repeats + 1)]
        ev[0].record()
        for i in range(repeats):
            fn(i % sets)
            ev[i + 1].record()
        ev[-1].synchronize()
        times = [elapsed(ev[i], ev[i + 1]) for i in range(repeats)]
    else:
        start, stop = make(), make()
        times = []
        for i in range(repeats):
            start.record()
            fn(i % sets)
            stop.record()
            stop.synchronize()
            times.append(elapsed(start, stop))
    return _summary([float(t) for t in times])


def host_time(fn: Callable[[], Any], repeats: int, warmup: int = 3, sync: Callable[[], Any] | None = None,
              comm: Any = None) -> dict[str, Any]:
    """Wall-clock milliseconds of ``fn()``: ``warmup`` untimed calls, then per repeat ``sync()`` and a
    barrier on ``comm`` (when given) before the clock starts and ``sync()`` before it stops; with
    ``comm`` each repeat counts the slowest rank (collective). Returns ``median_ms``, ``min_ms``,
    ``max_ms``, ``reps``."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        if comm is not None:
            from hpczeco.collectives.lifeline import guard  # noqa: PLC0415

            with guard(comm, "the barrier before a timed repeat"):  # blocking, as timed; bounded by the timeout
                comm.Barrier()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    if comm is not None:
        import numpy as np  # noqa: PLC0415
        from hpczeco.collectives import timed  # noqa: PLC0415
        from mpi4py import MPI  # noqa: PLC0415

        worst = np.array(times, dtype=np.float64)
        timed.Allreduce(comm, worst, MPI.MAX, "the slowest rank's times")  # per repetition, the slowest rank
        times = worst.tolist()
    return _summary(times)


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.wall`` and ``sw.cpu`` (this process's CPU time, all
    threads) in seconds."""

    wall: float = 0.0
    cpu: float = 0.0

    def __enter__(self) -> Stopwatch:
        self._w0, self._c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self._w0
        self.cpu = time.process_time() - self._c0


# --------------------------------------------------------------------------------------------- recorder


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:  # numpy scalars
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


class Recorder:
    """Result rows of one benchmark run in named tables; see the module docstring.

    ``out``: folder; ``stem``: file name stem; ``rank``: only rank 0 prints and writes; ``info``: the
    run's description (environment, settings), saved beside the tables. JSON layout:
    ``{"info": {...}, TABLE: [row, ...], ..., "wall_seconds": s}``.
    """

    def __init__(self, out: str | Path, stem: str, rank: int = 0, info: dict[str, Any] | None = None):
        self.out, self.stem, self.rank = Path(out), stem, rank
        self.info: dict[str, Any] = dict(info or {})
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.t0 = time.time()

    @property
    def json_path(self) -> Path:
        return self.out / f"{self.stem}.json"

    def csv_path(self, table: str) -> Path:
        return self.out / f"{self.stem}_{table}.csv"

    def say(self, *parts: Any) -> None:
        """Print on rank 0, prefixed by the seconds since the run began."""
        if self.rank == 0:
            print(f"[{time.time() - self.t0:6.1f}s]", *parts, flush=True)

    def record(self, row: dict[str, Any], table: str = "timings") -> dict[str, Any]:
        """Add ``row`` to ``table``, print it, rewrite the files. Returns the row."""
        self.tables.setdefault(table, []).append(row)
        if "name" in row:
            ms = row.get("median_ms")
            ms_s = "n/a" if ms is None else f"{ms:9.3f} ms"
            more = "  ".join(f"{k}={_cell(v)}" for k, v in row.items() if k not in ("name", "median_ms")
                             and not isinstance(v, (list, dict)))
            self.say(f"TIME  {row['name']:58s} {ms_s}  {more}")
        else:
            self.say(f"{table}: " + "  ".join(f"{k}={_cell(v)}" for k, v in row.items()
                                               if not isinstance(v, (list, dict))))
        self.save()
        return row

    def timing(self, name: str, ms: float | None, table: str = "timings", **extra: Any) -> dict[str, Any]:
        """Record ``{"name": name, "median_ms": ms, **extra}``."""
        return self.record({"name": name, "median_ms": ms, **extra}, table)

    def failed(self, name: str, exc: BaseException, table: str = "timings", **extra: Any) -> dict[str, Any]:
        """Record that measuring ``name`` raised ``exc`` (``median_ms`` None, ``error`` the reason)."""
        return self.timing(name, None, table, error=f"{type(exc).__name__}: {exc}"[:200], **extra)

    def save(self) -> Path:
        """Rewrite the JSON file and the CSV files (rank 0). Returns the JSON path."""
        if self.rank != 0:
            return self.json_path
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"info": self.info, **self.tables, "wall_seconds": round(time.time() - self.t0, 1)}
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=_jsonable))
        os.replace(tmp, self.json_path)
        for table, rows in self.tables.items():
            cols: list[str] = []
            for r in rows:
                cols += [k for k in r if k not in cols]
            with open(self.csv_path(table), "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=cols)
                w.writeheader()
                for r in rows:
                    w.writerow({k: json.dumps(v, default=_jsonable) if isinstance(v, (list, dict)) else v
                                for k, v in r.items()})
        return self.json_path

    def text(self) -> str:
        """The tables as plain text: ``name  median  extras`` rows, or aligned columns."""
        lines = []
        for table, rows in self.tables.items():
            lines.append(f"-- {table}")
            if all("name" in r for r in rows):
                for r in rows:
                    ms = "n/a" if r.get("median_ms") is None else f"{r['median_ms']:.3f} ms"
                    extra = "  ".join(f"{k}={_cell(v)}" for k, v in r.items()
                                      if k not in ("name", "median_ms") and not isinstance(v, (list, dict)))
                    lines.append(f"  {r['name']:52s} {ms:>12s}  {extra}")
                continue
            cols: list[str] = []
            for r in rows:
                cols += [k for k in r if k not in cols and not isinstance(r[k], (list, dict))]
            cells = [[_cell(r.get(c)) for c in cols] for r in rows]
            width = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
            lines.append("  " + " ".join(c.rjust(w) for c, w in zip(cols, width)))
            lines += ["  " + " ".join(x.rjust(w) for x, w in zip(row, width)) for row in cells]
        return "\n".join(lines)

    def finish(self, text: str | None = None,
               plot: Callable[[dict[str, list[dict[str, Any]]], Path], Any] | None = None) -> Path:
        """Save, write the PNG (``plot(tables, out)``, guarded), print ``text`` (default :meth:`text`)."""
        path = self.save()
        if self.rank != 0:
            return path
        if plot is not None:
            try:
                self.info["plot"] = str(plot(self.tables, self.out))
            except Exception as exc:  # noqa: BLE001 - a missing matplotlib must not lose the results
                self.info["plot"] = f"failed: {type(exc).__name__}: {exc}"
            path = self.save()
        print(flush=True)
        print(self.text() if text is None else text, flush=True)
        print(f"\nwall {time.time() - self.t0:.0f} s; results in {path}", file=sys.stdout, flush=True)
        return path
