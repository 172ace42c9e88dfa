"""The chunk output: o = scale (q * exp(Γq)) S_in + A v, with A the intra-chunk matrix (kernels.md 1.2)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .intra import intra_chunk_matrix, load_query_gate, load_rows, mm
from .layout import ChunkLayout, chunk_span


@triton.jit
def _output_kernel(q, k, v, gc, u, h, o, cu_seqlens, chunk_indices, scale,
                   H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr, HAS_U: tl.constexpr,
                   DT: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    m_t = rows < Tc
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V

    A = intra_chunk_matrix(q, k, gc, u, t0, Tc, i_h, scale, H, K, BT, BC, BK, EXCLUSIVE, HAS_U, DT)
    vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
    acc = mm(A, vv, DT)
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
        qg = qq * tl.exp2(tl.where(m_t[:, None], gq, float("-inf"))) * scale
        S = tl.load(h + (i_c.to(tl.int64) * H + i_h) * K * V + ck[:, None] * V + cv[None, :],
                    mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc += mm(qg, S, DT)
    off = ((t0 + rows)[:, None] * H + i_h) * V + cv[None, :]
    tl.store(o + off, acc.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


def chunk_output_fwd(q, k, v, gc, h, layout: ChunkLayout, scale: float, exclusive: bool, u, dot_dtype,
                     block_k: int, block_v: int, sub_chunk: int = 16):
    """o [B, T, H, V] in v's dtype from the per-chunk states h of `chunk_state_fwd`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    _output_kernel[(layout.num_chunks, H, triton.cdiv(V, block_v))](
        q, k, v, gc, u, h, o, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=layout.chunk_size, BC=sub_chunk, BK=block_k, BV=block_v,
        EXCLUSIVE=exclusive, HAS_U=u is not None, DT=dot_dtype, num_warps=8 if block_k >= 64 else 4, num_stages=1)
    return o
