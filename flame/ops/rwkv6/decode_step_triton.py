"""rwkv6_decode_step in Triton: one program per (sequence, head) holds the head's fp32 state
S [N, N] (key rows, value columns), reads it out with r plus the bonus, updates it with the
data-dependent decay, and applies the head's GroupNorm and the silu gate: one launch for the whole
time mix between the projections and the output projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.dependent_launch import dependent_launch, launch_options, wait_for_producers


@triton.jit
def _rwkv6_decode_kernel(r, k, v, gate, w_l, time_decay, u, ln_w, ln_b, state, y,
                         s_r, s_k, s_v, s_g, s_w, H, C, eps, N: tl.constexpr, BN: tl.constexpr,
                         PDL: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    ch = i_h * N + o_n
    p_s = state + i_bh * N * N + o_n[:, None] * N + o_n[None, :]
    m_s = m_n[:, None] & m_n[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0)  # the layer's own state: no earlier kernel of the step writes it
    wait_for_producers(PDL)

    b_r = tl.load(r + i_b * s_r + ch, mask=m_n, other=0).to(tl.float32)
    b_k = tl.load(k + i_b * s_k + ch, mask=m_n, other=0).to(tl.float32)
    b_v = tl.load(v + i_b * s_v + ch, mask=m_n, other=0).to(tl.float32)
    b_gate = tl.load(gate + i_b * s_g + ch, mask=m_n, other=0).to(tl.float32)
    b_w = tl.load(w_l + i_b * s_w + ch, mask=m_n, other=0).to(tl.float32) \
        + tl.load(time_decay + ch, mask=m_n, other=0).to(tl.float32)
    b_decay = tl.exp(-tl.exp(b_w))
    b_u = tl.load(u + ch, mask=m_n, other=0).to(tl.float32)

    b_o = tl.sum(b_r[:, None] * b_s, 0) + tl.sum(b_r * b_u * b_k, 0) * b_v
    tl.store(p_s, b_decay[:, None] * b_s + b_k[:, None] * b_v[None, :], mask=m_s)

    b_oc = tl.where(m_n, b_o - tl.sum(b_o, 0) / N, 0.0)
    b_o = b_oc / tl.sqrt(tl.sum(b_oc * b_oc, 0) / N + eps)
    b_o = b_o * tl.load(ln_w + ch, mask=m_n, other=0).to(tl.float32) \
        + tl.load(ln_b + ch, mask=m_n, other=0).to(tl.float32)
    b_y = b_o * (b_gate * tl.sigmoid(b_gate))
    tl.store(y + i_b * C + ch, b_y.to(y.dtype.element_ty), mask=m_n)


def rwkv6_decode_step_triton(r, k, v, gate, w_lora, time_decay, u, ln_weight, ln_bias, ln_eps, state):
    """Inputs are already checked (flame.ops.rwkv6.decode_step)."""
    B, C = r.shape
    H, N = u.shape
    y = torch.empty(B, C, dtype=r.dtype, device=r.device)
    BN = max(triton.next_power_of_2(N), 16)
    pdl = dependent_launch(r.device)
    _rwkv6_decode_kernel[(B * H,)](
        r, k, v, gate, w_lora, time_decay, u, ln_weight, ln_bias, state, y,
        r.stride(0), k.stride(0), v.stride(0), gate.stride(0), w_lora.stride(0), H, C, ln_eps,
        N=N, BN=BN, PDL=pdl, num_warps=4 if BN <= 64 else 8, **launch_options(pdl),
    )
    return y
