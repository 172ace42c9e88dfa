"""The RWKV6 recurrence, step by step (docs/kernels.md#rwkv6-recurrence): the test oracle.

For one (sequence, head), with the state S in R^{K x V} and sc the scale:

    o_t = S_{t-1}^T (sc r_t) + (sc r_t . (u * k_t)) v_t      (reads the state before the update,
    S_t = exp(w_t) * S_{t-1} + k_t v_t^T                      plus the bonus u for the current token)

w is the log-decay (<= 0) and exp(w_t) scales row i of S by exp(w_{t,i}).
"""

from __future__ import annotations

import torch

from ..common.chunk_torch import per_sequence


def _rwkv6_steps(r, k, v, w, u, scale, state):
    """r, k, w [N,T,H,K], v [N,T,H,V], u [H,K], state [N,H,K,V] -> o [N,T,H,V], final state."""
    outputs = []
    for t in range(r.shape[1]):
        r_t, k_t, v_t = r[:, t] * scale, k[:, t], v[:, t]                    # [N,H,K], [N,H,K], [N,H,V]
        from_state = torch.einsum("nhk,nhkv->nhv", r_t, state)
        bonus = (r_t * u * k_t).sum(-1, keepdim=True) * v_t
        outputs.append(from_state + bonus)
        state = torch.exp(w[:, t])[..., None] * state + k_t[..., None] * v_t[..., None, :]
    if not outputs:  # an empty sequence
        return v.new_zeros(v.shape), state
    return torch.stack(outputs, dim=1), state


def naive_rwkv6(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Step-by-step RWKV6 in the dtype of r (float64 for the test oracle), gradients by autograd.

    r, k, w: [B,T,H,K]; v: [B,T,H,V]; u: [H,K]; initial_state: [N,H,K,V] or None (zeros), with
    N = B, or N = len(cu_seqlens) - 1 when cu_seqlens packs N sequences into B == 1.
    Returns (o [B,T,H,V], final state [N,H,K,V] or None), both in the dtype of r.
    """
    B, _, H, K = r.shape
    dtype = r.dtype
    k, v, w, u = k.to(dtype), v.to(dtype), w.to(dtype), u.to(dtype)
    if initial_state is None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        initial_state = r.new_zeros(N, H, K, v.shape[-1])

    def steps(r, k, v, w, state):
        return _rwkv6_steps(r, k, v, w, u, scale, state)

    o, final = per_sequence(steps, (r, k, v, w), initial_state.to(dtype), cu_seqlens)
    return o, (final if output_final_state else None)
