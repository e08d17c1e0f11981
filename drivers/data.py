"""Training text for ``hpczeco train``: byte-level tokens (vocab 256), a sequence sampler whose state
checkpoints as plain JSON, and the split of one sequence into contiguous per-rank slices.

The default corpus exists offline wherever Python does: the standard library's own ``*.py`` sources
(``sysconfig.get_paths()['stdlib']``, ``site-packages``/``dist-packages`` excluded), concatenated in
a fixed order (depth first, names sorted), up to ``max_bytes``. It differs between Python versions, so its length
and sha256 go into the run config (a checkpoint from another corpus is refused on resume).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "VOCAB", "iter_corpus_files", "default_corpus_files", "read_corpus", "load_corpus", "corpus_id", "Sampler",
    "slice_bounds",
]

VOCAB = 256
DEFAULT_MAX_BYTES = 8 << 20


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def iter_corpus_files(root: str | os.PathLike | None = None) -> Iterator[Path]:
    """The standard library's ``*.py`` files in a fixed order: depth first, the entries of every folder
    sorted by name (files and folders together). Lazy, so reading stops as soon as enough bytes are in."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            if e.name not in _SKIP_DIRS:
                yield from iter_corpus_files(e.path)
        elif e.name.endswith(".py") and e.is_file():
            yield Path(e.path)


def default_corpus_files() -> list[Path]:
    """All files of :func:`iter_corpus_files`, in its order."""
    return list(iter_corpus_files())


def read_corpus(text: str | os.PathLike | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[bytes, str]:
    """``(bytes, description)`` of ``text`` (a file) or of the default stdlib corpus, cut at ``max_bytes``."""
    if max_bytes is not None and max_bytes < 2:
        raise ValueError(f"max_bytes must be at least 2, got {max_bytes}")
    if text is not None:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--text {text}: no such file")
        with open(path, "rb") as fh:
            data = fh.read() if max_bytes is None else fh.read(max_bytes)
        return data, f"{path} ({len(data)} bytes)"
    parts, total = [], 0
    for p in iter_corpus_files():
        try:
            b = p.read_bytes()
        except OSError:
            continue
        parts.append(b)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    if not parts:
        raise ValueError(f"no *.py files under {sysconfig.get_paths()['stdlib']}; pass --text FILE")
    data = b"".join(parts)
    if max_bytes is not None:
        data = data[:max_bytes]
    return data, f"Python {sysconfig.get_python_version()} stdlib sources, {len(parts)} files ({len(data)} bytes)"


def load_corpus(comm=None, text: str | os.PathLike | None = None,
                max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[np.ndarray, str]:
    """The corpus as uint8 tokens on every rank (collective: rank 0 reads, then ``Bcast``).

    Raises the same ``ValueError`` on every rank if rank 0 cannot read it."""
    rank = 0 if comm is None else comm.Get_rank()
    size = 1 if comm is None else comm.Get_size()
    data, desc, err = b"", "", None
    if rank == 0:
        try:
            data, desc = read_corpus(text, max_bytes)
        except (OSError, ValueError) as exc:
            err = str(exc)
    if size > 1:
        err, n, desc = comm.bcast((err, len(data), desc), root=0)
    else:
        n = len(data)
    if err:
        raise ValueError(err)
    tokens = np.frombuffer(data, dtype=np.uint8).copy() if rank == 0 else np.empty(n, dtype=np.uint8)
    if size > 1 and n:
        comm.Bcast(tokens, root=0)
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


class Sampler:
    """Random windows of ``seq + 1`` tokens (inputs and next-token targets) from a corpus.

    Replicated: every rank holds the same sampler and draws the same offsets, so the data of a step
    is global and nothing depends on the number of ranks. ``state()`` is plain JSON (the PCG64
    state and the number of sequences drawn, the data position) for checkpoints.
    """

    def __init__(self, n_tokens: int, seq: int, batch: int, seed: int):
        if seq < 1 or batch < 1:
            raise ValueError(f"seq and batch must be positive, got seq={seq}, batch={batch}")
        if n_tokens < seq + 1:
            raise ValueError(f"the corpus has {n_tokens} tokens, fewer than seq + 1 = {seq + 1}; use a smaller --seq")
        self.n_tokens, self.seq, self.batch = int(n_tokens), int(seq), int(batch)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.drawn = 0

    def next_offsets(self) -> np.ndarray:
        """``[batch]`` start offsets of the next step's windows."""
        off = self.rng.integers(0, self.n_tokens - self.seq, size=self.batch, endpoint=True)
        self.drawn += self.batch
        return off

    def batch_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """The next step's windows ``[batch, seq + 1]`` (int64 token ids)."""
        off = self.next_offsets()
        idx = off[:, None] + np.arange(self.seq + 1)[None, :]
        return tokens[idx].astype(np.int64)

    def state(self) -> dict[str, Any]:
        return {"bit_generator": self.rng.bit_generator.state, "drawn": self.drawn}

    def set_state(self, state: dict[str, Any]) -> None:
        bg = state["bit_generator"]
        if bg.get("bit_generator") != "PCG64":
            raise ValueError(f"sampler state is for {bg.get('bit_generator')!r}, expected PCG64")
        self.rng.bit_generator.state = bg
        self.drawn = int(state["drawn"])
