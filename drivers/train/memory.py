"""Memory of one training rank, estimated before any work, and the limit it must fit in.

Per rank (``N`` parameters, ``p`` bytes per parameter element -- 4 for float32 master weights, 8 for float64 --,
``c`` bytes per activation element in the compute dtype -- 2 under bf16 autocast --, ``n`` tokens of this rank
per step, ``d`` the width, ``f`` the MLP width, ``L`` layers, ``V`` the vocabulary):

- weights ``N p``, gradients ``N p`` (one flat buffer), AdamW moments ``2 N p``, and under autocast the bf16 copies
  of the weights ``2 N``;
- activations kept for the backward, per token and layer: the residual stream into both norms ``2 d p``; the
  attention's normalised input, q, k, v, g, the forget-gate logits, the output gate, o, its norm, the gated
  output and SiLU's output ``11 d c``; the MLP's normalised input ``d c`` and its gate, up, SiLU and product
  ``4 f c``. With ``--act-ckpt`` only the block input, the mixer's inputs and outputs and the mid residual stay
  (``2 d p + 6 d c``), plus one block's worth while it is recomputed;
- the loss: logits in the compute dtype, their float32 copy and log-softmax ``(c + 8) n V``;
- the GLA kernels' chunk states of one layer, ``4 H K V n / 64`` bytes (float32).

Allocator slack and library workspaces are not counted: the figure is a floor. The limit is the GPU's memory
shared by the ranks on it (``torch.cuda.mem_get_info``), or the node's available memory (``MemAvailable``)
shared by the ranks on the node.
"""

from __future__ import annotations

import os

from .config import ModelConfig

__all__ = ["estimate", "limit_bytes", "gib"]


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def estimate(cfg: ModelConfig, tokens: int, param_bytes: int, compute_bytes: int, autocast: bool,
             act_ckpt: bool) -> dict[str, int]:
    """Bytes per rank by part (module docstring) and ``total``; ``tokens``: this rank's tokens per step."""
    N, d, f, L, V = cfg.n_params(), cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab
    p, c = param_bytes, compute_bytes
    full = 2 * d * p + 12 * d * c + 4 * f * c
    per_layer = (2 * d * p + 6 * d * c) if act_ckpt else full
    out = {
        "weights": N * p + (2 * N if autocast else 0),
        "gradients": N * p,
        "optimizer": 2 * N * p,
        "activations": tokens * (per_layer * L + (full if act_ckpt else 0)),
        "loss": (c + 8) * tokens * V,
        "gla_states": 4 * cfg.n_heads * cfg.head_dim * cfg.head_dim * max(1, tokens // 64),
    }
    out["total"] = sum(out.values())
    return out


def limit_bytes(device_type: str, device_index: int | None, ranks_sharing: int) -> tuple[int, str]:
    """``(bytes, what)``: the memory this rank may use."""
    if device_type == "cuda":
        import torch

        _, total = torch.cuda.mem_get_info(device_index)
        share = f" / {ranks_sharing} ranks on it" if ranks_sharing > 1 else ""
        return total // max(1, ranks_sharing), f"GPU memory {gib(total)}{share}"
    avail = _mem_available()
    share = f" / {ranks_sharing} ranks on this node" if ranks_sharing > 1 else ""
    return avail // max(1, ranks_sharing), f"available host memory {gib(avail)}{share}"


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62
