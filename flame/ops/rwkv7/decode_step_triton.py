"""rwkv7_decode_step in Triton: one program per (sequence, head) holds the head's fp32 state
S [N, N] (key rows, value columns), computes the head's decay, in-context rate, value residual and
normalised key from the projections, updates S once, reads it out with r, and applies the head's
GroupNorm, the r.k bonus and the output gate: one launch for the whole time mix between the
projections and the output projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.dependent_launch import dependent_launch, launch_options, wait_for_producers


@triton.jit
def _rwkv7_decode_kernel(r, k, v, w_l, a_l, v_l, g, v_first, w0, a0, v0, k_k, k_a, r_k, ln_w, ln_b, state,
                         y, s_r, s_k, s_v, s_w, s_a, s_vl, s_g, H, C, eps, bound,
                         N: tl.constexpr, BN: tl.constexpr, IS_FIRST: tl.constexpr, PDL: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    ch = i_h * N + o_n  # the head's channels
    p_s = state + i_bh * N * N + o_n[:, None] * N + o_n[None, :]
    m_s = m_n[:, None] & m_n[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0)  # the layer's own state: no earlier kernel of the step writes it
    wait_for_producers(PDL)

    b_r = tl.load(r + i_b * s_r + ch, mask=m_n, other=0).to(tl.float32)
    b_k = tl.load(k + i_b * s_k + ch, mask=m_n, other=0).to(tl.float32)
    b_v = tl.load(v + i_b * s_v + ch, mask=m_n, other=0).to(tl.float32)
    b_g = tl.load(g + i_b * s_g + ch, mask=m_n, other=0).to(tl.float32)
    b_w = tl.load(w_l + i_b * s_w + ch, mask=m_n, other=0).to(tl.float32) \
        + tl.load(w0 + ch, mask=m_n, other=0).to(tl.float32)
    b_w = -bound * tl.sigmoid(b_w)
    b_a = tl.sigmoid(tl.load(a_l + i_b * s_a + ch, mask=m_n, other=0).to(tl.float32)
                     + tl.load(a0 + ch, mask=m_n, other=0).to(tl.float32))
    if IS_FIRST:
        tl.store(v_first + i_b * C + ch, b_v.to(v_first.dtype.element_ty), mask=m_n)
    else:
        b_vf = tl.load(v_first + i_b * C + ch, mask=m_n, other=0).to(tl.float32)
        b_vg = tl.sigmoid(tl.load(v_l + i_b * s_vl + ch, mask=m_n, other=0).to(tl.float32)
                          + tl.load(v0 + ch, mask=m_n, other=0).to(tl.float32))
        b_v = b_v + (b_vf - b_v) * b_vg
    b_kk = b_k * tl.load(k_k + ch, mask=m_n, other=0).to(tl.float32)
    b_kk = b_kk / tl.maximum(tl.sqrt(tl.sum(b_kk * b_kk, 0)), 1e-12)
    b_k = b_k * (1 + (b_a - 1) * tl.load(k_a + ch, mask=m_n, other=0).to(tl.float32))

    b_p = tl.sum(-b_kk[:, None] * b_s, 0)
    b_s = tl.exp(b_w)[:, None] * b_s + (b_kk * b_a)[:, None] * b_p[None, :] + b_k[:, None] * b_v[None, :]
    tl.store(p_s, b_s, mask=m_s)
    b_o = tl.sum(b_r[:, None] * b_s, 0)

    b_oc = tl.where(m_n, b_o - tl.sum(b_o, 0) / N, 0.0)
    b_o = b_oc / tl.sqrt(tl.sum(b_oc * b_oc, 0) / N + eps)
    b_o = b_o * tl.load(ln_w + ch, mask=m_n, other=0).to(tl.float32) \
        + tl.load(ln_b + ch, mask=m_n, other=0).to(tl.float32)
    bonus = tl.sum(b_r * b_k * tl.load(r_k + ch, mask=m_n, other=0).to(tl.float32), 0)
    b_y = (b_o + bonus * b_v) * b_g
    tl.store(y + i_b * C + ch, b_y.to(y.dtype.element_ty), mask=m_n)


def rwkv7_decode_step_triton(r, k, v, w_lora, a_lora, v_lora, g, v_first, w0, a0, v0, k_k, k_a, r_k, ln_weight,
                             ln_bias, ln_eps, state, decay_bound, is_first):
    """Inputs are already checked (flame.ops.rwkv7.decode_step)."""
    B, C = r.shape
    H, N = r_k.shape
    y = torch.empty(B, C, dtype=r.dtype, device=r.device)
    if is_first:
        v_lora, v0 = w_lora, w0  # unread placeholders of the right type
    BN = max(triton.next_power_of_2(N), 16)
    pdl = dependent_launch(r.device)
    _rwkv7_decode_kernel[(B * H,)](
        r, k, v, w_lora, a_lora, v_lora, g, v_first, w0, a0, v0, k_k, k_a, r_k, ln_weight, ln_bias, state, y,
        r.stride(0), k.stride(0), v.stride(0), w_lora.stride(0), a_lora.stride(0), v_lora.stride(0), g.stride(0),
        H, C, ln_eps, decay_bound, N=N, BN=BN, IS_FIRST=bool(is_first), PDL=pdl,
        num_warps=4 if BN <= 64 else 8, **launch_options(pdl),
    )
    return y
