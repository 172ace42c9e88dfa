"""The per-chunk backward of chunked RWKV7 in Triton: from the states, the state gradients and the
per-chunk intermediates, two kernels per intra regime (`_bwd_maps`: the output and state sides through
the maps Q', E, A, C; `_bwd_intra`: the WY backward, the column side and dw by identity I2) and their
host launcher `chunk_bwd` (chunk_triton.py describes the math)."""

import torch
import triton
import triton.language as tl

from ..common.chunk_triton.intra import mm_prec, mm_tf32_if
from .chunk_helpers_triton import (cast_to, centre_factors, chunk_tile, fallback_heads, gate_cumsums, load_tile,
                                   pairwise_cols_bwd, regime_selected, rows_bwd)


@triton.jit
def _v_block(i_v, H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Block i_v of V in the backward's reductions over V: the [BK, BV] offsets and mask of a state tile
    (from its chunk's base), and the [BT, BV] row offsets of V-wide tensors (from the chunk's first row)
    and the column mask [1, BV]."""
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = (o_v < V)[None, :]
    return o_k[:, None] * V + o_v[None, :], (o_k < K)[:, None] & m_v, (rows * H * V)[:, None] + o_v[None, :], m_v


@triton.jit
def _bwd_maps_kernel(
    q, w, k, v, b, do, hs, dhs, Wm, Gm, Mqb, cu_seqlens, chunk_info, scale, regime,
    dq, dEb, dMqbb, gq, dWb, dGb, dks, dbs, glast,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, MODE: tl.constexpr, LOWP: tl.constexpr,
    TF32: tl.constexpr, PREC: tl.constexpr, HP: tl.constexpr,
):
    """One chunk and head: the gradients through the scans' four maps Q', E, A, C (`_bwd_maps_chunk`)."""
    i_c = tl.program_id(0)
    if MODE == 2:
        for i_h in range(0, fallback_heads(regime, i_c, H, HP)):
            if regime_selected(regime, i_c, i_h, H, MODE):
                _bwd_maps_chunk(q, w, k, v, b, do, hs, dhs, Wm, Gm, Mqb, cu_seqlens, chunk_info, scale, dq, dEb,
                                dMqbb, gq, dWb, dGb, dks, dbs, glast, H, K, V, BT, BK, BV, MODE, LOWP, TF32, PREC,
                                i_c, i_h)
    else:
        i_h = tl.program_id(1)
        if regime_selected(regime, i_c, i_h, H, MODE):
            _bwd_maps_chunk(q, w, k, v, b, do, hs, dhs, Wm, Gm, Mqb, cu_seqlens, chunk_info, scale, dq, dEb,
                            dMqbb, gq, dWb, dGb, dks, dbs, glast, H, K, V, BT, BK, BV, MODE, LOWP, TF32, PREC,
                            i_c, i_h)


@triton.jit
def _bwd_maps_chunk(q, w, k, v, b, do, hs, dhs, Wm, Gm, Mqb, cu_seqlens, chunk_info, scale, dq, dEb, dMqbb, gq,
                    dWb, dGb, dks, dbs, glast, H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    MODE: tl.constexpr, LOWP: tl.constexpr, TF32: tl.constexpr, PREC: tl.constexpr, i_c, i_h):
    """Chunk i_c of head i_h, in two passes over the V blocks: the first reads its state S^in, state
    gradient dS^out, V and dO and forms dA = dS S^T, dC = V dS^T and dQ' = dO S^T; the second reads
    V and dO again (from L2) for dE = dO V^T.

    State side: from dA and dC through A = diag(e^Γ_L) + B̃^T W and C = K̃ + G^T B̃ to
    dB̃ = G dC + W dA^T, the state-path parts of dk and db, the chunk-total gate term of I2, and the parts
    B̃ dA of dW and B̃ dC^T of dG, which stay in registers.
    Output side: from dQ' and dE, dW += M^qb^T dQ', dG += M^qb^T dE (stored for
    `_bwd_intra`), dM^qb = incl(dQ' W^T + dE G^T), dq (dQ̂ e^Γ + the row side of dM^qk = incl(dE) and
    dM^qb) and its I2 term q dq. Stores dE, dM^qb and q dq (fp32) for `_bwd_intra`.
    One kernel for both sides keeps dW and dG out of global memory between them and reads the chunk's
    gates, keys, W and G once. S^in, the largest tile, is read once: the accumulator of dQ' in the
    first pass stays below the register peak that the state side sets, where a second read of S^in
    costs DRAM traffic (the states of a 340M layer's call are 134 MB, more than L2). It is faster
    than one kernel per side, than a second pass over S^in, and than one kernel for `_bwd_maps` and
    `_bwd_intra` with a barrier between (bench/RESULTS.md, "Chunk kernels' launch settings")."""
    t0, m_r, m_rk, p_k, p_t, bk, bT = chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    h_base = (i_c.to(tl.int64) * H + i_h) * K * V
    bv = (t0 * H + i_h) * V
    # state side
    dA = tl.zeros([BK, BK], dtype=tl.float32)
    dC = tl.zeros([BT, BK], dtype=tl.float32)
    dQ = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        s_off, m_s, p_v, m_v = _v_block(i_v, H, K, V, BT, BK, BV)
        S = tl.load(hs + h_base + s_off, mask=m_s, other=0.0)
        dS = tl.load(dhs + h_base + s_off, mask=m_s, other=0.0)
        dA += mm_tf32_if(dS, tl.trans(S), TF32, PREC)
        dC += mm_tf32_if(load_tile(v + bv, p_v, m_r & m_v), tl.trans(dS), TF32, PREC)
        dQ += mm_tf32_if(load_tile(do + bv, p_v, m_r & m_v), tl.trans(S), TF32, PREC)
    Gi, Ge, g_L = gate_cumsums(w + bk, p_k, m_rk)
    e_L = tl.exp2(g_L[None, :] - Gi)
    dbt = mm_tf32_if(load_tile(Gm + bT, p_t, m_r), dC, TF32, PREC) \
        + mm_tf32_if(load_tile(Wm + bk, p_k, m_rk), tl.trans(dA), TF32, PREC)
    o_kr = tl.arange(0, BK)[:, None]
    s_sum = tl.sum(tl.where(o_kr == o_k[None, :], dA, 0.0), 0)  # diag(dA) = rowsum(S^in * dS^out)
    dk_s = dC * e_L
    db_s = dbt * e_L
    tl.store(dks + bk + p_k, dk_s, mask=m_rk)
    tl.store(dbs + bk + p_k, db_s, mask=m_rk)
    g_last = tl.exp2(g_L) * s_sum + tl.sum(load_tile(k + bk, p_k, m_rk) * dk_s
                                           + load_tile(b + bk, p_k, m_rk) * db_s, 0)
    tl.store(glast + (i_c.to(tl.int64) * H + i_h) * K + o_k, g_last, mask=o_k < K)
    b_bt = load_tile(b + bk, p_k, m_rk) * e_L
    dW = mm_tf32_if(b_bt, dA, TF32, PREC)
    dG = mm_tf32_if(b_bt, tl.trans(dC), TF32, PREC)
    # output side
    incl = rows[:, None] >= rows[None, :]
    dE = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        _, _, p_v, m_v = _v_block(i_v, H, K, V, BT, BK, BV)
        b_do = load_tile(do + bv, p_v, m_r & m_v)
        dE += mm_tf32_if(b_do, tl.trans(load_tile(v + bv, p_v, m_r & m_v)), TF32, PREC)
    tl.store(dEb + bT + p_t, dE, mask=m_r)
    b_Mqb = load_tile(Mqb + bT, p_t, m_r)
    tl.store(dWb + bk + p_k, dW + mm_prec(tl.trans(b_Mqb), dQ, PREC), mask=m_rk)
    tl.store(dGb + bT + p_t, dG + mm_prec(tl.trans(b_Mqb), dE, PREC), mask=m_r)
    dMqb = tl.where(incl, mm_prec(dQ, tl.trans(load_tile(Wm + bk, p_k, m_rk)), PREC)
                    + mm_prec(dE, tl.trans(load_tile(Gm + bT, p_t, m_r)), PREC), 0.0)
    tl.store(dMqbb + bT + p_t, dMqb, mask=m_r)
    dMqk = tl.where(incl, dE, 0.0)
    # the gates loaded again rather than held over the second V pass (the exact-fallback launch spills
    # less so)
    Gi, Ge, g_L = gate_cumsums(w + bk, p_k, m_rk)
    i_dq = rows_bwd(dMqk, dMqb, k + bk, b + bk, p_k, m_rk, Gi, Ge, False, MODE == 1, BT, BK, PREC)
    b_dq = dQ * tl.exp2(Gi) + i_dq
    tl.store(dq + bk + p_k, cast_to(b_dq * scale, dq, LOWP), mask=m_rk)
    tl.store(gq + bk + p_k, load_tile(q + bk, p_k, m_rk) * scale * b_dq, mask=m_rk)


@triton.jit
def _bwd_intra_kernel(
    q, w, k, a, b, Tm, Mak, dWb, dGb, dEb, dMqbb, dks, dbs, gq, glast, cu_seqlens, chunk_info, scale, regime,
    da, dw, dk, db,
    H, K, BT: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, LOWP: tl.constexpr, TF32: tl.constexpr,
    PREC: tl.constexpr, HP: tl.constexpr,
):
    """One chunk and head: the WY backward, the column side and dw (`_bwd_intra_chunk`)."""
    i_c = tl.program_id(0)
    if MODE == 2:
        for i_h in range(0, fallback_heads(regime, i_c, H, HP)):
            if regime_selected(regime, i_c, i_h, H, MODE):
                _bwd_intra_chunk(q, w, k, a, b, Tm, Mak, dWb, dGb, dEb, dMqbb, dks, dbs, gq, glast, cu_seqlens,
                                 chunk_info, scale, da, dw, dk, db, H, K, BT, BK, MODE, LOWP, TF32, PREC, i_c, i_h)
    else:
        i_h = tl.program_id(1)
        if regime_selected(regime, i_c, i_h, H, MODE):
            _bwd_intra_chunk(q, w, k, a, b, Tm, Mak, dWb, dGb, dEb, dMqbb, dks, dbs, gq, glast, cu_seqlens,
                             chunk_info, scale, da, dw, dk, db, H, K, BT, BK, MODE, LOWP, TF32, PREC, i_c, i_h)


@triton.jit
def _bwd_intra_chunk(q, w, k, a, b, Tm, Mak, dWb, dGb, dEb, dMqbb, dks, dbs, gq, glast, cu_seqlens, chunk_info,
                     scale, da, dw, dk, db, H, K, BT: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr,
                     LOWP: tl.constexpr, TF32: tl.constexpr, PREC: tl.constexpr, i_c, i_h):
    """Chunk i_c of head i_h.

    WY backward (W = Tm Â, G = Tm M^ak, Tm = (I - M^ab)^-1): dTm = dG M^ak^T + dW Â^T,
    dM^ak = strict(Tm^T dG), dÂ = Tm^T dW, dM^ab = strict(Tm^T dTm Tm^T), then da (dÂ e^Γ̄ + the row side
    of dM^ak, dM^ab).
    Column side: dk = state part + the columns of dM^qk = incl(dE) and dM^ak, db = state part + the
    columns of dM^qb and dM^ab; then dw by I2: dw_s = sum_{τ>=s} γ_τ - (a da)_s + g_last,
    γ = q dq + a da - k dk - b db.
    dM^ak, dM^ab and a da stay in registers between the two, and the gates, a, k and b are read by one
    program: faster than one kernel per part, although this one spills under the plan's register cap
    (ChunkPlan.maxnreg). Each tile is loaded where it is first needed (dW and the gates after the M^ak
    products, dk's column products before db's), so fewer tiles are live at once and fewer registers
    spill."""
    t0, m_r, m_rk, p_k, p_t, bk, bT = chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    strict = rows[:, None] > rows[None, :]
    # WY backward
    b_Tm = tl.load(Tm + bT + p_t, mask=m_r, other=0.0)
    dG = load_tile(dGb + bT, p_t, m_r)
    dTm = mm_prec(dG, tl.trans(load_tile(Mak + bT, p_t, m_r)), PREC)
    dMak = tl.where(strict, mm_prec(tl.trans(b_Tm), dG, PREC), 0.0)
    Gi, Ge, g_L = gate_cumsums(w + bk, p_k, m_rk)
    b_a = load_tile(a + bk, p_k, m_rk)
    dW = load_tile(dWb + bk, p_k, m_rk)
    dTm += mm_prec(dW, tl.trans(b_a * tl.exp2(Ge)), PREC)
    dAh = mm_prec(tl.trans(b_Tm), dW, PREC)
    dMab = mm_prec(mm_prec(tl.trans(b_Tm), dTm, PREC), tl.trans(b_Tm), PREC)
    dMab = tl.where(strict, dMab, 0.0)
    i_da = rows_bwd(dMak, dMab, k + bk, b + bk, p_k, m_rk, Gi, Ge, True, MODE == 1, BT, BK, PREC)
    b_da = dAh * tl.exp2(Ge) + i_da
    tl.store(da + bk + p_k, cast_to(b_da, da, LOWP), mask=m_rk)
    g_a = b_a * b_da
    # column side (the gates and a loaded again: cheaper than holding them in registers)
    Gi, Ge, g_L = gate_cumsums(w + bk, p_k, m_rk)
    b_a = load_tile(a + bk, p_k, m_rk)
    dMqk = tl.where(rows[:, None] >= rows[None, :], load_tile(dEb + bT, p_t, m_r), 0.0)
    dMqb = load_tile(dMqbb + bT, p_t, m_r)
    b_q = load_tile(q + bk, p_k, m_rk) * scale
    # dk before db, and k dk formed at once: the column products of dk and of db are not live together
    if MODE == 1:
        e_q, e_k, e_a = centre_factors(Gi, Ge, BT)
        qc = b_q * e_q
        ac = b_a * e_a
        i_dk = (mm_tf32_if(tl.trans(dMqk), qc, TF32, PREC)
                + mm_tf32_if(tl.trans(dMak), ac, TF32, PREC)) * e_k
    else:
        i_dk, i_db = pairwise_cols_bwd(b_q, b_a, Gi, Ge, dMqk, dMak, dMqb, dMab, BT, BK, PREC)
    b_dk = load_tile(dks + bk, p_k, m_rk) + i_dk
    tl.store(dk + bk + p_k, cast_to(b_dk, dk, LOWP), mask=m_rk)
    kdk = load_tile(k + bk, p_k, m_rk) * b_dk
    if MODE == 1:
        i_db = (mm_tf32_if(tl.trans(dMqb), qc, TF32, PREC)
                + mm_tf32_if(tl.trans(dMab), ac, TF32, PREC)) * e_k
    b_db = load_tile(dbs + bk, p_k, m_rk) + i_db
    tl.store(db + bk + p_k, cast_to(b_db, db, LOWP), mask=m_rk)
    gam = load_tile(gq + bk, p_k, m_rk) + g_a
    gam -= kdk + load_tile(b + bk, p_k, m_rk) * b_db
    rev = tl.sum(gam, 0)[None, :] - tl.cumsum(gam, 0) + gam
    g_last = tl.load(glast + (i_c.to(tl.int64) * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
    tl.store(dw + bk + p_k, cast_to(rev - g_a + g_last[None, :], dw, LOWP), mask=m_rk)


def chunk_bwd(plan, pre, q, w, k, v, a, b, do, hs, dhs, scale):
    """dq, dw, dk, da, db from the states, the state gradients and the per-chunk intermediates: two
    per-chunk kernels (`_bwd_maps`: the output and state sides; `_bwd_intra`: the WY backward, the column
    side and I2) that pass fp32 tiles through global memory."""
    B, T, H, K, V, BT = plan.B, plan.T, plan.H, plan.K, plan.V, plan.BT
    f32 = dict(dtype=torch.float32, device=q.device)
    per_k = lambda: torch.empty(B, T, H, K, **f32)  # noqa: E731
    per_t = lambda: torch.empty(B, T, H, BT, **f32)  # noqa: E731
    gq, dWb, dks, dbs = per_k(), per_k(), per_k(), per_k()
    dEb, dMqbb, dGb = per_t(), per_t(), per_t()
    glast = torch.empty(plan.NT, H, K, **f32)
    dq, dw, dk, da, db = (torch.empty_like(x) for x in (q, w, k, a, b))
    common = dict(H=H, K=K, BT=BT, BK=plan.BK, PREC=plan.prec)
    for mode in plan.modes:
        _bwd_maps_kernel[plan.grid(mode)](q, w, k, v, b, do, hs, dhs, pre["Wm"], pre["Gm"], pre["Mqb"], plan.cu,
                                          plan.chunk_info, scale, pre["regime"], dq, dEb, dMqbb, gq, dWb, dGb, dks,
                                          dbs, glast, V=V, BV=plan.BV_bwd, MODE=mode, LOWP=plan.lowp, TF32=plan.tf32,
                                          HP=plan.HP, num_stages=plan.stages_maps, num_warps=plan.warps_maps,
                                          **common)
    for mode in plan.modes:
        _bwd_intra_kernel[plan.grid(mode)](q, w, k, a, b, pre["Tm"], pre["Mak"], dWb, dGb, dEb, dMqbb, dks, dbs, gq,
                                           glast, plan.cu, plan.chunk_info, scale, pre["regime"], da, dw, dk, db,
                                           MODE=mode, LOWP=plan.lowp, TF32=plan.tf32, HP=plan.HP, num_stages=1,
                                           num_warps=plan.warps_intra, maxnreg=plan.maxnreg, **common)
    return dq, dw, dk, da, db
