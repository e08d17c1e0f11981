"""The workloads of the DAAF GPU benchmark and its GPU tests: key-region plans, synthetic token streams,
a small random-weight decoder, planted needles, and the PyTorch attentions DAAF is compared with.

Used by :mod:`hpczeco.drivers.bench_gpu_daaf` (which times them) and ``tests/test_gpu_daaf_checks.py``
(which checks them), and by the Hopper kernels' checks (:mod:`hpczeco.drivers.gpu_daaf_checks`,
``tests/test_daaf_hopper_emu.py``: :func:`key_regions`). Everything here needs PyTorch with CUDA except
:func:`bench_plans`, :func:`key_regions` and :func:`synthetic_tokens` (numpy). The pair count of a plan (its
useful TFLOP/s) is the planner's :func:`hpczeco.daaf.attention_pairs`.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "TinyModel",
    "allowed_mask_torch",
    "bench_plans",
    "flash_backend",
    "key_regions",
    "make_flex",
    "needle_rates",
    "sdpa_causal",
    "synthetic_tokens",
]


def bench_plans(T: int) -> dict[str, np.ndarray]:
    """The timed key-region masks (bool ``[T]``): window only; the first 4096 tokens global; 8 regions of
    512 spread evenly (the last two only for T > 4096)."""
    plans = {"w128": np.zeros(T, dtype=bool)}
    if T > 4096:
        g = np.zeros(T, dtype=bool)
        g[:4096] = True
        plans["w128+first4096"] = g
        g = np.zeros(T, dtype=bool)
        for i in range(8):
            s = int((i + 0.5) * T / 8) // 512 * 512
            g[s : s + 512] = True
        plans["w128+8x512"] = g
    return plans


def key_regions(T: int, plan: str, rng: np.random.Generator) -> np.ndarray:
    """A key-region mask (bool ``[T]``) of the kernel checks: ``"none"``; ``"first"`` (the first 30 %);
    ``"scattered"`` (~10 % of the tokens at random); ``"all"``; ``"regions"`` (two spans crossing tile edges:
    query tiles that mix key-region queries with ordinary rows)."""
    g = np.zeros(T, dtype=bool)
    if plan == "first":
        g[: max(1, (3 * T) // 10)] = True
    elif plan == "scattered":
        g[rng.random(T) < 0.1] = True
    elif plan == "all":
        g[:] = True
    elif plan == "regions":
        g[T // 5 : T // 5 + max(1, T // 6)] = True
        g[(2 * T) // 3 : (2 * T) // 3 + max(1, T // 12)] = True
    elif plan != "none":
        raise ValueError(f"unknown key-region plan {plan!r}")
    return g


def synthetic_tokens(T: int, rng: np.random.Generator, window: int = 512, vocab: int = 32768,
                     depths=(0.1, 0.3, 0.5, 0.7, 0.9)) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Low-entropy background (16 ids) with one high-entropy window-aligned region of ``window`` tokens at
    each depth: ``(tokens int64 [T], [(start, end), ...])``."""
    tok = rng.integers(0, 16, T)
    regions: list[tuple[int, int]] = []
    for d in depths:
        s = int(d * T) // window * window
        if s + window <= T and (not regions or s >= regions[-1][1]):
            tok[s : s + window] = rng.integers(16, vocab, window)
            regions.append((s, s + window))
    return tok.astype(np.int64), regions


def flash_backend():
    """A context that restricts SDPA to its flash backend (a null context where torch cannot say so)."""
    import contextlib  # noqa: PLC0415

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    except Exception:  # noqa: BLE001 - older torch
        return contextlib.nullcontext()


def sdpa_causal(q, k, v):
    """Exact causal attention, torch ``[B, T, H, D]`` in and out (flash backend where it applies)."""
    import torch  # noqa: PLC0415

    F = torch.nn.functional
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


def allowed_mask_torch(g, W: int):
    """``[T, T]`` bool torch tensor of the DAAF rule on ``g``'s device (as ``hpczeco.daaf.allowed_mask``)."""
    import torch  # noqa: PLC0415

    t = torch.arange(g.shape[0], device=g.device)
    return (t[None, :] <= t[:, None]) & ((t[:, None] - t[None, :] <= W) | g[:, None] | g[None, :])


def make_flex(T: int, W: int = 128):
    """``(compiled flex_attention, block_mask(g) -> BlockMask)`` for sequence length ``T`` and the DAAF rule
    with window ``W`` (``g``: numpy bool ``[T]``, copied into the mask's buffer)."""
    import torch  # noqa: PLC0415
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415

    gbuf = torch.zeros(T, dtype=torch.bool, device="cuda")

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx <= W) | gbuf[kv_idx] | gbuf[q_idx])

    flex = torch.compile(flex_attention, dynamic=False)

    def block_mask(g_np: np.ndarray):
        gbuf.copy_(torch.from_numpy(g_np).cuda())
        try:
            return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device="cuda", _compile=True)
        except TypeError:
            return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device="cuda")

    return flex, block_mask


class TinyModel:
    """Random-weight decoder: embedding, L x [RMSNorm, Q/K/V projections, attention, out projection, RMSNorm,
    MLP], tied head; bf16 weights on ``device``.

    ``mlp``: ``"gelu"`` (``W2 gelu(W1 x)``, width ``ffn`` or ``mlp_ratio * d``) or ``"swiglu"`` (Llama's
    ``W2 (silu(Wg x) * (Wu x))``). Q, K and V come from three projections so that each is a contiguous
    ``[1, T, H, D]`` tensor (no copy before a kernel that needs contiguous inputs).
    """

    def __init__(self, layers: int, H: int, D: int, mlp_ratio: float, vocab: int, seed: int, *, mlp: str = "gelu",
                 ffn: int | None = None, device: str = "cuda"):
        import torch  # noqa: PLC0415

        if mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {mlp!r}")
        d = H * D
        f = int(ffn) if ffn is not None else int(mlp_ratio * d)
        gen = torch.Generator(device=device).manual_seed(seed)

        def w(*shape, std):
            return (torch.randn(*shape, device=device, generator=gen) * std).to(torch.bfloat16)

        self.H, self.D, self.d, self.ffn, self.mlp, self.vocab = H, D, d, f, mlp, vocab
        self.emb = w(vocab, d, std=1.0)
        self.layers = []
        for _ in range(layers):
            lw = dict(wq=w(d, d, std=d**-0.5), wk=w(d, d, std=d**-0.5), wv=w(d, d, std=d**-0.5),
                      wo=w(d, d, std=d**-0.5), w1=w(d, f, std=d**-0.5), w2=w(f, d, std=f**-0.5))
            if mlp == "swiglu":
                lw["wg"] = w(d, f, std=d**-0.5)
            self.layers.append(lw)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def param_bytes(self) -> int:
        """Bytes of the weights (bf16)."""
        return 2 * (self.emb.numel() + sum(t.numel() for lw in self.layers for t in lw.values()))

    @staticmethod
    def activation_bytes(T: int, d: int, ffn: int) -> int:
        """A bound on the bytes one prefill of ``T`` tokens holds at once (bf16 activations, fp32 norms)."""
        return 2 * T * (10 * d + 3 * ffn) + 8 * T * d

    @staticmethod
    def _norm(x):
        import torch  # noqa: PLC0415

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def prefill(self, tokens, attn):
        """tokens ``[T]`` (int64 on the model's device), ``attn(q, k, v) -> o`` on ``[1, T, H, D]`` -> (last
        hidden states ``[T, d]``, last-token logits ``[vocab]``)."""
        import torch  # noqa: PLC0415

        F = torch.nn.functional
        T = tokens.shape[0]
        x = self.emb[tokens]  # [T, d]
        for lw in self.layers:
            h = self._norm(x)
            q, k, v = ((h @ lw[n]).view(1, T, self.H, self.D) for n in ("wq", "wk", "wv"))
            x = x + attn(q, k, v).reshape(T, self.d) @ lw["wo"]
            h = self._norm(x)
            if self.mlp == "swiglu":
                x = x + (F.silu(h @ lw["wg"]) * (h @ lw["w1"])) @ lw["w2"]
            else:
                x = x + F.gelu(h @ lw["w1"]) @ lw["w2"]
        h = self._norm(x)
        return h, h[-1] @ self.emb.T


def needle_rates(T: int, regions: list[tuple[int, int]], impl: str, H: int, D: int, W: int = 128) -> dict:
    """Plant one key/value per key region (and two control needles in the background, outside the
    key regions and the window); the query at the end of the text whose direction matches a needle
    should return that needle's value. Returns the % of (needle, head) pairs whose DAAF / exact output
    points at the value (cosine > 0.9), for the key-region and the background needles."""
    import torch  # noqa: PLC0415
    from hpczeco.gpu import daaf as gd  # noqa: PLC0415

    scale = D**-0.5
    g = np.zeros(T, dtype=bool)
    for a, b in regions:
        g[a:b] = True
    bg = np.flatnonzero(~g[: T - 4 * W - 16])
    ctrl = [int(bg[int(f * (len(bg) - 1))]) for f in (0.2, 0.6)] if len(bg) else []
    pos = [a + 100 for a, _ in regions] + ctrl
    qpos = [T - 1 - i for i in range(len(pos))]
    q, k, v = (torch.randn(1, T, H, D, device="cuda") for _ in range(3))
    alpha = math.sqrt(16.0 / scale)  # needle score scale * q . k = 16
    vals = []
    for p, qp in zip(pos, qpos):
        u = torch.nn.functional.normalize(torch.randn(H, D, device="cuda"), dim=-1)
        k[0, p] = alpha * u
        q[0, qp] = alpha * u
        val = 3.0 * torch.randn(H, D, device="cuda")
        v[0, p] = val
        vals.append(val)
    q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    od = gd.attention_torch(q, k, v, np.flatnonzero(g).astype(np.int32), W, None, torch.from_numpy(g).cuda(),
                            impl=impl)
    oe = sdpa_causal(q, k, v)

    def hit(o, i):  # per head: the output points at the needle's value
        c = torch.nn.functional.cosine_similarity(o[0, qpos[i]].float(), vals[i].float(), dim=-1)
        return (c > 0.9).float().mean().item()

    nk = len(regions)
    rate = lambda o, idx: 100 * float(np.mean([hit(o, i) for i in idx])) if len(idx) else float("nan")
    return {"needle_daaf_key_pct": rate(od, range(nk)), "needle_exact_key_pct": rate(oe, range(nk)),
            "needle_daaf_background_pct": rate(od, range(nk, len(pos))),
            "needle_exact_background_pct": rate(oe, range(nk, len(pos))), "needle_positions": pos}
