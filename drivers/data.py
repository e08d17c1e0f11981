"""Training text for ``hpczeco train``: byte-level tokens (ids 0..255), the shuffled stream of training windows
(:class:`WindowStream`, whose whole state is one integer, saved in checkpoints), and the split of one
sequence into contiguous per-rank slices.

The default corpus exists offline wherever Python does: the standard library's own ``*.py`` sources
(``sysconfig.get_paths()['stdlib']``, ``site-packages``/``dist-packages`` excluded), concatenated in
a fixed order (depth first, names sorted), up to ``max_bytes``. It differs between Python versions, so its length
and sha256 go into the run config (a checkpoint from another corpus is refused on resume).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = [
    "VOCAB", "iter_corpus_files", "default_corpus_files", "check_text", "read_corpus", "load_corpus", "corpus_id",
    "WindowStream",
    "slice_bounds",
]

VOCAB = 256
DEFAULT_MAX_BYTES = 8 << 20


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def iter_corpus_files(root: str | os.PathLike | None = None, suffix: str | None = ".py") -> Iterator[Path]:
    """The files under ``root`` (default: the standard library) in a fixed order: depth first, the entries of every
    folder sorted by name (files and folders together); only names ending in ``suffix`` (None: every file whose
    name does not start with '.'). Lazy, so reading stops as soon as enough bytes are in."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.name.startswith(".") and suffix is None:
            continue
        if e.is_dir(follow_symlinks=False):
            if e.name not in _SKIP_DIRS:
                yield from iter_corpus_files(e.path, suffix)
        elif (e.name.endswith(suffix) if suffix else True) and e.is_file():
            yield Path(e.path)


def default_corpus_files() -> list[Path]:
    """All files of :func:`iter_corpus_files`, in its order."""
    return list(iter_corpus_files())


def _read_files(files: Iterator[Path], max_bytes: int | None) -> tuple[bytes, int]:
    """The files' bytes concatenated, cut at ``max_bytes``, and how many files went in. Each is read with a bound
    (:func:`hpczeco.drivers.files.read_bounded`: regular files only, never more than the bytes still wanted); one
    that cannot be read, or is no longer a regular file, is skipped."""
    from .files import read_bounded

    parts, total = [], 0
    for p in files:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            b = read_bounded(str(p), 0 if max_bytes is None else max_bytes - total, "--text", cut=True)
        except (OSError, ValueError):
            continue
        parts.append(b)
        total += len(b)
    return b"".join(parts), len(parts)


def check_text(text: str | os.PathLike) -> bool:
    """Whether ``text`` (a ``--text``) can be read, by what it is, without opening it: True for a folder, False for a
    regular file or ``-``; a ``ValueError`` naming ``--text`` for anything else (``/dev/zero``, a FIFO, a socket) or a
    path that is not there."""
    from .files import kind_of

    text = str(text)
    if text == "-":
        return False
    try:
        mode = os.stat(text).st_mode
    except OSError as exc:
        why = "no such file or folder" if isinstance(exc, FileNotFoundError) else (exc.strerror or str(exc))
        raise ValueError(f"--text {text}: {why}") from None
    if stat.S_ISDIR(mode):
        return True
    if not stat.S_ISREG(mode):
        raise ValueError(f"--text: {text} is {kind_of(mode)}, not a regular file or a folder" + (
            "; pipe it through standard input ('--text -') instead" if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)
            else ""))
    return False


def read_corpus(text: str | os.PathLike | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[bytes, str]:
    """``(bytes, description)`` of ``text`` -- a file, ``-`` (standard input), or a folder (its regular files in
    :func:`iter_corpus_files` order, hidden ones skipped) -- or of the default stdlib corpus, cut at ``max_bytes``.

    At most ``max_bytes`` bytes are read, whatever a file claims (:func:`hpczeco.drivers.files.read_bounded`); a
    path that is neither a regular file nor a folder (``/dev/zero``, a FIFO, a socket) is refused unopened: a
    ``ValueError`` naming ``--text``."""
    from .files import read_bounded

    if max_bytes is not None and max_bytes < 2:
        raise ValueError(f"max_bytes must be at least 2, got {max_bytes}")
    limit = 0 if max_bytes is None else max_bytes
    if text is not None:
        text = str(text)
        if text == "-":
            data = read_bounded("-", limit, "--text", cut=True)
            return data, f"standard input ({len(data)} bytes)"
        path = Path(text)
        if check_text(text):
            data, n = _read_files(iter_corpus_files(path, suffix=None), max_bytes)
            if not data:
                raise ValueError(f"--text {text}: the folder holds no readable, non-empty regular file")
            return data, f"{path}/ ({n} files, {len(data)} bytes)"
        data = read_bounded(text, limit, "--text", cut=True)
        return data, f"{path} ({len(data)} bytes)"
    data, n = _read_files(iter_corpus_files(), max_bytes)
    if not data:
        raise ValueError(f"no *.py files under {sysconfig.get_paths()['stdlib']}; pass --text FILE")
    return data, f"Python {sysconfig.get_python_version()} stdlib sources, {n} files ({len(data)} bytes)"


def load_corpus(comm=None, text: str | os.PathLike | None = None,
                max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[np.ndarray, str]:
    """The corpus as uint8 tokens on every rank (collective: rank 0 reads, then a broadcast; both waits honour the
    collective timeout, :mod:`hpczeco.collectives.timed`).

    Raises the same ``ValueError`` on every rank if rank 0 cannot read it."""
    rank = 0 if comm is None else comm.Get_rank()
    size = 1 if comm is None else comm.Get_size()
    data, desc, err = b"", "", None
    if rank == 0:
        try:
            data, desc = read_corpus(text, max_bytes)
        except (OSError, ValueError) as exc:
            err = str(exc) if isinstance(exc, ValueError) else f"--text {text}: {exc.strerror or exc}"
    if size > 1:
        from hpczeco.collectives import timed

        err, n, desc = timed.bcast(comm, (err, len(data), desc), 0,
                                   "hpczeco train: the other ranks wait while rank 0 reads the text")
    else:
        n = len(data)
    if err:
        raise ValueError(err)
    tokens = np.frombuffer(data, dtype=np.uint8).copy() if rank == 0 else np.empty(n, dtype=np.uint8)
    if size > 1 and n:
        timed.Bcast(comm, tokens, 0, "hpczeco train: the text's broadcast")
    return tokens, desc


def corpus_id(tokens: np.ndarray) -> str:
    """Short sha256 of the corpus bytes (goes into the run config)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.uint8).tobytes()).hexdigest()[:16]


def slice_bounds(T: int, P: int, p: int) -> tuple[int, int]:
    """Rank ``p``'s contiguous slice ``[start, stop)`` of ``T`` positions over ``P`` ranks: lengths
    differ by at most one, the first ``T % P`` ranks get the longer ones (as ``np.array_split``)."""
    if P < 1 or not 0 <= p < P:
        raise ValueError(f"rank {p} out of range for {P} ranks")
    base, extra = divmod(T, P)
    start = p * base + min(p, extra)
    return start, start + base + (1 if p < extra else 0)


class WindowStream:
    """The training stream: the corpus cut into windows of ``seq + 1`` tokens (inputs and next-token targets),
    visited in an order shuffled per epoch by ``seed``.

    Window ``i`` holds tokens ``[i seq, i seq + seq + 1)`` (consecutive windows share one token: the last
    target of one is the first input of the next), ``i`` in ``[0, n_windows)``, ``n_windows = (n_tokens - 1) //
    seq``. Epoch ``e`` visits them in the order ``np.random.default_rng([seed, e]).permutation(n_windows)``.
    The stream is a pure function of the *position* (windows consumed so far, over all ranks), the only
    state a checkpoint needs: every rank of any layout reads the same global stream, each its own part.
    """

    def __init__(self, n_tokens: int, seq: int, seed: int):
        if seq < 1:
            raise ValueError(f"seq must be positive, got {seq}")
        if n_tokens < seq + 1:
            raise ValueError(f"the corpus has {n_tokens} tokens, fewer than seq + 1 = {seq + 1}; use a smaller --seq")
        self.n_tokens, self.seq, self.seed = int(n_tokens), int(seq), int(seed)
        self.n_windows = (self.n_tokens - 1) // self.seq
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._orders[epoch]

    def window_ids(self, position: int, count: int) -> np.ndarray:
        """``[count]`` window indices at stream positions ``position .. position + count - 1``."""
        if position < 0 or count < 0:
            raise ValueError(f"position and count must be >= 0, got {position}, {count}")
        pos = position + np.arange(count)
        epochs, within = np.divmod(pos, self.n_windows)
        return np.array([self._order(int(e))[int(w)] for e, w in zip(epochs, within)], dtype=np.int64)

    def tokens(self, corpus: np.ndarray, position: int, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """``[rows[1] - rows[0], cols[1] - cols[0] + 1]`` int64 tokens: of the windows at stream positions
        ``position + rows[0] .. position + rows[1] - 1``, the columns ``cols[0] .. cols[1]`` (one past the slice:
        the target of its last token). ``rows``/``cols``: this rank's sequences and slice of the global batch."""
        ids = self.window_ids(position + rows[0], rows[1] - rows[0])
        idx = ids[:, None] * self.seq + np.arange(cols[0], cols[1] + 1)[None, :]
        return corpus[idx].astype(np.int64)
