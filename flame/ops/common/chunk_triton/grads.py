"""The chunk backward: dv with dA (one kernel), then dq, dk and the log-gate gradient (another).

Per chunk, with the stored intra matrix A, dA = do v^T (the gradient of the intra-chunk matrix
before scaling) and the states S_in (entering) and dS_out (gradient of the leaving state):
    dv = A^T do + (k * exp(Γ_L - Γ)) dS_out
    dq = scale [exp(Γq) * (do S_in^T) + intra(dA)]            (+ the bonus term)
    dk = exp(Γ_L - Γ) * (v dS_out^T) + scale intra^T(dA)       (+ the bonus term)
The dv kernel writes dA (scaled, masked to the intra triangle, fp32 [B, T, H, BT] like A) and, with
a bonus u, the diagonal scale (do_τ . v_τ) [B, T, H]; the dq/dk kernel reads dA back, whole for
the off-diagonal sub-block products and by single entries (gathered loads) for the exact diagonal
sub-blocks. The intra parts use the same sub-chunk reference points as the forward (every
exponent <= 0). The gate gradient follows identity I2 (docs/kernels.md#rwkv6-chunked-backward): with P = q * dq' and
D = k * dk' (dq', dk' without the bonus terms),
    dg_m = Σ_{τ >= m} (P - D)_τ  [- P_m if EXCLUSIVE]  +  exp(Γ_L) * rowsum(S_in * dS_out) + Σ_j k_j * dk^state_j
No autograd through exp, no per-pair gradient stored, no atomics: the bonus gradient is written
per chunk and reduced afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .intra import (diagonal_masks, load_column, load_query_gate, load_query_gate3, load_row, load_rows, load_rows3,
                    load_rows_native, mm, mm_tf32, sub_chunks)
from .layout import ChunkLayout, chunk_span

DV_WARPS = 4      # launch settings (module constants so that a benchmark can sweep them)
DQKG_WARPS = 4
DQKG_BLOCK_K = 64  # K-block of a dq/dk/dg program (at most)


@triton.jit
def _dv_kernel(k, v, gc, A, do, dh, dv, dA, dAd, cu_seqlens, chunk_indices, scale,
               H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr, HAS_U: tl.constexpr,
               STORE_DV: tl.constexpr, STORE_DA: tl.constexpr, DT: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = rows < Tc
    a_row = ((t0 + rows) * H + i_h) * BT
    if STORE_DV:
        Aw = tl.load(A + a_row[:, None] + cols[None, :], mask=m_t[:, None], other=0.0)
    if STORE_DA:
        dAw = tl.zeros([BT, BT], dtype=tl.float32)
        if HAS_U:
            dAd_ = tl.zeros([BT], dtype=tl.float32)
    for i_v in tl.static_range(0, triton.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        dd = load_rows(do, t0, rows, m_t, i_h, cv, m_v, H, V)
        if STORE_DA:
            vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
            dAw += mm(dd, tl.trans(vv), DT)
            if HAS_U:
                dAd_ += tl.sum(dd * vv, axis=1)
        if STORE_DV:
            acc = mm_tf32(tl.trans(Aw), dd, DT)
            for i_k in tl.static_range(0, triton.cdiv(K, BK)):
                ck = i_k * BK + tl.arange(0, BK)
                m_k = ck < K
                kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
                gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
                gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
                kg = kk * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gk, float("-inf")))
                dS = tl.load(dh + (i_c * H + i_h) * K * V + ck[:, None] * V + cv[None, :],
                             mask=m_k[:, None] & m_v[None, :], other=0.0)
                acc += mm(kg, dS, DT)
            off = ((t0 + rows)[:, None] * H + i_h) * V + cv[None, :]
            tl.store(dv + off, acc.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    if STORE_DA:
        if EXCLUSIVE:
            m_A = cols[None, :] < rows[:, None]
        else:
            m_A = cols[None, :] <= rows[:, None]
        tl.store(dA + a_row[:, None] + cols[None, :], tl.where(m_A, dAw * scale, 0.0), mask=m_t[:, None])
        if HAS_U:
            tl.store(dAd + (t0 + rows) * H + i_h, dAd_ * scale, mask=m_t)


@triton.jit
def _diag_column(q, k, gc, dA, t0, Tc, c, nb, ic, r3, m3, a_row3, i_h, ck, m_k, H, K: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr, EXCLUSIVE: tl.constexpr):
    """Row j = s BC + c of every sub-chunk s: k_j, Γ_j, q_j, the query gate of j [NB, BK] (fp32), and the
    dA entries dA[(s, i), j], dA[j, (s, i)] [NB, BC] (zero off the pair masks)."""
    j = nb * BC + c
    m_c = j < Tc
    m_j, m_i = diagonal_masks(c, ic, m3, m_c, EXCLUSIVE)
    kj, gj = load_column(k, gc, t0, Tc, j, i_h, ck, m_k, H, K)
    qj = load_rows(q, t0, j, m_c, i_h, ck, m_k, H, K)
    gqj = load_query_gate(gc, t0, j, m_c, i_h, ck, m_k, H, K, EXCLUSIVE)
    dA_qj = tl.load(dA + a_row3 + j[:, None], mask=m_j, other=0.0)
    dA_jk = tl.load(dA + (((t0 + j) * H + i_h) * BT)[:, None] + r3, mask=m_i, other=0.0)
    return kj, gj, qj, gqj, dA_qj, dA_jk


@triton.jit
def _dqkg_kernel(q, k, v, gc, u, h, do, dh, dA, dAd, dq, dk, dg, du, cu_seqlens, chunk_indices, scale,
                 H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr, HAS_U: tl.constexpr,
                 SOFTMAX_BWD: tl.constexpr, DT: tl.constexpr):
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

    dq_state = tl.zeros([BT, BK], dtype=tl.float32)
    dk_state = tl.zeros([BT, BK], dtype=tl.float32)
    s_ds = tl.zeros([BK], dtype=tl.float32)
    state_base = (i_c * H + i_h) * K * V
    for i_v in tl.static_range(0, triton.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        dd = load_rows(do, t0, rows, m_t, i_h, cv, m_v, H, V)
        vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
        s_off = state_base + ck[:, None] * V + cv[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        S = tl.load(h + s_off, mask=m_kv, other=0.0)
        dS = tl.load(dh + s_off, mask=m_kv, other=0.0)
        dq_state += mm(dd, tl.trans(S), DT)
        dk_state += mm(vv, tl.trans(dS), DT)
        s_ds += tl.sum(S * dS, axis=1)

    # k and q are held in their own dtype through the off-diagonal products (fewer registers spilled)
    kk = load_rows_native(k, t0, rows, m_t, i_h, ck, m_k, H, K)
    gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
    gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
    gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
    dq_ = dq_state * tl.exp2(tl.where(m_t[:, None], gq, float("-inf"))) * scale
    dk_ = dk_state * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gk, float("-inf")))
    g_last = tl.exp2(gl) * s_ds + tl.sum(kk * dk_, axis=0)

    a_row = ((t0 + rows) * H + i_h) * BT
    dAw = tl.load(dA + a_row[:, None] + cols[None, :], mask=m_t[:, None], other=0.0)  # scaled, masked
    # queries of sub-chunk s against the keys before it (reference: the row before s)
    for s in tl.static_range(1, BT // BC):
        ref = tl.minimum(s * BC - 1, Tc - 1)
        gn = load_row(gc, t0, ref, i_h, ck, m_k, H, K)
        ks = kk * tl.exp2(tl.where(((rows < s * BC) & m_t)[:, None], gn[None, :] - gk, float("-inf")))
        dq_ += mm_tf32(dAw, ks, DT) * tl.exp2(tl.where(((blk == s) & m_t)[:, None], gq - gn[None, :], float("-inf")))
    qq = load_rows_native(q, t0, rows, m_t, i_h, ck, m_k, H, K)
    # keys of sub-chunk s against the queries after it (reference: the last row of s)
    for s in tl.static_range(0, BT // BC - 1):
        ref = tl.minimum(s * BC + BC - 1, Tc - 1)
        gm = load_row(gc, t0, ref, i_h, ck, m_k, H, K)
        qs = qq * tl.exp2(tl.where(((rows >= (s + 1) * BC) & m_t)[:, None], gq - gm[None, :], float("-inf")))
        dk_ += mm_tf32(tl.trans(dAw), qs, DT) * tl.exp2(
            tl.where(((blk == s) & m_t)[:, None], gm[None, :] - gk, float("-inf")))
    # diagonal sub-blocks, pair by pair, in the [NB, BC, BK] view (NB = BT // BC sub-chunks): column
    # c of every sub-chunk at once, NB rows loaded per c; the dA entries are gathered from memory. The
    # loads of column c + 1 are issued before column c's products, so their latency overlaps them.
    NB: tl.constexpr = BT // BC
    nb, ic, r3, m3 = sub_chunks(Tc, BT, BC)
    dq3 = tl.reshape(dq_, [NB, BC, BK])
    dk3 = tl.reshape(dk_, [NB, BC, BK])
    gq3 = load_query_gate3(gc, t0, r3, m3, i_h, ck, m_k, H, K, EXCLUSIVE)
    gk3 = load_rows3(gc, t0, r3, m3, i_h, ck, m_k, H, K)
    a_row3 = ((t0 + r3) * H + i_h) * BT
    kj_n, gj_n, qj_n, gqj_n, dA_qj_n, dA_jk_n = _diag_column(q, k, gc, dA, t0, Tc, 0, nb, ic, r3, m3, a_row3, i_h,
                                                             ck, m_k, H, K, BT, BC, EXCLUSIVE)
    for c in range(0, BC):
        kj, gj, qj, gqj, dA_qj, dA_jk = kj_n, gj_n, qj_n, gqj_n, dA_qj_n, dA_jk_n
        kj_n, gj_n, qj_n, gqj_n, dA_qj_n, dA_jk_n = _diag_column(q, k, gc, dA, t0, Tc, tl.minimum(c + 1, BC - 1), nb,
                                                                 ic, r3, m3, a_row3, i_h, ck, m_k, H, K, BT, BC,
                                                                 EXCLUSIVE)
        m_j, m_i = diagonal_masks(c, ic, m3, nb * BC + c < Tc, EXCLUSIVE)
        dq3 += dA_qj[:, :, None] * kj[:, None, :] * tl.exp2(
            tl.where(m_j[:, :, None], gq3 - gj[:, None, :], float("-inf")))
        dk3 += dA_jk[:, :, None] * qj[:, None, :] * tl.exp2(
            tl.where(m_i[:, :, None], gqj[:, None, :] - gk3, float("-inf")))

    # dg by identity I2: reverse cumsum over the chunk's rows (one scan of the [BT, BK] view)
    q3 = load_rows3(q, t0, r3, m3, i_h, ck, m_k, H, K)
    k3 = load_rows3(k, t0, r3, m3, i_h, ck, m_k, H, K)
    P = q3 * dq3
    X = tl.reshape(P - k3 * dk3, [BT, BK])
    dg3 = tl.reshape(tl.cumsum(X, axis=0, reverse=True), [NB, BC, BK]) + g_last[None, None, :]
    if EXCLUSIVE:
        dg3 -= P
    if HAS_U:
        uu = tl.load(u + i_h * K + ck, mask=m_k, other=0.0).to(tl.float32)
        dA_diag = tl.load(dAd + (t0 + r3) * H + i_h, mask=m3, other=0.0)   # scaled
        dq3 += dA_diag[:, :, None] * uu[None, None, :] * k3
        dk3 += dA_diag[:, :, None] * uu[None, None, :] * q3
        tl.store(du + (i_c * H + i_h) * K + ck, tl.sum(tl.sum(dA_diag[:, :, None] * q3 * k3, axis=1), axis=0),
                 mask=m_k)
    if SOFTMAX_BWD:
        # q = softmax(z) over its K axis (one K block holds the whole row): store dz = q (dq - sum_K q dq)
        dq3 = q3 * (dq3 - tl.sum(q3 * dq3, axis=2)[:, :, None])
    off = ((t0 + r3)[:, :, None] * H + i_h) * K + ck[None, None, :]
    m = m3[:, :, None] & m_k[None, None, :]
    tl.store(dq + off, dq3.to(dq.dtype.element_ty), mask=m)
    tl.store(dk + off, dk3.to(dk.dtype.element_ty), mask=m)
    tl.store(dg + off, dg3.to(dg.dtype.element_ty), mask=m)


def chunk_dv_dA_bwd(k, v, gc, A, do, dh, layout: ChunkLayout, scale: float, exclusive: bool, has_u: bool,
                    dot_dtype, block_k: int, block_v: int, with_dv: bool = True, with_dA: bool = True,
                    maxnreg: int | None = None):
    """dv [B, T, H, V] in v's dtype (None unless `with_dv`; then k, gc, A and dh may be None), dA
    [B, T, H, BT] fp32 (scaled, masked to the intra triangle; None unless `with_dA`) and, with dA and
    `has_u`, dA's diagonal scale (do . v) [B, T, H] fp32 (else None), for `chunk_dqkg_from_dA`.
    maxnreg: a register cap per thread for the kernel's launch (None: Triton's choice); a family
    picks its own."""
    B, T, H, V = v.shape
    K = k.shape[-1] if k is not None else 1
    BT = layout.chunk_size
    dv = torch.empty_like(v) if with_dv else None
    has_u = has_u and with_dA
    dA = torch.empty(B, T, H, BT, device=v.device, dtype=torch.float32) if with_dA else None
    dAd = torch.empty(B, T, H, device=v.device, dtype=torch.float32) if has_u else None
    _dv_kernel[(layout.num_chunks, H)](
        k, v, gc, A, do, dh, dv, dA, dAd, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=BT, BK=block_k, BV=block_v, EXCLUSIVE=exclusive, HAS_U=has_u,
        STORE_DV=with_dv, STORE_DA=with_dA, DT=dot_dtype, num_warps=DV_WARPS, num_stages=1, maxnreg=maxnreg)
    return dv, dA, dAd


def chunk_dqkg_from_dA(q, k, v, g, gc, u, h, do, dh, dA, dAd, layout: ChunkLayout, scale: float,
                       exclusive: bool, dot_dtype, block_k: int, block_v: int, sub_chunk: int = 16,
                       num_warps: int | None = None, dk_dtype: torch.dtype | None = None,
                       softmax_bwd: bool = False):
    """dq, dk (dtypes of q and k, or dk_dtype), dg (dtype of g) [B, T, H, K], and du [H, K] fp32 (None
    without u). num_warps: the kernel's launch width (default DQKG_WARPS); a family may pick its own.
    With `softmax_bwd` (q = softmax(z) over K, and K within one K block: `fuses_softmax_bwd`), the
    first output is dz = q (dq - sum_K q dq) instead of dq; dk and dg are unchanged."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k, dtype=dk_dtype or k.dtype), torch.empty_like(g)
    du = torch.empty(layout.num_chunks, H, K, device=q.device, dtype=torch.float32) if u is not None else None
    block_k = min(block_k, DQKG_BLOCK_K)
    if softmax_bwd and not fuses_softmax_bwd(K, block_k):
        raise ValueError(f"softmax_bwd needs the whole K axis ({K}) in one block (at most {block_k})")
    _dqkg_kernel[(layout.num_chunks, H, triton.cdiv(K, block_k))](
        q, k, v, gc, u, h, do, dh, dA, dAd, dq, dk, dg, du, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=layout.chunk_size, BC=min(sub_chunk, layout.chunk_size), BK=block_k, BV=block_v,
        EXCLUSIVE=exclusive, HAS_U=u is not None, SOFTMAX_BWD=softmax_bwd, DT=dot_dtype,
        num_warps=num_warps or DQKG_WARPS, num_stages=1)
    return dq, dk, dg, (du.sum(0) if du is not None else None)


def fuses_softmax_bwd(K: int, block_k: int) -> bool:
    """Whether `chunk_dqkg_from_dA` can apply a softmax's backward over K (one K block holds it)."""
    return min(block_k, DQKG_BLOCK_K) >= K

