"""The device checks of the GLA GPU kernels (``hpczeco bench gpu-gla --check``) and the float64 reference they use.

Each check runs our kernels (the chunk-parallel tensor-core path of :mod:`hpczeco.gpu.gla_fwd_tc` /
:mod:`~hpczeco.gpu.gla_bwd_tc`, on the library's kernel runtime) on fresh random inputs and compares o, the final
state and the five gradients with a float64 recurrence: RMS error ratios ``||ours - ref|| / ||ref||`` against
:data:`TARGET` (o <= 4e-3, final state and gradients <= 5e-3):

- :func:`reference_check`: the float64 recurrence on the device (:func:`recurrence64`, the one the bench's accuracy
  grid uses) against :func:`hpczeco.gla.recurrent_gla` / ``recurrent_gla_bwd`` on the host (<= 1e-10);
- :func:`small_case`: the shapes of :data:`SMALL` in bf16 and :data:`SMALL_FP16` in fp16 (T off the chunk, T = 1,
  K != V, strong gates, h0 and dht, chunks per segment, fp32 chunk states) against the host recurrences;
- :func:`two_slices`: the prepare/finish split over two slices composed as two ZeCO ranks (:data:`TWO_SLICES`).

:func:`run` records one row per check in the bench's ``device_checks`` table (``ok``, the errors, why it failed).
The GPU tests (``pytest -m gpu tests/test_gpu_gla*.py``) check the same kernels; this runs the checks on the
machine and build the bench measures, beside its timings. Without a GPU, the bench's dry run
(``tests/test_gpu_gla_checks.py``) runs them on the CPU emulation of the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hpczeco.base import bf16

__all__ = ["TARGET", "NAMES", "SMALL", "SMALL_FP16", "TWO_SLICES", "f32_of", "rel", "recurrence64", "check_inputs",
           "reference_check", "small_case", "two_slices", "judge", "run"]

#: RMS error ratio targets against float64 (o; final state and gradients)
TARGET = {"o": 4e-3, "ht": 5e-3, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3, "dg": 5e-3, "dh0": 5e-3}
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dh0")
#: B, T, H, K, V, strong gates, chunks per segment (None: automatic), fp32 chunk states
SMALL = [
    (1, 1, 1, 16, 32, False, None, False), (2, 63, 2, 64, 64, False, None, False),
    (1, 130, 2, 32, 48, True, 1, False), (1, 300, 2, 128, 128, False, 2, False),
    (1, 300, 1, 128, 64, True, 1, True), (2, 777, 1, 64, 128, False, 3, False),
    (1, 1000, 2, 128, 128, False, None, False),
]  # fmt: skip
SMALL_FP16 = [(1, 130, 2, 64, 64, False, 1, False), (1, 300, 1, 128, 128, True, None, False)]
#: B, T, H, K, V, the cut between the two slices
TWO_SLICES = (1, 300, 2, 64, 64, 137)
#: the small shape (B, T, H, K, V, strong gates) each variant build is checked at (``--variants`` with ``--check``)
VARIANT_SMALL = (1, 300, 2, 64, 64, True)


# ------------------------------------------------------------------------------------------------ device helpers


def f32_of(cp: Any, x: Any) -> Any:
    """float32 values of a CuPy array (``uint16``: raw bf16 bits)."""
    if x.dtype == cp.uint16:
        return bf16.from_bits(x, xp=cp)
    return x.astype(cp.float32)


def rel(cp: Any, a: Any, ref: Any) -> float:
    """RMS error ratio ``||a - ref|| / ||ref||`` in float64 on the device (NaN if ``a`` is not finite)."""
    a64, r64 = f32_of(cp, a).astype(cp.float64), f32_of(cp, ref).astype(cp.float64)
    if not bool(cp.isfinite(a64).all()):
        return float("nan")
    return float(cp.linalg.norm(a64 - r64) / max(float(cp.linalg.norm(r64)), 1e-300))


def recurrence64(cp: Any, q, k, v, g, do, scale: float, h0, dht):
    """float64 recurrences on the device (hpczeco.gla.naive's formulas): ``(o, S_T, dq, dk, dv, dg, dh0)``.
    ``q, k, v, g, do``: CuPy arrays (raw bf16 bits or floats), ``h0, dht`` ``[B, H, K, V]``."""
    q, k, v, g, do = (f32_of(cp, x).astype(cp.float64) for x in (q, k, v, g, do))
    B, T, H, K = q.shape
    V = v.shape[3]
    q, k, v, g, do = (x.transpose(1, 0, 2, 3).reshape(T, B * H, -1) for x in (q, k, v, g, do))
    S = h0.astype(cp.float64).reshape(B * H, K, V).copy()
    states = cp.empty((T + 1, B * H, K, V), dtype=cp.float64)
    states[0] = S
    o = cp.empty((T, B * H, V))
    for t in range(T):
        S = cp.exp(g[t])[:, :, None] * S + k[t][:, :, None] * v[t][:, None, :]
        states[t + 1] = S
        o[t] = scale * cp.matmul(q[t][:, None, :], S)[:, 0, :]
    dS = dht.astype(cp.float64).reshape(B * H, K, V).copy()
    dq, dk, dg = (cp.empty((T, B * H, K)) for _ in range(3))
    dv = cp.empty((T, B * H, V))
    for t in range(T - 1, -1, -1):
        dS += scale * q[t][:, :, None] * do[t][:, None, :]
        dq[t] = scale * cp.matmul(states[t + 1], do[t][:, :, None])[:, :, 0]
        dk[t] = cp.matmul(dS, v[t][:, :, None])[:, :, 0]
        dv[t] = cp.matmul(k[t][:, None, :], dS)[:, 0, :]
        e = cp.exp(g[t])
        dg[t] = e * (states[t] * dS).sum(axis=2)
        dS = e[:, :, None] * dS
    back = lambda x: x.reshape(T, B, H, -1).transpose(1, 0, 2, 3)  # noqa: E731
    return back(o), S.reshape(B, H, K, V), back(dq), back(dk), back(dv), back(dg), dS.reshape(B, H, K, V)


def check_inputs(cp: Any, B: int, T: int, H: int, K: int, V: int, seed: int, dtype: str = "bf16",
                 strong: bool = False) -> dict[str, Any]:
    """q, k, v, do ~ N(0, 1), g = logsigmoid(N(0, 1)) (``strong``: half the gates in [-8, -4]) in the kernel dtype
    (``"bf16"``: uint16 bits, ``"f16"``: float16), and float32 h0, dht ~ N(0, 1), generated on the device."""
    rs = cp.random.RandomState(seed)
    f = lambda *s: rs.standard_normal(s, dtype=cp.float32)  # noqa: E731
    q, k, v, do = f(B, T, H, K), f(B, T, H, K), f(B, T, H, V), f(B, T, H, V)
    g = (-cp.log1p(cp.exp(-f(B, T, H, K)))).astype(cp.float32)
    if strong:
        g = cp.where(rs.uniform(size=g.shape) < 0.5, -rs.uniform(4.0, 8.0, g.shape), g).astype(cp.float32)
    conv = (lambda a: bf16.to_bits(a, xp=cp)) if dtype == "bf16" else (lambda a: a.astype(cp.float16))
    d = {n: cp.ascontiguousarray(conv(a)) for n, a in (("q", q), ("k", k), ("v", v), ("g", g), ("do", do))}
    d["h0"], d["dht"] = f(B, H, K, V), f(B, H, K, V)
    return d


def _host64(cp: Any, x: Any) -> np.ndarray:
    return cp.asnumpy(f32_of(cp, x)).astype(np.float64)


def _host_reference(cp: Any, d: dict[str, Any], scale: float | None = None) -> tuple:
    """``(o, ht, dq, dk, dv, dg, dh0)`` of hpczeco.gla's float64 CPU recurrences on the inputs ``d``."""
    from hpczeco.gla import recurrent_gla, recurrent_gla_bwd  # noqa: PLC0415

    x64 = [_host64(cp, d[n]) for n in ("q", "k", "v", "g", "do")]
    h0, dht = _host64(cp, d["h0"]), _host64(cp, d["dht"])
    o, ht = recurrent_gla(*x64[:4], scale=scale, initial_state=h0, output_final_state=True)
    return (o, ht) + tuple(recurrent_gla_bwd(*x64, scale=scale, initial_state=h0, dht=dht))


def _errors(cp: Any, got, ref) -> dict[str, float]:
    out = {}
    for n, m, r in zip(NAMES, got, ref):
        mm = _host64(cp, m)
        out[n] = float(np.linalg.norm(mm - r) / np.linalg.norm(r)) if np.isfinite(mm).all() else float("nan")
    return out


# ------------------------------------------------------------------------------------------------ the checks


def reference_check(cp: Any, seed: int) -> dict[str, float]:
    """:func:`recurrence64` against hpczeco.gla's CPU recurrences (scale 0.3, h0 and dht), relative errors."""
    d = check_inputs(cp, 1, 50, 2, 32, 16, seed)
    ref = _host_reference(cp, d, scale=0.3)
    mine = recurrence64(cp, *(d[n] for n in ("q", "k", "v", "g", "do")), 0.3, d["h0"], d["dht"])
    return {n: float(np.linalg.norm(cp.asnumpy(m) - r) / np.linalg.norm(r)) for n, m, r in zip(NAMES, mine, ref)}


def small_case(cp: Any, rt: Any, B: int, T: int, H: int, K: int, V: int, strong: bool, seed: int,
               dtype: str = "bf16", **opts: Any) -> dict[str, float]:
    """Forward and backward (h0, dht) of the kernels on runtime ``rt`` against the float64 CPU recurrences.
    ``opts``: the kernels' build options (``nc``, ``f32_states``, ``walk``; ``out`` goes to the forward only)."""
    from hpczeco.gpu import gla_bwd_tc, gla_fwd_tc  # noqa: PLC0415

    d = check_inputs(cp, B, T, H, K, V, seed, dtype, strong=strong)
    qkvg = [d[n] for n in ("q", "k", "v", "g")]
    o, ht = gla_fwd_tc.fwd_tc(rt, *qkvg, initial_state=d["h0"], output_final_state=True, **opts)
    bwd_opts = {k: v for k, v in opts.items() if k != "out"}
    grads = gla_bwd_tc.bwd_tc(rt, *qkvg, d["do"], initial_state=d["h0"], dht=d["dht"], **bwd_opts)
    return _errors(cp, (o, ht) + tuple(grads), _host_reference(cp, d))


def two_slices(cp: Any, rt: Any, B: int, T: int, H: int, K: int, V: int, cut: int, seed: int) -> dict[str, float]:
    """The prepare/finish split over tokens ``[0, cut)`` and ``[cut, T)`` composed as two ZeCO ranks (the state
    into the second slice and the gradient out of it passed by hand), bf16, strong gates, against float64."""
    from hpczeco.gpu import gla_bwd_tc, gla_fwd_tc  # noqa: PLC0415

    d = check_inputs(cp, B, T, H, K, V, seed, strong=True)
    h0, dht = d["h0"], d["dht"]
    part = [[cp.ascontiguousarray(d[n][:, s]) for n in ("q", "k", "v", "g", "do")]
            for s in (slice(0, cut), slice(cut, T))]  # fmt: skip
    fw = [gla_fwd_tc.fwd_tc_prepare(rt, *pp[:4], nc=1) for pp in part]
    s_in1 = fw[0].decay[..., None] * h0 + fw[0].local_final_state
    o0, _ = fw[0].finish(h0)
    o1, fin = fw[1].finish(s_in1, output_final_state=True)
    bw = [gla_bwd_tc.bwd_tc_prepare(rt, *pp, nc=1) for pp in part]
    d0 = bw[1].decay[..., None] * dht + bw[1].dh0_local
    g0, g1 = bw[0].finish(h0, d0), bw[1].finish(s_in1, dht)
    got = [cp.concatenate([o0, o1], axis=1), fin] + [cp.concatenate([g0[i], g1[i]], axis=1) for i in range(4)]
    return _errors(cp, got + [g0[4]], _host_reference(cp, d))


def judge(errors: dict[str, float], tol: float | dict[str, float] | None = None) -> tuple[bool, str]:
    """``(ok, why)``: every error within its tolerance (``TARGET``'s by default; NaN fails)."""
    bad = []
    for k, v in errors.items():
        lim = tol if isinstance(tol, float) else (tol or TARGET).get(k, 5e-3)
        if not v <= lim:
            bad.append(f"{k}={v:.2e}>{lim:.0e}")
    return not bad, ", ".join(bad)


def record(rec: Any, name: str, fn: Callable[[], dict[str, float]], tol: float | None = None, **extra: Any) -> bool:
    """Run one check ``fn() -> {metric: error}`` and record it in ``rec``'s ``device_checks`` table; True if it
    passed (an exception is a failure, recorded with its reason)."""
    try:
        errors = fn()
    except Exception as exc:  # noqa: BLE001 - record and go on
        rec.record({"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], **extra},
                   table="device_checks")
        return False
    ok, why = judge(errors, tol)
    rec.record({"check": name, "ok": ok, **errors, **({"why": why} if why else {}), **extra}, table="device_checks")
    return ok


def run(rec: Any, cp: Any, rt: Any, seed: int, fp16: bool = True) -> int:
    """Every check above on runtime ``rt`` (seeds drawn from ``seed``); returns the number that failed."""
    rng = np.random.default_rng(seed)
    draw = lambda: int(rng.integers(1 << 30))  # noqa: E731
    ok = [record(rec, "float64 recurrence on the device == hpczeco.gla's CPU recurrence",
                 lambda: reference_check(cp, draw()), 1e-10)]
    cases = [(c, "bf16") for c in SMALL] + ([(c, "f16") for c in SMALL_FP16] if fp16 else [])
    for (B, T, H, K, V, strong, nc, f32s), dtype in cases:
        name = f"{dtype} vs float64: B={B} T={T} H={H} K={K} V={V} strong={strong} nc={nc} f32 states={f32s}"
        ok.append(record(rec, name, lambda c=(B, T, H, K, V, strong), dt=dtype, nc=nc, f32s=f32s: small_case(
            cp, rt, *c, draw(), dt, nc=nc, f32_states=f32s)))
    ok.append(record(rec, "prepare/finish over two slices (ZeCO composition), bf16, strong gates",
                     lambda: two_slices(cp, rt, *TWO_SLICES, draw())))
    return sum(not x for x in ok)
