"""Float64 token-by-token GLA in PyTorch (differentiable by autograd): the reference of the torch tests.

Per batch ``b`` and head ``h``: ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``;
``q, k, g: [B, T, H, K]``, ``v, o: [B, T, H, V]``, states ``[B, H, K, V]``. Slow (a Python loop over T):
for test shapes only.
"""

from __future__ import annotations

import torch

__all__ = ["recurrent_gla_torch", "recurrent_gla_varlen_torch"]


def recurrent_gla_torch(q, k, v, g, scale=None, initial_state=None):
    """``(o [B, T, H, V], states [T + 1, B, H, K, V])`` in float64; ``states[t]`` is the state after ``t`` tokens
    (``states[0]`` the initial state, ``states[T]`` the final state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    s = K**-0.5 if scale is None else scale
    q, k, v, g = (x.to(torch.float64) for x in (q, k, v, g))
    S = torch.zeros(B, H, K, V, dtype=torch.float64) if initial_state is None else initial_state.to(torch.float64)
    states, outs = [S], []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        states.append(S)
        outs.append(torch.einsum("bhk,bhkv->bhv", s * q[:, t], S))
    o = torch.stack(outs, dim=1) if T else torch.zeros(B, 0, H, V, dtype=torch.float64)
    return o, torch.stack(states)


def recurrent_gla_varlen_torch(q, k, v, g, cu_seqlens, scale=None, initial_state=None):
    """Packed documents (``B == 1``, ``cu_seqlens [N + 1]``), each run alone.

    Returns ``(o [1, T, H, V], final states [N, H, K, V])`` in float64."""
    outs, finals = [], []
    bounds = [int(x) for x in cu_seqlens]
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[n : n + 1]
        o, states = recurrent_gla_torch(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], scale=scale, initial_state=h0)
        outs.append(o)
        finals.append(states[-1][0])
    return torch.cat(outs, dim=1), torch.stack(finals)
