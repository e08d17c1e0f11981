"""Offline tokenizers for raw text (nothing is downloaded).

* ``mode="word"`` (default): a GPT-2-like pre-tokenizer written with the standard ``re`` module
  (an optional leading space glued to a run of word characters, or to a run of punctuation;
  other whitespace runs are tokens of their own), each piece hashed into ``vocab_size`` ids with
  a stable hash (BLAKE2b, not Python's randomised ``hash``), so the ids are the same in every
  process and on every MPI rank.
* ``mode="byte"``: the UTF-8 bytes, vocabulary 256.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

__all__ = ["tokenize", "DEFAULT_VOCAB", "WORD_PATTERN"]

DEFAULT_VOCAB = 32768
WORD_PATTERN = re.compile(r" ?\w+| ?[^\w\s]+|\s+")


def _stable_id(piece: str, vocab_size: int) -> int:
    h = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") % vocab_size


def tokenize(text: str, mode: str = "word", vocab_size: int = DEFAULT_VOCAB) -> np.ndarray:
    """Token ids ``[T]`` (int32) of ``text``.

    ``mode="word"``: hashed word/punctuation/whitespace pieces in ``[0, vocab_size)``;
    ``mode="byte"``: UTF-8 bytes in ``[0, 256)`` (``vocab_size`` is ignored).
    Raises ``TypeError`` for non-str text and ``ValueError`` for empty text or a bad mode/vocab.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError("text is empty: nothing to tokenize")
    if mode == "byte":
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8).astype(np.int32)
    if mode != "word":
        raise ValueError(f"mode must be 'word' or 'byte', got {mode!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    cache: dict[str, int] = {}
    ids = []
    for piece in WORD_PATTERN.findall(text):
        tid = cache.get(piece)
        if tid is None:
            tid = cache[piece] = _stable_id(piece, int(vocab_size))
        ids.append(tid)
    return np.asarray(ids, dtype=np.int32)
