"""HDF5 checkpoints: atomic, checksummed, keep-last-N, never pickled, safe to load from elsewhere.

A checkpoint is one file ``ckpt_<step:08d>.h5`` in a folder:

* **datasets** — one per array, under nested names such as ``params/layer0/wq`` or ``adam/m/...``;
  each carries a ``sha256`` attribute (of dtype, shape and bytes);
* **root attributes** — ``format``, ``format_version``, ``step``, ``nranks`` (ranks that wrote it),
  ``created`` (UTC time), the caller's plain attributes (strings, numbers, booleans, numeric arrays,
  JSON-able dicts/lists such as the run config or an RNG state), ``_manifest`` (JSON: name -> shape,
  dtype, sha256 of every dataset), ``_attr_kinds`` (how each attribute is encoded) and
  ``_attrs_sha256`` (a checksum over all the attributes).

Writes are atomic: a hidden temporary file in the same folder, fsync'ed, then ``os.replace``'d onto its
final name and the folder fsync'ed; a crash leaves at worst a hidden temporary file, never a
half-written newest checkpoint (the next successful write removes such leftovers). HDF5 writes the
temporary through a Python file object (:class:`GuardedFile`: ordinary ``os.pwrite``) that keeps I/O
errors away from HDF5: a write that fails (a full disk) is remembered and its bytes kept in memory, so
HDF5 never fails half-way inside its caches (the PyPI h5py then crashed the process at exit, status
11); afterwards the error is one ``CheckpointError`` on every rank naming the folder and the space
needed, the partial temporary removed. Only the newest ``keep`` are kept.

Loading (:func:`load_latest`) takes the newest checkpoint that passes every check (readable HDF5,
format, step, every dataset's name/shape/dtype/checksum against the manifest, the attribute checksum,
the run config against ``expect_config``, the arrays against ``expect_arrays`` and the caller's
``validate``); a corrupt or mismatched one is reported with the reason and the previous one is used.
What is read is bounded before it is read: with ``expect_arrays`` exactly the expected names, shapes and
dtypes, and in any case only contiguous (or compact) datasets whose stored size equals their declared
size and whose sizes sum to at most the file's size (a chunked, never-written ``(10**12,)`` dataset is
refused, not allocated). Any error while loading a candidate (``MemoryError`` included) rejects it;
none escapes on one rank. Nothing is unpickled and no path read from a file is followed: dataset
names must be plain relative names (no leading ``/``, no ``.``/``..`` parts), and soft/external links,
external storage and virtual datasets (which point at other files) are refused.

Parallelism: parameters are replicated, so every rank passes the same arrays (checked by comparing
their checksums across ranks). With a parallel h5py (``h5py.get_config().mpi``) the file is opened
by every rank with ``driver='mpio'`` and rank 0 writes the data (``make phdf5`` builds such an h5py,
``make test-phdf5`` tests this path); with the serial PyPI wheels (the usual case) rank 0 writes the
file alone. Both paths write the same file contents.
Loading is done by rank 0 and broadcast, so a checkpoint written by P ranks loads on any number of
ranks. Every exchange honours ``$HPCZECO_COLLECTIVE_TIMEOUT`` (:mod:`hpczeco.collectives.timed`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "parallel_hdf5",
    "hdf5_mode",
]

FORMAT = "hpczeco-checkpoint"
FORMAT_VERSION = 1
_FILE_RE = re.compile(r"^ckpt_(\d{8,})\.h5$")
_TMP_RE = re.compile(r"^\.ckpt_\d{8,}\.h5\.tmp-\d+-\d+$")

_PART = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_NAME_RE = re.compile(rf"^{_PART}(/{_PART})*$")
_RESERVED = {"format", "format_version", "step", "nranks", "created", "_manifest", "_attr_kinds", "_attrs_sha256"}
_INT64 = (-(2**63), 2**63 - 1)


#: fault injection for the reliability tests: ``MODE[:STEP]`` with MODE ``mid-write`` (the process exits
#: abruptly after writing about half of the datasets into the temporary file) or ``before-rename`` (exits
#: after the temporary file is complete and fsync'ed, before it is renamed); STEP limits it to that
#: checkpoint step. The process ends with ``os._exit(FAULT_EXIT_CODE)`` (no cleanup, like a crash).
FAULT_ENV = "HPCZECO_FAULT_CKPT"
FAULT_EXIT_CODE = 77
_FAULT_MODES = ("mid-write", "before-rename")


def _fault_here(mode: str, step: int) -> bool:
    env = os.environ.get(FAULT_ENV, "").strip()
    if not env:
        return False
    want, _, at = env.partition(":")
    if want not in _FAULT_MODES:
        raise ValueError(f"${FAULT_ENV} must be MODE[:STEP] with MODE in {_FAULT_MODES}, got {env!r}")
    return want == mode and (not at or int(at) == step)


def _crash(mode: str, step: int) -> None:
    sys.stderr.write(f"hpczeco checkpoint: fault injection: exiting abruptly ({mode}) while writing step {step}\n")
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or no stored checkpoint passes the checks."""


# --------------------------------------------------------------------------------------------- helpers


def parallel_hdf5() -> bool:
    """True when this h5py was built against parallel HDF5 (``driver='mpio'`` usable)."""
    return bool(h5py.get_config().mpi)


def hdf5_mode() -> str:
    """One line describing how checkpoints are written with this h5py."""
    if parallel_hdf5():
        return "parallel (driver='mpio', collective create, rank 0 writes the replicated data)"
    return "serial: rank 0 writes the file through os.pwrite (GuardedFile: I/O errors kept from HDF5), then fsync"


def _rank_size(comm) -> tuple[int, int]:
    return (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())


def _contig(a: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (``np.ascontiguousarray`` makes them 1-d)."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def array_sha256(a: np.ndarray) -> str:
    """sha256 over dtype, shape and the C-order bytes of ``a``."""
    a = _contig(np.asarray(a))
    h = hashlib.sha256()
    h.update(a.dtype.str.encode())
    h.update(repr(tuple(int(s) for s in a.shape)).encode())
    h.update(memoryview(a).cast("B") if a.size else b"")
    return h.hexdigest()


def check_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a plain relative dataset name like ``params/layer0/wq``."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"array name {name!r} is not a plain relative name: use parts of letters, digits, '_', '.', '-' "
            "joined by '/', none starting with '.' (no absolute paths, no '.' or '..')"
        )


def _to_host(x: Any) -> np.ndarray:
    from hpczeco.base.backend import to_numpy

    a = to_numpy(x)
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    return a


def _check_array(name: str, a: np.ndarray) -> None:
    if a.dtype.kind not in "biuf" or a.dtype.fields is not None:
        raise TypeError(f"array {name!r} has dtype {a.dtype}: only bool, integer and floating arrays are stored")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"value of type {type(o).__name__} is not JSON-serialisable")


def _dumps(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=_json_default, allow_nan=True)


def _encode_attr(name: str, value: Any) -> tuple[str, Any]:
    """(kind, value to store). Kinds: str, bool, int, float, array, json."""
    if isinstance(value, (bool, np.bool_)):
        return "bool", np.bool_(value)
    if isinstance(value, (int, np.integer)):
        v = int(value)
        return ("int", np.int64(v)) if _INT64[0] <= v <= _INT64[1] else ("json", _dumps(v))
    if isinstance(value, (float, np.floating)):
        return "float", np.float64(value)
    if isinstance(value, str):
        return "str", value
    if isinstance(value, np.ndarray):
        _check_array(f"attribute {name}", value)
        return "array", _contig(value)
    if value is None or isinstance(value, (dict, list, tuple)):
        try:
            return "json", _dumps(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"attribute {name!r} is not JSON-serialisable: {exc}") from None
    raise TypeError(
        f"attribute {name!r} has type {type(value).__name__}: use str, bool, int, float, a numeric numpy array, "
        "or a JSON-able dict/list"
    )


def _decode_attr(kind: str, raw: Any) -> Any:
    if kind == "str":
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    if kind == "bool":
        return bool(raw)
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "array":
        return np.asarray(raw)
    if kind == "json":
        return json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    raise ValueError(f"unknown attribute kind {kind!r}")


def _canonical(kind: str, value: Any) -> Any:
    if kind == "array":
        return array_sha256(np.asarray(value))
    if kind == "float" and not math.isfinite(value):
        return repr(value)
    return value


def _attrs_digest(kinds: Mapping[str, str], values: Mapping[str, Any]) -> str:
    items = [[k, kinds[k], _canonical(kinds[k], values[k])] for k in sorted(kinds)]
    return hashlib.sha256(_dumps(items).encode()).hexdigest()


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_name(step: int) -> str:
    return f"ckpt_{int(step):08d}.h5"


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoint files in ``folder``, oldest first (hidden temporaries excluded)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for entry in folder.iterdir():
        m = _FILE_RE.match(entry.name)
        if m and entry.is_file() and not entry.is_symlink():
            out.append((int(m.group(1)), entry))
    return sorted(out)


def _default_report(comm) -> Callable[[str], None]:
    rank, _ = _rank_size(comm)

    def report(msg: str) -> None:
        if rank == 0:
            print(f"hpczeco checkpoint: {msg}", file=sys.stderr, flush=True)

    return report


# --------------------------------------------------------------------------------------------- writing


class CheckpointWriter:
    """Writes checkpoints of replicated arrays into ``folder``, keeping the newest ``keep``.

    ``save`` is collective over ``comm`` (``None`` = a single process): every rank passes the same
    ``arrays`` and ``attrs`` and gets the same path back, or the same ``CheckpointError``/``ValueError``.
    """

    def __init__(self, folder: str | os.PathLike, comm=None, keep: int | None = 3, parallel: bool | None = None):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None (keep all), got {keep!r}")
        self.folder = Path(folder)
        self.comm = comm
        self.keep = keep
        self.rank, self.size = _rank_size(comm)
        self.parallel = parallel_hdf5() if parallel is None else bool(parallel)
        if self.parallel and not parallel_hdf5():
            raise ValueError("parallel=True needs an h5py built with parallel HDF5 (h5py.get_config().mpi)")
        if self.parallel and comm is None:
            self.parallel = False
        err = None
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                err = f"cannot create checkpoint folder {self.folder}: {exc}"
        self._raise_if_any(err)

    @property
    def mode(self) -> str:
        return "mpio" if self.parallel else "serial"

    def _raise_if_any(self, err: str | None, root_only: bool = True) -> None:
        """Same ``CheckpointError`` on every rank if rank 0 (or any rank) had ``err``."""
        if self.comm is not None and self.size > 1:
            from hpczeco.collectives import timed  # noqa: PLC0415

            errs = ([timed.bcast(self.comm, err, 0, "checkpoint save")] if root_only
                    else timed.allgather(self.comm, err, "checkpoint save"))
        else:
            errs = [err]
        bad = [e for e in errs if e]
        if bad:
            raise CheckpointError(bad[0])

    def _prepare(self, step: int, arrays: Mapping[str, Any], attrs: Mapping[str, Any]):
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not isinstance(arrays, Mapping):
            raise TypeError(f"arrays must be a dict of name -> array, got {type(arrays).__name__}")
        host: dict[str, np.ndarray] = {}
        names = sorted(arrays)
        for name in names:
            check_name(name)
            a = _to_host(arrays[name])
            _check_array(name, a)
            host[name] = _contig(a)
        # a name may not be both an array and a group of arrays ("a" and "a/b")
        prefixes = {"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)}
        clash = sorted(prefixes & set(names))
        if clash:
            raise ValueError(f"array name {clash[0]!r} is also used as a group of other arrays")
        kinds: dict[str, str] = {}
        stored: dict[str, Any] = {}
        for key, value in dict(attrs or {}).items():
            if not isinstance(key, str) or not key or key in _RESERVED or key.startswith("_") or "/" in key:
                raise ValueError(
                    f"attribute name {key!r} is reserved or invalid (non-empty, no '/', not starting with '_', "
                    f"not one of {sorted(_RESERVED)})"
                )
            kinds[key], stored[key] = _encode_attr(key, value)
        manifest = {
            n: {"shape": list(a.shape), "dtype": a.dtype.str, "sha256": array_sha256(a)} for n, a in host.items()
        }
        return int(step), host, kinds, stored, manifest

    def save(self, step: int, arrays: Mapping[str, Any], attrs: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` atomically; returns its path (collective).

        ``arrays``: name -> numpy (or CuPy) array, identical on every rank. ``attrs``: plain values
        (str/bool/int/float/numeric array/JSON-able dict or list), e.g. ``config``, ``rng``, ``data_pos``.
        """
        err: BaseException | None = None
        prepared = None
        try:
            prepared = self._prepare(step, arrays, attrs or {})
        except (ValueError, TypeError) as exc:
            err = exc
        from hpczeco.collectives.agree import collective_check

        collective_check(self.comm, "checkpoint save", err)
        step, host, kinds, stored, manifest = prepared
        if self.comm is not None and self.size > 1:
            mine = (step, {n: m["sha256"] for n, m in manifest.items()}, _attrs_digest(kinds, _decoded(kinds, stored)))
            from hpczeco.collectives import timed  # noqa: PLC0415

            everyone = timed.allgather(self.comm, mine, "checkpoint save")
            for r, theirs in enumerate(everyone):
                if theirs != everyone[0]:
                    what = _first_difference(everyone[0], theirs)
                    raise ValueError(
                        f"checkpoint save: rank {r} differs from rank 0 in {what}; checkpointed arrays and "
                        "attributes must be replicated (identical on every rank)"
                    )
        final = self.folder / checkpoint_name(step)
        tmp_name = f".{final.name}.tmp-{os.getpid()}-{time.time_ns()}" if self.rank == 0 else None
        if self.comm is not None and self.size > 1:
            from hpczeco.collectives import timed  # noqa: PLC0415

            tmp_name = timed.bcast(self.comm, tmp_name, 0, "checkpoint save")
        tmp = self.folder / tmp_name
        root_attrs = {
            "format": FORMAT,
            "format_version": np.int64(FORMAT_VERSION),
            "step": np.int64(step),
            "nranks": np.int64(self.size),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "_manifest": _dumps(manifest),
            "_attr_kinds": _dumps(kinds),
            "_attrs_sha256": _attrs_digest(kinds, _decoded(kinds, stored)),
        }
        if self.parallel:
            err_s = self._space_short(step, host, stored, root_attrs)
            if err_s is None:
                err_s = self._write_mpio(tmp, host, manifest, stored, root_attrs)
        else:
            err_s = self._write_serial(tmp, host, manifest, stored, root_attrs) if self.rank == 0 else None
        if err_s is None and self.rank == 0:
            if _fault_here("before-rename", step):
                _crash("before-rename", step)
            err_s = self._publish(tmp, final)
        if err_s is not None and self.rank == 0:
            _silent_unlink(tmp)
        self._raise_if_any(err_s, root_only=not self.parallel)
        return final

    # -- file writing ---------------------------------------------------------------------------------

    @staticmethod
    def _fill(f: h5py.File, host, manifest, stored, root_attrs, write_data: bool) -> None:
        crash_at = len(host) // 2 if _fault_here("mid-write", int(root_attrs["step"])) else -1
        for i, (name, a) in enumerate(host.items()):
            if i == crash_at:
                f.flush()
                _crash("mid-write", int(root_attrs["step"]))
            ds = f.create_dataset(name, shape=a.shape, dtype=a.dtype)
            ds.attrs["sha256"] = manifest[name]["sha256"]
            if write_data and a.size:
                ds[...] = a
        for key, value in root_attrs.items():
            f.attrs[key] = value
        for key, value in stored.items():
            f.attrs[key] = value

    def _write_serial(self, tmp: Path, host, manifest, stored, root_attrs) -> str | None:
        """Write the file through a :class:`GuardedFile` (HDF5 never sees an I/O error), then fsync it."""
        step = int(root_attrs["step"])
        guarded: GuardedFile | None = None
        error: BaseException | None = None
        try:
            with GuardedFile(tmp) as guarded:
                with h5py.File(guarded, "w") as f:
                    self._fill(f, host, manifest, stored, root_attrs, write_data=True)
                    f.flush()
                guarded.sync()
            error = guarded.error
        except Exception as exc:  # noqa: BLE001 - reported collectively
            error = guarded.error if guarded is not None and guarded.error is not None else exc
        if error is None:
            return None
        _silent_unlink(tmp)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            need = guarded.size if guarded is not None else 0
            return (f"cannot write checkpoint {checkpoint_name(step)} into {self.folder}: no space left on the "
                    f"device ({error.strerror}): it needs {need:,} bytes, {_free_bytes(self.folder):,} bytes are "
                    "free there; the previous checkpoints are kept")
        return f"cannot write checkpoint {tmp.name} in {self.folder}: {type(error).__name__}: {error}"

    def _space_short(self, step: int, host, stored, root_attrs) -> str | None:
        """Parallel HDF5 only: rank 0 checks the free space against :func:`estimated_bytes` before any rank
        opens the file, and every rank gets its answer (the same error, or None). An MPI-IO write that fails
        for want of space can crash HDF5 itself when the file is closed (seen: Debian's libhdf5-openmpi
        1.10, a segfault in ``H5F__close_cb`` after ``mca_fbtl_posix_pwritev: No space left on device``), so
        the common case is refused before HDF5 sees it. Space that runs out during the write is not covered."""
        short = None
        if self.rank == 0:
            need, free = estimated_bytes(host, stored, root_attrs), _free_bytes(self.folder)
            if 0 <= free < need:
                short = (f"cannot write checkpoint {checkpoint_name(step)} into {self.folder}: no space left on the "
                         f"device (checked before writing, parallel HDF5): it needs {need:,} bytes, {free:,} bytes "
                         "are free there; the previous checkpoints are kept")
        if self.size > 1:
            from hpczeco.collectives import timed  # noqa: PLC0415

            short = timed.bcast(self.comm, short, 0, "checkpoint save")
        return short

    def _write_mpio(self, tmp: Path, host, manifest, stored, root_attrs) -> str | None:
        """Parallel HDF5: object creation and attributes are collective (same values on every rank);
        the replicated data are written by rank 0 alone (independent I/O). Tested by
        tests/test_checkpoint_mpio.py with an h5py from ``make phdf5``."""
        err = None
        try:
            with h5py.File(tmp, "w", driver="mpio", comm=self.comm) as f:
                self._fill(f, host, manifest, stored, root_attrs, write_data=self.rank == 0)
                f.flush()
            if self.rank == 0:
                _fsync_path(tmp)
        except Exception as exc:  # noqa: BLE001
            err = f"rank {self.rank}: cannot write checkpoint {tmp.name} (mpio): {type(exc).__name__}: {exc}"
        from hpczeco.collectives import timed  # noqa: PLC0415

        errs = [e for e in timed.allgather(self.comm, err, "checkpoint save (mpio)") if e]
        return errs[0] if errs else None

    def _publish(self, tmp: Path, final: Path) -> str | None:
        try:
            os.replace(tmp, final)
            _fsync_path(self.folder, directory=True)
        except Exception as exc:  # noqa: BLE001
            return f"cannot move checkpoint into place as {final}: {type(exc).__name__}: {exc}"
        if self.keep is not None:
            for _, old in list_checkpoints(self.folder)[: -self.keep]:
                _silent_unlink(old)
        for leftover in _leftover_temporaries(self.folder):  # of writers killed mid-write
            _silent_unlink(leftover)
        return None


class GuardedFile:
    """A new file that h5py writes through (a Python file object) with ordinary ``os.pwrite`` calls, keeping
    I/O errors from HDF5.

    The first failing write (``ENOSPC``...) is stored in :attr:`error`; from then on the bytes of every
    write are kept in memory instead (reads see them), and every call succeeds, so HDF5 finishes its file in
    a consistent state and the caller reports :attr:`error` afterwards. :attr:`size` is the file's size as
    HDF5 sees it (what the disk would have needed). Costs the same as HDF5's own writes (one copy into the
    page cache): docs/RELIABILITY.md."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.pos = 0
        self.size = 0
        self.error: OSError | None = None
        self._kept: list[tuple[int, bytes]] = []

    def __enter__(self) -> GuardedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            os.close(self.fd)
        except OSError as err:
            self.error = self.error or err

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else (self.pos + offset if whence == 1 else self.size + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, done = view.nbytes, 0
        if self.error is None:
            try:
                while done < n:
                    done += os.pwrite(self.fd, view[done:], self.pos + done)
            except OSError as err:
                self.error = err
        if done < n:
            self._kept.append((self.pos + done, bytes(view[done:])))
        self.pos += n
        self.size = max(self.size, self.pos)
        return n

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(view.nbytes, self.size - self.pos))
        got = os.preadv(self.fd, [view[:n]], self.pos) if n else 0
        if got < n:
            view[got:n] = bytes(n - got)
        for offset, data in self._kept:
            lo, hi = max(offset, self.pos), min(offset + len(data), self.pos + n)
            if lo < hi:
                view[lo - self.pos:hi - self.pos] = data[lo - offset:hi - offset]
        self.pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        buf = bytearray(self.size - self.pos if n is None or n < 0 else n)
        return bytes(buf[: self.readinto(buf)])

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else int(size)
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as err:
                self.error = err
        self.size = size
        return size

    def flush(self) -> None:
        return None

    def sync(self) -> None:
        """fsync the file (a delayed allocation may report a full disk only here)."""
        if self.error is None:
            try:
                os.fsync(self.fd)
            except OSError as err:
                self.error = err


def estimated_bytes(host: Mapping[str, np.ndarray], stored: Mapping[str, Any], root_attrs: Mapping[str, Any]) -> int:
    """An upper estimate of a checkpoint file's size: the array bytes, the attributes' bytes, 4 KiB of HDF5
    headers per dataset (object header, its sha256 attribute, B-tree and heap entries) and 64 KiB for the file
    (superblock, root group, free-space slack); ``tests/test_checkpoint.py`` checks it against written files."""
    data = sum(int(a.nbytes) for a in host.values())
    attrs = sum((int(v.nbytes) if isinstance(v, np.ndarray) else len(str(v).encode())) + 256
                for v in (*stored.values(), *root_attrs.values()))
    return data + attrs + 4096 * len(host) + 65536


def _free_bytes(folder: Path) -> int:
    try:
        return int(shutil.disk_usage(folder).free)
    except OSError:
        return -1


def _leftover_temporaries(folder: Path) -> list[Path]:
    """Hidden temporaries (``.ckpt_*.h5.tmp-PID-NS``, regular files) in ``folder``."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return [e for e in entries if _TMP_RE.match(e.name) and e.is_file() and not e.is_symlink()]


def _decoded(kinds: Mapping[str, str], stored: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _decode_attr(kinds[k], stored[k]) for k in kinds}


def _first_difference(a, b) -> str:
    if a[0] != b[0]:
        return f"step ({a[0]} vs {b[0]})"
    for name in sorted(set(a[1]) | set(b[1])):
        if a[1].get(name) != b[1].get(name):
            return f"array {name!r}"
    return "attributes"


def _silent_unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# --------------------------------------------------------------------------------------------- loading


def _walk(group: h5py.Group, prefix: str = "") -> list[str]:
    """Names of all datasets under ``group``; refuses anything that points outside the file."""
    names = []
    for key in group:
        full = f"{prefix}{key}"
        link = group.get(key, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise CheckpointError(f"{full!r} is a {type(link).__name__} (only plain datasets are accepted)")
        obj = group[key]
        if isinstance(obj, h5py.Group):
            names += _walk(obj, full + "/")
        elif isinstance(obj, h5py.Dataset):
            if obj.is_virtual or obj.external:
                raise CheckpointError(f"dataset {full!r} stores its data outside the file (refused)")
            names.append(full)
        else:
            raise CheckpointError(f"{full!r} is neither a group nor a dataset")
    return names


#: what a caller expects of the arrays: name -> (shape, dtype)
ExpectArrays = Mapping[str, tuple[tuple[int, ...], Any]]


def _check_expected(manifest: Mapping[str, Any], expect_arrays: ExpectArrays) -> None:
    """The manifest holds exactly the expected names, shapes and dtypes (checked before anything is read)."""
    missing = sorted(set(expect_arrays) - set(manifest))
    extra = sorted(set(manifest) - set(expect_arrays))
    if missing or extra:
        more = lambda xs: " ..." if len(xs) > 4 else ""  # noqa: E731
        raise CheckpointError(f"arrays differ from what this run expects (missing {missing[:4]}{more(missing)}, "
                              f"unexpected {extra[:4]}{more(extra)})")
    for name, (shape, dtype) in expect_arrays.items():
        want = manifest[name]
        if list(want.get("shape", [])) != [int(n) for n in shape] or want.get("dtype") != np.dtype(dtype).str:
            raise CheckpointError(f"array {name!r} is {want.get('dtype')}{want.get('shape')}, this run expects "
                                  f"{np.dtype(dtype).str}{list(shape)}")


def _check_storage(name: str, ds: h5py.Dataset) -> int:
    """Bytes ``ds`` declares; refuses layouts this format never writes (chunked, filtered, sparse) and a
    stored size other than the declared one (checked before the data are read)."""
    layout = ds.id.get_create_plist().get_layout()
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.COMPACT):
        raise CheckpointError(f"dataset {name!r} is chunked or otherwise not stored contiguously (refused: this "
                              "format writes contiguous datasets, and a chunked one may declare far more data "
                              "than the file holds)")
    nbytes = int(np.prod(ds.shape, dtype=object)) * ds.dtype.itemsize
    stored = int(ds.id.get_storage_size())
    if stored != nbytes:
        raise CheckpointError(f"dataset {name!r} declares {nbytes:,} bytes but stores {stored:,} (refused)")
    return nbytes


def load_checkpoint(
    path: str | os.PathLike, expect_config: Mapping[str, Any] | None = None,
    expect_arrays: ExpectArrays | None = None,
) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
    """Read and verify one checkpoint file (single process). Raises ``CheckpointError`` saying why it
    is rejected: unreadable/truncated, wrong format, checksum mismatch, config mismatch, arrays other
    than ``expect_arrays`` (name -> (shape, dtype), exact; checked before reading), or storage that
    declares more than the file holds. Any other error while reading is a ``CheckpointError`` too."""
    try:
        return _load_checkpoint(Path(path), expect_config, expect_arrays)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - MemoryError, h5py internals: the candidate is rejected
        raise CheckpointError(f"cannot be loaded ({type(exc).__name__}: {exc})") from None


def _load_checkpoint(
    path: Path, expect_config: Mapping[str, Any] | None, expect_arrays: ExpectArrays | None,
) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
    m = _FILE_RE.match(path.name)
    try:
        file_bytes = path.stat().st_size
        with h5py.File(path, "r") as f:
            fmt = _decode_attr("str", f.attrs.get("format", b""))
            if fmt != FORMAT:
                raise CheckpointError(f"not an hpczeco checkpoint (format attribute {fmt!r})")
            version = int(f.attrs.get("format_version", -1))
            if version != FORMAT_VERSION:
                raise CheckpointError(f"format version {version} (this code reads {FORMAT_VERSION})")
            step = int(f.attrs["step"])
            if m and int(m.group(1)) != step:
                raise CheckpointError(f"file name says step {int(m.group(1))} but the file says {step}")
            manifest = json.loads(_decode_attr("str", f.attrs["_manifest"]))
            kinds = json.loads(_decode_attr("str", f.attrs["_attr_kinds"]))
            if not isinstance(manifest, dict) or not isinstance(kinds, dict):
                raise CheckpointError("the manifest or the attribute kinds are not JSON objects")
            if expect_arrays is not None:
                _check_expected(manifest, expect_arrays)
            found = sorted(_walk(f))
            if found != sorted(manifest):
                missing = sorted(set(manifest) - set(found))
                extra = sorted(set(found) - set(manifest))
                raise CheckpointError(f"datasets do not match the manifest (missing {missing}, unexpected {extra})")
            total = 0
            for name in found:
                check_name(name)
                ds = f[name]
                want = manifest[name]
                if list(ds.shape) != list(want["shape"]) or ds.dtype.str != want["dtype"]:
                    raise CheckpointError(
                        f"dataset {name!r} is {ds.dtype.str}{list(ds.shape)}, "
                        f"manifest says {want['dtype']}{want['shape']}"
                    )
                _check_array(name, np.empty(0, ds.dtype))
                total += _check_storage(name, ds)
            if total > file_bytes:
                raise CheckpointError(f"the datasets declare {total:,} bytes, more than the file's {file_bytes:,}")
            arrays: dict[str, np.ndarray] = {}
            for name in found:
                ds = f[name]
                want = manifest[name]
                a = ds[()] if ds.shape == () else ds[...]
                a = np.asarray(a, dtype=ds.dtype)
                if array_sha256(a) != want["sha256"]:
                    raise CheckpointError(f"checksum mismatch in dataset {name!r} (the data are corrupt)")
                arrays[name] = a
            attrs: dict[str, Any] = {}
            for key, kind in kinds.items():
                if key not in f.attrs:
                    raise CheckpointError(f"attribute {key!r} is missing")
                attrs[key] = _decode_attr(kind, f.attrs[key])
            if _attrs_digest(kinds, attrs) != _decode_attr("str", f.attrs["_attrs_sha256"]):
                raise CheckpointError("checksum mismatch in the attributes (they are corrupt)")
            nranks = int(f.attrs["nranks"])
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot be read ({type(exc).__name__}: {exc}); truncated or corrupt?") from None
    if expect_config is not None:
        stored = attrs.get("config")
        want = json.loads(_dumps(dict(expect_config)))
        if not isinstance(stored, dict):
            raise CheckpointError("has no 'config' attribute to compare with the expected run config")
        diff = [k for k in sorted(set(stored) | set(want)) if stored.get(k) != want.get(k)]
        if diff:
            shown = ", ".join(f"{k}: stored {stored.get(k)!r} vs expected {want.get(k)!r}" for k in diff[:6])
            raise CheckpointError(f"config mismatch ({shown}{', ...' if len(diff) > 6 else ''})")
    attrs["step"] = step
    attrs["nranks"] = nranks
    return step, arrays, attrs


def _odd_entries(folder: str | os.PathLike) -> list[tuple[Path, str]]:
    """Entries of ``folder`` named like a checkpoint that are not regular files: ``(path, what it is)``."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    odd = []
    for e in sorted(entries):
        if not _FILE_RE.match(e.name):
            continue
        try:
            mode = e.lstat().st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            odd.append((e, "a symbolic link (not followed)"))
        elif stat.S_ISDIR(mode):
            odd.append((e, "a directory"))
        elif stat.S_ISFIFO(mode):
            odd.append((e, "a FIFO"))
        elif not stat.S_ISREG(mode):
            odd.append((e, "not a regular file"))
    return odd


def load_latest(
    folder: str | os.PathLike,
    comm=None,
    expect_config: Mapping[str, Any] | None = None,
    report: Callable[[str], None] | None = None,
    expect_arrays: ExpectArrays | None = None,
    validate: Callable[[int, dict[str, np.ndarray], dict[str, Any]], None] | None = None,
) -> tuple[int, dict[str, np.ndarray], dict[str, Any]] | None:
    """The newest valid checkpoint in ``folder`` as ``(step, arrays, attrs)``; ``None`` if there is none.

    Collective over ``comm``: rank 0 reads and verifies, then broadcasts, so every rank gets the same
    result (works for any number of ranks, whatever number wrote it). A candidate is checked completely
    before it is chosen: the file checks of :func:`load_checkpoint` (with ``expect_config`` and
    ``expect_arrays``: name -> (shape, dtype), exact, checked before any data are read), then
    ``validate(step, arrays, attrs)``, the caller's model-level checks (attribute types and ranges,
    finiteness...), which raises to reject it. Checkpoints that fail a check are reported through
    ``report`` (default: stderr on rank 0) with the file and the reason and skipped: the previous one is
    used. Entries named like a checkpoint that are not regular files (directories, FIFOs, symbolic
    links) are reported and skipped. If checkpoints exist but none passes, ``CheckpointError`` is
    raised on every rank. ``attrs`` holds the stored attributes plus ``step`` and ``nranks`` (ranks that
    wrote it).
    """
    rank, size = _rank_size(comm)
    report = report or _default_report(comm)
    result = None
    error = None
    if rank == 0:
        try:
            candidates = list_checkpoints(folder)
            for path, what in _odd_entries(folder):
                report(f"skipped {path}: {what}, not a checkpoint file")
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            candidates, error = [], f"cannot list checkpoints in {folder}: {type(exc).__name__}: {exc}"
        rejected = []
        for step, path in reversed(candidates):
            try:
                result = load_checkpoint(path, expect_config, expect_arrays)
                if validate is not None:
                    try:
                        validate(*result)
                    except CheckpointError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - any failure of the caller's checks rejects it
                        raise CheckpointError(f"{type(exc).__name__}: {exc}") from None
                break
            except CheckpointError as exc:
                result = None
                rejected.append(f"{path.name}: {exc}")
                older = [p.name for s, p in candidates if s < step]
                nxt = f"falls back to {older[-1]}" if older else "no older checkpoint left"
                report(f"rejected {path} ({exc}); {nxt}")
        if result is None and candidates:
            error = f"no valid checkpoint in {folder}: " + "; ".join(rejected)
        elif result is not None and rejected:
            report(f"resuming from {folder}/{checkpoint_name(result[0])} (step {result[0]})")
    if comm is None or size == 1:
        if error:
            raise CheckpointError(error)
        return result
    # broadcast: metadata (plain Python values, between our own ranks) then the array buffers
    meta = None
    if rank == 0 and result is not None:
        step, arrays, attrs = result
        plain = {k: v for k, v in attrs.items() if not isinstance(v, np.ndarray)}
        arr_attrs = {k: v for k, v in attrs.items() if isinstance(v, np.ndarray)}
        meta = (step, [(n, a.shape, a.dtype.str) for n, a in arrays.items()],
                [(n, a.shape, a.dtype.str) for n, a in arr_attrs.items()], plain)
    from hpczeco.collectives import timed  # noqa: PLC0415

    error, meta = timed.bcast(comm, (error, meta), 0, "checkpoint load")
    if error:
        raise CheckpointError(error)
    if meta is None:
        return None
    step, arr_meta, attr_meta, plain = meta
    if rank == 0:
        arrays, attrs = result[1], result[2]
    else:  # the shapes were bounded by rank 0's checks (the file's size, expect_arrays)
        arrays = {n: np.empty(shape, np.dtype(dt)) for n, shape, dt in arr_meta}
        attrs = dict(plain)
        attrs.update({n: np.empty(shape, np.dtype(dt)) for n, shape, dt in attr_meta})
    for n, _, _ in arr_meta:
        if arrays[n].size:
            timed.Bcast(comm, _contig(arrays[n]), 0, "checkpoint load")
    for n, _, _ in attr_meta:
        if attrs[n].size:
            timed.Bcast(comm, _contig(attrs[n]), 0, "checkpoint load")
    return step, arrays, attrs
