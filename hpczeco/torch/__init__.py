"""PyTorch interface of hpczeco (the optional ``torch`` extra: ``pip install hpczeco[torch]``).

- :func:`chunk_gla`: flash-linear-attention's ``chunk_gla`` (same signature and semantics, ``[B, T, H, K]``)
  as a ``torch.autograd.Function`` on hpczeco's kernels: CUDA bf16/fp16/fp32 tensors as zero-copy CuPy
  views on torch's current stream, CPU fp32/fp64 tensors through numpy views.
- :func:`zeco_gla` / :class:`ZeCOGLAttention`: the same on this rank's slice of one sequence split over an
  mpi4py communicator (ZeCO: All-Scan forward, reverse-scan backward), collective and collectively validated.

Nothing in the rest of hpczeco imports this package (or torch). ``hpczeco bench torch`` times the autograd
call against the bare kernel call on a GPU (:mod:`hpczeco.drivers.bench_torch`).
"""

from .chunk import chunk_gla, supports_cu_seqlens
from .zeco import ZeCOGLAttention, zeco_gla

# what users call; the autograd Functions behind them (chunk.ChunkGLAFunction, zeco.ZeCOGLAFunction) are internals
__all__ = ["chunk_gla", "zeco_gla", "ZeCOGLAttention", "supports_cu_seqlens"]
