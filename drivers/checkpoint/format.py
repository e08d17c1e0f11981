"""The checkpoint file format, shared by the writer and the reader: names, attribute encoding, checksums,
path rules (no HDF5 here: this module never imports h5py).

One checkpoint is ``ckpt_<step:08d>.h5``; a writer's temporary is ``.ckpt_<step>.h5.tmp-<job>-<host>-<pid>-<ns>``
(``<job>``: the batch job's id, ``local`` outside one; older writers named it ``.ckpt_<step>.h5.tmp-<pid>-<ns>``),
locked (``flock``) by its writer while it exists; a writing job holds :data:`LOCK_NAME` in the folder. The
root attributes ``format`` (:data:`FORMAT`), ``format_version`` (:data:`FORMAT_VERSION`), ``step``,
``nranks``, ``created``, ``_manifest``, ``_attr_kinds`` and ``_attrs_sha256`` are reserved; the caller's
attributes are stored with one of the kinds ``str``, ``bool``, ``int``, ``float``, ``array``, ``json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "hpczeco-checkpoint"
FORMAT_VERSION = 1
FILE_RE = re.compile(r"^ckpt_(\d{8,})\.h5$")
TMP_RE = re.compile(r"^\.ckpt_\d{8,}\.h5\.tmp-(?:[A-Za-z0-9_.]+-)*\d+-\d+$")
#: the file in a checkpoint folder that the writing job holds locked (``flock``) while it may write there
LOCK_NAME = ".hpczeco-ckpt.lock"

_PART = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_NAME_RE = re.compile(rf"^{_PART}(/{_PART})*$")
RESERVED = {"format", "format_version", "step", "nranks", "created", "_manifest", "_attr_kinds", "_attrs_sha256"}
_INT64 = (-(2**63), 2**63 - 1)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or no stored checkpoint passes the checks."""


def rank_size(comm) -> tuple[int, int]:
    """``(rank, size)`` of ``comm``; ``(0, 1)`` for ``None`` (a single process)."""
    return (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())


def contig(a: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (``np.ascontiguousarray`` makes them 1-d)."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def array_sha256(a: np.ndarray) -> str:
    """sha256 over dtype, shape and the C-order bytes of ``a``."""
    a = contig(np.asarray(a))
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


def check_array(name: str, a: np.ndarray) -> None:
    """Raise ``TypeError`` unless ``a`` has a dtype the format stores (bool, integer, floating)."""
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


def dumps(v: Any) -> str:
    """The format's JSON: sorted keys, numpy scalars and arrays as plain values, NaN/Inf allowed."""
    return json.dumps(v, sort_keys=True, default=_json_default, allow_nan=True)


def encode_attr(name: str, value: Any) -> tuple[str, Any]:
    """(kind, value to store). Kinds: str, bool, int, float, array, json."""
    if isinstance(value, (bool, np.bool_)):
        return "bool", np.bool_(value)
    if isinstance(value, (int, np.integer)):
        v = int(value)
        return ("int", np.int64(v)) if _INT64[0] <= v <= _INT64[1] else ("json", dumps(v))
    if isinstance(value, (float, np.floating)):
        return "float", np.float64(value)
    if isinstance(value, str):
        return "str", value
    if isinstance(value, np.ndarray):
        check_array(f"attribute {name}", value)
        return "array", contig(value)
    if value is None or isinstance(value, (dict, list, tuple)):
        try:
            return "json", dumps(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"attribute {name!r} is not JSON-serialisable: {exc}") from None
    raise TypeError(
        f"attribute {name!r} has type {type(value).__name__}: use str, bool, int, float, a numeric numpy array, "
        "or a JSON-able dict/list"
    )


def decode_attr(kind: str, raw: Any) -> Any:
    """The value of an attribute stored as ``kind`` (the inverse of :func:`encode_attr`)."""
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


def attrs_digest(kinds: Mapping[str, str], values: Mapping[str, Any]) -> str:
    """``_attrs_sha256``: sha256 over the sorted ``[name, kind, canonical value]`` of every attribute."""
    items = [[k, kinds[k], _canonical(kinds[k], values[k])] for k in sorted(kinds)]
    return hashlib.sha256(dumps(items).encode()).hexdigest()


def checkpoint_name(step: int) -> str:
    """The file name of checkpoint ``step``: ``ckpt_<step:08d>.h5``."""
    return f"ckpt_{int(step):08d}.h5"


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoint files in ``folder``, oldest first (hidden temporaries excluded)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for entry in folder.iterdir():
        m = FILE_RE.match(entry.name)
        if m and entry.is_file() and not entry.is_symlink():
            out.append((int(m.group(1)), entry))
    return sorted(out)
