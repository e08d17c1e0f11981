"""A small gated-linear-attention (GLA) language model in PyTorch, trained on one long sequence split over MPI ranks.

Copy this file to start your own (the full training job -- fla's GLA architecture, SP x DP, bf16 autocast,
HDF5 checkpoints, data -- is ``hpczeco train``). Every rank holds the same model (same seed) and a contiguous slice of
one token sequence; each GLA layer runs :class:`hpczeco.torch.ZeCOGLAttention` over ``MPI.COMM_WORLD``
(the All-Scan passes each layer's state from slice to slice, the backward runs the reverse scan), and the
parameter gradients are all-reduced over the same communicator before ``torch.optim.AdamW`` steps. The
loss on P ranks is the loss of the whole sequence on one rank (``--compare-single`` shows it)::

    mpiexec -n 4 python examples/gla_lm.py --steps 10 --compare-single          # CPU, float64
    mpiexec -n 2 python examples/gla_lm.py --device cuda --dtype float32        # one GPU per rank
    mpiexec -n 2 python examples/gla_lm.py --dtype bfloat16                     # bf16 weights

Model: token embedding, ``--layers`` blocks of ``x + GLA(LayerNorm(x))`` and ``x + MLP(LayerNorm(x))``, a
final LayerNorm and a linear head; GLA: q, k, v and gate projections (``g = logsigmoid(W_g x) / 16``), heads
``[1, L, H, K]``, output projection. Data: a sequence sampled from a random first-order Markov chain (so the
loss has something to learn), identical on every rank.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hpczeco.torch import ZeCOGLAttention, chunk_gla


@dataclass
class Config:
    vocab: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 2
    head_k: int = 16
    head_v: int = 16
    mlp_mult: int = 4
    gate_norm: float = 16.0


class LocalGLA(nn.Module):
    """GLA of a whole sequence on this process (:func:`hpczeco.torch.chunk_gla`): ``(q, k, v, g) -> o``."""

    def forward(self, q, k, v, g):
        return chunk_gla(q, k, v, g)[0]


class SequenceParallelGLA(nn.Module):
    """GLA of this rank's slice of a sequence split over ``comm`` (ZeCO): ``(q, k, v, g) -> o``."""

    def __init__(self, comm, topology: str = "ring"):
        super().__init__()
        self.attn = ZeCOGLAttention(comm, topology=topology)

    def forward(self, q, k, v, g):
        return self.attn(q, k, v, g)[0]


class GLALayer(nn.Module):
    """``x [B, L, D] -> [B, L, D]``: projections to ``q, k, g [B, L, H, K]``, ``v [B, L, H, V]``, the attention
    module ``attention(q, k, v, g) -> o [B, L, H, V]``, and the output projection."""

    def __init__(self, cfg: Config, attention: nn.Module):
        super().__init__()
        self.cfg = cfg
        hk, hv = cfg.heads * cfg.head_k, cfg.heads * cfg.head_v
        self.wq = nn.Linear(cfg.d_model, hk, bias=False)
        self.wk = nn.Linear(cfg.d_model, hk, bias=False)
        self.wv = nn.Linear(cfg.d_model, hv, bias=False)
        self.wg = nn.Linear(cfg.d_model, hk, bias=True)
        self.wo = nn.Linear(hv, cfg.d_model, bias=False)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        H, K, V = self.cfg.heads, self.cfg.head_k, self.cfg.head_v
        q = self.wq(x).view(B, L, H, K)
        k = self.wk(x).view(B, L, H, K)
        v = self.wv(x).view(B, L, H, V)
        g = F.logsigmoid(self.wg(x)).view(B, L, H, K) / self.cfg.gate_norm  # log forget gate, < 0
        return self.wo(self.attention(q, k, v, g).reshape(B, L, H * V))


class Block(nn.Module):
    def __init__(self, cfg: Config, attention: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.gla = GLALayer(cfg, attention)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_mult * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_mult * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.gla(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GLALM(nn.Module):
    """``tokens [B, L] -> logits [B, L, vocab]``; ``make_attention()`` builds each layer's attention module."""

    def __init__(self, cfg: Config, make_attention: Callable[[], nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, make_attention()) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def markov_tokens(n: int, vocab: int, seed: int) -> np.ndarray:
    """``n`` tokens of a random first-order Markov chain (sparse-ish transitions), the same for a given seed."""
    rng = np.random.default_rng(seed)
    cum = np.cumsum(rng.dirichlet(np.full(vocab, 0.1), size=vocab), axis=1)
    u = rng.random(n)
    out = np.empty(n, dtype=np.int64)
    out[0] = rng.integers(vocab)
    for t in range(1, n):
        out[t] = min(int(np.searchsorted(cum[out[t - 1]], u[t])), vocab - 1)
    return out


def allreduce_grads(params: list[nn.Parameter], comm) -> None:
    """Sum the gradients over ``comm`` in one ``Allreduce`` (staged through a host buffer, so any MPI will do).
    Half-precision gradients are summed in float32 (numpy, hence MPI's buffer, has no bfloat16)."""
    from mpi4py import MPI

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    dtype = grads[0].dtype
    host = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    flat = torch.cat([x.reshape(-1) for x in grads]).detach().to("cpu", host).contiguous()
    comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
    off = 0
    for p, x in zip(params, grads):
        n = x.numel()
        p.grad = flat[off : off + n].view_as(x).to(x.device, x.dtype)
        off += n


def train(comm, tokens: np.ndarray, cfg: Config, steps: int, lr: float = 3e-3, dtype=torch.float64,
          device: str = "cpu", seed: int = 0, topology: str = "ring", log: Callable[[str], None] | None = None) -> dict:
    """Train on ``tokens`` (``T + 1`` of them: inputs ``tokens[:-1]``, next-token targets ``tokens[1:]``) split over
    the ranks of ``comm``. Returns ``{"losses": [...], "params": flat parameter vector (numpy), "seconds": [...]}``;
    the loss of a step is the mean cross-entropy over all T positions (the same on every rank)."""
    P, r = comm.Get_size(), comm.Get_rank()
    T = len(tokens) - 1
    lo, hi = T * r // P, T * (r + 1) // P
    torch.manual_seed(seed)  # the same initial model on every rank
    model = GLALM(cfg, lambda: SequenceParallelGLA(comm, topology)).to(device=device, dtype=dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    x = torch.as_tensor(tokens[lo:hi], device=device).unsqueeze(0)  # this rank's slice [1, L_p]
    y = torch.as_tensor(tokens[lo + 1 : hi + 1], device=device)
    losses, seconds = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x).view(-1, cfg.vocab)
        if dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        (loss_sum / T).backward()  # collective: every rank runs the reverse scans of every layer
        allreduce_grads(params, comm)
        opt.step()
        losses.append(comm.allreduce(float(loss_sum.item())) / T)
        seconds.append(time.perf_counter() - t0)
        if log is not None:
            log(f"step {step:3d}  loss {losses[-1]:.12f}  {seconds[-1] * 1e3:8.1f} ms")
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to("cpu", torch.float64).numpy()
    return {"losses": losses, "params": flat, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024, help="sequence length T (split over the ranks)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank: rank %% device count)")
    ap.add_argument("--dtype", default=None, help="float64 (CPU default), float32 (CUDA default), bfloat16")
    ap.add_argument("--topology", default="ring", help="ring, tree, allgather, serial, exscan or auto")
    ap.add_argument("--layers", type=int, default=Config.layers)
    ap.add_argument("--d-model", type=int, default=Config.d_model)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-single", action="store_true",
                    help="rank 0 then trains on the whole sequence alone and prints the largest loss difference")
    ap.add_argument("--json", default=None, help="write the losses (and the single-rank ones) here (rank 0)")
    args = ap.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    dtype = getattr(torch, args.dtype or ("float64" if device == "cpu" else "float32"))
    cfg = Config(layers=args.layers, d_model=args.d_model)
    tokens = markov_tokens(args.tokens + 1, cfg.vocab, args.seed)
    say = print if rank == 0 else (lambda _msg: None)
    say(f"GLA LM: {comm.Get_size()} rank(s), T={args.tokens}, {dtype}, {device}, topology={args.topology}, "
        f"{asdict(cfg)}")
    res = train(comm, tokens, cfg, args.steps, args.lr, dtype, device, args.seed, args.topology, log=say)
    out = {"ranks": comm.Get_size(), "tokens": args.tokens, "dtype": str(dtype), "losses": res["losses"]}
    if args.compare_single and rank == 0:
        single = train(MPI.COMM_SELF, tokens, cfg, args.steps, args.lr, dtype, device, args.seed, args.topology)
        diff = max(abs(a - b) for a, b in zip(res["losses"], single["losses"]))
        pdiff = float(np.max(np.abs(res["params"] - single["params"])))
        out.update(single_losses=single["losses"], max_loss_diff=diff, max_param_diff=pdiff)
        say(f"1 rank: final loss {single['losses'][-1]:.12f}; largest |loss(P) - loss(1)| over the steps {diff:.3e}, "
            f"largest parameter difference {pdiff:.3e}")
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
