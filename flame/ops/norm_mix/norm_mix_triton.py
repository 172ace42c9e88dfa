"""norm_mix in Triton: one program per row (sequence) holds the whole row of C
channels.

Per row: x (+ add * sigmoid(gate)) rounded to x's dtype and stored back, optional silu, LayerNorm
or RMSNorm in fp32 with the affine parameters, h rounded to x's dtype; with lerps, delta =
previous - h, previous <- h, and out_i = h + delta * mu_i for each of the N coefficient rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_mix_kernel(x, add, gate, weight, bias, previous, mu, out, C, B, stride_add, stride_gate, eps,
                     N_MIX: tl.constexpr, HAS_ADD: tl.constexpr, HAS_GATE: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr, SILU: tl.constexpr,
                     BLOCK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    row = i_b * C
    b_x = tl.load(x + row + cols, mask=mask, other=0).to(tl.float32)
    if HAS_ADD:
        b_y = tl.load(add + i_b * stride_add + cols, mask=mask, other=0).to(tl.float32)
        if HAS_GATE:
            b_g = tl.load(gate + i_b * stride_gate + cols, mask=mask, other=0).to(tl.float32)
            b_y = b_y * tl.sigmoid(b_g)
        b_x = (b_x + b_y).to(x.dtype.element_ty)
        tl.store(x + row + cols, b_x, mask=mask)
        b_x = b_x.to(tl.float32)
    if SILU:
        b_x = b_x * tl.sigmoid(b_x)
    if RMS:
        b_n = b_x / tl.sqrt(tl.sum(b_x * b_x, 0) / C + eps)
    else:
        b_c = tl.where(mask, b_x - tl.sum(b_x, 0) / C, 0.0)
        b_n = b_c / tl.sqrt(tl.sum(b_c * b_c, 0) / C + eps)
    if HAS_WEIGHT:
        b_n = b_n * tl.load(weight + cols, mask=mask, other=0).to(tl.float32)
    if HAS_BIAS:
        b_n = b_n + tl.load(bias + cols, mask=mask, other=0).to(tl.float32)
    b_h = b_n.to(out.dtype.element_ty)
    if N_MIX == 0:
        tl.store(out + row + cols, b_h, mask=mask)
    else:
        b_hf = b_h.to(tl.float32)
        b_d = tl.load(previous + row + cols, mask=mask, other=0).to(tl.float32) - b_hf
        tl.store(previous + row + cols, b_h, mask=mask)
        for i in tl.static_range(N_MIX):
            b_mu = tl.load(mu + i * C + cols, mask=mask, other=0).to(tl.float32)
            tl.store(out + i * B * C + row + cols, (b_hf + b_d * b_mu).to(out.dtype.element_ty), mask=mask)


def norm_mix_triton(x, weight, bias, eps, norm, add, gate, previous, mu, silu):
    """Inputs are already checked (flame.ops.norm_mix)."""
    B, C = x.shape
    n_mix = 0 if mu is None else mu.shape[0]
    out = torch.empty((n_mix, B, C) if n_mix else (B, C), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(C)
    _norm_mix_kernel[(B,)](
        x, add, gate, weight, bias, previous, None if mu is None else mu.contiguous(), out, C, B,
        add.stride(0) if add is not None else 0, gate.stride(0) if gate is not None else 0, eps,
        N_MIX=n_mix, HAS_ADD=add is not None, HAS_GATE=gate is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None and norm == "layer", RMS=norm == "rms", SILU=bool(silu), BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
    return out
