"""Fitting the cost model's parameters to measured scan times, and the ZeCO paper's Table 2 as data.

:func:`fit` adjusts chosen fields of a :class:`~hpczeco.collectives.costmodel.LinkParams` so that the model's
predictions match measured times in the least-squares sense of ``log(predicted / measured)`` (every point weighs
the same whatever its size; the residual is a ratio). The search is a Nelder-Mead simplex over the
logarithms of the fields (they stay positive). :func:`fit_paper` fits the ``nvlink4`` (inside a node)
and ``ib-ndr`` (between nodes) presets jointly to :data:`PAPER_TABLE2` through
:func:`~hpczeco.collectives.costmodel.predict_hier`. Pure arithmetic: no MPI, no arrays. ``hpczeco model
--fit-paper`` and ``hpczeco report`` (its refit of the measured scans) use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from hpczeco.collectives import costmodel as cm
from hpczeco.collectives.costmodel import LinkParams

__all__ = ["PAPER_TABLE2", "PAPER_STATE_BYTES", "PAPER_PER_NODE", "Point", "nelder_mead", "fit", "fit_paper",
           "residuals", "paper_rows", "estimate_piece"]

#: ZeCO paper (arXiv 2507.01004) Table 2: communication time per layer, ms, All-Scan (ring) vs LASP-2's
#: AllGather, 8k tokens per GPU, d = 4096, H = 32 heads, on H100 nodes of 8 GPUs
PAPER_TABLE2: dict[int, dict[str, float]] = {
    8: {"ring": 0.226, "allgather": 0.375},
    16: {"ring": 0.297, "allgather": 0.658},
    32: {"ring": 0.448, "allgather": 1.616},
    64: {"ring": 0.739, "allgather": 2.543},
    128: {"ring": 1.272, "allgather": 4.350},
    256: {"ring": 2.165, "allgather": 8.514},
}
#: assumed state per GPU behind Table 2: H=32 heads of K=V=128 in bf16 (the paper prints no state size)
PAPER_STATE_BYTES = 32 * 128 * 128 * 2
#: GPUs per node in the paper's cluster
PAPER_PER_NODE = 8

#: a measurement: (topology, P, state bytes, seconds)
Point = tuple[str, int, float, float]


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 0.5, iters: int = 3000,
                tol: float = 1e-12) -> tuple[list[float], float]:
    """Minimise ``f`` from ``x0`` (Nelder-Mead simplex, standard coefficients); ``(x, f(x))``."""
    n = len(x0)
    pts = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * (abs(vals[0]) + tol):
            break
        cen = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        worst = pts[-1]
        refl = [c + (c - w) for c, w in zip(cen, worst)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [c + 2 * (c - w) for c, w in zip(cen, worst)]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(cen, worst)]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:  # shrink towards the best point
                best = pts[0]
                pts = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = min(range(n + 1), key=vals.__getitem__)
    return pts[i], vals[i]


def _sq_log_ratio(pred: float, meas: float) -> float:
    if pred <= 0 or meas <= 0:
        return 1e6
    return math.log(pred / meas) ** 2


def fit(points: Sequence[Point], start: LinkParams, free: Sequence[str], *, K: int = 128, V: int = 128,
        exscan_algorithm: str = "recursive_doubling", name: str | None = None) -> tuple[LinkParams, float]:
    """``start`` with the fields ``free`` refit to ``points``; and the RMS of ``log(predicted/measured)``.

    The pieces of the ring (ptree) are the model's choice unless the topology is given as ``"ring/k=N"``
    (``"ptree/k=N"``). A free field
    that starts at 0 starts the search at 1e-6 s (or 1e-12 s/B for ``beta``/``gamma``).
    """
    if not points:
        raise ValueError("fit needs at least one measured point")
    seed = {"beta": 1e-12, "gamma": 1e-13}

    def params_of(x: Sequence[float]) -> LinkParams:
        return replace(start, name=name or f"{start.name} (fit)", **{k: math.exp(v) for k, v in zip(free, x)})

    def loss(x: Sequence[float]) -> float:
        p = params_of(x)
        return sum(_sq_log_ratio(_predict(t, P, m, p, K, V, exscan_algorithm), s) for t, P, m, s in points)

    x0 = [math.log(getattr(start, k) or seed.get(k, 1e-6)) for k in free]
    x, val = nelder_mead(loss, x0)
    x, val = nelder_mead(loss, x, step=0.1)  # restart: Nelder-Mead can stall on a ridge
    return params_of(x), math.sqrt(val / len(points))


def _predict(topo: str, P: int, m: float, p: LinkParams, K: int, V: int, alg: str) -> float:
    if topo.startswith(("ring/k=", "ptree/k=")):
        return cm.predict(topo.split("/", 1)[0], P, m, p, blocks=int(topo.split("=", 1)[1]), K=K, V=V)
    return cm.predict(topo, P, m, p, K=K, V=V, exscan_algorithm=alg)


def residuals(points: Sequence[Point], params: LinkParams, *, K: int = 128, V: int = 128,
              exscan_algorithm: str = "recursive_doubling") -> list[tuple[str, int, float, float, float]]:
    """``(topology, P, bytes, measured s, predicted s)`` for every point."""
    return [(t, P, m, s, _predict(t, P, m, params, K, V, exscan_algorithm)) for t, P, m, s in points]


def estimate_piece(points: Sequence[Point], params: LinkParams
                   ) -> tuple[float, list[tuple[int, float, int, int]]] | None:
    """The ring's per-piece cost (``LinkParams.piece``) from measured ring points, as
    :func:`.calibrate.measure_piece` measures it: for every pair of ``"ring/k=N"`` points at the same
    ``(P, bytes)`` with different piece counts whose pieces are all above ``params.eager``,
    :func:`~.costmodel.piece_from_times`; ``(median over the pairs, [(P, bytes, k1, k2), ...])``, or None
    without such a pair. For results whose calibration predates the term."""
    groups: dict[tuple[int, float], dict[int, float]] = {}
    for topo, P, m, sec in points:
        if topo.startswith("ring/k="):
            k = int(topo.split("=", 1)[1])
            if m / k > params.eager:
                groups.setdefault((P, m), {})[k] = sec
    vals, used = [], []
    for (P, m), by_k in sorted(groups.items()):
        ks = sorted(by_k)
        for i, k1 in enumerate(ks):
            for k2 in ks[i + 1:]:
                vals.append(cm.piece_from_times(P, m, k1, by_k[k1], k2, by_k[k2], params))
                used.append((P, m, k1, k2))
    if not vals:
        return None
    vals.sort()
    n = len(vals)
    return (vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])), used


def paper_rows(intra: LinkParams, inter: LinkParams, state_bytes: float = PAPER_STATE_BYTES,
               per_node: int = PAPER_PER_NODE, K: int = 128, V: int = 128) -> list[dict[str, float]]:
    """Table 2 beside the two-level model: ``P``, measured and predicted ring / allgather (s), model's k, tree."""
    rows = []
    for P, meas in PAPER_TABLE2.items():
        ring, k = cm.predict_hier("ring", P, state_bytes, intra, inter, per_node, K=K, V=V)
        ag, _ = cm.predict_hier("allgather", P, state_bytes, intra, inter, per_node, K=K, V=V)
        tree, _ = cm.predict_hier("tree", P, state_bytes, intra, inter, per_node, K=K, V=V)
        rows.append({"P": P, "ring_paper": meas["ring"] * 1e-3, "ring": ring, "k": k,
                     "allgather_paper": meas["allgather"] * 1e-3, "allgather": ag, "tree": tree})
    return rows


def fit_paper(state_bytes: float = PAPER_STATE_BYTES, per_node: int = PAPER_PER_NODE
              ) -> tuple[LinkParams, LinkParams, float]:
    """``(nvlink4, ib-ndr, rms log residual)`` fitted to :data:`PAPER_TABLE2` through the two-level model.

    Free: the per-hop cost ``alpha`` and bandwidth ``beta`` of each link and one fixed cost per call
    ``overhead`` (shared: launching and synchronising the layer's communication); ``delta`` stays at one kernel
    launch (2 us; the fit cannot tell it from ``alpha``) and ``gamma`` at HBM speed.
    """
    start_nv, start_ib = cm.PRESETS["nvlink4"], cm.PRESETS["ib-ndr"]

    def unpack(x: Sequence[float]) -> tuple[LinkParams, LinkParams]:
        a_nv, b_nv, a_ib, b_ib, c0 = (math.exp(v) for v in x)
        return (replace(start_nv, alpha=a_nv, beta=b_nv, delta=2e-6, overhead=c0, name="nvlink4"),
                replace(start_ib, alpha=a_ib, beta=b_ib, delta=2e-6, overhead=c0, name="ib-ndr"))

    def loss(x: Sequence[float]) -> float:
        nv, ib = unpack(x)
        tot = 0.0
        for r in paper_rows(nv, ib, state_bytes, per_node):
            tot += _sq_log_ratio(r["ring"], r["ring_paper"]) + _sq_log_ratio(r["allgather"], r["allgather_paper"])
        return tot

    x0 = [math.log(v) for v in (10e-6, 1 / 200e9, 3e-6, 1 / 50e9, 20e-6)]
    x, _ = nelder_mead(loss, x0)
    x, val = nelder_mead(loss, x, step=0.1)
    nv, ib = unpack(x)
    return nv, ib, math.sqrt(val / (2 * len(PAPER_TABLE2)))
