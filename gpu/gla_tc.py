"""Host side of the tensor-core GLA forward (``gla_tc.cu``): segment states, segment scan, outputs; and the
chunk local states every pass starts from (:func:`local_states`: simt, or tensor cores on opt-in).

Used by :func:`hpczeco.gpu.gla.chunk_gla` for bf16/fp16 inputs with K, V multiples of 16 up to 128 and
chunk size 64. The sequence of each (b, h) is cut into segments of ``NC`` chunks of 64 tokens:
kernel 1 computes each segment's local state (and total decay), the simt ``gla_state_scan`` turns
those into incoming states, kernel 2 recomputes the chunks of each segment from its incoming state and
writes ``o``. ``NC`` defaults to about eight waves of blocks on the device; ``$HPCZECO_TC_NC`` fixes it.

Builds of the same kernels (``$HPCZECO_TC_VARIANT``), same arithmetic:

- ``"ldsm-pf"`` (default): V, the decayed keys and the state operand row-major in shared memory, read
  with ``ldmatrix.trans``; the next chunk's loads are issued before this chunk's matrix work;
- ``"ldsm"``: the same without the prefetch;
- ``"plain"``: those operands stored transposed with scalar stores, read as 32-bit pairs (no ldmatrix).
"""

from __future__ import annotations

import os
from typing import Any

from .gla_common import NT_SIMT, f32, i32, state_scan, tc_applies

# mirror of the shared-memory layout in gla_tc.cu (bytes)
_BP, _CP, _KP = 132, 72, 136
_BASE = 64 * _BP * 4 + 2 * 128 * _CP * 2  # cumulative gate, V^T, (k*decay)^T
SMEM_STATE = _BASE + 64 * _KP * 2  # + raw k
SMEM_OUTPUT = _BASE + 64 * _KP * 2 * 3 + 6 * 16 * _KP * 2 + 64 * _CP * 2 + 128 * _KP * 2 + 16
#: largest diagonal sub-chunk decay span (log units) done on tensor cores; beyond it: elementwise
SPAN_LIMIT = {"bf16": 40.0, "f16": 8.0}
_THREADS = 256


def _num_sms(rt: Any) -> int:
    try:
        dev = rt.xp.cuda.Device()
        return int(dev.attributes["MultiProcessorCount"])
    except Exception:
        return 132


def chunks_per_segment(rt: Any, BH: int, NT: int) -> int:
    env = os.environ.get("HPCZECO_TC_NC")
    if env:
        return max(1, int(env))
    target_blocks = 8 * _num_sms(rt)
    ns = max(1, -(-target_blocks // max(BH, 1)))
    return max(1, -(-NT // ns))


#: variant -> (row-major operands read by ldmatrix, prefetch) template arguments
VARIANTS = {"ldsm-pf": ("true", "true"), "ldsm": ("true", "false"), "plain": ("false", "false")}
DEFAULT_VARIANT = "ldsm-pf"


def variant() -> str:
    v = os.environ.get("HPCZECO_TC_VARIANT", DEFAULT_VARIANT)
    if v not in VARIANTS:
        raise ValueError(f"HPCZECO_TC_VARIANT must be one of {sorted(VARIANTS)}, got {v!r}")
    return v


def prepare(rt: Any, k, v, g, t: str, B: int, T: int, H: int, K: int, V: int, nc=None):
    """Segment states from a zero start: ``(incoming states [B*H, NS, K, V], segment log decays [B*H, NS, K],
    final state [B*H, K, V], NC)`` on the current stream."""
    xp = rt.xp
    NT = -(-T // 64)
    BH = B * H
    NC = nc or chunks_per_segment(rt, BH, NT)
    NS = -(-NT // NC)
    lds, _ = VARIANTS[variant()]
    st = xp.empty((BH, NS, K, V), dtype=xp.float32)
    gseg = xp.empty((BH, NS, K), dtype=xp.float32)
    rt.launch(
        f"gla_tc_seg_state<{t}, {lds}>", (NS, BH), (_THREADS,),
        (k, v, g, st, gseg, i32(B), i32(T), i32(H), i32(K), i32(V), i32(NC), i32(NS)),
        shared_mem=SMEM_STATE,
    )  # fmt: skip
    fin = state_scan(rt, st, gseg, None, NS, K, V, BH, reverse=False)
    return st, gseg, fin, NC


def finish(rt: Any, q, k, v, g, st, o, scale: float, S0, pre, t: str, B: int, T: int, H: int, K: int, V: int, NC: int):
    """Write ``o`` from the zero-start segment states ``st`` plus ``exp(pre) * S0`` (if ``S0``)."""
    NS = int(st.shape[1])
    lds, pf = VARIANTS[variant()]
    rt.launch(
        f"gla_tc_seg_output<{t}, {lds}, {pf}>", (NS, B * H), (_THREADS,),
        (q, k, v, g, st, o, f32(scale), i32(B), i32(T), i32(H), i32(K), i32(V), i32(NC), i32(NS),
         f32(SPAN_LIMIT[t]), S0, pre),
        shared_mem=SMEM_OUTPUT,
    )  # fmt: skip


def local_states(rt, left, right, g, t, B, T, H, K, V, C, NT, mode, scale):
    """Per-chunk local states ``[B*H, NT, K, V]`` and chunk decay totals ``[B*H, NT, K]`` (fp32).

    mode 0: ``sum_t (left_t * exp(bL - b_t))^T right_t`` (the chunk's state from zero); mode 1:
    ``scale * sum_t (left_t * exp(b_t))^T right_t`` (its d-state), ``b`` the gate's cumulative sum in the
    chunk. ``$HPCZECO_TC_STATES=1`` computes them on tensor cores for 16-bit inputs (operands rounded to
    16 bits, which costs the backward's dg precision), else fp32 simt.
    """
    xp = rt.xp
    st = xp.empty((B * H, NT, K, V), dtype=xp.float32)
    gtot = xp.empty((B * H, NT, K), dtype=xp.float32)
    if (
        os.environ.get("HPCZECO_TC_STATES", "0") == "1"  # opt-in: 16-bit state operands cost dg precision
        and C == 64
        and tc_applies(t, K, V, C)
        and all(rt.ptr(x) % 16 == 0 for x in (left, right, g))
        and rt.available("gla_tc.cu", t)
    ):  # tensor cores (16-bit operands, fp32 accumulation)
        rt.launch(
            f"gla_tc_chunk_outer<{t}>", (NT, B * H), (_THREADS,),
            (left, right, g, st, gtot, i32(B), i32(T), i32(H), i32(K), i32(V), i32(NT), i32(mode), f32(scale)),
            shared_mem=SMEM_STATE,
        )  # fmt: skip
        return st, gtot
    grid = (NT, B * H, -(-K // 32) * -(-V // 32))
    rt.launch(
        f"gla_chunk_outer<{t}>", grid, (NT_SIMT,),
        (left, right, g, st, gtot, i32(B), i32(T), i32(H), i32(K), i32(V), i32(C), i32(NT), i32(mode), f32(scale)),
    )  # fmt: skip
    return st, gtot
