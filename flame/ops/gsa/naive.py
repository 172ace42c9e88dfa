"""The GSA (gated slot attention) recurrence, step by step (docs/kernels.md#gsa-recurrence): the test oracle.

For one (sequence, head), with M slots, key-slot state Hk in R^{K x M}, slot-value state
Hv in R^{M x V}, alpha_t = exp(g_t) and sc the scale:

    Hk_t = Hk_{t-1} diag(alpha_t) + k_t s_t^T
    p_t  = softmax_M(Hk_t^T (sc q_t))
    Hv_t = diag(alpha_t) Hv_{t-1} + s_t v_t^T
    o_t  = Hv_t^T p_t                                         (both passes read the updated state)

Grouped queries: q has HQ = G*H heads; query head j reads the states of key/value head j // G.
"""

from __future__ import annotations

import torch

from ..common.chunk_torch import per_sequence


def _gsa_steps(q, k, v, s, g, scale, hk, hv):
    """q [N,T,HQ,K], k [N,T,H,K], v [N,T,H,V], s, g [N,T,H,M], hk [N,H,K,M], hv [N,H,M,V]."""
    N, T, HQ, K = q.shape
    H = k.shape[2]
    G = HQ // H
    outputs = []
    for t in range(T):
        alpha = torch.exp(g[:, t])                                          # [N,H,M]
        hk = hk * alpha[:, :, None, :] + k[:, t, :, :, None] * s[:, t, :, None, :]
        q_t = q[:, t].reshape(N, H, G, K) * scale
        p_t = torch.softmax(torch.einsum("nhgk,nhkm->nhgm", q_t, hk), dim=-1)
        hv = alpha[..., None] * hv + s[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(torch.einsum("nhgm,nhmv->nhgv", p_t, hv).reshape(N, HQ, -1))
    if not outputs:  # an empty sequence
        return q.new_zeros(N, 0, HQ, v.shape[-1]), hk, hv
    return torch.stack(outputs, dim=1), hk, hv


def naive_gsa(q, k, v, s, g, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Step-by-step GSA in the dtype of q (float64 for the test oracle), gradients by autograd.

    q: [B,T,HQ,K] with HQ = G*H; k: [B,T,H,K]; v: [B,T,H,V]; s, g: [B,T,H,M] (g the log-forget,
    <= 0); initial_state: (hk [N,H,K,M], hv [N,H,M,V]) or None (zeros), with N = B, or
    N = len(cu_seqlens) - 1 when cu_seqlens packs N sequences into B == 1.
    Returns (o [B,T,HQ,V], (hk, hv) or None), in the dtype of q.
    """
    B, _, _, K = q.shape
    H, M, V = k.shape[2], s.shape[-1], v.shape[-1]
    dtype = q.dtype
    k, v, s, g = (x.to(dtype) for x in (k, v, s, g))
    if initial_state is None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        hk0, hv0 = q.new_zeros(N, H, K, M), q.new_zeros(N, H, M, V)
    else:
        hk0, hv0 = (h.to(dtype) for h in initial_state)

    def steps(q, k, v, s, g, state):
        o, hk, hv = _gsa_steps(q, k, v, s, g, scale, *state)
        return o, (hk, hv)

    o, final = per_sequence(steps, (q, k, v, s, g), (hk0, hv0), cu_seqlens)
    return o, (final if output_final_state else None)
