"""What a training user watches: step timing (forward / backward / all-reduce / optimizer / checkpoint), tokens/s
per GPU, MFU, peak GPU memory; the JSON-lines log, the benchmark summary and the loss-curve PNG.

MFU = ``6 N tokens / (step seconds x GPUs x peak)`` with ``N`` all the model's parameters (embedding and head
included: the convention of the issue's 1.47B / 54 % anchor) and ``peak`` the dense bf16 rate of one GPU
(:data:`H200_BF16_PEAK`, ``--peak-tflops`` for another GPU). The GLA mixer's own FLOPs are not counted.

Timing: on a GPU the host runs ahead of the device, so a phase split needs a synchronisation at every phase
boundary, which costs the overlap between phases; the split is measured only on the steps of ``--timing-every``
(and ``--timing-every 1`` measures every step). The step time itself is always exact: it runs from one step's
synchronisation point (the loss is read before the optimizer step) to the next.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["H200_BF16_PEAK", "PHASES", "StepTimer", "mfu", "peak_memory", "summarise", "bench_row", "plot_losses"]

#: dense bf16 FLOP/s of one H200 used for MFU (the issue's 790 TFLOP/s)
H200_BF16_PEAK = 790e12
#: the phases of a step, in order
PHASES = ("forward", "backward", "allreduce", "optimizer", "checkpoint")


class StepTimer:
    """Phase times of one step; ``measure`` (set per step) synchronises ``device`` at each mark first."""

    def __init__(self, device: torch.device):
        self.device = device
        self.measure = False
        self.times: dict[str, float] = {}
        self._t = 0.0

    def start(self, measure: bool) -> None:
        self.measure = measure or self.device.type == "cpu"
        self.times = {}
        self._sync()
        self._t = time.perf_counter()

    def _sync(self) -> None:
        if self.measure and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark(self, phase: str) -> None:
        """End ``phase`` (its time is recorded on measured steps)."""
        if not self.measure:
            return
        self._sync()
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + now - self._t
        self._t = now

    def split(self) -> dict[str, float] | None:
        return dict(self.times) if self.measure else None


def mfu(n_params: int, tokens: int, seconds: float, n_gpus: int, peak: float) -> float | None:
    """Model FLOPs utilisation by ``6 N tokens`` (module docstring); None without GPUs or time."""
    if n_gpus < 1 or seconds <= 0 or peak <= 0:
        return None
    return 6.0 * n_params * tokens / (seconds * n_gpus * peak)


def peak_memory(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` of ``device`` (bytes; None on the CPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def summarise(steps: list[dict[str, Any]], skip: int, ckpts: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark figures of the ``step`` records after the first ``skip`` (warm-up: compilation, autotuning)."""
    timed = steps[skip:] if len(steps) > skip else steps[-1:]
    if not timed:
        return {}
    tokens = sum(r["tokens"] for r in timed)
    wall = sum(r["step_s"] for r in timed)
    out: dict[str, Any] = {
        "steps_timed": len(timed),
        "steps_skipped": len(steps) - len(timed),
        "step_s_median": _median([r["step_s"] for r in timed]),
        "tokens_per_s_median": _median([r["tokens_per_s"] for r in timed]),
        "tokens_per_s_mean": tokens / wall if wall > 0 else None,  # over the whole window, saves included
        "tokens_per_s_per_gpu_median": _median([r["tokens_per_s_per_gpu"] for r in timed]),
        "mfu_median": _median([r["mfu"] for r in timed if r.get("mfu") is not None]),
        "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0) for r in steps) or None,
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
    }
    for ph in PHASES:
        out[f"{ph}_s_median"] = _median([r["split"][ph] for r in timed if r.get("split") and ph in r["split"]])
    blocked = [r["checkpoint_s"] for r in steps if r.get("checkpoint_s")]
    if blocked or ckpts:
        out["checkpoint"] = {
            "saves": len(blocked),
            "blocked_s_max": max(blocked) if blocked else None,
            "copy_s_max": max((c.get("copy_s") or 0.0 for c in ckpts), default=None),
            "write_s_median": _median([c.get("write_s") for c in ckpts]),
        }
    return out


def bench_row(label: str, s: dict[str, Any]) -> str:
    """One table row: label, tokens/s/GPU, MFU, peak memory, step time and its split (median seconds)."""
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    mem = s.get("peak_memory_bytes")
    split = " ".join(f"{ph[:4]} {f(s.get(f'{ph}_s_median'), '.3f')}" for ph in PHASES[:4])
    return (f"{label}: {f(s.get('tokens_per_s_per_gpu_median'), ',.0f')} tokens/s/GPU, MFU "
            f"{f(None if s.get('mfu_median') is None else 100 * s['mfu_median'], '.1f')} %, peak "
            f"{'-' if not mem else f'{mem / 2**30:.1f} GiB'}, step {f(s.get('step_s_median'), '.3f')} s ({split})")


def plot_losses(steps: list[dict[str, Any]], path: str | Path, title: str) -> str | None:
    """The loss curve of the ``step`` records as a PNG; None (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean cross entropy, nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, default=str) + "\n")
