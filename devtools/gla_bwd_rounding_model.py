"""A float64 model of the tensor-core GLA backward's dk, with each of its 16-bit roundings switched on or off.

Reproduces the kernel's dk error on flash-linear-attention's test inputs (q, k, v ~ U[0, 1), g = logsigmoid(U[0, 1)),
do ~ N(0, 1)) and splits it into the roundings of dA' (scale do v^T), Qh (q exp(b - r_I)), the incoming state
gradient dS and the output (docs/benchmarks/gla_tc_design.md section 12). One head, ``[T, K]`` / ``[T, V]``:

    python devtools/gla_bwd_rounding_model.py [--T 2048] [--K 64] [--V 64] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np
from hpczeco.base import bf16


def rb(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (as float64)."""
    return bf16.from_bits(bf16.to_bits(np.asarray(x, np.float32))).astype(np.float64)


def reference_dk(q, k, v, g, do, scale):
    """dk by the reverse recurrence: G_t = scale q_t^T do_t + diag(exp(g_{t+1})) G_{t+1}, dk_t = G_t v_t. Also G."""
    T, K = q.shape
    a, G = np.exp(g), np.zeros((K, v.shape[1]))
    dk, Gs = np.zeros_like(q), np.zeros((T, K, v.shape[1]))
    for t in range(T - 1, -1, -1):
        if t < T - 1:
            G = a[t + 1][:, None] * G
        G = G + scale * np.outer(q[t], do[t])
        Gs[t], dk[t] = G, G @ v[t]
    return dk, Gs


def model_dk(q, v, g, do, Gs, scale, round_dA, round_Qh, round_dS, round_out):
    """dk as the kernel computes it (chunks of 64, sub-chunks of 16), with the chosen roundings."""
    T, K = q.shape
    a, dk = np.exp(g), np.zeros_like(q)
    for s0 in range(0, T, 64):
        sl = slice(s0, s0 + 64)
        b = np.cumsum(g[sl], axis=0)
        dS = a[s0 + 64][:, None] * Gs[s0 + 64] if s0 + 64 < T else np.zeros((K, v.shape[1]))
        inter = np.exp(b[-1] - b) * (v[sl] @ (rb(dS) if round_dS else dS).T)
        dA = np.tril(scale * do[sl] @ v[sl].T)
        dA = rb(dA) if round_dA else dA
        intra = np.zeros((64, K))
        for i in range(4):
            r = b[16 * i]
            qh = q[sl][16 * i:16 * i + 16] * np.exp(b[16 * i:16 * i + 16] - r)
            qh = rb(qh) if round_Qh else qh
            for j in range(i + 1):
                intra[16 * j:16 * j + 16] += np.exp(r - b[16 * j:16 * j + 16]) * (dA[16 * i:16 * i + 16,
                                                                                     16 * j:16 * j + 16].T @ qh)
        d = inter + intra
        dk[sl] = rb(d) if round_out else d
    return dk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048, help="tokens (a multiple of 64)")
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    T, K, V = args.T, args.K, args.V
    q, k, v = rb(rng.uniform(size=(T, K))), rb(rng.uniform(size=(T, K))), rb(rng.uniform(size=(T, V)))
    g = rb(np.log(1 / (1 + np.exp(-rng.uniform(size=(T, K))))))
    do = rb(rng.standard_normal((T, V)))
    scale = K**-0.5
    ref, Gs = reference_dk(q, k, v, g, do, scale)
    print("rounded: dA' Qh dS out -> RMS error ratio of dk")
    for flags in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (1, 1, 1, 1), (0, 1, 1, 1)]:
        err = np.linalg.norm(model_dk(q, v, g, do, Gs, scale, *flags) - ref) / np.linalg.norm(ref)
        print(f"  {' '.join('yes' if f else ' no' for f in flags)}  {err:.3e}")


if __name__ == "__main__":
    main()
