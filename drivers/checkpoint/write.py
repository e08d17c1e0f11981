"""Writing checkpoints: :class:`CheckpointWriter` (collective, atomic, checksummed, keep-last-N).

Rank 0 writes a hidden temporary in the target folder -- through a :class:`~.guarded_file.GuardedFile` with
the serial h5py, or with every rank opening it through ``driver='mpio'`` with a parallel h5py -- fsyncs it,
``os.replace``-s it onto ``ckpt_<step:08d>.h5`` and fsyncs the folder; any failure is one
``CheckpointError`` on every rank and the temporary is removed. Then checkpoints beyond the newest ``keep``
and leftover temporaries of killed writers are removed.

One writing job per folder: rank 0 of a job holds :data:`~.format.LOCK_NAME` in the folder locked (``flock``) from
the writer's creation for as long as the writer exists (released when its process ends, however it ends); a second
live job that makes a writer for the same folder gets a ``CheckpointError`` naming the holder, before it writes
anything. The temporary's name holds the job (``.ckpt_<step>.h5.tmp-<job>-<host>-<pid>-<ns>``) and its writer keeps
it locked until it is renamed; the clean-up removes only temporaries that no process holds locked (their writers are
gone), never one being written. On a file system without ``flock`` (some NFS set-ups) neither lock is taken, and
that is said once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .faults import crash, fault_here
from .format import (
    FORMAT,
    FORMAT_VERSION,
    LOCK_NAME,
    RESERVED,
    TMP_RE,
    CheckpointError,
    array_sha256,
    attrs_digest,
    check_array,
    check_name,
    checkpoint_name,
    contig,
    decode_attr,
    dumps,
    encode_attr,
    list_checkpoints,
    rank_size,
)
from .guarded_file import GuardedFile
from .hdf5 import parallel_hdf5


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
        self.rank, self.size = rank_size(comm)
        self.parallel = parallel_hdf5() if parallel is None else bool(parallel)
        if self.parallel and not parallel_hdf5():
            raise ValueError("parallel=True needs an h5py built with parallel HDF5 (h5py.get_config().mpi)")
        if self.parallel and comm is None:
            self.parallel = False
        err = None
        self._lock: _FolderLock | None = None
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                err = f"cannot create checkpoint folder {self.folder}: {exc}"
            if err is None:
                try:
                    self._lock = _FolderLock.acquire(self.folder)
                except OSError as exc:
                    err = f"cannot lock checkpoint folder {self.folder} ({exc.strerror or exc}: {exc.filename})"
                except CheckpointError as exc:
                    err = str(exc)
        self._raise_if_any(err)
        if self._lock is not None:
            weakref.finalize(self, self._lock.release)
        self._tmp_lock: int | None = None

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
            check_array(name, a)
            host[name] = contig(a)
        # a name may not be both an array and a group of arrays ("a" and "a/b")
        prefixes = {"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)}
        clash = sorted(prefixes & set(names))
        if clash:
            raise ValueError(f"array name {clash[0]!r} is also used as a group of other arrays")
        kinds: dict[str, str] = {}
        stored: dict[str, Any] = {}
        for key, value in dict(attrs or {}).items():
            if not isinstance(key, str) or not key or key in RESERVED or key.startswith("_") or "/" in key:
                raise ValueError(
                    f"attribute name {key!r} is reserved or invalid (non-empty, no '/', not starting with '_', "
                    f"not one of {sorted(RESERVED)})"
                )
            kinds[key], stored[key] = encode_attr(key, value)
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
            mine = (step, {n: m["sha256"] for n, m in manifest.items()}, attrs_digest(kinds, _decoded(kinds, stored)))
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
        tmp_name = f".{final.name}.tmp-{_job_tag()}-{os.getpid()}-{time.time_ns()}" if self.rank == 0 else None
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
            "_manifest": dumps(manifest),
            "_attr_kinds": dumps(kinds),
            "_attrs_sha256": attrs_digest(kinds, _decoded(kinds, stored)),
        }
        if self.parallel:
            err_s = self._space_short(step, host, stored, root_attrs)
            if err_s is None:
                err_s = self._write_mpio(tmp, host, manifest, stored, root_attrs)
        else:
            err_s = self._write_serial(tmp, host, manifest, stored, root_attrs) if self.rank == 0 else None
        if err_s is None and self.rank == 0:
            if fault_here("before-rename", step):
                crash("before-rename", step)
            err_s = self._publish(tmp, final)
        if err_s is not None and self.rank == 0:
            _silent_unlink(tmp)
        self._unlock_tmp()
        self._raise_if_any(err_s, root_only=not self.parallel)
        return final

    def _lock_tmp(self, tmp: Path) -> None:
        """Rank 0: hold the temporary locked (a descriptor of its own, kept until the rename) so that no clean-up
        takes it for a killed writer's."""
        self._tmp_lock = _lock_fd(tmp)

    def _unlock_tmp(self) -> None:
        if self._tmp_lock is not None:
            try:
                os.close(self._tmp_lock)
            except OSError:
                pass
            self._tmp_lock = None

    # -- file writing ---------------------------------------------------------------------------------

    @staticmethod
    def _fill(f: h5py.File, host, manifest, stored, root_attrs, write_data: bool) -> None:
        crash_at = len(host) // 2 if fault_here("mid-write", int(root_attrs["step"])) else -1
        for i, (name, a) in enumerate(host.items()):
            if i == crash_at:
                f.flush()
                crash("mid-write", int(root_attrs["step"]))
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
                self._lock_tmp(tmp)
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
                if self.rank == 0:
                    self._lock_tmp(tmp)
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
        for leftover in _leftover_temporaries(self.folder):  # of writers killed mid-write (never a live one's)
            if leftover != tmp:
                _unlink_if_unlocked(leftover)
        return None


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
    return [e for e in entries if TMP_RE.match(e.name) and e.is_file() and not e.is_symlink()]


def _job_tag() -> str:
    """``<job>-<host>`` for a temporary's name: the batch job's id (Slurm, PBS, LSF; ``local`` outside one) and the
    host, with anything but letters, digits, ``_`` and ``.`` replaced by ``_``."""
    job = (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or os.environ.get("LSB_JOBID")
           or "local")
    host = socket.gethostname().split(".")[0] or "host"
    return re.sub(r"[^A-Za-z0-9_.]", "_", f"{job}") + "-" + re.sub(r"[^A-Za-z0-9_.]", "_", host)


_NO_FLOCK = {"said": False}


def _flock_unsupported(exc: OSError) -> bool:
    """True (and a note, once) when ``flock`` is not supported where the checkpoints are (some NFS set-ups)."""
    if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF, errno.EINVAL):
        return False
    if not _NO_FLOCK["said"]:
        _NO_FLOCK["said"] = True
        print(f"hpczeco checkpoint: note: the file system does not support flock ({exc.strerror}): the checkpoint "
              "folder and temporaries are not locked (do not let two jobs share a --ckpt-dir)", file=sys.stderr,
              flush=True)
    return True


def _lock_fd(path: Path) -> int | None:
    """A new descriptor of ``path`` holding an exclusive ``flock`` on it (None where flock is not supported)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if _flock_unsupported(exc):
            return None
        raise
    return fd


def _unlink_if_unlocked(path: Path) -> None:
    """Remove the temporary ``path`` only if no process holds it locked (its writer is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return  # a live writer holds it
            if not _flock_unsupported(exc):
                return
        _silent_unlink(path)
    finally:
        os.close(fd)


class _FolderLock:
    """The lock of one checkpoint folder, held by this process (shared by its writers; released with the last)."""

    _held: dict[str, _FolderLock] = {}
    _guard = threading.Lock()

    def __init__(self, key: str, fd: int | None):
        self.key, self.fd, self.users = key, fd, 0

    @classmethod
    def acquire(cls, folder: Path) -> _FolderLock:
        """This process's lock of ``folder`` (taken now, or shared); ``CheckpointError`` naming the holder when
        another process holds it."""
        key = os.path.realpath(folder)
        with cls._guard:
            lock = cls._held.get(key)
            if lock is None:
                lock = cls(key, cls._take(Path(key)))
                cls._held[key] = lock
            lock.users += 1
            return lock

    @staticmethod
    def _take(folder: Path) -> int | None:
        path = folder / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if _flock_unsupported(exc):
                os.close(fd)
                return None
            holder = ""
            try:
                info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
                holder = (f" (process {info.get('pid')} on {info.get('host')}, job {info.get('job')}, since "
                          f"{info.get('since')})")
            except (OSError, ValueError):
                pass
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"checkpoint folder {folder} is in use by another live job{holder}: two jobs "
                                      f"writing one folder would remove each other's files; give this run another "
                                      f"--ckpt-dir (the lock: {path})") from None
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "job": _job_tag().split("-")[0],
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError:
            pass  # the lock itself is what counts (a full disk may refuse the few bytes)
        return fd

    def release(self) -> None:
        with self._guard:
            self.users -= 1
            if self.users > 0:
                return
            self._held.pop(self.key, None)
            if self.fd is not None:
                try:
                    os.close(self.fd)
                except OSError:
                    pass
                self.fd = None


def _decoded(kinds: Mapping[str, str], stored: Mapping[str, Any]) -> dict[str, Any]:
    return {k: decode_attr(kinds[k], stored[k]) for k in kinds}


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


def _to_host(x: Any) -> np.ndarray:
    from hpczeco.base.backend import to_numpy

    a = to_numpy(x)
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    return a


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
