"""RWKV6 in chunked form, in PyTorch (docs/kernels.md#rwkv6-chunked-forward); gradients by autograd.

Per chunk with the inclusive / exclusive chunk-local cumsums G / Gx of the log-decay w:

    o     = sc (r * exp(Gx)) S_in  +  A v  +  sc (r . (u * k)) v      A[t,j] = sc sum_i r k exp(Gx_t - G_j), j < t
    S_out = exp(G_L) * S_in  +  (k * exp(G_L - G))^T v

Intra-chunk products are vectorised over batch, heads and chunks; only the state pass loops over
chunks. Math runs in fp32 (fp64 for fp64 inputs), o is returned in the input dtype.
"""

from __future__ import annotations

import torch

from ..common.chunk_torch import (DEFAULT_CHUNK, DEFAULT_SUB_CHUNK, decayed_scores, from_chunks,
                                  per_sequence, to_chunks)
from ..utils.dtypes import accumulation_dtype


def _chunk_rwkv6(r, k, v, w, u, scale, state, chunk_size, sub_chunk):
    """One batch of equal-length sequences; state [B,H,K,V] in the accumulation dtype (never None)."""
    dt = state.dtype
    T = r.shape[1]
    rc, kc, vc, wc = (to_chunks(x, chunk_size, dt) for x in (r, k, v, w))       # [B,H,NC,C,D]
    rc = rc * scale
    G = wc.cumsum(-2)
    Gx = G - wc
    G_last = G[..., -1:, :]                                                        # [B,H,NC,1,K]

    (A,) = decayed_scores(rc, Gx, G, (kc,), inclusive=False, sub=sub_chunk)       # [B,H,NC,C,C]
    bonus = (rc * u.to(dt)[None, :, None, None, :] * kc).sum(-1, keepdim=True)    # [B,H,NC,C,1]
    o = A @ vc + bonus * vc

    k_to_end = kc * torch.exp(G_last - G)
    chunk_decay = torch.exp(G_last).transpose(-1, -2)                             # [B,H,NC,K,1]
    states_in = []
    for n in range(rc.shape[2]):
        states_in.append(state)
        state = chunk_decay[:, :, n] * state + k_to_end[:, :, n].transpose(-1, -2) @ vc[:, :, n]
    if states_in:
        o = o + (rc * torch.exp(Gx)) @ torch.stack(states_in, dim=2)
    return from_chunks(o, T), state


def chunk_rwkv6_torch(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                      chunk_size=DEFAULT_CHUNK, sub_chunk=DEFAULT_SUB_CHUNK):
    """Chunked RWKV6 (same arguments as chunk_rwkv6, inputs already validated).

    Returns (o in r's dtype, final state [N,H,K,V] in fp32 (fp64 for fp64 inputs) or None).
    With cu_seqlens each sequence runs on its own, so chunks never cross a boundary.
    """
    dt = accumulation_dtype(r.dtype)
    B, T, H, K = r.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = r.new_zeros(N, H, K, v.shape[-1], dtype=dt) if initial_state is None else initial_state.to(dt)

    def run(r, k, v, w, state):
        return _chunk_rwkv6(r, k, v, w, u, scale, state, chunk_size, sub_chunk)

    o, final = per_sequence(run, (r, k, v, w), h0, cu_seqlens)
    return o.to(r.dtype), (final if output_final_state else None)
