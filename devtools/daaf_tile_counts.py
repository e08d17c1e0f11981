"""Tile counts of the Hopper DAAF kernels' tile rule on the benchmark plans (no GPU): computed / useful pairs
per query-tile shape, key tiles per query tile, and the makespan of the CTA orders (greedy list scheduling on
132 SMs, cost = key tiles + 3) over its lower bound; with --flex, FlexAttention's 128 x 128 block-mask counts.
The numbers of docs/benchmarks/daaf_hopper_design.md (round 2).

    PYTHONPATH=. python devtools/daaf_tile_counts.py [--seqs 8192,32768] [--flex]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hpczeco.drivers.gpu_daaf_model import bench_plans  # noqa: E402

from hpczeco.daaf import attention_pairs  # noqa: E402

W = 128
H = 16
SHAPES = ((128, 128), (192, 64), (128, 64), (64, 192))  # (query rows, keys per tile) per CTA


def key_tiles(g: np.ndarray, bm: int, bn: int) -> list[int]:
    """Key tiles each query tile of ``bm`` rows visits (gpu/daaf_hopper.cu's dh_plan_of)."""
    T = len(g)
    gidx = np.flatnonzero(g)
    out = []
    for t0 in range(0, T, bm):
        t1 = min(t0 + bm, T) - 1
        if g[t0 : t1 + 1].any():
            out.append(t1 // bn + 1)
        else:
            ks = max(0, t0 - W)
            n_pre = int(np.searchsorted(gidx, ks))
            out.append((n_pre + bn - 1) // bn + (t1 - ks) // bn + 1)
    return out


def makespan(costs: list[float], order: list[int], n_sm: int = 132) -> float:
    free = [0.0] * n_sm
    for i in order:
        t = heapq.heappop(free)
        heapq.heappush(free, t + costs[i])
    return max(free)


def flex_blocks(g: np.ndarray, b: int = 128) -> tuple[int, int]:
    """(full, partial) 128 x 128 blocks of the DAAF mask (causal, window W, key regions g)."""
    T = len(g)
    full = part = 0
    for qb in range(T // b):
        t = np.arange(qb * b, qb * b + b)[:, None]
        for kb in range(qb + 1):
            j = np.arange(kb * b, kb * b + b)[None, :]
            m = (j <= t) & ((t - j <= W) | g[kb * b : kb * b + b][None, :] | g[qb * b : qb * b + b][:, None])
            n = int(m.sum())
            full += n == b * b
            part += 0 < n < b * b
    return full, part


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--flex", action="store_true", help="FlexAttention's block counts (slow above 32k)")
    a = ap.parse_args(argv)
    for T in (int(x) for x in a.seqs.split(",")):
        for name, g in bench_plans(T).items():
            useful = attention_pairs(g, W)
            print(f"T={T} {name}: {useful / 1e6:.1f} M useful pairs per head")
            for bm, bn in SHAPES:
                n = key_tiles(g, bm, bn)
                cost = [float(x + 3) for x in n for _ in range(H)]  # CTA (query tile, head), heads fastest
                nq = len(n)
                orders = {
                    "s1": [qt * H + h for h in range(H) for qt in range(nq)],
                    "s3": [(nq - 1 - qt) * H + h for qt in range(nq) for h in range(H)],
                    "sorted": sorted(range(len(cost)), key=lambda i: -cost[i]),
                }
                bound = sum(cost) / 132
                ms = "  ".join(f"{k} {makespan(cost, o) / bound:.3f}" for k, o in orders.items())
                print(f"  {bm:>3} rows x {bn:>3} keys: computed/useful {sum(n) * bm * bn / useful:.3f}, key tiles per "
                      f"query tile {np.mean(n):.1f} (max {max(n)}); makespan/bound {ms}")
            if a.flex:
                f, p = flex_blocks(g)
                ratio = (f + p) * 128 * 128 / useful
                print(f"  flex 128 x 128 blocks: {f} full, {p} partial, computed/useful {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
