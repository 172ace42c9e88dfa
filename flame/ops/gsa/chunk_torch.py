"""GSA in chunked form, in PyTorch (docs/kernels.md#gsa-chunked-forward): two gated passes around a softmax; autograd.

Per chunk with G the inclusive chunk-local cumsum of the slot log-forget g:

    pass K:  z = exp(G) * (sc q Hk_in) + sum_{j<=t} (sc q_t . k_j) s_j exp(G_t - G_j)      [C, M]
             Hk_out = Hk_in exp(G_L) + k^T (s * exp(G_L - G))
    softmax: p = softmax_M(z)   (fp32)
    pass V:  o = (p * exp(G)) Hv_in + A v,   A[t,j] = sum_m p_t s_j exp(G_t - G_j), j <= t
             Hv_out = exp(G_L) * Hv_in + (s * exp(G_L - G))^T v

Grouped queries are handled by repeating k, v, s, g and the initial states over each group of
query heads (autograd sums their gradients back); the final state is read from the first copy.
"""

from __future__ import annotations

import torch

from ..common.chunk_torch import (DEFAULT_CHUNK, DEFAULT_SUB_CHUNK, decayed_mix, decayed_scores, from_chunks,
                                  per_sequence, to_chunks)
from ..utils.dtypes import accumulation_dtype


def _chunk_gsa(q, k, v, s, g, scale, state, chunk_size, sub_chunk):
    """One batch of equal-length sequences with HQ == H; state = (hk [B,H,K,M], hv [B,H,M,V]) in the
    accumulation dtype. Returns (o, (hk, hv))."""
    hk, hv = state
    dt = hk.dtype
    T = q.shape[1]
    qc, kc, vc, sc_, gc = (to_chunks(x, chunk_size, dt) for x in (q, k, v, s, g))     # [B,H,NC,C,D]
    qc = qc * scale
    G = gc.cumsum(-2)
    G_last = G[..., -1:, :]
    C = qc.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()
    s_to_end = sc_ * torch.exp(G_last - G)
    chunk_decay = torch.exp(G_last)                                                     # [B,H,NC,1,M]

    # pass K: keys -> slot scores
    A_qk = torch.where(causal, qc @ kc.transpose(-1, -2), 0.0)
    z = decayed_mix(A_qk, sc_, G, sub=sub_chunk)
    hk_in = []
    for n in range(qc.shape[2]):
        hk_in.append(hk)
        hk = hk * chunk_decay[:, :, n] + kc[:, :, n].transpose(-1, -2) @ s_to_end[:, :, n]
    if not hk_in:
        return q.new_zeros(q.shape[:3] + v.shape[-1:], dtype=dt), (hk, hv)
    z = z + torch.exp(G) * (qc @ torch.stack(hk_in, dim=2))
    p = torch.softmax(z, dim=-1)

    # pass V: slots -> values
    (A_ps,) = decayed_scores(p, G, G, (sc_,), inclusive=True, sub=sub_chunk)
    hv_in = []
    for n in range(qc.shape[2]):
        hv_in.append(hv)
        hv = chunk_decay[:, :, n].transpose(-1, -2) * hv + s_to_end[:, :, n].transpose(-1, -2) @ vc[:, :, n]
    o = (p * torch.exp(G)) @ torch.stack(hv_in, dim=2) + A_ps @ vc
    return from_chunks(o, T), (hk, hv)


def chunk_gsa_torch(q, k, v, s, g, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                    chunk_size=DEFAULT_CHUNK, sub_chunk=DEFAULT_SUB_CHUNK):
    """Chunked GSA (same arguments as chunk_gsa, inputs already validated).

    Returns (o [B,T,HQ,V] in q's dtype, (hk, hv) in fp32 (fp64 for fp64 inputs) or None).
    With cu_seqlens each sequence runs on its own, so chunks never cross a boundary.
    """
    dt = accumulation_dtype(q.dtype)
    B, T, HQ, K = q.shape
    H, M, V = k.shape[2], s.shape[-1], v.shape[-1]
    group = HQ // H
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        hk0, hv0 = q.new_zeros(N, H, K, M, dtype=dt), q.new_zeros(N, H, M, V, dtype=dt)
    else:
        hk0, hv0 = (h.to(dt) for h in initial_state)
    if group > 1:
        k, v, s, g = (x.repeat_interleave(group, dim=2) for x in (k, v, s, g))
        hk0, hv0 = (h.repeat_interleave(group, dim=1) for h in (hk0, hv0))

    def run(q, k, v, s, g, state):
        return _chunk_gsa(q, k, v, s, g, scale, state, chunk_size, sub_chunk)

    o, (hk, hv) = per_sequence(run, (q, k, v, s, g), (hk0, hv0), cu_seqlens)
    if not output_final_state:
        return o.to(q.dtype), None
    return o.to(q.dtype), (hk[:, ::group], hv[:, ::group])
