"""gsa_decode_step in Triton: one program per (sequence, key/value head) walks the head's key-slot
state Hk [K, M] in blocks of BK rows (update, store, accumulate the G query heads' scores Hk^T q),
takes the softmax over the M slots, then walks the slot-value state Hv [M, V] in blocks of BV
columns (update, store, write o = Hv^T p): one launch for the whole attention of one token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.dependent_launch import dependent_launch, launch_options, wait_for_producers

TILE_ELEMENTS = 8192
"""fp32 state elements per block of the walk (8 warps): two blocks per state at K = 256, M = 64,
so a program's loads are few and large (its latency, not the bandwidth, bounds one token)."""


@triton.jit
def _expm1(x):
    """e^x - 1 without the cancellation of exp(x) - 1 near 0 (a Taylor polynomial for |x| < 1e-2)."""
    poly = x * (1 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24))))
    return tl.where(tl.abs(x) < 1e-2, poly, tl.exp(x) - 1)


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0 without the rounding of 1 + x near 0 (a Taylor polynomial for x < 1e-3)."""
    return tl.where(x < 1e-3, x * (1 - x * (0.5 - x * (1.0 / 3))), tl.log(1 + x))


@triton.jit
def _gsa_decode_kernel(q, k, v, f, state_k, state_v, o, s_q, s_k, s_v, s_f, normalizer, H,
                       G: tl.constexpr, K: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                       BG: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
                       PDL: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    o_g = tl.arange(0, BG)
    o_m = tl.arange(0, BM)
    m_g = o_g < G
    m_m = o_m < M
    # The first block of each state is in flight before the wait (the layer's own state: no earlier
    # kernel of the step writes it); each walk loads its next block before it updates the current.
    p_hk = state_k + i_bh * K * M
    p_hv = state_v + i_bh * M * V
    o_k = tl.arange(0, BK)
    b_hk = tl.load(p_hk + o_k[:, None] * M + o_m[None, :], mask=(o_k < K)[:, None] & m_m[None, :], other=0)
    o_v = tl.arange(0, BV)
    b_hv = tl.load(p_hv + o_m[:, None] * V + o_v[None, :], mask=m_m[:, None] & (o_v < V)[None, :], other=0)
    wait_for_producers(PDL)

    b_f = tl.load(f + i_b * s_f + i_h * M + o_m, mask=m_m, other=0).to(tl.float32)
    b_lg = tl.minimum(b_f, 0.0) - _log1p(tl.exp(-tl.abs(b_f)))  # logsigmoid
    b_gate = b_lg / normalizer
    b_alpha = tl.exp(b_gate)
    b_s = tl.where(m_m, -_expm1(b_gate), 0.0)

    q_heads = i_h * G + o_g  # the group's query heads
    b_z = tl.zeros([BG, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(k + i_b * s_k + i_h * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = b_k * tl.sigmoid(b_k)
        b_q = tl.load(q + i_b * s_q + q_heads[:, None] * K + o_k[None, :], mask=m_g[:, None] & m_k[None, :],
                      other=0).to(tl.float32)
        b_q = b_q * tl.sigmoid(b_q)
        m_km = m_k[:, None] & m_m[None, :]
        o_next = o_k + BK
        b_hk_next = tl.load(p_hk + o_next[:, None] * M + o_m[None, :], mask=(o_next < K)[:, None] & m_m[None, :],
                            other=0)
        b_hk = b_hk * b_alpha[None, :] + b_k[:, None] * b_s[None, :]
        tl.store(p_hk + o_k[:, None] * M + o_m[None, :], b_hk, mask=m_km)
        b_z += tl.sum(b_q[:, :, None] * b_hk[None, :, :], 1)
        b_hk = b_hk_next

    b_z = tl.where(m_m[None, :], b_z, float("-inf"))
    b_p = tl.exp(b_z - tl.max(b_z, 1)[:, None])
    b_p = b_p / tl.sum(b_p, 1)[:, None]

    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        b_v = tl.load(v + i_b * s_v + i_h * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_v = b_v * tl.sigmoid(b_v)
        m_mv = m_m[:, None] & m_v[None, :]
        o_next = o_v + BV
        b_hv_next = tl.load(p_hv + o_m[:, None] * V + o_next[None, :], mask=m_m[:, None] & (o_next < V)[None, :],
                            other=0)
        b_hv = b_alpha[:, None] * b_hv + b_s[:, None] * b_v[None, :]
        tl.store(p_hv + o_m[:, None] * V + o_v[None, :], b_hv, mask=m_mv)
        b_o = tl.sum(b_p[:, :, None] * b_hv[None, :, :], 1)
        b_hv = b_hv_next
        tl.store(o + i_b * (H * G * V) + q_heads[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_g[:, None] & m_v[None, :])


def gsa_decode_step_triton(q, k, v, f, normalizer, state_k, state_v):
    """Inputs are already checked (flame.ops.gsa.decode_step)."""
    B, H, K, M = state_k.shape
    V = state_v.shape[-1]
    G = q.shape[1] // (H * K)
    out = torch.empty(B, H * G * V, dtype=q.dtype, device=q.device)
    BG = triton.next_power_of_2(G)
    BM = max(triton.next_power_of_2(M), 16)
    BK = min(max(triton.next_power_of_2(K), 16), max(16, TILE_ELEMENTS // (BG * BM)))
    BV = min(max(triton.next_power_of_2(V), 16), max(16, TILE_ELEMENTS // (BG * BM)))
    pdl = dependent_launch(q.device)
    _gsa_decode_kernel[(B * H,)](
        q, k, v, f, state_k, state_v, out, q.stride(0), k.stride(0), v.stride(0), f.stride(0), normalizer, H,
        G=G, K=K, M=M, V=V, BG=BG, BK=BK, BM=BM, BV=BV, PDL=pdl, num_warps=8, **launch_options(pdl),
    )
    return out
