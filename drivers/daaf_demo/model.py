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

import hashlib
import math
import time
from dataclasses import astuple, dataclass, field
from typing import Any

import numpy as np
from hpczeco.collectives import timed
from hpczeco.collectives.agree import collective_check, local_error
from hpczeco.collectives.halo import allreduce, gather_lengths

from hpczeco.daaf.attention import attention, exact_attention
from hpczeco.daaf.distributed import distributed_attention, head_range, sequence_range
from hpczeco.daaf.planner import Plan, check_tokens, plan_from_mask

__all__ = ["ModelConfig", "PrefillModel", "PrefillResult", "PrefillEstimate", "MLP_ROWS"]

#: token rows the MLP processes at a time (its hidden activations are ``[MLP_ROWS, mlp_mult * d_model]``)
MLP_ROWS = 4096


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and seed of the random-weight model (checked: positive ints, ``vocab_size >= 2``, ``n_layers >= 0``,
    a positive finite ``rope_base``)."""

    vocab_size: int = 32768
    d_model: int = 128
    n_heads: int = 4
    head_dim: int = 32
    n_layers: int = 2
    mlp_mult: int = 4
    rope_base: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, lo in (("vocab_size", 2), ("d_model", 1), ("n_heads", 1), ("head_dim", 1), ("n_layers", 0),
                         ("mlp_mult", 1), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"ModelConfig.{name} must be an int, got {type(v).__name__} {v!r}")
            if v < lo:
                raise ValueError(f"ModelConfig.{name} must be >= {lo}, got {v}")
        rb = self.rope_base
        if isinstance(rb, bool) or not isinstance(rb, (int, float, np.integer, np.floating)) or not (
                math.isfinite(float(rb)) and float(rb) > 0):
            raise ValueError(f"ModelConfig.rope_base must be a positive finite number, got {rb!r}")


@dataclass(frozen=True)
class PrefillEstimate:
    """What a prefill will cost, computed before it starts (:meth:`PrefillModel.estimate`).

    ``tokens`` ``T``; ``n_global`` key-region tokens (their share ``global_fraction``); ``pairs`` the exact
    query-key pairs of the attention; ``flops`` of the whole prefill (attention ``4 Dh`` per pair and head,
    projections and MLP ``2`` per weight and token, every layer); ``bytes_per_rank`` the largest rank's
    memory: weights, token ids and the activations that are live at once (see :meth:`PrefillModel.estimate`).
    """

    tokens: int
    n_global: int
    pairs: int
    flops: float
    bytes_per_rank: int
    ranks: int
    mode: str

    @property
    def global_fraction(self) -> float:
        return self.n_global / max(1, self.tokens)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "n_global": self.n_global, "global_fraction": self.global_fraction,
                "pairs": self.pairs, "flops": self.flops, "bytes_per_rank": self.bytes_per_rank,
                "ranks": self.ranks, "mode": self.mode}

    def summary(self) -> str:
        return (f"{self.tokens:,} tokens, {100 * self.global_fraction:.1f}% global, {self.pairs:.3g} attention pairs "
                f"(~{self.flops:.2g} flop), ~{self.bytes_per_rank / 2**20:,.0f} MiB per rank on {self.ranks} "
                f"rank(s) ({self.mode})")


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

    # ------------------------------------------------------------------ cost

    def weight_bytes(self) -> int:
        """Bytes of the weights (every rank holds all of them)."""
        return int(self.emb.nbytes + self.nf.nbytes + sum(a.nbytes for L in self.layers for a in L.values()))

    def estimate(self, T: int, n_global: int, pairs: int, ranks: int = 1, mode: str = "sequence",
                 local_window: int = 0) -> PrefillEstimate:
        """:class:`PrefillEstimate` of a prefill of ``T`` tokens with ``n_global`` key-region tokens and
        ``pairs`` attention pairs over ``ranks`` ranks in ``mode`` (no work is done).

        Memory of the largest rank, float32 activations (4 bytes) of the ``R`` token rows it holds
        (``ceil(T / ranks)`` plus the ``local_window`` halo in sequence mode, ``T`` in heads mode, where
        it holds ``Hp = ceil(H / ranks)`` heads): the residual, its norm and the projected outputs (``4 d``
        per row), q/k/v with the RoPE, head-major and concatenated copies alive at once (``9 Hp Dh``), the
        RoPE table (``Dh``), the MLP's hidden rows (``3 mlp d`` for at most :data:`MLP_ROWS` rows), in sequence
        mode the gathered key-region rows of every rank (``3 H Dh`` per key-region token) and their
        partial softmax states, plus token ids (12 bytes each) and the weights. Checked against the
        measured peak RSS in docs/RELIABILITY.md.
        """
        cfg = self.cfg
        d, H, Dh, m = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.mlp_mult
        P = max(1, int(ranks))
        if P == 1:
            rows, Hp, G = T, H, 0
        elif mode == "heads":
            rows, Hp, G = T, -(-H // P), 0
        else:
            rows, Hp, G = -(-T // P) + min(int(local_window), T), H, n_global
        per_row = 4 * d + 9 * Hp * Dh + Dh
        mlp = 3 * m * d * min(rows, MLP_ROWS)
        gathered = G * (3 * H * Dh + 2 * H * (Dh + 2))
        nbytes = 4 * (rows * per_row + mlp + gathered) + 12 * T + self.weight_bytes()
        proj = 2 * T * (3 * d * H * Dh + H * Dh * d + 2 * d * m * d)
        flops = float(cfg.n_layers) * (4.0 * Dh * H * pairs + proj)
        return PrefillEstimate(int(T), int(n_global), int(pairs), flops, int(nbytes), P,
                               "single" if P == 1 else mode)

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
            # every rank must hold the same tokens and the same model (weights come from cfg.seed): a digest of
            # the ids, not a sum (a sum misses swapped tokens), and the whole config
            agree = {} if err is not None else {
                "T": len(tokens), "attn": attn, "mode": mode, "model": astuple(self.cfg),
                "tokens": hashlib.blake2b(np.ascontiguousarray(tokens, np.int64).tobytes(), digest_size=16).hexdigest(),
            }
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
        """The MLP of rows ``x`` ``[T, d]`` (its hidden units ``cols``), :data:`MLP_ROWS` rows at a time."""
        if len(x) <= MLP_ROWS:
            return _gelu(_rmsnorm(x, L["n2"]) @ L["w1"][:, cols]) @ L["w2"][cols]
        out = np.empty((len(x), L["w2"].shape[1]), dtype=np.result_type(x, L["w2"]))
        for a in range(0, len(x), MLP_ROWS):
            xa = x[a:a + MLP_ROWS]
            out[a:a + MLP_ROWS] = _gelu(_rmsnorm(xa, L["n2"]) @ L["w1"][:, cols]) @ L["w2"][cols]
        return out

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
        timed.Bcast(comm, logits, owner, "PrefillModel.prefill (the last token's logits)")
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
