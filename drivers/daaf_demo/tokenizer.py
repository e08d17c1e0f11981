"""Offline tokenizers for raw text (nothing is downloaded).

* ``mode="word"`` (default): a GPT-2-like pre-tokenizer written with the standard ``re`` module
  (an optional leading space glued to a run of word characters, or to a run of punctuation;
  other whitespace runs are tokens of their own), each piece hashed into ``vocab_size`` ids with
  a stable hash (BLAKE2b, not Python's randomised ``hash``), so the ids are the same in every
  process and on every MPI rank.
* ``mode="byte"``: the UTF-8 bytes, vocabulary 256.

The word pieces are found a chunk of the text at a time (about 1 MB), so the memory beyond the ids
``[T]`` (int32) is one chunk's pieces, not a Python string per token of the whole text; ``max_tokens``
stops as soon as the text is known to have more tokens than that.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

__all__ = ["tokenize", "DEFAULT_VOCAB", "WORD_PATTERN", "TokenLimitError"]

DEFAULT_VOCAB = 32768
WORD_PATTERN = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
#: characters of text matched at a time (the pieces of one chunk are the tokenizer's working memory)
CHUNK_CHARS = 1 << 20


class TokenLimitError(ValueError):
    """The text has more tokens than the ``max_tokens`` given to :func:`tokenize`."""


def word_pieces(text: str, chunk: int = CHUNK_CHARS):
    """The pieces of ``WORD_PATTERN.findall(text)``, yielded as lists, one chunk of about ``chunk``
    characters at a time. Every character belongs to some piece and a match depends only on the text
    from where it starts, so each chunk's last piece (which may continue past the chunk) is matched
    again at the start of the next chunk: the pieces equal those of one ``findall`` over the text."""
    n, pos, size = len(text), 0, chunk
    while pos < n:
        end = min(n, pos + size)
        pieces = WORD_PATTERN.findall(text, pos, end)
        if end < n:
            pieces.pop()
            if not pieces:  # one piece longer than the chunk: widen it
                size *= 2
                continue
            pos += sum(map(len, pieces))
        else:
            pos = n
        size = chunk
        yield pieces


def _stable_id(piece: str, vocab_size: int) -> int:
    h = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") % vocab_size


def tokenize(text: str, mode: str = "word", vocab_size: int = DEFAULT_VOCAB,
             max_tokens: int | None = None) -> np.ndarray:
    """Token ids ``[T]`` (int32) of ``text``.

    ``mode="word"``: hashed word/punctuation/whitespace pieces in ``[0, vocab_size)``;
    ``mode="byte"``: UTF-8 bytes in ``[0, 256)`` (``vocab_size`` is ignored).
    ``max_tokens``: raise :class:`TokenLimitError` (a ``ValueError``) as soon as the text is found to
    have more tokens than that (the rest is not tokenized).
    Raises ``TypeError`` for non-str text and ``ValueError`` for empty text or a bad mode/vocab.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError("text is empty: nothing to tokenize")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer))
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens must be an int >= 1 or None, got {max_tokens!r}")
    if mode == "byte":
        data = text.encode("utf-8", "surrogatepass")
        if max_tokens is not None and len(data) > max_tokens:
            raise TokenLimitError(f"the text has {len(data):,} byte tokens, more than {int(max_tokens):,}")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    if mode != "word":
        raise ValueError(f"mode must be 'word' or 'byte', got {mode!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    cache: dict[str, int] = {}
    get, vocab = cache.get, int(vocab_size)
    parts: list[np.ndarray] = []
    count = 0
    for pieces in word_pieces(text):
        ids: list[int] = []
        append = ids.append
        for piece in pieces:
            tid = get(piece)
            if tid is None:
                tid = cache[piece] = _stable_id(piece, vocab)
            append(tid)
        count += len(ids)
        if max_tokens is not None and count > max_tokens:
            raise TokenLimitError(f"the text has more than {int(max_tokens):,} tokens (tokenizing stopped there)")
        parts.append(np.asarray(ids, dtype=np.int32))
    return np.concatenate(parts) if parts else np.empty(0, np.int32)
