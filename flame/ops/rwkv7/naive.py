"""The RWKV7 (DPLR delta rule) recurrence, step by step (docs/kernels.md#rwkv7-recurrence): the test oracle.

For one (sequence, head), with the state S in R^{K x V} and sc the scale:

    p_t = a_t^T S_{t-1}                                       (1 x V)
    S_t = exp(w_t) * S_{t-1} + b_t p_t + k_t v_t^T
    o_t = S_t^T (sc r_t)                                      (reads the state after the update)

w is the log-decay (<= 0). In the RWKV7 layer a = -kappa_hat and b = kappa_hat * alpha.
"""

from __future__ import annotations

import torch

from ..common.chunk_torch import per_sequence


def _rwkv7_steps(r, w, k, v, a, b, scale, state):
    """r, w, k, a, b [N,T,H,K], v [N,T,H,V], state [N,H,K,V] -> o [N,T,H,V], final state."""
    outputs = []
    for t in range(r.shape[1]):
        p_t = torch.einsum("nhk,nhkv->nhv", a[:, t], state)
        state = (
            torch.exp(w[:, t])[..., None] * state
            + b[:, t, :, :, None] * p_t[..., None, :]
            + k[:, t, :, :, None] * v[:, t, :, None, :]
        )
        outputs.append(torch.einsum("nhk,nhkv->nhv", r[:, t] * scale, state))
    if not outputs:  # an empty sequence
        return v.new_zeros(v.shape), state
    return torch.stack(outputs, dim=1), state


def naive_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                gate_lower_bound=None):
    """Step-by-step RWKV7 in the dtype of r (float64 for the test oracle), gradients by autograd.

    r, w, k, a, b: [B,T,H,K]; v: [B,T,H,V]; initial_state: [N,H,K,V] or None (zeros), with N = B,
    or N = len(cu_seqlens) - 1 when cu_seqlens packs N sequences into B == 1.
    gate_lower_bound is accepted for signature parity and unused (the recurrence needs no bound).
    Returns (o [B,T,H,V], final state [N,H,K,V] or None), both in the dtype of r.
    """
    B, _, H, K = r.shape
    dtype = r.dtype
    w, k, v, a, b = (x.to(dtype) for x in (w, k, v, a, b))
    if initial_state is None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        initial_state = r.new_zeros(N, H, K, v.shape[-1])

    def steps(r, w, k, v, a, b, state):
        return _rwkv7_steps(r, w, k, v, a, b, scale, state)

    o, final = per_sequence(steps, (r, w, k, v, a, b), initial_state.to(dtype), cu_seqlens)
    return o, (final if output_final_state else None)
