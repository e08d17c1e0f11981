"""The GLA language model of ``hpczeco train`` in PyTorch: flash-linear-attention's GLA architecture.

Per block (pre-norm residual; ``x: [B, L, D]`` is this rank's contiguous slice of the sequences, kept in the
parameter dtype -- float32 under bf16 autocast -- so the residual stream is accumulated in full precision)::

    h = RMSNorm(x)                                        -> compute dtype (bf16 under autocast)
    q, k = h Wq, h Wk -> [B, L, H, K];  v = h Wv -> [B, L, H, V]
    g = logsigmoid((h W1) W2 + b2) / 16                   low-rank forget gate (fla: rank 16, normaliser 16)
    o = GLA(q, k, v, g)                                   the token mixer: the only part that sees other ranks
    x = x + Wo (RMSNorm_head(o) * silu(h Wgate))          per-head RMSNorm, SiLU output gate (fla's g_norm_swish_gate)
    x = x + Wdown (silu(RMSNorm(x) Wg) * (RMSNorm(x) Wu)) SwiGLU MLP
    logits = RMSNorm(x) Whead                             (Whead = the embedding with tied embeddings)

Token mixer (:func:`make_mixer`): :func:`hpczeco.torch.chunk_gla` when the sequence is on one rank, and
:func:`hpczeco.torch.zeco_gla` (ZeCO: All-Scan forward, reverse scan backward) when it is split over the ranks
of a communicator. The loss (:meth:`GLALM.forward`) is this rank's *sum* of next-token cross entropies divided
by the number of target tokens of the whole global batch, so the sum over ranks is the mean over the batch and
the sum of the ranks' gradients is the gradient of one process holding everything.

Initialisation (fla's ``_init_weights``): every linear and the embedding ``N(0, 0.02)``, biases zero, norms one,
and the projections into the residual stream (``o_proj``, ``down``) ``N(0, 0.02 / sqrt(2 n_layers))``; drawn
from one generator seeded by ``seed``, so every rank builds the same replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig

__all__ = ["RMSNorm", "GLAttention", "Block", "GLALM", "make_mixer", "LocalGLA", "SequenceParallelGLA"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, accumulated in float32 (or float64),
    outside autocast; the result has ``x``'s dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


class LocalGLA(nn.Module):
    """The whole sequence on this process: :func:`hpczeco.torch.chunk_gla`. ``(q, k, v, g) -> o [B, L, H, V]``."""

    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        from hpczeco.torch import chunk_gla

        return chunk_gla(q, k, v, g)[0]


class SequenceParallelGLA(nn.Module):
    """This rank's slice of sequences split over ``comm`` (ZeCO). ``(q, k, v, g) -> o [B, L_p, H, V]``; collective
    over ``comm`` in the forward and in the backward."""

    def __init__(self, comm: Any, topology: str = "ring", blocks: int | None = None, chunk_size: int = 64):
        super().__init__()
        self.comm, self.topology, self.blocks, self.chunk_size = comm, topology, blocks, chunk_size

    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        from hpczeco.torch import zeco_gla

        # the one call into the ZeCO layer (its topology keyword is named here only); the values were checked
        # where they were made (the step's loss is checked for NaN/Inf), so the layer's per-call check is off
        return zeco_gla(q, k, v, g, self.comm, topology=self.topology, blocks=self.blocks, chunk_size=self.chunk_size,
                        check_values=False)[0]

    def extra_repr(self) -> str:
        return f"ranks={self.comm.Get_size()}, topology={self.topology!r}, blocks={self.blocks}"


def make_mixer(comm: Any, topology: str = "ring", blocks: int | None = None, chunk_size: int = 64) -> nn.Module:
    """The token mixer of one layer: :class:`LocalGLA` when ``comm`` is None or has one rank, else
    :class:`SequenceParallelGLA` over ``comm``."""
    if comm is None or comm.Get_size() == 1:
        return LocalGLA()
    return SequenceParallelGLA(comm, topology, blocks, chunk_size)


class GLAttention(nn.Module):
    """fla's ``GatedLinearAttention`` (``expand_k = expand_v = 1``, output gate, fused norm + swish gate):
    ``project(h) -> (q, k, v, g, gate)`` around the mixer, ``output(o, gate) -> [B, L, D]``."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        d, self.H, self.K = cfg.d_model, cfg.n_heads, cfg.head_dim
        hk = self.H * self.K
        self.normaliser = cfg.gate_normaliser
        self.q_proj = nn.Linear(d, hk, bias=False)
        self.k_proj = nn.Linear(d, hk, bias=False)
        self.v_proj = nn.Linear(d, hk, bias=False)
        self.g_proj = nn.Linear(d, hk, bias=False)  # output gate
        self.gk_proj = nn.Sequential(nn.Linear(d, cfg.gate_low_rank, bias=False),
                                     nn.Linear(cfg.gate_low_rank, hk, bias=True))  # forget gate, low rank
        self.g_norm = RMSNorm(self.K, cfg.norm_eps)  # per head
        self.o_proj = nn.Linear(hk, d, bias=False)
        self.mixer = mixer

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``h [B, L, D]`` -> ``q, k, v, g [B, L, H, K]`` (g <= 0, the dtype of q) and the gate ``[B, L, H, K]``."""
        heads = (self.H, self.K)
        q = self.q_proj(h).unflatten(-1, heads)
        k = self.k_proj(h).unflatten(-1, heads)
        v = self.v_proj(h).unflatten(-1, heads)
        g = (F.logsigmoid(self.gk_proj(h)) / self.normaliser).unflatten(-1, heads).to(q.dtype)
        gate = self.g_proj(h).unflatten(-1, heads)
        return q, k, v, g, gate

    def output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``o, gate [B, L, H, K]`` -> ``[B, L, D]``."""
        return self.o_proj((self.g_norm(o) * F.silu(gate)).flatten(-2))


class Block(nn.Module):
    """One pre-norm block: GLA token mixing, then the SwiGLU MLP. ``x [B, L, D] -> [B, L, D]``.

    ``act_ckpt``: recompute the projections, the gated output and the MLP in the backward (activation
    checkpointing of everything but the mixer, whose inputs are kept: nothing collective is recomputed)."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module, act_ckpt: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = GLAttention(cfg, mixer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act_ckpt = act_ckpt

    def _attn_in(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.attn.project(self.attn_norm(x).to(dtype))

    def _mlp(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = self.mlp_norm(x).to(dtype)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``dtype``: the compute dtype of the matmul inputs (bfloat16 under autocast, else x's)."""
        run = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if self.act_ckpt and self.training \
            else (lambda f, *a: f(*a))
        q, k, v, g, gate = run(self._attn_in, x, dtype)
        o = self.attn.mixer(q, k, v, g)
        x = x + run(self.attn.output, o, gate)
        return x + run(self._mlp, x, dtype)


class GLALM(nn.Module):
    """``forward(tokens [B, L], targets [B, L], n_targets) -> loss share`` (a 0-d tensor in float32/float64).

    ``make_mixer()`` builds each layer's token mixer. ``compute_dtype``: the dtype the matmuls see (set by the
    caller's autocast; the model only casts the normalised activations to it once per use)."""

    def __init__(self, cfg: ModelConfig, make_mixer: Callable[[], nn.Module], act_ckpt: bool = False,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, make_mixer(), act_ckpt) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """fla's initialisation (module docstring), from one generator on the parameters' device seeded by ``seed``."""
        dev = next(self.parameters()).device
        gen = torch.Generator(device=dev).manual_seed(int(seed))
        std, scaled = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, mod in self.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                s = scaled if name.endswith(("o_proj", "down_proj")) else std
                mod.weight.normal_(0.0, s, generator=gen)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, n_targets: int) -> torch.Tensor:
        x = self.embed(tokens)  # [B, L, D] in the parameter dtype: the residual stream
        dtype = self.compute_dtype or x.dtype
        for blk in self.blocks:
            x = blk(x, dtype)
        h = self.norm(x).to(dtype)
        logits = self.head(h) if self.head is not None else F.linear(h, self.embed.weight.to(dtype))
        loss = F.cross_entropy(logits.flatten(0, 1).float() if logits.dtype in (torch.bfloat16, torch.float16)
                               else logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return loss / n_targets
