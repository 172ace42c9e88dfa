"""RWKV7 in chunked form, in PyTorch: the UT / WY transform of
docs/kernels.md#rwkv7-chunked-form; gradients by autograd.

Per chunk with the inclusive / exclusive chunk-local cumsums G / Gx of the log-decay w, the
pseudo-values P (p_t = a_t^T S_{t-1}) solve a unit lower-triangular system:

    P     = (I - M_ab)^-1 (A_hat S_in + M_ak V)                 A_hat = a * exp(Gx)
    O     = (sc r * exp(G)) S_in + M_qk V + M_qb P
    S_out = exp(G_L) * S_in + (k * exp(G_L - G))^T V + (b * exp(G_L - G))^T P

with M_qk, M_qb inclusive (j <= t) and M_ak, M_ab strict (j < t) decayed products. Everything
except the state pass is vectorised over batch, heads and chunks. Math runs in fp32 (fp64 for fp64
inputs), o is returned in the input dtype. gate_lower_bound is not needed: every exponent is <= 0.
"""

from __future__ import annotations

import torch

from ..common.chunk_torch import (DEFAULT_CHUNK, DEFAULT_SUB_CHUNK, decayed_scores, from_chunks,
                                  per_sequence, to_chunks)
from ..utils.dtypes import accumulation_dtype


def _chunk_rwkv7(r, w, k, v, a, b, scale, state, chunk_size, sub_chunk):
    """One batch of equal-length sequences; state [B,H,K,V] in the accumulation dtype (never None)."""
    dt = state.dtype
    T = r.shape[1]
    rc, wc, kc, vc, ac, bc = (to_chunks(x, chunk_size, dt) for x in (r, w, k, v, a, b))   # [B,H,NC,C,D]
    rc = rc * scale
    G = wc.cumsum(-2)
    Gx = G - wc
    G_last = G[..., -1:, :]

    M_qk, M_qb = decayed_scores(rc, G, G, (kc, bc), inclusive=True, sub=sub_chunk)
    M_ak, M_ab = decayed_scores(ac, Gx, G, (kc, bc), inclusive=False, sub=sub_chunk)

    eye = torch.eye(rc.shape[-2], dtype=dt, device=rc.device)
    lower = eye - M_ab                                                                     # unit lower triangular
    # one solve for both right-hand sides: W = Tm A_hat [.., C, K] and U = Tm M_ak V [.., C, V]
    rhs = torch.cat([ac * torch.exp(Gx), M_ak @ vc], dim=-1)
    W, U = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True).split(
        [ac.shape[-1], vc.shape[-1]], dim=-1)

    to_end = torch.exp(G_last - G)
    k_to_end, b_to_end = kc * to_end, bc * to_end
    chunk_decay = torch.exp(G_last).transpose(-1, -2)                                      # [B,H,NC,K,1]
    states_in, pseudo = [], []
    for n in range(rc.shape[2]):
        P = U[:, :, n] + W[:, :, n] @ state
        states_in.append(state)
        pseudo.append(P)
        state = (chunk_decay[:, :, n] * state + k_to_end[:, :, n].transpose(-1, -2) @ vc[:, :, n]
                 + b_to_end[:, :, n].transpose(-1, -2) @ P)
    if not states_in:
        return r.new_zeros(r.shape[:3] + v.shape[-1:], dtype=dt), state
    S_in, P = torch.stack(states_in, dim=2), torch.stack(pseudo, dim=2)
    o = (rc * torch.exp(G)) @ S_in + M_qk @ vc + M_qb @ P
    return from_chunks(o, T), state


def chunk_rwkv7_torch(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                      gate_lower_bound=None, chunk_size=DEFAULT_CHUNK, sub_chunk=DEFAULT_SUB_CHUNK):
    """Chunked RWKV7 (same arguments as chunk_rwkv7, inputs already validated).

    Returns (o in r's dtype, final state [N,H,K,V] in fp32 (fp64 for fp64 inputs) or None).
    With cu_seqlens each sequence runs on its own, so chunks never cross a boundary.
    """
    dt = accumulation_dtype(r.dtype)
    B, T, H, K = r.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = r.new_zeros(N, H, K, v.shape[-1], dtype=dt) if initial_state is None else initial_state.to(dt)

    def run(r, w, k, v, a, b, state):
        return _chunk_rwkv7(r, w, k, v, a, b, scale, state, chunk_size, sub_chunk)

    o, final = per_sequence(run, (r, w, k, v, a, b), h0, cu_seqlens)
    return o.to(r.dtype), (final if output_final_state else None)
