"""Chunk-local cumulative sum of a log-gate, in fp32, pre-scaled by log2(e) (docs/kernels.md#base-2-exponents)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import ChunkLayout, chunk_span

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _chunk_cumsum_kernel(g, gc, cu_seqlens, chunk_indices,
                         H, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    m_t = rows < Tc
    for i_d in tl.static_range(0, triton.cdiv(D, BD)):
        cols = i_d * BD + tl.arange(0, BD)
        m = m_t[:, None] & (cols < D)[None, :]
        off = ((t0 + rows)[:, None] * H + i_h) * D + cols[None, :]
        x = tl.load(g + off, mask=m, other=0.0).to(tl.float32) * LOG2E
        tl.store(gc + off, tl.cumsum(x, axis=0), mask=m)


def chunk_local_cumsum(g: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Γ = log2(e) * (inclusive cumsum of g within each chunk), fp32, same shape as g [B, T, H, D].

    exp2(Γ_a - Γ_b) = exp(sum of g over (b, a]). The exclusive sum of row τ is Γ of row τ-1 (0 at a
    chunk start): kernels load it shifted, so that Γ̄_τ and Γ_{τ-1} are bitwise equal.
    """
    B, T, H, D = g.shape
    gc = torch.empty(g.shape, device=g.device, dtype=torch.float32)
    BD = min(64, max(16, triton.next_power_of_2(D)))
    _chunk_cumsum_kernel[(layout.num_chunks, H)](
        g, gc, layout.cu_seqlens, layout.chunk_indices, H=H, D=D, BT=layout.chunk_size, BD=BD)
    return gc
