"""The trained model of ``hpczeco bench daaf-quality``: a small byte-level softmax-attention decoder in PyTorch,
its training data (Python standard-library sources mixed with a synthetic key-value retrieval task) and a
time-boxed training loop.

Model (pre-norm residual; ``x: [B, T, d]``)::

    x = embed[tokens]
    for each layer l:
        h = rmsnorm(x) * g1;  q, k, v = h Wqkv -> [B, T, H, D];  q, k = rope(q), rope(k)
        x = x + attn(l, q, k, v) Wo              (attn: exact causal SDPA, or any [B, T, H, D] kernel)
        h = rmsnorm(x) * g2;  x = x + (silu(h Wg) * (h Wu)) Wd     (SwiGLU)
    logits = rmsnorm(x) * gf  Whead              -> [B, T, 256]   (float32, also under bf16 autocast)

RoPE with base 500000 (long wavelengths: some frequency pairs barely rotate over 32k tokens, so content
matching survives long distances); training runs at ``seq`` tokens and, for the last ``long_frac`` of the run,
at ``long_seq`` tokens, so every length the evaluation uses was seen in training.

Data: the corpus of :mod:`hpczeco.drivers.data` (the standard library's ``*.py`` files in a fixed order,
byte-level), split by file: every ``heldout_every``-th file is held out (evaluation only). With probability
``kv_prob`` a training sequence also holds ``#def KEY=VALUE`` lines (random lowercase keys, random
uppercase/digit values) and later ``#ask KEY=VALUE`` lines for the same keys, at distances well beyond 128
tokens: the value after ``#ask KEY=`` is predictable only by retrieving the definition.
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .data import corpus_id, iter_corpus_files

__all__ = [
    "KV",
    "PRESETS",
    "Corpus",
    "DecoderLM",
    "KVFormat",
    "LMConfig",
    "Preset",
    "RetrievalDoc",
    "TrainConfig",
    "apply_rope",
    "build_model",
    "kv_training_sequence",
    "load_corpus_split",
    "load_weights",
    "lr_at",
    "n_params",
    "retrieval_doc",
    "save_weights",
    "sdpa_causal",
    "train",
    "training_batch",
    "with_overrides",
]

VOCAB = 256


# --------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class LMConfig:
    """Model shape: ``d_model = n_heads * head_dim``; ``ffn`` the SwiGLU hidden width."""

    vocab: int = VOCAB
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    ffn: int = 1408
    rope_base: float = 500000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    """Training recipe. Progress ``p`` in [0, 1] is ``step / steps`` when ``steps`` is set, else
    ``elapsed / seconds``; with both, the larger. The learning rate warms up linearly over the first
    ``warmup`` of progress, then decays by a cosine to ``min_lr_frac * lr``; sequences are ``seq`` tokens
    long until ``p >= 1 - long_frac``, then ``long_seq``; every step holds ``batch_tokens`` tokens."""

    seq: int = 8192
    long_seq: int = 32768
    long_frac: float = 0.25
    batch_tokens: int = 65536
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup: float = 0.03
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seconds: float | None = 285.0
    steps: int | None = None
    seed: int = 0
    kv_prob: float = 0.5
    log_every_s: float = 15.0


@dataclass(frozen=True)
class Preset:
    model: LMConfig
    train: TrainConfig
    max_bytes: int | None = None  # corpus bytes read (None: all)
    heldout_every: int = 20


PRESETS: dict[str, Preset] = {
    # one H200: 8 layers, d 512, 8 heads of 64; 8k then 32k tokens; trained by the clock
    "gpu": Preset(LMConfig(), TrainConfig()),
    # the CPU tests: seconds
    "tiny": Preset(LMConfig(d_model=64, n_layers=2, n_heads=2, ffn=128, rope_base=10000.0),
                   TrainConfig(seq=256, long_seq=512, long_frac=0.25, batch_tokens=1024, lr=3e-3, warmup=0.1,
                               seconds=None, steps=4, log_every_s=1e9),
                   max_bytes=1_200_000, heldout_every=10),
}


# --------------------------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """The byte corpus split by file: ``train`` and ``heldout`` uint8 ``[n]``, and where they came from."""

    train: np.ndarray
    heldout: np.ndarray
    info: dict = field(default_factory=dict)


def load_corpus_split(max_bytes: int | None = None, heldout_every: int = 20, min_bytes: int = 4 << 20) -> Corpus:
    """The standard-library corpus of :func:`hpczeco.drivers.data.iter_corpus_files` (its fixed file order),
    read until ``max_bytes`` (None: all), every ``heldout_every``-th file (index ``i % heldout_every ==
    heldout_every // 2``) held out. When the stdlib sources hold fewer than ``min_bytes`` (an image that strips
    them), the ``*.py`` files of ``site-packages`` follow. ``ValueError`` if either part is empty."""
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2, got {heldout_every}")
    train, held, total, n_files, roots = [], [], 0, 0, ["stdlib"]
    stdlib = iter_corpus_files()
    extra = None
    i = 0
    while True:
        path = next(stdlib, None)
        if path is None:
            if extra is None and total < min_bytes:
                purelib = sysconfig.get_paths().get("purelib")
                extra = iter_corpus_files(purelib) if purelib and Path(purelib).is_dir() else iter(())
                roots.append(str(purelib))
                stdlib = extra
                continue
            break
        try:
            b = path.read_bytes()
        except OSError:
            continue
        (held if i % heldout_every == heldout_every // 2 else train).append(b)
        i += 1
        total += len(b)
        n_files += 1
        if max_bytes is not None and total >= max_bytes:
            break
    if not train or not held:
        raise ValueError("no *.py sources found here (standard library, site-packages): no corpus")
    tr = np.frombuffer(b"".join(train), dtype=np.uint8).copy()
    he = np.frombuffer(b"".join(held), dtype=np.uint8).copy()
    info = {"files": n_files, "roots": roots, "train_bytes": int(tr.size), "heldout_bytes": int(he.size),
            "train_sha": corpus_id(tr), "heldout_sha": corpus_id(he), "heldout_every": heldout_every}
    return Corpus(tr, he, info)


# --------------------------------------------------------------------------------------------- retrieval task


@dataclass(frozen=True)
class KVFormat:
    """``#def KEY=VALUE\\n`` and ``#ask KEY=VALUE\\n`` lines; keys lowercase, values uppercase or digits."""

    key_len: int = 6
    val_len: int = 6

    @property
    def line_len(self) -> int:
        return 5 + self.key_len + 1 + self.val_len + 1

    @property
    def value_offset(self) -> int:
        """Offset of the value inside either line."""
        return 5 + self.key_len + 1

    def define(self, key: bytes, val: bytes) -> bytes:
        return b"#def " + key + b"=" + val + b"\n"

    def ask(self, key: bytes, val: bytes) -> bytes:
        return b"#ask " + key + b"=" + val + b"\n"

    def pairs(self, n: int, rng: np.random.Generator) -> list[tuple[bytes, bytes]]:
        """``n`` (key, value) pairs with distinct keys."""
        keys: dict[bytes, bytes] = {}
        while len(keys) < n:
            k = _KEY_CHARS[rng.integers(0, len(_KEY_CHARS), self.key_len)].tobytes()
            if k not in keys:
                keys[k] = _VAL_CHARS[rng.integers(0, len(_VAL_CHARS), self.val_len)].tobytes()
        return list(keys.items())


KV = KVFormat()
_KEY_CHARS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
_VAL_CHARS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)


def _line_starts(text: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Positions in ``[lo, hi)`` where a line starts (after a newline); every position when there is none."""
    lo, hi = max(0, int(lo)), max(int(lo) + 1, int(hi))
    nl = np.flatnonzero(text[max(0, lo - 1) : hi - 1] == 10) + max(0, lo - 1) + 1
    nl = nl[(nl >= lo) & (nl < hi)]
    return nl if nl.size else np.arange(lo, min(hi, max(lo + 1, text.size)))


def _splice(text: np.ndarray, inserts: list[tuple[int, int, bytes]]) -> tuple[np.ndarray, list[int]]:
    """``text`` with ``inserts`` = ``[(position, order, bytes)]`` put in before ``text[position]`` (sorted by
    position, then order). Returns the new array and, per insert (in the given list's order), its start."""
    order = sorted(range(len(inserts)), key=lambda i: (inserts[i][0], inserts[i][1]))
    parts, starts, cur, shift = [], [0] * len(inserts), 0, 0
    for i in order:
        pos, _, b = inserts[i]
        parts.append(text[cur:pos].tobytes())
        shift += pos - cur
        starts[i] = shift
        parts.append(b)
        shift += len(b)
        cur = pos
    parts.append(text[cur:].tobytes())
    return np.frombuffer(b"".join(parts), dtype=np.uint8).copy(), starts


def kv_training_sequence(src: np.ndarray, n_tokens: int, rng: np.random.Generator, fmt: KVFormat = KV,
                         min_gap: int = 256) -> np.ndarray:
    """``n_tokens`` bytes (uint8) of ``src`` at a random offset with 4..24 key-value definitions (one block, or
    scattered over the first 70 %) and their questions later: all together near the end, or each at a random
    line start at least ``min_gap`` bytes after its definition."""
    if n_tokens < 4 * fmt.line_len:  # too short for a definition and its question: plain text
        off = int(rng.integers(0, src.size - n_tokens + 1))
        return src[off : off + n_tokens].copy()
    n = int(rng.integers(4, 25))
    n = max(1, min(n, n_tokens // (4 * fmt.line_len)))
    body = n_tokens - 2 * n * fmt.line_len
    off = int(rng.integers(0, src.size - body + 1))
    text = src[off : off + body]
    pairs = fmt.pairs(n, rng)
    if rng.random() < 0.5:  # one block of definitions
        p0 = int(rng.choice(_line_starts(text, 0, int(0.6 * body))))
        dpos = [p0] * n
    else:
        dpos = sorted(int(p) for p in rng.choice(_line_starts(text, 0, int(0.7 * body)), n))
    ins = [(p, i, fmt.define(k, v)) for i, (p, (k, v)) in enumerate(zip(dpos, pairs))]
    if rng.random() < 0.5:  # all questions together, near the end
        qpos = int(rng.choice(_line_starts(text, int(0.85 * body), body)))
        for j, i in enumerate(rng.permutation(n)):
            ins.append((qpos, n + j, fmt.ask(*pairs[i])))
    else:
        for i, (k, v) in enumerate(pairs):
            cand = _line_starts(text, dpos[i] + min_gap, body)
            cand = cand[cand >= dpos[i] + min_gap]
            p = int(rng.choice(cand)) if cand.size else body
            ins.append((p, n + i, fmt.ask(k, v)))
    out, _ = _splice(text, ins)
    return out[:n_tokens]


def training_batch(corpus: np.ndarray, seq: int, batch: int, rng: np.random.Generator, kv_prob: float,
                   fmt: KVFormat = KV) -> np.ndarray:
    """``[batch, seq + 1]`` int64 token windows (inputs and next-token targets)."""
    out = np.empty((batch, seq + 1), dtype=np.int64)
    for b in range(batch):
        if rng.random() < kv_prob:
            out[b] = kv_training_sequence(corpus, seq + 1, rng, fmt)
        else:
            off = int(rng.integers(0, corpus.size - seq))
            out[b] = corpus[off : off + seq + 1]
    return out


@dataclass
class RetrievalDoc:
    """An evaluation text with key-value definitions in its context and the questions after it.

    ``tokens`` int64 ``[T]``; the context is ``tokens[:context]``, the questions fill ``tokens[context:]``.
    ``queries``: per question ``key``, ``value``, ``kind`` ("block" or "scatter"), ``def_value`` (position of
    the value's first byte in the definition) and ``ask_value`` (in the question)."""

    tokens: np.ndarray
    context: int
    queries: list[dict]


def retrieval_doc(src: np.ndarray, offset: int, T: int, rng: np.random.Generator, n_block: int, n_scatter: int,
                  fmt: KVFormat = KV) -> RetrievalDoc:
    """``T`` tokens: held-out text from ``src[offset:]`` with ``n_block`` definitions in one block (a line start
    in the first 60 % of the context) and ``n_scatter`` single definitions at random line starts of the first
    90 %, then every question (shuffled). The questions take ``(n_block + n_scatter) * line_len`` tokens."""
    n = n_block + n_scatter
    C = T - n * fmt.line_len
    body = C - n * fmt.line_len
    if body < 4 * fmt.line_len:
        raise ValueError(f"T={T} is too short for {n} key-value pairs")
    if offset + body > src.size:
        raise ValueError(f"the held-out text ({src.size} bytes) is too short for a document of {T} tokens")
    text = src[offset : offset + body].copy()
    text[-1] = 10  # the questions start on a line of their own
    pairs = fmt.pairs(n, rng)
    p0 = int(rng.choice(_line_starts(text, int(0.05 * body), int(0.6 * body))))
    pos = [p0] * n_block + [int(p) for p in rng.choice(_line_starts(text, 0, int(0.9 * body)), n_scatter)]
    ins = [(p, i, fmt.define(k, v)) for i, (p, (k, v)) in enumerate(zip(pos, pairs))]
    ctx, starts = _splice(text, ins)
    order = rng.permutation(n)
    asks = b"".join(fmt.ask(*pairs[i]) for i in order)
    tokens = np.concatenate([ctx, np.frombuffer(asks, dtype=np.uint8)]).astype(np.int64)
    queries = []
    for j, i in enumerate(order):
        k, v = pairs[i]
        queries.append({"key": k.decode(), "value": v.decode(), "kind": "block" if i < n_block else "scatter",
                        "def_value": starts[i] + fmt.value_offset,
                        "ask_value": C + j * fmt.line_len + fmt.value_offset})
    assert tokens.size == T
    return RetrievalDoc(tokens, C, queries)


# --------------------------------------------------------------------------------------------- model


def sdpa_causal(q, k, v):
    """Exact causal attention (torch SDPA; flash for 16-bit CUDA inputs): ``[B, T, H, D]`` in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on ``x [B, T, H, D]`` with ``cos, sin [1, T, 1, D/2]`` (float32 maths, x's dtype out)."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class DecoderLM(nn.Module):
    """The decoder of the module docstring; weights drawn from ``gen`` (a CPU ``torch.Generator``), float32.

    ``forward(tokens [B, T], attn=None, last_only=False, keep_from=0) -> logits [B, T - keep_from, vocab]``
    (``[B, vocab]`` with ``last_only``); ``attn(layer, q, k, v) -> o`` on ``[B, T, H, D]`` (q, k after RoPE),
    None: exact SDPA."""

    def __init__(self, cfg: LMConfig, gen: torch.Generator):
        super().__init__()
        self.cfg = cfg
        d, H, L = cfg.d_model, cfg.n_heads, cfg.n_layers
        if d % H or (d // H) % 2:
            raise ValueError(f"d_model {d} must split into {H} heads of an even size")

        def lin(i: int, o: int, std: float) -> nn.Linear:
            m = nn.Linear(i, o, bias=False)
            with torch.no_grad():
                m.weight.copy_(torch.randn(o, i, generator=gen) * std)
            return m

        self.embed = nn.Embedding(cfg.vocab, d)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(cfg.vocab, d, generator=gen) * 0.02)
        out_std = 0.02 / math.sqrt(2 * L)
        self.layers = nn.ModuleList()
        for _ in range(L):
            blk = nn.Module()
            blk.norm1 = nn.Parameter(torch.ones(d))
            blk.wqkv = lin(d, 3 * d, 0.02)
            blk.wo = lin(d, d, out_std)
            blk.norm2 = nn.Parameter(torch.ones(d))
            blk.wgu = lin(d, 2 * cfg.ffn, 0.02)
            blk.wd = lin(cfg.ffn, d, out_std)
            self.layers.append(blk)
        self.norm_f = nn.Parameter(torch.ones(d))
        self.head = lin(d, cfg.vocab, 0.02)
        half = cfg.head_dim // 2
        inv = 1.0 / (cfg.rope_base ** (torch.arange(half, dtype=torch.float64) / half))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self._rope: tuple = ()

    def rope(self, T: int, device) -> tuple:
        """``(cos, sin)`` ``[1, T, 1, D/2]`` float32 of positions ``0..T-1`` (the last length cached)."""
        if not self._rope or self._rope[0] != (T, str(device)):
            t = torch.arange(T, device=device, dtype=torch.float32)
            ang = torch.outer(t, self.inv_freq.to(device))
            self._rope = ((T, str(device)), ang.cos()[None, :, None, :], ang.sin()[None, :, None, :])
        return self._rope[1], self._rope[2]

    def norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), self.cfg.norm_eps)

    def forward(self, tokens, attn: Callable | None = None, last_only: bool = False, keep_from: int = 0):
        B, T = tokens.shape
        H, D = self.cfg.n_heads, self.cfg.head_dim
        x = self.embed(tokens)
        cos, sin = self.rope(T, tokens.device)
        for i, blk in enumerate(self.layers):
            h = self.norm(x, blk.norm1)
            q, k, v = blk.wqkv(h).view(B, T, 3, H, D).unbind(2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = sdpa_causal(q, k, v) if attn is None else attn(i, q, k, v)
            x = x + blk.wo(o.reshape(B, T, H * D))
            h = self.norm(x, blk.norm2)
            g, u = blk.wgu(h).chunk(2, dim=-1)
            x = x + blk.wd(F.silu(g) * u)
        if last_only:
            x = x[:, -1]
        elif keep_from:
            x = x[:, keep_from:]
        with torch.autocast(x.device.type, enabled=False):  # the head in float32, also under autocast
            return self.head(self.norm(x.float(), self.norm_f))


def build_model(cfg: LMConfig, seed: int, device: str = "cpu") -> DecoderLM:
    """A :class:`DecoderLM` with weights drawn from ``seed`` (float32) on ``device``."""
    return DecoderLM(cfg, torch.Generator().manual_seed(int(seed))).to(device)


def n_params(model) -> int:
    return int(sum(p.numel() for p in model.parameters()))


# --------------------------------------------------------------------------------------------- training


def lr_at(p: float, cfg: TrainConfig) -> float:
    """Learning rate at progress ``p`` in [0, 1]: linear warm-up over ``warmup``, cosine to ``min_lr_frac``."""
    p = min(max(p, 0.0), 1.0)
    if cfg.warmup > 0 and p < cfg.warmup:
        return cfg.lr * (p + 1e-3) / cfg.warmup
    c = (p - cfg.warmup) / max(1e-9, 1.0 - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * c)))


def train(model, corpus: np.ndarray, cfg: TrainConfig, device: str = "cpu",
          log: Callable[[str], Any] = print) -> dict:
    """Train ``model`` in place on ``corpus`` (uint8 ``[n]``) by ``cfg``; returns the recipe, the loss curve
    (one entry per log line) and the throughput. On CUDA: bf16 autocast, fused AdamW, TF32 matmuls. The data
    order and the initial weights depend only on the seeds; with ``steps`` (and no ``seconds``) the run is
    deterministic on the CPU."""
    if cfg.steps is None and cfg.seconds is None:
        raise ValueError("set TrainConfig.steps or .seconds")
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    kw = {"fused": True} if cuda else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, **kw)
    rng = np.random.default_rng(cfg.seed + 1)
    model.train()
    t0 = time.perf_counter()
    step, tokens, last_log = 0, 0, t0
    curve, phase_tokens = [], {"short": 0, "long": 0}
    switch: tuple[float, int] | None = None  # (seconds, tokens) when the long phase began
    loss_v = float("nan")

    def progress() -> float:
        p = 0.0
        if cfg.steps is not None:
            p = step / cfg.steps
        if cfg.seconds is not None:
            p = max(p, (time.perf_counter() - t0) / cfg.seconds)
        return p

    long_ok = True
    while (p := progress()) < 1.0:
        long = long_ok and p >= 1.0 - cfg.long_frac and cfg.long_seq > cfg.seq
        seq = cfg.long_seq if long else cfg.seq
        seq = min(seq, corpus.size - 2)
        batch = max(1, cfg.batch_tokens // seq)
        if long and switch is None:
            if cuda:
                torch.cuda.synchronize()
            switch = (time.perf_counter() - t0, tokens)
        arr = torch.from_numpy(training_batch(corpus, seq, batch, rng, cfg.kv_prob))
        arr = arr.pin_memory().to(device, non_blocking=True) if cuda else arr
        lr = lr_at(p, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                logits = model(arr[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), arr[:, 1:].reshape(-1))
            loss.backward()
        except torch.cuda.OutOfMemoryError:
            if not long:
                raise
            logits = loss = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            long_ok = False
            log(f"out of memory at seq {seq}: the rest of the run stays at seq {cfg.seq}")
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += batch * seq
        name = "long" if long else "short"
        phase_tokens[name] += batch * seq
        now = time.perf_counter()
        if now - last_log >= cfg.log_every_s or progress() >= 1.0 or step == 1:
            loss_v = float(loss.item())  # one host read per log line
            now = time.perf_counter()
            curve.append({"step": step, "seconds": round(now - t0, 2), "seq": seq, "loss": loss_v, "lr": lr,
                          "tokens": tokens})
            log(f"train step {step:5d}  seq {seq:6d}  loss {loss_v:.4f} ({loss_v / math.log(2):.3f} bits/byte)  "
                f"lr {lr:.2e}  {tokens / (now - t0):,.0f} tokens/s")
            last_log = now
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    model.eval()
    rates = {"short": tokens / max(wall, 1e-9)} if switch is None else {
        "short": switch[1] / max(switch[0], 1e-9), "long": (tokens - switch[1]) / max(wall - switch[0], 1e-9)}
    return {"steps": step, "tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": tokens / max(wall, 1e-9),
            "final_loss": loss_v, "curve": curve,
            "tokens_per_s_by_phase": rates,
            "tokens_by_phase": phase_tokens, "config": asdict(cfg), "long_phase_oom": not long_ok,
            "bound_by": "steps" if cfg.steps is not None and step >= cfg.steps else "seconds"}


# --------------------------------------------------------------------------------------------- weights


def save_weights(model, path: str | Path, extra: dict | None = None) -> Path:
    """The weights as float32 arrays in ``path`` (``.npz``, no pickle) and the config beside it (``.json``)."""
    path = Path(path).with_suffix(".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k.replace(".", "/"): v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    np.savez(path, **arrays)
    meta = {"config": asdict(model.cfg), **(extra or {})}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1, default=str))
    return path


def load_weights(path: str | Path, device: str = "cpu"):
    """The model saved by :func:`save_weights` (``ValueError`` when the files are missing or do not fit)."""
    path = Path(path).with_suffix(".npz")
    if not path.is_file() or not path.with_suffix(".json").is_file():
        raise ValueError(f"no saved model at {path} (and {path.with_suffix('.json').name})")
    from .files import read_bounded  # noqa: PLC0415

    meta = json.loads(read_bounded(str(path.with_suffix(".json")), 16 << 20, "--load"))  # a regular file, bounded
    cfg = LMConfig(**meta["config"])
    model = build_model(cfg, 0)
    with np.load(path, allow_pickle=False) as z:
        state = {k.replace("/", "."): torch.from_numpy(z[k]) for k in z.files}
    model.load_state_dict(state, strict=True)
    return model.to(device), meta


def with_overrides(preset: Preset, **train_overrides: Any) -> TrainConfig:
    """The preset's training recipe with the given fields replaced (None values ignored)."""
    return replace(preset.train, **{k: v for k, v in train_overrides.items() if v is not None})
