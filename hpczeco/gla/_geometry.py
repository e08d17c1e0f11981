"""Chunk geometry of the CPU GLA: chunks, sub-chunks, streaming groups and the span limit.

Shared by the fused chunked form (:mod:`hpczeco.gla.fused`) and the phase-split form
(:mod:`hpczeco.gla.split`). A sequence of ``T`` tokens is cut into ``N`` chunks of ``C`` tokens; each chunk
is padded to ``Cp = ns c`` rows, ``ns`` sub-chunks of ``c <= SUB`` tokens. Work streams over groups of
consecutive chunks of about ``GROUP_TOKENS`` padded tokens (``GROUP_TOKENS_LIGHT`` for the phases that
keep little scratch per chunk), so the scratch stays in cache.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Geom", "SUB", "SPAN_LIMIT", "GROUP_TOKENS", "GROUP_TOKENS_LIGHT"]

SUB = 16  # sub-chunk size (tokens)
#: largest diagonal-block span exp(span) may take before that block is computed pairwise, per compute dtype
SPAN_LIMIT = {np.dtype(np.float32): 40.0, np.dtype(np.float64): 300.0}
GROUP_TOKENS = 512  # padded tokens per streaming group: the fused forward/backward, intra(), local(), finish()
GROUP_TOKENS_LIGHT = 1024  # ... in the light phases (the split constructors): little scratch per chunk


class Geom:
    """Chunk geometry of ``[B, T, H, *]`` sequences: ``N`` chunks of ``C`` tokens, each padded to
    ``Cp = ns * c`` rows (``ns`` sub-chunks of ``c`` tokens); ``Z = B H N`` chunks in all. ``T >= 1``."""

    def __init__(self, B: int, T: int, H: int, K: int, V: int, chunk_size: int):
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.C = C = max(1, min(chunk_size, T))
        self.N = -(-T // C)
        self.ns = -(-C // SUB)
        self.c = -(-C // self.ns)
        self.Cp = self.ns * self.c
        self.Z = B * H * self.N

    def group(self) -> int:
        """Chunks per streaming group: about ``GROUP_TOKENS`` padded tokens (at least 1, at most ``N``)."""
        return max(1, min(self.N, GROUP_TOKENS // self.Cp))

    def group_light(self) -> int:
        """Chunks per group in the light phases: about ``GROUP_TOKENS_LIGHT`` padded tokens."""
        return max(1, min(self.N, GROUP_TOKENS_LIGHT // self.Cp))

    def whole(self, n0: int, gc: int) -> bool:
        """Chunks ``n0 .. n0 + gc - 1`` are all whole and unpadded, so their token rows are a plain view."""
        return self.Cp == self.C and (n0 + gc) * self.C <= self.T

    def span_limit(self, dtype: np.dtype) -> float:
        """The span limit of the compute dtype (read at call time, so tests may lower it)."""
        return SPAN_LIMIT[np.dtype(dtype)]


def num_chunks(T: int, chunk_size: int) -> int:
    """``N``, the number of chunks of ``T`` tokens (0 for ``T = 0``)."""
    return Geom(1, T, 1, 1, 1, chunk_size).N if T else 0
