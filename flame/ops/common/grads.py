"""The chunk backward: dq, dk and the log-gate gradient (one kernel), and dv (another).

Per chunk, with dA = do v^T (the gradient of the intra-chunk matrix before scaling) and the states
S_in (entering) and dS_out (gradient of the leaving state) from the two state passes:
    dq = scale [exp(Γq) * (do S_in^T) + intra(dA)]            (+ the bonus term)
    dk = exp(Γ_L - Γ) * (v dS_out^T) + scale intra^T(dA)       (+ the bonus term)
    dv = A^T do + (k * exp(Γ_L - Γ)) dS_out
The intra parts use the same sub-chunk reference points as the forward (every exponent <= 0).
The gate gradient follows identity I2 (kernels.md 0.3, 1.4): with P = q * dq' and D = k * dk'
(dq', dk' without the bonus terms),
    dg_m = Σ_{τ >= m} (P - D)_τ  [- P_m if EXCLUSIVE]  +  exp(Γ_L) * rowsum(S_in * dS_out) + Σ_j k_j * dk^state_j
No autograd through exp, no per-pair gradient stored, no atomics: the bonus gradient is written
per chunk and reduced afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .intra import intra_chunk_matrix, load_query_gate, load_row, load_rows, mm, mm_tf32
from .layout import ChunkLayout, chunk_span


@triton.jit
def _dqkg_kernel(q, k, v, gc, u, h, do, dh, dq, dk, dg, du, cu_seqlens, chunk_indices, scale,
                 H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr, HAS_U: tl.constexpr,
                 DT: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_k = tl.program_id(2)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = rows < Tc
    blk = rows // BC
    ck = i_k * BK + tl.arange(0, BK)
    m_k = ck < K

    qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
    kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
    gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
    gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
    gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)

    dA = tl.zeros([BT, BT], dtype=tl.float32)
    dq_state = tl.zeros([BT, BK], dtype=tl.float32)
    dk_state = tl.zeros([BT, BK], dtype=tl.float32)
    s_ds = tl.zeros([BK], dtype=tl.float32)
    state_base = (i_c.to(tl.int64) * H + i_h) * K * V
    for i_v in tl.static_range(0, triton.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        dd = load_rows(do, t0, rows, m_t, i_h, cv, m_v, H, V)
        vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
        s_off = state_base + ck[:, None] * V + cv[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        S = tl.load(h + s_off, mask=m_kv, other=0.0)
        dS = tl.load(dh + s_off, mask=m_kv, other=0.0)
        dA += mm(dd, tl.trans(vv), DT)
        dq_state += mm(dd, tl.trans(S), DT)
        dk_state += mm(vv, tl.trans(dS), DT)
        s_ds += tl.sum(S * dS, axis=1)

    dq_ = dq_state * tl.exp2(tl.where(m_t[:, None], gq, float("-inf"))) * scale
    dk_ = dk_state * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gk, float("-inf")))
    g_last = tl.exp2(gl) * s_ds + tl.sum(kk * dk_, axis=0)

    if HAS_U:
        dA_diag = tl.sum(tl.where(cols[None, :] == rows[:, None], dA, 0.0), axis=1)
    if EXCLUSIVE:
        m_A = cols[None, :] < rows[:, None]
    else:
        m_A = cols[None, :] <= rows[:, None]
    dA = tl.where(m_A & m_t[:, None], dA, 0.0) * scale

    # queries of sub-chunk s against the keys before it (reference: the row before s)
    for s in tl.static_range(1, BT // BC):
        ref = tl.minimum(s * BC - 1, Tc - 1)
        gn = load_row(gc, t0, ref, i_h, ck, m_k, H, K)
        ks = kk * tl.exp2(tl.where(((rows < s * BC) & m_t)[:, None], gn[None, :] - gk, float("-inf")))
        dq_ += mm_tf32(dA, ks, DT) * tl.exp2(tl.where(((blk == s) & m_t)[:, None], gq - gn[None, :], float("-inf")))
    # keys of sub-chunk s against the queries after it (reference: the last row of s)
    for s in tl.static_range(0, BT // BC - 1):
        ref = tl.minimum(s * BC + BC - 1, Tc - 1)
        gm = load_row(gc, t0, ref, i_h, ck, m_k, H, K)
        qs = qq * tl.exp2(tl.where(((rows >= (s + 1) * BC) & m_t)[:, None], gq - gm[None, :], float("-inf")))
        dk_ += mm_tf32(tl.trans(dA), qs, DT) * tl.exp2(
            tl.where(((blk == s) & m_t)[:, None], gm[None, :] - gk, float("-inf")))
    # diagonal sub-blocks, pair by pair: column c of every sub-chunk at once
    for c in range(0, BC):
        j = blk * BC + c
        if EXCLUSIVE:
            m_j = (j < rows) & m_t
            m_i = (j > rows) & (j < Tc)
        else:
            m_j = (j <= rows) & m_t
            m_i = (j >= rows) & (j < Tc)
        kj = load_rows(k, t0, j, m_j, i_h, ck, m_k, H, K)
        gj = load_rows(gc, t0, j, m_j, i_h, ck, m_k, H, K)
        dA_qj = tl.sum(tl.where(cols[None, :] == j[:, None], dA, 0.0), axis=1)       # dA[τ, j(τ)]
        dq_ += dA_qj[:, None] * kj * tl.exp2(tl.where(m_j[:, None], gq - gj, float("-inf")))
        qi = load_rows(q, t0, j, m_i, i_h, ck, m_k, H, K)
        gi = load_query_gate(gc, t0, j, m_i, i_h, ck, m_k, H, K, EXCLUSIVE)
        dA_ik = tl.sum(tl.where(rows[:, None] == j[None, :], dA, 0.0), axis=0)       # dA[i(κ), κ]
        dk_ += dA_ik[:, None] * qi * tl.exp2(tl.where(m_i[:, None], gi - gk, float("-inf")))

    P = qq * dq_
    dg_ = tl.cumsum(P - kk * dk_, axis=0, reverse=True) + g_last[None, :]
    if EXCLUSIVE:
        dg_ -= P
    if HAS_U:
        uu = tl.load(u + i_h * K + ck, mask=m_k, other=0.0).to(tl.float32)
        dA_diag = dA_diag * scale
        dq_ += dA_diag[:, None] * uu[None, :] * kk
        dk_ += dA_diag[:, None] * uu[None, :] * qq
        tl.store(du + (i_c.to(tl.int64) * H + i_h) * K + ck, tl.sum(dA_diag[:, None] * qq * kk, axis=0), mask=m_k)
    off = ((t0 + rows)[:, None] * H + i_h) * K + ck[None, :]
    m = m_t[:, None] & m_k[None, :]
    tl.store(dq + off, dq_.to(dq.dtype.element_ty), mask=m)
    tl.store(dk + off, dk_.to(dk.dtype.element_ty), mask=m)
    tl.store(dg + off, dg_.to(dg.dtype.element_ty), mask=m)


@triton.jit
def _dv_kernel(q, k, gc, u, do, dh, dv, cu_seqlens, chunk_indices, scale,
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
    dd = load_rows(do, t0, rows, m_t, i_h, cv, m_v, H, V)
    acc = mm_tf32(tl.trans(A), dd, DT)
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
        gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
        gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
        kg = kk * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gk, float("-inf")))
        dS = tl.load(dh + (i_c.to(tl.int64) * H + i_h) * K * V + ck[:, None] * V + cv[None, :],
                     mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc += mm(kg, dS, DT)
    off = ((t0 + rows)[:, None] * H + i_h) * V + cv[None, :]
    tl.store(dv + off, acc.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


def chunk_dqkg_bwd(q, k, v, g, gc, u, h, do, dh, layout: ChunkLayout, scale: float, exclusive: bool,
                   dot_dtype, block_k: int, block_v: int, sub_chunk: int = 16):
    """dq, dk (dtypes of q, k), dg (dtype of g) [B, T, H, K], and du [H, K] fp32 (None without u)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    du = torch.empty(layout.num_chunks, H, K, device=q.device, dtype=torch.float32) if u is not None else None
    _dqkg_kernel[(layout.num_chunks, H, triton.cdiv(K, block_k))](
        q, k, v, gc, u, h, do, dh, dq, dk, dg, du, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=layout.chunk_size, BC=sub_chunk, BK=block_k, BV=block_v,
        EXCLUSIVE=exclusive, HAS_U=u is not None, DT=dot_dtype, num_warps=8 if block_k >= 64 else 4, num_stages=1)
    return dq, dk, dg, (du.sum(0) if du is not None else None)


def chunk_dv_bwd(q, k, v, gc, u, do, dh, layout: ChunkLayout, scale: float, exclusive: bool,
                 dot_dtype, block_k: int, block_v: int, sub_chunk: int = 16):
    """dv [B, T, H, V] in v's dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dv = torch.empty_like(v)
    _dv_kernel[(layout.num_chunks, H, triton.cdiv(V, block_v))](
        q, k, gc, u, do, dh, dv, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=layout.chunk_size, BC=sub_chunk, BK=block_k, BV=block_v,
        EXCLUSIVE=exclusive, HAS_U=u is not None, DT=dot_dtype, num_warps=8 if block_k >= 64 else 4, num_stages=1)
    return dv
