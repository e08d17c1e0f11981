"""Token-by-token float64 reference of gated linear attention (GLA) and of its backward.

Semantics (flash-linear-attention's ``chunk_gla``), per batch ``b`` and head ``h``::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        S_{-1} = initial_state (zeros if None)
    o_t = (scale * q_t) S_t                         inclusive of token t; scale = K**-0.5 by default

Layout: ``q, k, g: [B, T, H, K]``; ``v, o: [B, T, H, V]``; states ``[B, H, K, V]``. These are the
references the chunked and device paths are tested against: simple, slow (a Python loop over T,
vectorised over B and H), computed in float64 whatever the input dtype.

Packed documents (``cu_seqlens [N + 1]``, ``B == 1``, as flash-linear-attention): literally each document
``cu_seqlens[i] .. cu_seqlens[i + 1]`` run alone, with its own initial state ``initial_state[i]`` and final
state / ``dht`` / ``dh0`` row ``i`` (states ``[N, H, K, V]``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.backend import to_numpy
from ..base.checks import check_scale
from .validate import check_cu_seqlens, check_document_states, validate_gla_inputs

__all__ = ["recurrent_gla", "recurrent_gla_bwd"]


def _f64(x: Any) -> np.ndarray | None:
    return None if x is None else np.asarray(to_numpy(x), dtype=np.float64)


def recurrent_gla(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Reference GLA forward: ``(o [B, T, H, V], final_state [B, H, K, V] or None)``.

    Computed in float64 on the host; both results are returned in the dtype of ``q`` (numpy). With
    ``cu_seqlens [N + 1]`` (B == 1): each document alone, ``initial_state`` and the final state ``[N, H, K, V]``.
    """
    if cu_seqlens is not None:
        cu = _documents(q, k, v, g, cu_seqlens, initial_state=initial_state)
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            h0 = None if initial_state is None else initial_state[i : i + 1]
            o, fin = recurrent_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], scale, h0, True)
            outs.append(o)
            finals.append(fin)
        return np.concatenate(outs, axis=1), (np.concatenate(finals) if output_final_state else None)
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, initial_state=initial_state)
    s = check_scale(scale, K)
    dt = np.dtype(q.dtype)
    q64, k64, v64, g64 = (_f64(x) for x in (q, k, v, g))
    S = np.zeros((B, H, K, V)) if initial_state is None else _f64(initial_state).copy()
    o = np.empty((B, T, H, V))
    for t in range(T):
        S *= np.exp(g64[:, t])[..., None]
        S += k64[:, t, :, :, None] * v64[:, t, :, None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", s * q64[:, t], S)
    return o.astype(dt), (S.astype(dt) if output_final_state else None)


def recurrent_gla_bwd(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    do: Any,
    scale: float | None = None,
    initial_state: Any = None,
    dht: Any = None,
    cu_seqlens: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reference GLA backward (float64, reverse-time recurrence; all results float64).

    Gradients of ``L = sum(o * do) + sum(S_T * dht)`` (``dht`` None means zeros) with respect to
    ``q, k, v, g`` and the initial state: ``(dq, dk, dv, dg, dh0)`` with shapes ``[B, T, H, K]``
    (dq, dk, dg), ``[B, T, H, V]`` (dv), ``[B, H, K, V]`` (dh0, returned even when
    ``initial_state`` is None). Uses the direct formulas (not the cumulative-sum identity for dg)::

        dS_t = scale q_t^T do_t + diag(exp(g_{t+1})) dS_{t+1},   dS_{T-1} includes dht
        dq_t = scale do_t S_t^T      dk_t = dS_t v_t      dv_t = k_t dS_t
        dg_t = exp(g_t) * sum_v(S_{t-1} * dS_t)            dh0 = diag(exp(g_0)) dS_0

    Stores all T states ``[T, B, H, K, V]`` in float64: for small test shapes only. With ``cu_seqlens
    [N + 1]`` (B == 1): each document alone; ``initial_state``, ``dht`` and ``dh0`` are ``[N, H, K, V]``.
    """
    if cu_seqlens is not None:
        cu = _documents(q, k, v, g, cu_seqlens, initial_state=initial_state, do=do, dht=dht)
        parts = []
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            h0 = None if initial_state is None else initial_state[i : i + 1]
            d = None if dht is None else dht[i : i + 1]
            parts.append(recurrent_gla_bwd(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], do[:, a:b], scale, h0, d))
        return tuple(np.concatenate([p[j] for p in parts], axis=0 if j == 4 else 1) for j in range(5))
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, initial_state=initial_state, do=do, dht=dht)
    s = check_scale(scale, K)
    q64, k64, v64, g64, do64 = (_f64(x) for x in (q, k, v, g, do))
    S = np.zeros((B, H, K, V)) if initial_state is None else _f64(initial_state).copy()
    states = np.empty((T + 1, B, H, K, V))  # states[t + 1] = S_t, states[0] = S_{-1}
    states[0] = S
    for t in range(T):
        S = np.exp(g64[:, t])[..., None] * S + k64[:, t, :, :, None] * v64[:, t, :, None, :]
        states[t + 1] = S
    dq = np.empty((B, T, H, K))
    dk = np.empty((B, T, H, K))
    dg = np.empty((B, T, H, K))
    dv = np.empty((B, T, H, V))
    dS = np.zeros((B, H, K, V)) if dht is None else _f64(dht).copy()
    for t in range(T - 1, -1, -1):
        dS += s * q64[:, t, :, :, None] * do64[:, t, :, None, :]
        dq[:, t] = s * np.einsum("bhv,bhkv->bhk", do64[:, t], states[t + 1])
        dk[:, t] = np.einsum("bhkv,bhv->bhk", dS, v64[:, t])
        dv[:, t] = np.einsum("bhk,bhkv->bhv", k64[:, t], dS)
        decay = np.exp(g64[:, t])
        dg[:, t] = decay * np.einsum("bhkv,bhkv->bhk", states[t], dS)
        dS = decay[..., None] * dS
    return dq, dk, dv, dg, dS


def _documents(q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, **states: Any) -> list[int]:
    """Checks of a packed call (``do`` among ``states`` is a token array); the offsets as ints."""
    do = states.pop("do", None)
    B, T, H, K, V = validate_gla_inputs(q, k, v, g, do=do)
    cu = check_cu_seqlens(cu_seqlens, B, T)
    for name, x in states.items():
        if x is not None:
            check_document_states(name, x, len(cu) - 1, H, K, V, q)
    return [int(x) for x in cu]
