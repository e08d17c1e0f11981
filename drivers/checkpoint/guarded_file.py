"""The file object h5py writes a checkpoint through: ordinary ``os.pwrite`` calls, I/O errors kept from HDF5."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
