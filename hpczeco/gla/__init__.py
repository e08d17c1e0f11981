"""Gated linear attention (GLA) on one rank: float64 reference, chunked forward and backward, phase split.

One algorithm a module, the reference beside them (as flash-linear-attention's ``ops/gla``):

- :mod:`~hpczeco.gla.naive`: :func:`recurrent_gla` / :func:`recurrent_gla_bwd`, the token-by-token float64
  references the fast paths are tested against;
- :mod:`~hpczeco.gla.chunk`: :func:`chunk_gla` / :func:`chunk_gla_bwd`, the chunked numpy path (packed documents
  with ``cu_seqlens`` too); CuPy inputs go to :mod:`hpczeco.gpu.gla`. Its numba kernels: :mod:`~hpczeco.gla.kernels`;
- :mod:`~hpczeco.gla.split`: the same forward and backward cut where the incoming state enters, for the ZeCO
  layer (the split protocol on numpy, CuPy and packed documents: ``split_forward``, ``split_backward``);
- :mod:`~hpczeco.gla.validate`: :func:`validate_gla_inputs` and the other per-rank input checks (only
  ``ValueError``/``TypeError``).

Layout ``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``, states ``[B, H, K, V]``; see docs/DESIGN.md.
"""

from .chunk import chunk_gla, chunk_gla_bwd
from .naive import recurrent_gla, recurrent_gla_bwd
from .validate import validate_gla_inputs

__all__ = ["recurrent_gla", "recurrent_gla_bwd", "chunk_gla", "chunk_gla_bwd", "validate_gla_inputs"]
