"""Gated linear attention (GLA) on one rank: float64 reference, chunked forward and backward, phase split.

- :func:`recurrent_gla` / :func:`recurrent_gla_bwd`: token-by-token float64 references (``naive.py``)
- :func:`chunk_gla` / :func:`chunk_gla_bwd`: chunked, vectorised numpy path (``chunk.py``, its body ``fused.py``); CuPy
  inputs go to :mod:`hpczeco.gpu.gla`
- :mod:`hpczeco.gla.split`: the same forward and backward cut where the incoming state enters
  (``ForwardSplit``, ``BackwardSplit``); :mod:`hpczeco.gla.protocol`: the split protocol the ZeCO layer
  talks to on numpy and CuPy alike (:mod:`hpczeco.gla.device_split` adapts the device kernels)
- :func:`validate_gla_inputs`: the per-rank input checks (only ``ValueError``/``TypeError``)

The fused and split forms share one thread runner (``_runner.py``), one chunk geometry (``_geometry.py``),
one set of numba kernels (``_kernels.py``, ``_kernels_grad.py``, ``_pairwise.py``) and the group steps
built on them (``_steps.py``).

Layout ``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``, states ``[B, H, K, V]``; see docs/DESIGN.md.
"""

from .chunk import chunk_gla, chunk_gla_bwd
from .naive import recurrent_gla, recurrent_gla_bwd
from .validate import validate_gla_inputs

__all__ = ["recurrent_gla", "recurrent_gla_bwd", "chunk_gla", "chunk_gla_bwd", "validate_gla_inputs"]
