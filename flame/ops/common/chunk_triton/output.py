"""The forward's chunk-parallel kernels: the intra-chunk matrix A (stored), and the output from it.

o = scale (q * exp(Γq)) S_in + A v   (docs/kernels.md#rwkv6-chunked-forward), with A [BT, BT] per
(chunk, head) stored in fp32 as [B, T, H, BT] (row τ of chunk c at token t0 + τ), zero above the
diagonal and in the columns >= the chunk's length; the backward reuses it (dv = A^T do + ...). The A
kernel can also write the chunk's local state term Δ = Σ_j (k_j * exp(Γ_L - Γ_j)) v_j^T (state.py)
while k and Γ are loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .intra import diagonal_pairs, load_query_gate, load_row, load_rows, load_rows3, mm, sub_chunks
from .layout import ChunkLayout, chunk_span

INTRA_WARPS = 4  # default launch settings (module constants so that a benchmark can sweep them)
INTRA_BLOCK_K = 64  # the A kernel loops over K in blocks of at most this width
OUTPUT_WARPS = 4


@triton.jit
def _intra_fwd_kernel(q, k, v, gc, u, A, h, cu_seqlens, chunk_indices, scale,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr, HAS_U: tl.constexpr,
                      LOCAL_STATE: tl.constexpr, DT: tl.constexpr):
    """A[τ, j] = scale Σ_i q[τ,i] k[j,i] exp(Γq[τ,i] - Γ[j,i]) for j < τ (j <= τ if not EXCLUSIVE),
    plus scale Σ_i q[τ,i] u[i] k[τ,i] on the diagonal if HAS_U.

    Off-diagonal sub-blocks (query sub-chunk s, keys before it): tensor-core products factored
    around the reference n = the row before sub-chunk s (clamped to the last valid row), so both
    exp(Γq - Γ_n) and exp(Γ_n - Γ_j) are <= 1 for any decay (docs/kernels.md#stable-decay-placement).
    The BC x BC diagonal sub-blocks: exact per-pair exponents (`diagonal_pairs`, in the [NB, BC, BK]
    view of the chunk, NB = BT // BC sub-chunks), collected in an [NB, BC, BC] tile and stored at
    columns s * BC + (0..BC-1).
    """
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = rows < Tc
    blk = rows // BC
    NB: tl.constexpr = BT // BC
    nb, ic, r3, m3 = sub_chunks(Tc, BT, BC)  # [NB, BC]: row i of sub-chunk s is chunk row s * BC + i
    A_off = tl.zeros([BT, BT], dtype=tl.float32)
    A_diag = tl.zeros([NB, BC, BC], dtype=tl.float32)
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
        gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
        if LOCAL_STATE:
            gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
            kg = kk * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gk, float("-inf")))
            for i_v in tl.static_range(0, triton.cdiv(V, BV)):
                cv = i_v * BV + tl.arange(0, BV)
                m_v = cv < V
                vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
                tl.store(h + (i_c * H + i_h) * K * V + ck[:, None] * V + cv[None, :], mm(tl.trans(kg), vv, DT),
                         mask=m_k[:, None] & m_v[None, :])
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
        for s in tl.static_range(1, NB):
            ref = tl.minimum(s * BC - 1, Tc - 1)
            gn = load_row(gc, t0, ref, i_h, ck, m_k, H, K)
            qs = qq * tl.exp2(tl.where(((blk == s) & m_t)[:, None], gq - gn[None, :], float("-inf")))
            ks = kk * tl.exp2(tl.where(((rows < s * BC) & m_t)[:, None], gn[None, :] - gk, float("-inf")))
            A_off += mm(qs, tl.trans(ks), DT)
        A_diag += diagonal_pairs(q, k, gc, t0, Tc, i_h, ck, m_k, H, K, BT, BC, EXCLUSIVE)
        if HAS_U:
            q3 = load_rows3(q, t0, r3, m3, i_h, ck, m_k, H, K)
            k3 = load_rows3(k, t0, r3, m3, i_h, ck, m_k, H, K)
            uu = tl.load(u + i_h * K + ck, mask=m_k, other=0.0).to(tl.float32)
            bonus = tl.sum(q3 * uu[None, None, :] * k3, axis=2)
            A_diag = tl.where(ic[None, None, :] == ic[None, :, None], A_diag + bonus[:, :, None], A_diag)
    a_row = ((t0 + rows) * H + i_h) * BT
    tl.store(A + a_row[:, None] + cols[None, :], A_off * scale,
             mask=m_t[:, None] & ((cols // BC)[None, :] != blk[:, None]))
    a_row3 = ((t0 + r3) * H + i_h) * BT
    tl.store(A + a_row3[:, :, None] + (nb * BC)[:, None, None] + ic[None, None, :], A_diag * scale,
             mask=m3[:, :, None])


@triton.jit
def _output_kernel(q, v, gc, h, A, o, cu_seqlens, chunk_indices, scale,
                   H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr, DT: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = rows < Tc
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V

    a_row = ((t0 + rows) * H + i_h) * BT
    Aw = tl.load(A + a_row[:, None] + cols[None, :], mask=m_t[:, None], other=0.0)
    vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
    acc = mm(Aw, vv, DT)
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
        qg = qq * tl.exp2(tl.where(m_t[:, None], gq, float("-inf"))) * scale
        S = tl.load(h + (i_c * H + i_h) * K * V + ck[:, None] * V + cv[None, :],
                    mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc += mm(qg, S, DT)
    off = ((t0 + rows)[:, None] * H + i_h) * V + cv[None, :]
    tl.store(o + off, acc.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


def chunk_intra_fwd(q, k, gc, u, layout: ChunkLayout, scale: float, exclusive: bool, dot_dtype,
                    block_k: int, v=None, block_v: int = 64, sub_chunk: int = 16, num_warps: int | None = None):
    """A [B, T, H, BT] fp32 (see the module docstring), and, if v is given, the local state terms
    Δ [num_chunks, H, K, V] fp32 of every chunk (for `chunk_scan_states`), else None.
    num_warps: the kernel's launch width (default INTRA_WARPS); a family may pick its own."""
    B, T, H, K = q.shape
    V = v.shape[-1] if v is not None else 1
    BT = layout.chunk_size
    A = torch.empty(B, T, H, BT, device=q.device, dtype=torch.float32)
    h = torch.empty(layout.num_chunks, H, K, V, device=q.device, dtype=torch.float32) if v is not None else None
    _intra_fwd_kernel[(layout.num_chunks, H)](
        q, k, v, gc, u, A, h, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=BT, BC=min(sub_chunk, BT), BK=min(block_k, INTRA_BLOCK_K), BV=block_v, EXCLUSIVE=exclusive,
        HAS_U=u is not None, LOCAL_STATE=v is not None, DT=dot_dtype, num_warps=num_warps or INTRA_WARPS, num_stages=1)
    return A, h


def chunk_output(q, v, gc, h, A, layout: ChunkLayout, scale: float, exclusive: bool, dot_dtype,
                 block_k: int, block_v: int):
    """o [B, T, H, V] in v's dtype from the per-chunk entering states h and the intra matrix A."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    _output_kernel[(layout.num_chunks, H, triton.cdiv(V, block_v))](
        q, v, gc, h, A, o, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=layout.chunk_size, BK=block_k, BV=block_v, EXCLUSIVE=exclusive, DT=dot_dtype,
        num_warps=OUTPUT_WARPS, num_stages=1)
    return o
