"""A small byte-level language model whose token mixers are GLA layers, with a hand-written backward.

Architecture (pre-norm residual; ``x: [B, L, D]`` is this rank's contiguous slice of the sequence)::

    x = embed[tokens]
    for each layer:
        h = rmsnorm(x) * norm1
        q = h Wq, k = h Wk  -> [B, L, H, K];   v = h Wv -> [B, L, H, Vh]
        g = logsigmoid(h Wg + bg) / gate_norm  -> [B, L, H, K]   (log forget gate, <= 0)
        o = GLA(q, k, v, g)                      (ZeCO across ranks: hpczeco.ZeCOGLA)
        x = x + o Wo
        h = rmsnorm(x) * norm2
        x = x + silu(h W1) W2
    logits = (rmsnorm(x) * norm_f) head         -> [B, L, vocab]
    loss = sum of next-token cross entropy over the rank's positions / total positions (all ranks)

The GLA mixer is the only part that sees other ranks: each layer holds its own mixer object
(forward caches what backward needs). Mixers: :class:`ZeCOMixer` (``hpczeco.ZeCOGLA``, any number
of ranks), :class:`ChunkMixer` (``hpczeco.gla.chunk_gla`` on one process) and :class:`RecurrentMixer`
(token-by-token float64 reference with its own backward, one process; for tests).

Parameters are a flat ``dict[str, ndarray]`` with names like ``layer0/wq`` (checkpoint-ready) in the
model dtype (float32 or float64); the gradients have the same names. Parameters and tokens may be
numpy arrays (CPU) or CuPy arrays (GPU): the array module is taken from them. On the CPU every
operation is deterministic; on the GPU the embedding gradient uses atomics, so it is not bitwise
reproducible.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
from hpczeco.base.backend import get_array_module

__all__ = [
    "LMConfig",
    "GLALM",
    "Mixer",
    "ZeCOMixer",
    "ChunkMixer",
    "RecurrentMixer",
    "make_mixers",
    "init_params",
    "param_names",
]


@dataclass(frozen=True)
class LMConfig:
    """Model shape. ``head_k``/``head_v`` default to ``d_model // n_heads``, ``d_ff`` to ``4 d_model``."""

    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    head_k: int = 0
    head_v: int = 0
    d_ff: int = 0
    gate_norm: float = 16.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.head_k:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; set head_k")
            object.__setattr__(self, "head_k", self.d_model // self.n_heads)
        if not self.head_v:
            object.__setattr__(self, "head_v", self.head_k)
        if not self.d_ff:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.gate_norm <= 0:
            raise ValueError(f"gate_norm must be positive, got {self.gate_norm}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def param_shapes(cfg: LMConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter, in a fixed order (the order gradients are flattened in)."""
    D, H, K, Vh, F = cfg.d_model, cfg.n_heads, cfg.head_k, cfg.head_v, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab, D)}
    for i in range(cfg.n_layers):
        p = f"layer{i}/"
        shapes.update({
            p + "norm1": (D,), p + "wq": (D, H * K), p + "wk": (D, H * K), p + "wv": (D, H * Vh),
            p + "wg": (D, H * K), p + "bg": (H * K,), p + "wo": (H * Vh, D),
            p + "norm2": (D,), p + "w1": (D, F), p + "w2": (F, D),
        })  # fmt: skip
    shapes["norm_f"] = (D,)
    shapes["head"] = (D, cfg.vocab)
    return shapes


def param_names(cfg: LMConfig) -> list[str]:
    return list(param_shapes(cfg))


def init_params(cfg: LMConfig, seed: int, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Deterministic initialisation from ``seed`` (the same on every rank, whatever the rank count)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    params = {}
    for name, shape in param_shapes(cfg).items():
        leaf = name.rsplit("/", 1)[-1]
        if leaf.startswith("norm"):
            w = np.ones(shape)
        elif leaf == "bg":
            w = np.zeros(shape)
        elif leaf == "embed":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[0])
            if leaf in ("wo", "w2"):
                w *= out_scale
        params[name] = w.astype(dtype)
    return params


# --------------------------------------------------------------------------------------------- mixers


class Mixer(Protocol):
    """One GLA token mixer: ``forward(q, k, v, g) -> o`` on this rank's slice; ``backward(do)`` ->
    ``(dq, dk, dv, dg)`` for the last forward (collective over the mixer's communicator, if any)."""

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray) -> np.ndarray: ...

    def backward(self, do: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...


class ZeCOMixer:
    """``hpczeco.ZeCOGLA`` over ``comm``: each rank holds a contiguous slice of the sequence."""

    def __init__(self, comm, scan: str = "ring", blocks: int | None = None, chunk_size: int = 64):
        from hpczeco.zeco import ZeCOGLA

        self.layer = ZeCOGLA(comm, topology=scan, blocks=blocks, chunk_size=chunk_size)

    def forward(self, q, k, v, g):
        return self.layer.forward(q, k, v, g)

    def backward(self, do):
        dq, dk, dv, dg, _ = self.layer.backward(do)
        return dq, dk, dv, dg


class ChunkMixer:
    """``hpczeco.gla.chunk_gla`` / ``chunk_gla_bwd`` on one process (the whole sequence)."""

    def __init__(self, chunk_size: int = 64):
        self.chunk_size = chunk_size
        self._saved = None

    def forward(self, q, k, v, g):
        from hpczeco.gla import chunk_gla

        self._saved = (q, k, v, g)
        o, _ = chunk_gla(q, k, v, g, chunk_size=self.chunk_size)
        return o

    def backward(self, do):
        from hpczeco.gla import chunk_gla_bwd

        q, k, v, g = self._saved
        dq, dk, dv, dg, _ = chunk_gla_bwd(q, k, v, g, do, chunk_size=self.chunk_size)
        return dq, dk, dv, dg


class RecurrentMixer:
    """Token-by-token GLA with its own reverse-time backward, in float64 (one process; tests)::

        S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,   o_t = scale q_t S_t
        dS_t = scale q_t^T do_t + diag(exp(g_{t+1})) dS_{t+1}
        dq_t = scale do_t S_t^T,  dk_t = dS_t v_t,  dv_t = k_t dS_t,  dg_t = exp(g_t) sum_v S_{t-1} dS_t
    """

    def __init__(self):
        self._saved = None

    def forward(self, q, k, v, g):
        B, T, H, K = q.shape
        V = v.shape[-1]
        s = K**-0.5
        q64, k64, v64, g64 = (np.asarray(x, np.float64) for x in (q, k, v, g))
        S = np.zeros((B, H, K, V))
        states = np.empty((T + 1, B, H, K, V))
        states[0] = S
        o = np.empty((B, T, H, V))
        for t in range(T):
            S = S * np.exp(g64[:, t])[..., None] + k64[:, t, :, :, None] * v64[:, t, :, None, :]
            states[t + 1] = S
            o[:, t] = np.einsum("bhk,bhkv->bhv", s * q64[:, t], S)
        self._saved = (q64, k64, v64, g64, states, q.dtype)
        return o.astype(q.dtype)

    def backward(self, do):
        q, k, v, g, states, dt = self._saved
        B, T, H, K = q.shape
        s = K**-0.5
        do64 = np.asarray(do, np.float64)
        dq, dk, dg = (np.empty_like(q) for _ in range(3))
        dv = np.empty_like(v)
        dS = np.zeros_like(states[0])
        for t in range(T - 1, -1, -1):
            dS = dS + s * q[:, t, :, :, None] * do64[:, t, :, None, :]
            dq[:, t] = s * np.einsum("bhv,bhkv->bhk", do64[:, t], states[t + 1])
            dk[:, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, t])
            dv[:, t] = np.einsum("bhk,bhkv->bhv", k[:, t], dS)
            a = np.exp(g[:, t])
            dg[:, t] = a * np.einsum("bhkv,bhkv->bhk", states[t], dS)
            dS = dS * a[..., None]
        return tuple(x.astype(dt) for x in (dq, dk, dv, dg))


def make_mixers(kind: str, n_layers: int, comm=None, scan: str = "ring", blocks: int | None = None,
                chunk_size: int = 64) -> list[Mixer]:
    """One mixer per layer. ``kind``: "zeco", "chunk", "recurrent" or "auto" (ZeCO when
    ``hpczeco.zeco`` imports, else chunk_gla on one rank). "chunk"/"recurrent" need one rank."""
    size = 1 if comm is None else comm.Get_size()
    if kind == "auto":
        try:
            import hpczeco.zeco  # noqa: F401

            kind = "zeco" if comm is not None else "chunk"
        except ImportError:
            kind = "chunk"
    if kind in ("chunk", "recurrent") and size > 1:
        raise ValueError(f"mixer {kind!r} runs on one process; use mixer 'zeco' on {size} ranks")
    if kind == "zeco":
        if comm is None:
            raise ValueError("mixer 'zeco' needs a communicator")
        return [ZeCOMixer(comm, scan=scan, blocks=blocks, chunk_size=chunk_size) for _ in range(n_layers)]
    if kind == "chunk":
        return [ChunkMixer(chunk_size) for _ in range(n_layers)]
    if kind == "recurrent":
        return [RecurrentMixer() for _ in range(n_layers)]
    raise ValueError(f"mixer must be 'auto', 'zeco', 'chunk' or 'recurrent', got {kind!r}")


# --------------------------------------------------------------------------------------------- layers


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(y, xhat, r)`` with ``r = sqrt(mean(x^2) + eps)``, ``xhat = x / r``, ``y = xhat * w``."""
    r = ((x * x).mean(axis=-1, keepdims=True) + eps) ** 0.5
    xhat = x / r
    return xhat * w, xhat, r


def _rmsnorm_bwd(dy: np.ndarray, xhat: np.ndarray, r: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dx, dw)`` of :func:`_rmsnorm`."""
    dw = (dy * xhat).reshape(-1, dy.shape[-1]).sum(axis=0)
    dxhat = dy * w
    dx = (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)) / r
    return dx, dw


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function (numpy or CuPy)."""
    xp = get_array_module(z)
    return 0.5 * (1 + xp.tanh(0.5 * z))


def _logsigmoid(z: np.ndarray) -> np.ndarray:
    xp = get_array_module(z)
    return xp.minimum(z, 0) - xp.log1p(xp.exp(-xp.abs(z)))


def _mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x [..., a] @ w [a, b]``."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def _wgrad(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """``sum over leading dims of x^T dy`` -> ``[a, b]``."""
    return x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])


class GLALM:
    """The model: ``loss_and_grads(params, tokens, targets, n_total)`` on this rank's slice.

    ``mixers`` holds one :class:`Mixer` per layer; with :class:`ZeCOMixer` every rank of its
    communicator must call ``loss_and_grads`` together (the GLA state crosses rank boundaries; all
    other parts are per token).
    """

    def __init__(self, cfg: LMConfig, mixers: list[Mixer]):
        if len(mixers) != cfg.n_layers:
            raise ValueError(f"need {cfg.n_layers} mixers (one per layer), got {len(mixers)}")
        self.cfg = cfg
        self.mixers = mixers

    def forward(self, params: dict[str, np.ndarray], tokens: np.ndarray) -> tuple[np.ndarray, list]:
        """Logits ``[B, L, vocab]`` for ``tokens [B, L]`` and the cache for :meth:`backward`."""
        cfg = self.cfg
        B, L = tokens.shape
        H, K, Vh, eps = cfg.n_heads, cfg.head_k, cfg.head_v, cfg.norm_eps
        x = params["embed"][tokens]
        caches = []
        for i, mixer in enumerate(self.mixers):
            p = f"layer{i}/"
            h1, xh1, r1 = _rmsnorm(x, params[p + "norm1"], eps)
            q = _mm(h1, params[p + "wq"]).reshape(B, L, H, K)
            k = _mm(h1, params[p + "wk"]).reshape(B, L, H, K)
            v = _mm(h1, params[p + "wv"]).reshape(B, L, H, Vh)
            z = _mm(h1, params[p + "wg"]) + params[p + "bg"]
            g = (_logsigmoid(z) / cfg.gate_norm).reshape(B, L, H, K)
            o = mixer.forward(q, k, v, g).astype(x.dtype, copy=False).reshape(B, L, H * Vh)
            x = x + _mm(o, params[p + "wo"])
            h2, xh2, r2 = _rmsnorm(x, params[p + "norm2"], eps)
            u = _mm(h2, params[p + "w1"])
            s = _sigmoid(u)
            a = u * s
            x = x + _mm(a, params[p + "w2"])
            caches.append((h1, xh1, r1, z, o, h2, xh2, r2, u, s, a))
        hf, xhf, rf = _rmsnorm(x, params["norm_f"], eps)
        logits = _mm(hf, params["head"])
        return logits, [caches, (hf, xhf, rf)]

    def loss_and_grads(
        self, params: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray, n_total: int
    ) -> tuple[float, dict[str, np.ndarray]]:
        """``(loss_part, grads)``: this rank's share ``sum CE(slice) / n_total`` of the mean next-token
        cross entropy and its gradients (sum them over ranks for the full gradient).
        ``tokens, targets: [B, L]`` int ids; ``n_total`` = positions over all ranks (``B * T``)."""
        cfg = self.cfg
        B, L = tokens.shape
        H, K, Vh = cfg.n_heads, cfg.head_k, cfg.head_v
        xp = get_array_module(params["embed"])
        logits, (caches, (hf, xhf, rf)) = self.forward(params, tokens)
        m = logits.max(axis=-1, keepdims=True)
        ex = xp.exp(logits - m)
        se = ex.sum(axis=-1, keepdims=True)
        logp_t = xp.take_along_axis(logits, targets[..., None], axis=-1) - m - xp.log(se)
        loss = -float(logp_t.sum(dtype=xp.float64)) / n_total
        # backward
        grads: dict[str, np.ndarray] = {}
        dlogits = ex / se
        flat = dlogits.reshape(-1, cfg.vocab)
        flat[xp.arange(flat.shape[0]), targets.reshape(-1)] -= 1
        dlogits *= 1.0 / n_total
        grads["head"] = _wgrad(hf, dlogits)
        dhf = _mm(dlogits, params["head"].T)
        dx, grads["norm_f"] = _rmsnorm_bwd(dhf, xhf, rf, params["norm_f"])
        for i in range(cfg.n_layers - 1, -1, -1):
            p = f"layer{i}/"
            h1, xh1, r1, z, o, h2, xh2, r2, u, s, a = caches[i]
            # MLP block
            grads[p + "w2"] = _wgrad(a, dx)
            da = _mm(dx, params[p + "w2"].T)
            du = da * (s * (1 + u * (1 - s)))
            grads[p + "w1"] = _wgrad(h2, du)
            dh2 = _mm(du, params[p + "w1"].T)
            dxn, grads[p + "norm2"] = _rmsnorm_bwd(dh2, xh2, r2, params[p + "norm2"])
            dx = dx + dxn
            # GLA block
            grads[p + "wo"] = _wgrad(o, dx)
            do = _mm(dx, params[p + "wo"].T).reshape(B, L, H, Vh)
            dq, dk, dv, dg = self.mixers[i].backward(do)
            dq = dq.astype(dx.dtype, copy=False).reshape(B, L, H * K)
            dk = dk.astype(dx.dtype, copy=False).reshape(B, L, H * K)
            dv = dv.astype(dx.dtype, copy=False).reshape(B, L, H * Vh)
            dz = dg.astype(dx.dtype, copy=False).reshape(B, L, H * K) * (_sigmoid(-z) / cfg.gate_norm)
            grads[p + "wq"] = _wgrad(h1, dq)
            grads[p + "wk"] = _wgrad(h1, dk)
            grads[p + "wv"] = _wgrad(h1, dv)
            grads[p + "wg"] = _wgrad(h1, dz)
            grads[p + "bg"] = dz.reshape(-1, H * K).sum(axis=0)
            dh1 = (_mm(dq, params[p + "wq"].T) + _mm(dk, params[p + "wk"].T) + _mm(dv, params[p + "wv"].T)
                   + _mm(dz, params[p + "wg"].T))
            dxn, grads[p + "norm1"] = _rmsnorm_bwd(dh1, xh1, r1, params[p + "norm1"])
            dx = dx + dxn
        demb = xp.zeros_like(params["embed"])
        if xp is np:
            np.add.at(demb, tokens.reshape(-1), dx.reshape(-1, cfg.d_model))  # sequential: deterministic
        else:
            import cupyx  # noqa: PLC0415

            cupyx.scatter_add(demb, tokens.reshape(-1), dx.reshape(-1, cfg.d_model))  # atomics: order varies
        grads["embed"] = demb
        return loss, {name: grads[name].astype(params[name].dtype, copy=False) for name in params}
