"""The commands' files: inputs read with a bound, outputs checked before the work.

- :func:`read_bounded`: the bytes of a regular file (or ``-``, standard input) with at most ``limit`` bytes read
  whatever the file claims (``st_size`` is 0 for ``/dev/zero``); a directory, FIFO, device or socket is refused
  by what it is, without opening it (opening a FIFO with no writer blocks).
- :func:`check_output_dir` / :func:`check_output_file`: the folder exists or is made, and a file can be created in
  it (a probe file, removed), so that a read-only path, a file where a folder is expected or a missing parent is
  reported before a benchmark runs, not after it.
- :func:`rank0_verdict`: collective; rank 0's check (an error message or None) raised on every rank as the same
  :class:`~hpczeco.collectives.errors.CollectiveInputError` (a ``ValueError``; the commands report it once and end
  every rank with status 2; the collective timeout bounds the wait for rank 0).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["read_bounded", "kind_of", "check_output_dir", "check_output_file", "rank0_verdict"]


def kind_of(mode: int) -> str:
    """What a ``stat`` mode is, in words: "a regular file", "a directory", "a FIFO (named pipe)", ..."""
    for test, words in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def read_bounded(path: str, limit: int, what: str, too_large: str = "", cut: bool = False) -> bytes:
    """The bytes of ``path`` (``-``: standard input, read up to ``limit + 1`` bytes), at most ``limit`` of them
    (0: no limit, for regular files and standard input only).

    ``ValueError`` naming ``what`` (e.g. ``"--in scan_P2.json"``) for a path that is not a regular file (checked
    before it is opened), or holds more than ``limit`` bytes (``too_large`` is appended: what to do about it);
    ``OSError`` (with the path) when it cannot be read. ``cut``: the first ``limit`` bytes of a larger input are
    returned instead (no more than ``limit`` bytes are read)."""
    if path == "-":
        if cut and limit:
            return sys.stdin.buffer.read(limit)
        data = sys.stdin.buffer.read(limit + 1) if limit else sys.stdin.buffer.read()
        if limit and len(data) > limit:
            raise ValueError(f"{what}: standard input holds more than {limit:,} bytes{too_large}")
        return data
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what}: {path} is {kind_of(mode)}, not a regular file" + (
            "; pipe it through standard input ('-') instead" if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) else ""))
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the stat and the open
            raise ValueError(f"{what}: {path} is not a regular file")
        size = os.fstat(fd).st_size
        if limit and size > limit and not cut:
            raise ValueError(f"{what}: {path} has {size:,} bytes, more than {limit:,}{too_large}")
        chunks, total = [], 0
        want = limit if cut else limit + 1
        while not limit or total < want:  # a file that grows while it is read is still read to at most want bytes
            piece = os.read(fd, min(1 << 24, want - total) if limit else 1 << 24)
            if not piece:
                break
            chunks.append(piece)
            total += len(piece)
            if limit and total > limit:
                raise ValueError(f"{what}: {path} holds more than {limit:,} bytes{too_large}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """Make the folder ``path`` (and its parents) if needed and check that a file can be created in it; returns it.
    ``ValueError`` naming ``what`` (e.g. ``"--out"``) and the reason otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {p}: it exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what} {p}: cannot create the folder ({exc.strerror or exc})") from None
    probe = p / f".hpczeco-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{what} {p}: cannot write into the folder ({exc.strerror or exc})") from None
    return p


def check_output_file(path: str | os.PathLike, what: str) -> Path:
    """Check that the file ``path`` can be written (its folder exists and takes a new file; the path is not a
    folder; an existing file is writable); returns it. ``ValueError`` naming ``what`` otherwise."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {p} is a folder; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{what} {p}: the folder {parent} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{what} {p}: the file is not writable")
    check_output_dir(parent, what)
    return p


def rank0_verdict(comm: Any, check: Callable[[], Any], op: str) -> Any:
    """Run ``check()`` on rank 0 (``comm`` None or of one rank: here); its ``ValueError``/``OSError`` is raised on
    every rank as the same ``CollectiveInputError`` (collective: a timed broadcast); returns ``check()``'s value on
    rank 0, None elsewhere."""
    result, err = None, None
    if comm is None or comm.Get_rank() == 0:
        try:
            result = check()
        except (ValueError, OSError) as exc:
            err = str(exc) if isinstance(exc, ValueError) else (f"{exc.strerror or exc}: {exc.filename or ''}"
                                                                .rstrip(": "))
    if comm is not None and comm.Get_size() > 1:
        from hpczeco.collectives import timed  # noqa: PLC0415

        err = timed.bcast(comm, err, 0, op)
    if err:
        from hpczeco.collectives.errors import CollectiveInputError  # noqa: PLC0415

        raise CollectiveInputError(err)
    return result
