"""Loading checkpoints: :func:`load_checkpoint` (one file, every check) and :func:`load_latest` (the newest
one that passes, collective: rank 0 reads, every rank gets it).

What is read is bounded before it is read (the expected arrays, contiguous storage of the declared size, at
most the file's size in all); nothing is unpickled and no path read from a file is followed (plain relative
dataset names; links, external storage and virtual datasets refused). A rejected checkpoint is reported with
its reason and the previous one is tried.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .format import (
    FILE_RE,
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    array_sha256,
    attrs_digest,
    check_array,
    check_name,
    checkpoint_name,
    contig,
    decode_attr,
    dumps,
    list_checkpoints,
    rank_size,
)


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
    m = FILE_RE.match(path.name)
    try:
        file_bytes = path.stat().st_size
        with h5py.File(path, "r") as f:
            fmt = decode_attr("str", f.attrs.get("format", b""))
            if fmt != FORMAT:
                raise CheckpointError(f"not an hpczeco checkpoint (format attribute {fmt!r})")
            version = int(f.attrs.get("format_version", -1))
            if version != FORMAT_VERSION:
                raise CheckpointError(f"format version {version} (this code reads {FORMAT_VERSION})")
            step = int(f.attrs["step"])
            if m and int(m.group(1)) != step:
                raise CheckpointError(f"file name says step {int(m.group(1))} but the file says {step}")
            manifest = json.loads(decode_attr("str", f.attrs["_manifest"]))
            kinds = json.loads(decode_attr("str", f.attrs["_attr_kinds"]))
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
                check_array(name, np.empty(0, ds.dtype))
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
                attrs[key] = decode_attr(kind, f.attrs[key])
            if attrs_digest(kinds, attrs) != decode_attr("str", f.attrs["_attrs_sha256"]):
                raise CheckpointError("checksum mismatch in the attributes (they are corrupt)")
            nranks = int(f.attrs["nranks"])
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot be read ({type(exc).__name__}: {exc}); truncated or corrupt?") from None
    if expect_config is not None:
        stored = attrs.get("config")
        want = json.loads(dumps(dict(expect_config)))
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
        if not FILE_RE.match(e.name):
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
    rank, size = rank_size(comm)
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
            timed.Bcast(comm, contig(arrays[n]), 0, "checkpoint load")
    for n, _, _ in attr_meta:
        if attrs[n].size:
            timed.Bcast(comm, contig(attrs[n]), 0, "checkpoint load")
    return step, arrays, attrs


def _default_report(comm) -> Callable[[str], None]:
    rank, _ = rank_size(comm)

    def report(msg: str) -> None:
        if rank == 0:
            print(f"hpczeco checkpoint: {msg}", file=sys.stderr, flush=True)

    return report
