"""The per-chunk preparation of chunked RWKV7 in Triton: per chunk and head, the intra matrices, the WY
inverse Tm, W and G, and the four maps Q', E, A, C of the scans (chunk_triton.py), in one kernel launched
once per intra regime; its host launcher `prepare`."""

import torch
import triton
import triton.language as tl

from ..common.chunk_triton.intra import mm_prec
from .chunk_helpers_triton import (cast_to, centre_factors, centred_a_side, centred_q_side, chunk_tile, cumsums_of,
                                   fallback_heads, gates_keep_bound, load_tile, pairwise_a_side, pairwise_q_side,
                                   regime_selected)
from .chunk_plan import intermediate_specs
from .wy_inverse_triton import unit_lower_inverse


@triton.jit
def _prepare_kernel(
    q, w, k, a, b, cu_seqlens, chunk_info, scale, lower_bound,
    Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, regime,
    H, K, BT: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, STORE_BWD: tl.constexpr, TM_MODE: tl.constexpr,
    LOWP: tl.constexpr, TF32: tl.constexpr, PREC: tl.constexpr, HP: tl.constexpr,
):
    """One chunk and head: M^ak, M^ab, the WY inverse Tm, W = Tm Â and G = Tm M^ak, then M^qk, M^qb and
    the four chunk matrices Q', E, A, C of the scans. With STORE_BWD also W, G, M^ak and M^qb (fp32) for
    the backward; without, W and G never leave the registers. TM_MODE 0: Tm computed; 1: computed and
    stored; 2: loaded (the forward stored it: the backward's run skips M^ab and the inverse).

    MODE 0: every chunk, exact regime (no usable bound). With a bound, two launches: MODE 1 decides each
    chunk's regime from its own gates, records it in `regime` and takes the centred chunks; MODE 2 then
    takes the chunks that broke the bound (exact per-pair path at the same chunk size). One program
    holding both paths spills registers, the centred path alone does not."""
    i_c = tl.program_id(0)
    if MODE == 1:
        i_h = tl.program_id(1)
        t0, m_r, m_rk, p_k, p_t, bk, bT = chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
        b_w = load_tile(w + bk, p_k, m_rk)
        centred = gates_keep_bound(b_w, m_rk, lower_bound)
        tl.store(regime + i_c.to(tl.int64) * H + i_h, centred.to(tl.int8))
        if centred:
            _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                           m_r, m_rk, p_k, p_t, bk, bT, BT, BK, True, STORE_BWD, TM_MODE, LOWP, TF32, PREC)
    elif MODE == 2:
        for i_h in range(0, fallback_heads(regime, i_c, H, HP)):
            if regime_selected(regime, i_c, i_h, H, MODE):
                t0, m_r, m_rk, p_k, p_t, bk, bT = chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
                b_w = load_tile(w + bk, p_k, m_rk)
                _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                               m_r, m_rk, p_k, p_t, bk, bT, BT, BK, False, STORE_BWD, TM_MODE, LOWP, TF32, PREC)
    else:
        i_h = tl.program_id(1)
        t0, m_r, m_rk, p_k, p_t, bk, bT = chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
        b_w = load_tile(w + bk, p_k, m_rk)
        _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                       m_r, m_rk, p_k, p_t, bk, bT, BT, BK, False, STORE_BWD, TM_MODE, LOWP, TF32, PREC)


@triton.jit
def _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                   m_r, m_rk, p_k, p_t, bk, bT, BT: tl.constexpr, BK: tl.constexpr, CENTRED: tl.constexpr,
                   STORE_BWD: tl.constexpr, TM_MODE: tl.constexpr, LOWP: tl.constexpr, TF32: tl.constexpr,
                   PREC: tl.constexpr):
    """`_prepare_kernel`'s work on one chunk (gate tile b_w), in the centred regime if CENTRED."""
    Gi, Ge, g_L = cumsums_of(b_w)
    b_a = load_tile(a + bk, p_k, m_rk)
    if CENTRED:
        e_q, e_k, e_a = centre_factors(Gi, Ge, BT)
        b_Mak, b_Mab = centred_a_side(b_a * e_a, load_tile(k + bk, p_k, m_rk) * e_k,
                                       load_tile(b + bk, p_k, m_rk) * e_k, BT, PREC)
    else:
        b_Mak, b_Mab = pairwise_a_side(b_a, load_tile(k + bk, p_k, m_rk), load_tile(b + bk, p_k, m_rk), Gi, Ge,
                                        BT, PREC)
    # the q side before the inverse, which it does not depend on: its products then fill the latency of
    # the inverse's serial chain. The centred factors and the k, b tiles are formed again from the
    # loads: one branch holding them for both sides spills more. For the same reason the a and q tiles
    # are loaded again (from cache) after the inverse instead of being held over it
    b_q = load_tile(q + bk, p_k, m_rk) * scale
    if CENTRED:
        e_q, e_k, e_a = centre_factors(Gi, Ge, BT)
        b_Mqk, b_Mqb = centred_q_side(b_q * e_q, load_tile(k + bk, p_k, m_rk) * e_k,
                                       load_tile(b + bk, p_k, m_rk) * e_k, BT, LOWP, PREC)
    else:
        b_Mqk, b_Mqb = pairwise_q_side(b_q, load_tile(k + bk, p_k, m_rk), load_tile(b + bk, p_k, m_rk), Gi,
                                        BT, PREC)
    if STORE_BWD:
        tl.store(Mqb + bT + p_t, b_Mqb, mask=m_r)
    if TM_MODE == 2:
        b_Tm = tl.load(Tm + bT + p_t, mask=m_r, other=0.0)
    else:
        b_Tm = unit_lower_inverse(b_Mab, BT, TF32, PREC)
        if TM_MODE == 1:
            tl.store(Tm + bT + p_t, b_Tm, mask=m_r)
    b_W = mm_prec(b_Tm, load_tile(a + bk, p_k, m_rk) * tl.exp2(Ge), PREC)
    b_G = mm_prec(b_Tm, b_Mak, PREC)
    if STORE_BWD:
        tl.store(Mak + bT + p_t, b_Mak, mask=m_r)
        tl.store(Wm + bk + p_k, b_W, mask=m_rk)
        tl.store(Gm + bT + p_t, b_G, mask=m_r)

    b_Q = load_tile(q + bk, p_k, m_rk) * scale * tl.exp2(Gi) + mm_prec(b_Mqb, b_W, PREC)
    tl.store(Qs + bk + p_k, cast_to(b_Q, Qs, LOWP), mask=m_rk)
    b_E = b_Mqk + mm_prec(b_Mqb, b_G, PREC)
    tl.store(Es + bT + p_t, cast_to(b_E, Es, LOWP), mask=m_r)

    e_L = tl.exp2(g_L[None, :] - Gi)
    b_bt = load_tile(b + bk, p_k, m_rk) * e_L
    b_C = load_tile(k + bk, p_k, m_rk) * e_L + mm_prec(tl.trans(b_G), b_bt, PREC)
    tl.store(Cs + bk + p_k, cast_to(b_C, Cs, LOWP), mask=m_rk)
    o_kr = tl.arange(0, BK)[:, None]
    o_kc = tl.arange(0, BK)[None, :]
    b_A = tl.where(o_kr == o_kc, tl.exp2(g_L)[None, :], 0.0) + mm_prec(tl.trans(b_bt), b_W, PREC)
    tl.store(As + (i_c.to(tl.int64) * H + i_h) * K * K + o_kr * K + o_kc, b_A, mask=(o_kr < K) & (o_kc < K))


def prepare(plan, q, w, k, a, b, scale, store_bwd, keep_tm, tm=None):
    """The per-chunk matrices of the scans (Q', E, C in plan.scan_dtype, A fp32) and, in the centred regime,
    each chunk's regime (int8 [NT, H], 1: centred); with store_bwd also W, G, M^ak, M^qb (fp32) for the
    backward; with keep_tm also the inverse Tm (fp32), or, given tm (a previous call's), that one."""
    H, K, BT = plan.H, plan.K, plan.BT
    specs = intermediate_specs(plan.B, plan.T, H, K, BT, plan.NT, plan.centred, plan.scan_dtype)
    names = ["Qs", "Es", "Cs", "As", "regime"] + (["Wm", "Gm", "Mak", "Mqb"] if store_bwd else [])
    if tm is None and keep_tm:
        names.append("Tm")
    out = {name: None if specs[name][0] is None else torch.empty(specs[name][0], dtype=specs[name][1],
                                                                 device=q.device)
           for name in names}
    if tm is not None:
        out["Tm"] = tm
    for mode in plan.modes:
        _prepare_kernel[plan.grid(mode)](
            q, w, k, a, b, plan.cu, plan.chunk_info, scale, plan.lower_bound,
            out.get("Wm"), out.get("Gm"), out.get("Tm"), out.get("Mak"), out.get("Mqb"),
            out["Qs"], out["Es"], out["Cs"], out["As"], out["regime"],
            H=H, K=K, BT=BT, BK=plan.BK, MODE=mode, STORE_BWD=store_bwd,
            TM_MODE=2 if tm is not None else int(keep_tm), LOWP=plan.lowp, TF32=plan.tf32, PREC=plan.prec,
            HP=plan.HP, num_warps=plan.warps_prepare, num_stages=1, maxnreg=plan.maxnreg,
        )
    return out
