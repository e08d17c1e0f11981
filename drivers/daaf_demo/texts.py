"""Offline test texts for DAAF: Python standard-library source (high entropy) mixed with repetitive
log lines (low entropy). Nothing is downloaded; the same arguments give the same text everywhere
the same Python version is installed.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

from .tokenizer import DEFAULT_VOCAB, WORD_PATTERN, tokenize

__all__ = ["log_lines", "stdlib_source", "mixed_tokens"]

_USERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
_PATHS = ("/api/v1/items", "/api/v1/users", "/healthz", "/api/v1/orders", "/static/app.js")


def log_lines(n_lines: int, seed: int = 0) -> str:
    """``n_lines`` of web-server-like log records with few distinct fields (low entropy)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_lines):
        sec = i % 60
        status = (200, 200, 200, 200, 404, 500)[rng.integers(6)]
        lvl = "INFO" if status == 200 else ("WARN" if status == 404 else "ERROR")
        out.append(f"2024-05-01T12:{(i // 60) % 60:02d}:{sec:02d}Z {lvl} [worker-{rng.integers(8)}] GET "
                   f"{_PATHS[rng.integers(len(_PATHS))]}/{rng.integers(20)} {status} {rng.integers(1, 40)}ms "
                   f"user={_USERS[rng.integers(len(_USERS))]}\n")
    return "".join(out)


def stdlib_source(min_chars: int, seed: int = 0) -> str:
    """At least ``min_chars`` characters of Python standard-library source, files in a seeded order."""
    d = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(d) if f.endswith(".py"))
    if not files:
        raise RuntimeError(f"no Python source files found in {d}")
    order = np.random.default_rng(seed).permutation(len(files))
    parts, n = [], 0
    for i in np.tile(order, 1 + min_chars // 200_000):
        with open(os.path.join(d, files[i]), encoding="utf-8", errors="replace") as f:
            txt = f.read()
        parts.append(txt)
        n += len(txt)
        if n >= min_chars:
            break
    return "".join(parts)


def mixed_tokens(n_tokens: int, source_share: float = 0.2, segment: int = 4096, seed: int = 0,
                 vocab_size: int = DEFAULT_VOCAB) -> tuple[np.ndarray, np.ndarray, str]:
    """``(tokens [n_tokens] int32, is_source [n_tokens] bool, text)``: segments of ``segment`` tokens,
    each ``source_share`` of stdlib source followed by log lines (word tokenizer, hashed vocab).
    ``text`` is the concatenated source text of the tokens (re-tokenizing it can differ by a few
    tokens where pieces join)."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if not 0 <= source_share <= 1:
        raise ValueError(f"source_share must lie in [0, 1], got {source_share}")
    src_text = stdlib_source(int(n_tokens * source_share * 6) + 10_000, seed)
    src_tok = tokenize(src_text, vocab_size=vocab_size)
    src_pieces = WORD_PATTERN.findall(src_text)
    log_text = log_lines(n_tokens // 20 + 100, seed)  # about 30 tokens per line
    log_tok = tokenize(log_text, vocab_size=vocab_size)
    log_pieces = WORD_PATTERN.findall(log_text)
    toks, src, pieces = [], [], []
    si = li = 0
    n = 0
    while n < n_tokens:
        n_src = int(round(min(segment, n_tokens - n) * source_share))
        n_log = min(segment, n_tokens - n) - n_src
        for count, is_src in ((n_src, True), (n_log, False)):
            if count <= 0:
                continue
            if is_src:
                if si + count > len(src_tok):
                    si = 0
                piece = src_tok[si : si + count]
                pieces.append("".join(src_pieces[si : si + count]))
                si += count
            else:
                if li + count > len(log_tok):
                    li = 0
                piece = log_tok[li : li + count]
                pieces.append("".join(log_pieces[li : li + count]))
                li += count
            toks.append(piece)
            src.append(np.full(len(piece), is_src))
        n += n_log + n_src
    tokens = np.concatenate(toks)[:n_tokens].astype(np.int32)
    is_source = np.concatenate(src)[:n_tokens]
    return tokens, is_source, "".join(pieces)
