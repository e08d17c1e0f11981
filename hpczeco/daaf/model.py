"""A small multi-layer attention model with random weights whose prefill uses dense attention or DAAF.

Pre-norm decoder blocks (numpy float32): ``x = emb[tokens]``; per layer
``h = rmsnorm(x); q, k, v = h W_qkv`` (RoPE on q, k), ``x += attn(q, k, v) W_o``,
``x += gelu(rmsnorm(x) W_1) W_2``; the first token is ``argmax(rmsnorm(x[-1]) emb^T)`` (tied
unembedding). Weights come from a seeded generator, so every rank builds the same model.

Prefill modes:

* one rank: :meth:`PrefillModel.prefill` with ``attn="daaf"`` (a :class:`Plan`) or ``"dense"``;
* sequence split over ranks (``mode="sequence"``): each rank embeds and runs its token slice;
  attention is :func:`~hpczeco.daaf.distributed.distributed_attention` (halo + key-region
  allgather); everything else is per token. The last token's rank computes the first token.
* heads split over ranks (``mode="heads"``, tensor parallel): every rank holds all tokens, computes
  Q/K/V and attention for its heads and its share of the MLP hidden units; the partial outputs of
  ``W_o`` and ``W_2`` are summed with an allreduce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..collectives.agree import collective_check, local_error
from ..collectives.halo import allreduce, gather_lengths
from .attention import attention, exact_attention
from .distributed import distributed_attention, head_range
from .planner import Plan, check_tokens, plan_from_mask

__all__ = ["ModelConfig", "PrefillModel", "PrefillResult"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32768
    d_model: int = 128
    n_heads: int = 4
    head_dim: int = 32
    n_layers: int = 2
    mlp_mult: int = 4
    rope_base: float = 10000.0
    seed: int = 0


@dataclass
class PrefillResult:
    """``first_token`` (int), ``logits`` ``[vocab]`` of the last position (on every rank),
    ``seconds`` of the prefill, per-part ``timings``; ``hidden`` is this rank's final hidden states
    ``[T_local, d_model]`` when asked for; ``qkv`` the per-layer ``(q, k, v)`` when asked for."""

    first_token: int
    logits: np.ndarray
    seconds: float
    timings: dict = field(default_factory=dict)
    hidden: np.ndarray | None = None
    qkv: list | None = None


def _rmsnorm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * w


def _gelu(x: np.ndarray) -> np.ndarray:
    """tanh-approximate GELU (in place on a temporary)."""
    t = x * x
    t *= 0.044715
    t += 1.0
    t *= x
    t *= 0.7978845608
    np.tanh(t, out=t)
    t += 1.0
    t *= x
    t *= 0.5
    return t


class PrefillModel:
    """Random-weight decoder (see the module docstring). ``cfg`` fixes sizes and the seed."""

    def __init__(self, cfg: ModelConfig | None = None):
        self.cfg = cfg = cfg or ModelConfig()
        rng = np.random.default_rng(cfg.seed)
        d, H, Dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        f32 = np.float32
        self.emb = (rng.standard_normal((cfg.vocab_size, d)) * 0.5).astype(f32)
        self.layers = []
        for _ in range(cfg.n_layers):
            self.layers.append({
                "n1": np.ones(d, f32),
                "wq": (rng.standard_normal((d, H, Dh)) / np.sqrt(d)).astype(f32),
                "wk": (rng.standard_normal((d, H, Dh)) / np.sqrt(d)).astype(f32),
                "wv": (rng.standard_normal((d, H, Dh)) / np.sqrt(d)).astype(f32),
                "wo": (rng.standard_normal((H, Dh, d)) / np.sqrt(H * Dh)).astype(f32),
                "n2": np.ones(d, f32),
                "w1": (rng.standard_normal((d, cfg.mlp_mult * d)) / np.sqrt(d)).astype(f32),
                "w2": (rng.standard_normal((cfg.mlp_mult * d, d)) / np.sqrt(cfg.mlp_mult * d)).astype(f32),
            })
        self.nf = np.ones(d, f32)
        half = Dh // 2
        self._inv_freq = (1.0 / cfg.rope_base ** (np.arange(half) / half)).astype(np.float64)
        self._rope_key: tuple[int, int] | None = None
        self._rope_cs: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ pieces

    def _rope_table(self, pos0: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        key = (pos0, T)
        if self._rope_key != key:
            ang = np.outer(np.arange(pos0, pos0 + T), self._inv_freq)
            self._rope_cs = (np.cos(ang).astype(np.float32)[:, None], np.sin(ang).astype(np.float32)[:, None])
            self._rope_key = key
        return self._rope_cs

    def _rope(self, x: np.ndarray, pos0: int) -> np.ndarray:
        """Rotary embedding of ``x`` ``[T, H, Dh]`` at positions ``pos0 ..``."""
        T, _, Dh = x.shape
        half = Dh // 2
        cos, sin = self._rope_table(pos0, T)
        a, b = x[..., :half], x[..., half : 2 * half]
        out = x.copy()
        out[..., :half] = a * cos - b * sin
        out[..., half : 2 * half] = a * sin + b * cos
        return out

    def _qkv(self, L: dict, h: np.ndarray, pos0: int, heads: slice):
        """``q, k, v`` ``[1, T, H_sel, Dh]`` of the selected heads (one matmul; RoPE on q and k)."""
        d = h.shape[-1]
        w = np.concatenate([L[n][:, heads].reshape(d, -1) for n in ("wq", "wk", "wv")], axis=1)
        qkv = (h @ w).reshape(h.shape[0], 3, -1, self.cfg.head_dim)
        return (self._rope(qkv[:, 0], pos0)[None], self._rope(qkv[:, 1], pos0)[None],
                np.ascontiguousarray(qkv[:, 2])[None])

    @staticmethod
    def _out(o: np.ndarray, wo: np.ndarray) -> np.ndarray:
        """``o`` ``[T, H_sel, Dh]`` through ``W_o`` rows of those heads -> ``[T, d_model]``."""
        return o.reshape(o.shape[0], -1) @ wo.reshape(-1, wo.shape[-1])

    def _logits(self, x_last: np.ndarray) -> np.ndarray:
        return _rmsnorm(x_last, self.nf) @ self.emb.T

    # ------------------------------------------------------------------ prefill

    def prefill(self, tokens: Any, attn: str = "daaf", plan: Plan | None = None, comm=None, mode: str = "sequence",
                keep_hidden: bool = False, keep_qkv: bool = False) -> PrefillResult:
        """Prefill ``tokens`` ``[T]`` (on every rank: the whole token stream) and return the first token.

        ``attn="daaf"`` needs ``plan`` (over the same ``T`` tokens); ``attn="dense"`` is exact causal
        attention. ``comm`` (size > 1) distributes the prefill by ``mode`` ("sequence" or "heads");
        collective, with collective validation first.
        """
        size = 1 if comm is None else comm.Get_size()

        def check() -> None:
            tok = check_tokens(tokens)
            if attn not in ("daaf", "dense"):
                raise ValueError(f"attn must be 'daaf' or 'dense', got {attn!r}")
            if int(tok.max()) >= self.cfg.vocab_size:
                raise ValueError(f"tokens holds id {int(tok.max())} >= vocab_size ({self.cfg.vocab_size})")
            if attn == "daaf":
                if not isinstance(plan, Plan):
                    raise TypeError(f"plan must be a hpczeco.daaf.Plan for attn='daaf', got {type(plan).__name__}")
                if plan.T != len(tok):
                    raise ValueError(f"plan covers T={plan.T} but tokens has {len(tok)} tokens")
            if mode not in ("sequence", "heads"):
                raise ValueError(f"mode must be 'sequence' or 'heads', got {mode!r}")

        err = local_error(check)
        if size > 1:
            agree = {} if err is not None else {"T": len(tokens), "attn": attn, "mode": mode,
                                                 "tokens": int(np.asarray(tokens, np.int64).sum() % (1 << 61))}
            collective_check(comm, "prefill", err, agree)
        elif err is not None:
            raise err
        tok = check_tokens(tokens)
        if attn == "dense":
            the_plan = plan_from_mask(np.ones(len(tok), bool), 0, "dense")
        else:
            the_plan = plan
        t_start = time.perf_counter()
        if size == 1:
            res = self._prefill_local(tok, attn, the_plan, keep_hidden, keep_qkv)
        elif mode == "sequence":
            res = self._prefill_sequence(tok, the_plan, comm, keep_hidden)
        else:
            res = self._prefill_heads(tok, attn, the_plan, comm, keep_hidden)
        res.seconds = time.perf_counter() - t_start
        return res

    def _mlp(self, L: dict, x: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        return _gelu(_rmsnorm(x, L["n2"]) @ L["w1"][:, cols]) @ L["w2"][cols]

    def _prefill_local(self, tok, attn, p: Plan, keep_hidden, keep_qkv) -> PrefillResult:
        x = self.emb[tok]
        qkvs = [] if keep_qkv else None
        t_attn = 0.0
        for L in self.layers:
            q, k, v = self._qkv(L, _rmsnorm(x, L["n1"]), 0, slice(None))
            if keep_qkv:
                qkvs.append((q, k, v))
            a = time.perf_counter()
            o = exact_attention(q, k, v) if attn == "dense" else attention(q, k, v, p)
            t_attn += time.perf_counter() - a
            x = x + self._out(o[0], L["wo"])
            x = x + self._mlp(L, x)
        logits = self._logits(x[-1])
        return PrefillResult(int(np.argmax(logits)), logits, 0.0, {"attention": t_attn},
                             x if keep_hidden else None, qkvs)

    def _prefill_sequence(self, tok, p: Plan, comm, keep_hidden) -> PrefillResult:
        from .distributed import sequence_range  # noqa: PLC0415

        a, b = sequence_range(len(tok), comm)
        x = self.emb[tok[a:b]]
        t_attn = 0.0
        for L in self.layers:
            q, k, v = self._qkv(L, _rmsnorm(x, L["n1"]), a, slice(None))
            t0 = time.perf_counter()
            o = distributed_attention(q, k, v, p, comm)
            t_attn += time.perf_counter() - t0
            x = x + self._out(o[0], L["wo"])
            x = x + self._mlp(L, x)
        lengths = gather_lengths(b - a, comm)
        owner = max(r for r, n in enumerate(lengths) if n > 0)
        logits = self._logits(x[-1]) if comm.Get_rank() == owner else np.empty(self.cfg.vocab_size, np.float32)
        comm.Bcast(logits, root=owner)
        return PrefillResult(int(np.argmax(logits)), logits, 0.0, {"attention": t_attn}, x if keep_hidden else None)

    def _prefill_heads(self, tok, attn, p: Plan, comm, keep_hidden) -> PrefillResult:
        h0, h1 = head_range(self.cfg.n_heads, comm)
        heads = slice(h0, h1)
        cols = slice(*head_range(self.cfg.mlp_mult * self.cfg.d_model, comm))
        x = self.emb[tok]
        t_attn = 0.0
        for L in self.layers:
            q, k, v = self._qkv(L, _rmsnorm(x, L["n1"]), 0, heads)
            t0 = time.perf_counter()
            o = distributed_attention(q, k, v, p, comm, mode="heads")
            t_attn += time.perf_counter() - t0
            x = x + allreduce(self._out(o[0], L["wo"][heads]), comm)
            x = x + allreduce(self._mlp(L, x, cols), comm)
        logits = self._logits(x[-1])
        return PrefillResult(int(np.argmax(logits)), logits, 0.0, {"attention": t_attn}, x if keep_hidden else None)
