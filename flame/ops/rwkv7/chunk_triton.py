"""Triton chunked RWKV7 (DPLR delta rule, UT/WY form), forward and backward (kernels.md 2.2-2.4).

Per chunk of BT tokens, with Γ the fp32 chunk-local inclusive cumsum of w (scaled by log2 e, so
every factor is an exp2 of a non-positive number) and Γ̄ the exclusive one:

    M^qk = tril_incl(sc q e^{Γ_τ-Γ_j} k^T)   M^qb = tril_incl(sc q e^{Γ_τ-Γ_j} b^T)
    M^ak = strict(a e^{Γ̄_τ-Γ_j} k^T)          M^ab = strict(a e^{Γ̄_τ-Γ_j} b^T)
    Tm = (I - M^ab)^-1,  W = Tm Â,  G = Tm M^ak,  U = G V
    P = U + W S^in,  O = Q̂ S^in + M^qk V + M^qb P,  S^out = e^{Γ_L} S^in + K̃^T V + B̃^T P

Kernels, forward: `_prepare` (one program per chunk and head: cumsum, the four M matrices, the
inverse, W, G, U, gated vectors), `_state` (the sequential scan over chunks, one program per
sequence*head and V-block, whole K), `_output` (one program per chunk, head and V-block).
Backward: `_prepare` again unless its outputs were cached, `_dstate` (reverse scan, dS^out of every
chunk and dh0), `_backward_state` (one program per chunk and head: every contraction over V, and
dv), and `_backward_intra` (one program per chunk and head: the WY backward
dM^ab = strict(Tm^T dTm Tm^T), the intra backward and dw by the reverse cumsum of identity I2).
No atomics anywhere: the backward is deterministic. Head dims K > 128 do not fit one program's
tiles and run on the fused recurrent kernels instead.

Intra regimes (kernels.md 2.3):
- exact per-pair exponents (any gate): a loop over the key column with exponents Γ_τ - Γ_j <= 0;
  the default, with BT = 16;
- centred tensor-core factorisation around the middle row m: taken only when the caller gives a
  gate_lower_bound that passes the fp32 headroom rule |lb| (BT/2 + 1) log2 e <= 124, and then
  only for chunks whose gates really are >= lb (checked inside the kernel, per chunk, no host
  sync). A chunk that breaks the promise falls back to the exact per-pair path.
Operands of the centred products are fp32 (tf32) or bf16, never fp16 (the 2.3 fp16 caveat).
"""

import math
import os

import torch
import triton
import triton.language as tl

from .wy_inverse_triton import unit_lower_inverse

LOG2E = 1.4426950408889634
HEADROOM_LOG2 = 124.0  # fp32 exponent range (128) minus 4 bits of headroom
MAX_CHUNK_K = 128  # larger head dims go to the fused recurrent kernels
# 4 warps for every chunk kernel: on an H100 (triton 3.6) the BT = 64 intra-backward kernel compiled for
# 8 warps hit an illegal memory access, while 4 warps matched the fused recurrent kernel to 3e-7 (fp32)
NUM_WARPS = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def centred_chunk_size(gate_lower_bound) -> int | None:
    """Largest chunk size in (64, 32, 16) whose centred factors stay within fp32 headroom, or None."""
    if gate_lower_bound is None:
        return None
    lb = float(gate_lower_bound)
    if not math.isfinite(lb) or lb > 0:
        raise ValueError(f"gate_lower_bound must be a finite number <= 0 (a bound on the log-decay), got {lb}")
    for bt in (64, 32, 16):
        if abs(lb) * (bt / 2 + 1) * LOG2E <= HEADROOM_LOG2:
            return bt
    return None


# ------------------------------------------------------------------------------------------------
# intra-chunk helpers (the four M matrices and their backward), two regimes
# ------------------------------------------------------------------------------------------------

@triton.jit
def _intra_pairwise_fwd(q, k, a, b, G, Gb, BT: tl.constexpr, PREC: tl.constexpr):
    """Exact per-pair exponents; q is pre-scaled. Returns M^qk, M^qb (incl), M^ak, M^ab (strict).

    One key column j per step: its exponents Γ_τ - Γ_j (Γ̄_τ - Γ_j) are <= 0 on the kept rows and
    set to 0 elsewhere before exp2, then the column comes from a product with the tile holding only
    row j of k (b), so every op stays a select, an exp2 or a tl.dot (no reductions in the loop)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    zero_tt = tl.zeros([BT, BT], dtype=tl.float32)
    Mqk = tl.zeros([BT, BT], dtype=tl.float32)
    Mqb = tl.zeros([BT, BT], dtype=tl.float32)
    Mak = tl.zeros([BT, BT], dtype=tl.float32)
    Mab = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(0, BT):
        # every row = row j of Γ, bit-exact (one-hot product in ieee fp32; no nested call, no reduction)
        g_j = tl.dot(tl.where(cols == j, 1.0, 0.0) + zero_tt, G, input_precision="ieee")
        incl = rows >= j
        strict = rows > j
        qe = q * tl.exp2(tl.where(incl, G - g_j, 0.0))
        ae = a * tl.exp2(tl.where(strict, Gb - g_j, 0.0))
        k_j = tl.where(rows == j, k, 0.0)
        b_j = tl.where(rows == j, b, 0.0)
        Mqk += tl.where(incl, tl.dot(qe, tl.trans(k_j), input_precision=PREC), 0.0)
        Mqb += tl.where(incl, tl.dot(qe, tl.trans(b_j), input_precision=PREC), 0.0)
        Mak += tl.where(strict, tl.dot(ae, tl.trans(k_j), input_precision=PREC), 0.0)
        Mab += tl.where(strict, tl.dot(ae, tl.trans(b_j), input_precision=PREC), 0.0)
    return Mqk, Mqb, Mak, Mab


@triton.jit
def _intra_pairwise_bwd(q, k, a, b, G, Gb, dMqk, dMqb, dMak, dMab, BT: tl.constexpr, BK: tl.constexpr,
                        PREC: tl.constexpr):
    """Gradients of the four (masked) M matrices into q (pre-scaled), k, a, b, exact per pair."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    zero_tt = tl.zeros([BT, BT], dtype=tl.float32)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    da = tl.zeros([BT, BK], dtype=tl.float32)
    db = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(0, BT):
        # every row = row j of Γ, bit-exact (one-hot product in ieee fp32; no nested call, no reduction)
        g_j = tl.dot(tl.where(cols == j, 1.0, 0.0) + zero_tt, G, input_precision="ieee")
        e_q = tl.exp2(tl.where(rows >= j, G - g_j, 0.0))
        e_a = tl.exp2(tl.where(rows > j, Gb - g_j, 0.0))
        k_j = tl.where(rows == j, k, 0.0)
        b_j = tl.where(rows == j, b, 0.0)
        d_qk = tl.where(cols == j, dMqk, 0.0)
        d_qb = tl.where(cols == j, dMqb, 0.0)
        d_ak = tl.where(cols == j, dMak, 0.0)
        d_ab = tl.where(cols == j, dMab, 0.0)
        dq += (tl.dot(d_qk, k_j, input_precision=PREC) + tl.dot(d_qb, b_j, input_precision=PREC)) * e_q
        da += (tl.dot(d_ak, k_j, input_precision=PREC) + tl.dot(d_ab, b_j, input_precision=PREC)) * e_a
        qe = q * e_q
        ae = a * e_a
        dk += tl.dot(tl.trans(d_qk), qe, input_precision=PREC) + tl.dot(tl.trans(d_ak), ae, input_precision=PREC)
        db += tl.dot(tl.trans(d_qb), qe, input_precision=PREC) + tl.dot(tl.trans(d_ab), ae, input_precision=PREC)
    return dq, dk, da, db


@triton.jit
def _centre_factors(G, Gb, BT: tl.constexpr):
    """exp2 factors around the middle row m: q side e^{Γ-Γm}, k/b side e^{Γm-Γ}, a side e^{Γ̄-Γm}."""
    rows = tl.arange(0, BT)
    g_m = tl.sum(tl.where((rows == BT // 2)[:, None], G, 0.0), 0)[None, :]
    return tl.exp2(G - g_m), tl.exp2(g_m - G), tl.exp2(Gb - g_m)


@triton.jit
def _intra_centred_fwd(q, k, a, b, G, Gb, BT: tl.constexpr, QK_BF16: tl.constexpr, PREC: tl.constexpr):
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    e_q, e_k, e_a = _centre_factors(G, Gb, BT)
    qc = q * e_q
    kc = k * e_k
    bc = b * e_k
    ac = a * e_a
    if QK_BF16:
        Mqk = tl.dot(qc.to(tl.bfloat16), tl.trans(kc.to(tl.bfloat16)))
        Mqb = tl.dot(qc.to(tl.bfloat16), tl.trans(bc.to(tl.bfloat16)))
    else:
        Mqk = tl.dot(qc, tl.trans(kc), input_precision=PREC)
        Mqb = tl.dot(qc, tl.trans(bc), input_precision=PREC)
    Mak = tl.dot(ac, tl.trans(kc), input_precision=PREC)
    Mab = tl.dot(ac, tl.trans(bc), input_precision=PREC)
    Mqk = tl.where(rows >= cols, Mqk, 0.0)
    Mqb = tl.where(rows >= cols, Mqb, 0.0)
    Mak = tl.where(rows > cols, Mak, 0.0)
    Mab = tl.where(rows > cols, Mab, 0.0)
    return Mqk, Mqb, Mak, Mab


@triton.jit
def _intra_centred_bwd(q, k, a, b, G, Gb, dMqk, dMqb, dMak, dMab, BT: tl.constexpr, PREC: tl.constexpr):
    e_q, e_k, e_a = _centre_factors(G, Gb, BT)
    qc = q * e_q
    kc = k * e_k
    bc = b * e_k
    ac = a * e_a
    dq = (tl.dot(dMqk, kc, input_precision=PREC) + tl.dot(dMqb, bc, input_precision=PREC)) * e_q
    dk = (tl.dot(tl.trans(dMqk), qc, input_precision=PREC) + tl.dot(tl.trans(dMak), ac, input_precision=PREC)) * e_k
    db = (tl.dot(tl.trans(dMqb), qc, input_precision=PREC) + tl.dot(tl.trans(dMab), ac, input_precision=PREC)) * e_k
    da = (tl.dot(dMak, kc, input_precision=PREC) + tl.dot(dMab, bc, input_precision=PREC)) * e_a
    return dq, dk, da, db


@triton.jit
def _load_chunk(q, w, k, a, b, cu_seqlens, chunk_info, i_c, i_h, scale,
                H, K, BT: tl.constexpr, BK: tl.constexpr):
    """Locate chunk i_c, load its q (scaled), w, k, a, b as fp32 [BT, BK] and build the cumsums."""
    i_n = tl.load(chunk_info + 2 * i_c)
    i_t = tl.load(chunk_info + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t.to(tl.int64) * BT
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_rk = (rows < eos - t0)[:, None] & (o_k < K)[None, :]
    p_k = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + p_k, mask=m_rk, other=0.0).to(tl.float32) * scale
    b_w = tl.load(w + p_k, mask=m_rk, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_rk, other=0.0).to(tl.float32)
    b_a = tl.load(a + p_k, mask=m_rk, other=0.0).to(tl.float32)
    b_b = tl.load(b + p_k, mask=m_rk, other=0.0).to(tl.float32)
    return t0, eos, p_k, m_rk, b_q, b_w, b_k, b_a, b_b


# ------------------------------------------------------------------------------------------------
# forward kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def _prepare_kernel(
    q, w, k, v, a, b, cu_seqlens, chunk_info, scale, lower_bound,
    qh, kt, bt, Wm, U, Mqk, Mqb, Gm, Tm, Mak, gL,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CENTRED: tl.constexpr, STORE_BWD: tl.constexpr, QK_BF16: tl.constexpr, PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, eos, p_k, m_rk, b_q, b_w, b_k, b_a, b_b = _load_chunk(
        q, w, k, a, b, cu_seqlens, chunk_info, i_c, i_h, scale, H, K, BT, BK)
    rows = tl.arange(0, BT)
    m_r = rows < eos - t0
    wl = b_w * 1.4426950408889634
    G = tl.cumsum(wl, 0)
    Gb = G - wl
    g_L = tl.sum(wl, 0)

    if CENTRED:
        # the promise w >= lower_bound is verified here, per chunk, before the centred path is used
        if tl.min(tl.where(m_rk, b_w, 0.0)) >= lower_bound:
            b_Mqk, b_Mqb, b_Mak, b_Mab = _intra_centred_fwd(b_q, b_k, b_a, b_b, G, Gb, BT, QK_BF16, PREC)
        else:
            b_Mqk, b_Mqb, b_Mak, b_Mab = _intra_pairwise_fwd(b_q, b_k, b_a, b_b, G, Gb, BT, PREC)
    else:
        b_Mqk, b_Mqb, b_Mak, b_Mab = _intra_pairwise_fwd(b_q, b_k, b_a, b_b, G, Gb, BT, PREC)

    b_Tm = unit_lower_inverse(b_Mab, BT, PREC)
    b_ah = b_a * tl.exp2(Gb)
    b_W = tl.dot(b_Tm, b_ah, input_precision=PREC)
    b_G = tl.dot(b_Tm, b_Mak, input_precision=PREC)
    e_L = tl.exp2(g_L[None, :] - G)

    tl.store(qh + p_k, b_q * tl.exp2(G), mask=m_rk)
    tl.store(kt + p_k, b_k * e_L, mask=m_rk)
    tl.store(bt + p_k, b_b * e_L, mask=m_rk)
    tl.store(Wm + p_k, b_W, mask=m_rk)
    p_t = ((t0 + rows) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
    m_t = m_r[:, None]
    tl.store(Mqk + p_t, b_Mqk, mask=m_t)
    tl.store(Mqb + p_t, b_Mqb, mask=m_t)
    if STORE_BWD:
        tl.store(Gm + p_t, b_G, mask=m_t)
        tl.store(Tm + p_t, b_Tm, mask=m_t)
        tl.store(Mak + p_t, b_Mak, mask=m_t)
    o_k = tl.arange(0, BK)
    tl.store(gL + (i_c.to(tl.int64) * H + i_h) * K + o_k, g_L, mask=o_k < K)

    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_rv = m_t & (o_v < V)[None, :]
        p_v = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_rv, other=0.0).to(tl.float32)
        tl.store(U + p_v, tl.dot(b_G, b_v, input_precision=PREC), mask=m_rv)


@triton.jit
def _state_kernel(
    v, Wm, U, kt, bt, gL, h0, hs, ht, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = o_k[:, None] * V + o_v[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        m_r = (rows < eos - t0)[:, None]
        tl.store(hs + ((c0 + i_t) * H + i_h) * K * V + s_off, S, mask=m_kv)
        p_k = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
        p_v = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        b_W = tl.load(Wm + p_k, mask=m_r & m_k[None, :], other=0.0)
        b_kt = tl.load(kt + p_k, mask=m_r & m_k[None, :], other=0.0)
        b_bt = tl.load(bt + p_k, mask=m_r & m_k[None, :], other=0.0)
        b_U = tl.load(U + p_v, mask=m_r & m_v[None, :], other=0.0)
        b_v = tl.load(v + p_v, mask=m_r & m_v[None, :], other=0.0).to(tl.float32)
        b_gL = tl.load(gL + ((c0 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_P = b_U + tl.dot(b_W, S, input_precision=PREC)
        S = tl.exp2(b_gL)[:, None] * S + tl.dot(tl.trans(b_kt), b_v, input_precision=PREC) \
            + tl.dot(tl.trans(b_bt), b_P, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)


@triton.jit
def _output_kernel(
    v, qh, Wm, U, Mqk, Mqb, hs, o, cu_seqlens, chunk_info, NV,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1) // NV
    i_v = tl.program_id(1) % NV
    i_n = tl.load(chunk_info + 2 * i_c)
    i_t = tl.load(chunk_info + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t.to(tl.int64) * BT
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_r = (rows < eos - t0)[:, None]
    m_k = (o_k < K)[None, :]
    m_v = (o_v < V)[None, :]
    p_k = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
    p_v = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
    p_t = ((t0 + rows) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
    S = tl.load(hs + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=(o_k < K)[:, None] & m_v, other=0.0)
    b_W = tl.load(Wm + p_k, mask=m_r & m_k, other=0.0)
    b_qh = tl.load(qh + p_k, mask=m_r & m_k, other=0.0)
    b_U = tl.load(U + p_v, mask=m_r & m_v, other=0.0)
    b_v = tl.load(v + p_v, mask=m_r & m_v, other=0.0).to(tl.float32)
    b_Mqk = tl.load(Mqk + p_t, mask=m_r, other=0.0)
    b_Mqb = tl.load(Mqb + p_t, mask=m_r, other=0.0)
    b_P = b_U + tl.dot(b_W, S, input_precision=PREC)
    b_o = tl.dot(b_qh, S, input_precision=PREC) + tl.dot(b_Mqk, b_v, input_precision=PREC) \
        + tl.dot(b_Mqb, b_P, input_precision=PREC)
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_r & m_v)


# ------------------------------------------------------------------------------------------------
# backward kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def _dstate_kernel(
    do, qh, Wm, bt, Mqb, gL, dht, dhs, dh0, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = o_k[:, None] * V + o_v[None, :]

    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for i in range(0, NT):
        i_t = NT - 1 - i
        t0 = bos + i_t * BT
        m_r = (rows < eos - t0)[:, None]
        tl.store(dhs + ((c0 + i_t) * H + i_h) * K * V + s_off, dS, mask=m_kv)
        p_k = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
        p_v = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        p_t = ((t0 + rows) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
        b_do = tl.load(do + p_v, mask=m_r & m_v[None, :], other=0.0).to(tl.float32)
        b_Mqb = tl.load(Mqb + p_t, mask=m_r, other=0.0)
        b_bt = tl.load(bt + p_k, mask=m_r & m_k[None, :], other=0.0)
        b_W = tl.load(Wm + p_k, mask=m_r & m_k[None, :], other=0.0)
        b_qh = tl.load(qh + p_k, mask=m_r & m_k[None, :], other=0.0)
        b_gL = tl.load(gL + ((c0 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_dP = tl.dot(tl.trans(b_Mqb), b_do, input_precision=PREC) + tl.dot(b_bt, dS, input_precision=PREC)
        dS = tl.exp2(b_gL)[:, None] * dS + tl.dot(tl.trans(b_qh), b_do, input_precision=PREC) \
            + tl.dot(tl.trans(b_W), b_dP, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)


@triton.jit
def _backward_state_kernel(
    v, do, kt, bt, Wm, U, Mqk, Mqb, Gm, hs, dhs, cu_seqlens, chunk_info,
    dv, d_qh, d_kt, d_bt, d_W, d_Mqk, d_Mqb, d_G, s_sum,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """All contractions over V of one chunk: dv, and the fp32 gradients of q̂, k̃, b̃, W, M^qk, M^qb,
    G = Tm M^ak, plus rowsum(S^in * dS^out) for the chunk-total gate term."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.load(chunk_info + 2 * i_c)
    i_t = tl.load(chunk_info + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t.to(tl.int64) * BT
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_r = (rows < eos - t0)[:, None]
    m_rk = m_r & (o_k < K)[None, :]
    p_k = ((t0 + rows) * H + i_h)[:, None] * K + o_k[None, :]
    p_t = ((t0 + rows) * H + i_h)[:, None] * BT + cols[None, :]

    a_qh = tl.zeros([BT, BK], dtype=tl.float32)
    a_kt = tl.zeros([BT, BK], dtype=tl.float32)
    a_bt = tl.zeros([BT, BK], dtype=tl.float32)
    a_W = tl.zeros([BT, BK], dtype=tl.float32)
    a_Mqk = tl.zeros([BT, BT], dtype=tl.float32)
    a_Mqb = tl.zeros([BT, BT], dtype=tl.float32)
    a_G = tl.zeros([BT, BT], dtype=tl.float32)
    a_s = tl.zeros([BK], dtype=tl.float32)
    h_base = (i_c.to(tl.int64) * H + i_h) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = (o_v < V)[None, :]
        m_kv = (o_k < K)[:, None] & m_v
        s_off = o_k[:, None] * V + o_v[None, :]
        p_v = ((t0 + rows) * H + i_h)[:, None] * V + o_v[None, :]
        b_W = tl.load(Wm + p_k, mask=m_rk, other=0.0)
        b_kt = tl.load(kt + p_k, mask=m_rk, other=0.0)
        b_bt = tl.load(bt + p_k, mask=m_rk, other=0.0)
        b_Mqk = tl.load(Mqk + p_t, mask=m_r, other=0.0)
        b_Mqb = tl.load(Mqb + p_t, mask=m_r, other=0.0)
        b_G = tl.load(Gm + p_t, mask=m_r, other=0.0)
        S = tl.load(hs + h_base + s_off, mask=m_kv, other=0.0)
        dS = tl.load(dhs + h_base + s_off, mask=m_kv, other=0.0)
        b_do = tl.load(do + p_v, mask=m_r & m_v, other=0.0).to(tl.float32)
        b_v = tl.load(v + p_v, mask=m_r & m_v, other=0.0).to(tl.float32)
        b_U = tl.load(U + p_v, mask=m_r & m_v, other=0.0)
        b_P = b_U + tl.dot(b_W, S, input_precision=PREC)
        b_dP = tl.dot(tl.trans(b_Mqb), b_do, input_precision=PREC) + tl.dot(b_bt, dS, input_precision=PREC)
        a_qh += tl.dot(b_do, tl.trans(S), input_precision=PREC)
        a_kt += tl.dot(b_v, tl.trans(dS), input_precision=PREC)
        a_bt += tl.dot(b_P, tl.trans(dS), input_precision=PREC)
        a_W += tl.dot(b_dP, tl.trans(S), input_precision=PREC)
        a_s += tl.sum(S * dS, 1)
        a_Mqk += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        a_Mqb += tl.dot(b_do, tl.trans(b_P), input_precision=PREC)
        a_G += tl.dot(b_dP, tl.trans(b_v), input_precision=PREC)
        b_dv = tl.dot(tl.trans(b_Mqk), b_do, input_precision=PREC) + tl.dot(b_kt, dS, input_precision=PREC) \
            + tl.dot(tl.trans(b_G), b_dP, input_precision=PREC)
        tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_r & m_v)
    tl.store(d_qh + p_k, a_qh, mask=m_rk)
    tl.store(d_kt + p_k, a_kt, mask=m_rk)
    tl.store(d_bt + p_k, a_bt, mask=m_rk)
    tl.store(d_W + p_k, a_W, mask=m_rk)
    tl.store(d_Mqk + p_t, a_Mqk, mask=m_r)
    tl.store(d_Mqb + p_t, a_Mqb, mask=m_r)
    tl.store(d_G + p_t, a_G, mask=m_r)
    tl.store(s_sum + (i_c.to(tl.int64) * H + i_h) * K + o_k, a_s, mask=o_k < K)


@triton.jit
def _backward_intra_kernel(
    q, w, k, a, b, cu_seqlens, chunk_info, scale, lower_bound,
    Tm, Mak, d_qh, d_kt, d_bt, d_W, d_Mqk, d_Mqb, d_G, s_sum,
    dq, dw, dk, da, db,
    H, K, BT: tl.constexpr, BK: tl.constexpr, CENTRED: tl.constexpr, PREC: tl.constexpr,
):
    """The WY backward (dM^ab = strict(Tm^T dTm Tm^T)), the intra backward of either regime, the gated
    vectors, and dw by identity I2."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, eos, p_k, m_rk, b_q, b_w, b_k, b_a, b_b = _load_chunk(
        q, w, k, a, b, cu_seqlens, chunk_info, i_c, i_h, scale, H, K, BT, BK)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_r = (rows < eos - t0)[:, None]
    wl = b_w * 1.4426950408889634
    G = tl.cumsum(wl, 0)
    Gb = G - wl
    g_L = tl.sum(wl, 0)
    e_L = tl.exp2(g_L[None, :] - G)
    b_ah = b_a * tl.exp2(Gb)
    p_t = ((t0 + rows) * H + i_h)[:, None] * BT + cols[None, :]
    incl = rows[:, None] >= cols[None, :]
    strict = rows[:, None] > cols[None, :]

    # WY backward: W = Tm Â, G = Tm M^ak, Tm = (I - M^ab)^-1
    b_Tm = tl.load(Tm + p_t, mask=m_r, other=0.0)
    b_Mak = tl.load(Mak + p_t, mask=m_r, other=0.0)
    b_dG = tl.load(d_G + p_t, mask=m_r, other=0.0)
    b_dW = tl.load(d_W + p_k, mask=m_rk, other=0.0)
    d_Tm = tl.dot(b_dG, tl.trans(b_Mak), input_precision=PREC) + tl.dot(b_dW, tl.trans(b_ah), input_precision=PREC)
    d_Mak = tl.where(strict, tl.dot(tl.trans(b_Tm), b_dG, input_precision=PREC), 0.0)
    d_ah = tl.dot(tl.trans(b_Tm), b_dW, input_precision=PREC)
    d_Mab = tl.dot(tl.dot(tl.trans(b_Tm), d_Tm, input_precision=PREC), tl.trans(b_Tm), input_precision=PREC)
    d_Mab = tl.where(strict, d_Mab, 0.0)
    d_Mqk = tl.where(incl, tl.load(d_Mqk + p_t, mask=m_r, other=0.0), 0.0)
    d_Mqb = tl.where(incl, tl.load(d_Mqb + p_t, mask=m_r, other=0.0), 0.0)

    # gated vectors q̂ = q e^Γ, k̃ = k e^{Γ_L-Γ}, b̃ = b e^{Γ_L-Γ}, Â = a e^Γ̄
    a_kt = tl.load(d_kt + p_k, mask=m_rk, other=0.0)
    a_bt = tl.load(d_bt + p_k, mask=m_rk, other=0.0)
    b_dq = tl.load(d_qh + p_k, mask=m_rk, other=0.0) * tl.exp2(G)
    b_dk = a_kt * e_L
    b_db = a_bt * e_L
    b_da = d_ah * tl.exp2(Gb)
    b_s = tl.load(s_sum + (i_c.to(tl.int64) * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
    g_last = tl.exp2(g_L) * b_s + tl.sum(b_k * b_dk + b_b * b_db, 0)

    if CENTRED:
        if tl.min(tl.where(m_rk, b_w, 0.0)) >= lower_bound:
            i_dq, i_dk, i_da, i_db = _intra_centred_bwd(
                b_q, b_k, b_a, b_b, G, Gb, d_Mqk, d_Mqb, d_Mak, d_Mab, BT, PREC)
        else:
            i_dq, i_dk, i_da, i_db = _intra_pairwise_bwd(
                b_q, b_k, b_a, b_b, G, Gb, d_Mqk, d_Mqb, d_Mak, d_Mab, BT, BK, PREC)
    else:
        i_dq, i_dk, i_da, i_db = _intra_pairwise_bwd(b_q, b_k, b_a, b_b, G, Gb, d_Mqk, d_Mqb, d_Mak, d_Mab, BT, BK, PREC)
    b_dq += i_dq
    b_dk += i_dk
    b_da += i_da
    b_db += i_db

    # identity I2: dw_s = sum_{τ>=s} γ_τ - (a da)_s + g_last, γ = q dq + a da - k dk - b db
    g_a = b_a * b_da
    gam = b_q * b_dq + g_a - b_k * b_dk - b_b * b_db
    rev = tl.sum(gam, 0)[None, :] - tl.cumsum(gam, 0) + gam
    b_dw = rev - g_a + g_last[None, :]

    tl.store(dq + p_k, (b_dq * scale).to(dq.dtype.element_ty), mask=m_rk)
    tl.store(dk + p_k, b_dk.to(dk.dtype.element_ty), mask=m_rk)
    tl.store(da + p_k, b_da.to(da.dtype.element_ty), mask=m_rk)
    tl.store(db + p_k, b_db.to(db.dtype.element_ty), mask=m_rk)
    tl.store(dw + p_k, b_dw.to(dw.dtype.element_ty), mask=m_rk)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------

def _chunk_layout(B, T, BT, cu_seqlens, device):
    """cu_seqlens (int64), chunk_info [NT, 2] = (sequence, chunk-in-sequence), chunk_offsets [N+1]."""
    if cu_seqlens is None:
        nt = triton.cdiv(T, BT)
        cu = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
        seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(nt)
        idx = torch.arange(nt, device=device, dtype=torch.int32).repeat(B)
        offsets = torch.arange(0, B + 1, device=device, dtype=torch.int64) * nt
        return cu, torch.stack([seq, idx], 1).contiguous(), offsets, B
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    counts = [triton.cdiv(int(n), BT) for n in (cu[1:] - cu[:-1]).tolist()]
    info = [(n, i) for n, c in enumerate(counts) for i in range(c)]
    chunk_info = torch.tensor(info, dtype=torch.int32, device=device).reshape(-1, 2)
    offsets = torch.tensor([0] + counts, dtype=torch.int64, device=device).cumsum(0)
    return cu, chunk_info, offsets, len(counts)


def _state_block_v(BK, V):
    return min(max(triton.next_power_of_2(V), 16), 64 if BK <= 64 else 32)


def _check_kernel_dtype(op, r):
    if r.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: the Triton kernels take float32, float16 or bfloat16 inputs, got {r.dtype}; "
                        "use backend='torch' for float64")


class _Plan:
    """Everything the kernels need to know about one call's shapes and regime."""

    def __init__(self, r, v, cu_seqlens, gate_lower_bound):
        B, T, H, K = r.shape
        V = v.shape[-1]
        bt_centred = centred_chunk_size(gate_lower_bound)
        self.centred = bt_centred is not None
        self.BT = bt_centred if self.centred else 16
        self.lower_bound = float(gate_lower_bound) if self.centred else 0.0
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.BK = max(triton.next_power_of_2(K), 16)
        self.BV = _state_block_v(self.BK, V)
        self.NV = triton.cdiv(V, self.BV)
        # the scans keep loads of the next chunk in flight (2 stages) only where shared memory allows
        self.scan_stages = 2 if self.BK <= 64 else 1
        self.cu, self.chunk_info, self.chunk_offsets, self.N = _chunk_layout(B, T, self.BT, cu_seqlens, r.device)
        self.NT = self.chunk_info.shape[0]
        interp = _interpreting()
        # fp32-accurate products (3xTF32) for every input dtype: with plain TF32 the nilpotent-product
        # inverse and the state scan lost so much that a trained RWKV7-340M head (bf16, T = 2048,
        # slow decays, aligned kappa) overflowed to inf by chunk 29 on the H100, while 3xTF32 and
        # IEEE matched the fp64 reference to 3e-3 of the output's range (session 2 GPU probe)
        self.prec = "tf32x3"
        self.qk_bf16 = r.dtype == torch.bfloat16 and not interp


def _prepare(plan, q, w, k, v, a, b, scale, store_bwd):
    B, T, H, K, V, BT = plan.B, plan.T, plan.H, plan.K, plan.V, plan.BT
    f32 = dict(dtype=torch.float32, device=q.device)
    out = dict(
        qh=torch.empty(B, T, H, K, **f32), kt=torch.empty(B, T, H, K, **f32), bt=torch.empty(B, T, H, K, **f32),
        Wm=torch.empty(B, T, H, K, **f32), U=torch.empty(B, T, H, V, **f32),
        Mqk=torch.empty(B, T, H, BT, **f32), Mqb=torch.empty(B, T, H, BT, **f32), Gm=torch.empty(B, T, H, BT, **f32) if store_bwd else None,
        Tm=torch.empty(B, T, H, BT, **f32) if store_bwd else None,
        Mak=torch.empty(B, T, H, BT, **f32) if store_bwd else None,
        gL=torch.empty(plan.NT, H, K, **f32),
    )
    _prepare_kernel[(plan.NT, H)](
        q, w, k, v, a, b, plan.cu, plan.chunk_info, scale, plan.lower_bound,
        out["qh"], out["kt"], out["bt"], out["Wm"], out["U"], out["Mqk"], out["Mqb"], out["Gm"], out["Tm"],
        out["Mak"], out["gL"],
        H=H, K=K, V=V, BT=BT, BK=plan.BK, BV=min(max(triton.next_power_of_2(V), 16), 64),
        CENTRED=plan.centred, STORE_BWD=store_bwd, QK_BF16=plan.qk_bf16, PREC=plan.prec,
        num_warps=NUM_WARPS, num_stages=1,
    )
    return out


class ChunkRWKV7Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, gate_lower_bound,
                cache_intermediates):
        r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
        plan = _Plan(r, v, cu_seqlens, gate_lower_bound)
        H, K, V = plan.H, plan.K, plan.V
        need_grad = any(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 4, 5, 7))
        pre = _prepare(plan, r, w, k, v, a, b, scale, store_bwd=need_grad and cache_intermediates)
        hs = r.new_empty(plan.NT, H, K, V, dtype=torch.float32)
        ht = r.new_empty(plan.N, H, K, V, dtype=torch.float32) if output_final_state else None
        h0 = initial_state.contiguous() if initial_state is not None else None
        _state_kernel[(plan.N * H, plan.NV)](
            v, pre["Wm"], pre["U"], pre["kt"], pre["bt"], pre["gL"], h0, hs, ht, plan.cu, plan.chunk_offsets,
            H=H, K=K, V=V, BT=plan.BT, BK=plan.BK, BV=plan.BV, USE_H0=h0 is not None, STORE_HT=output_final_state,
            PREC=plan.prec, num_warps=NUM_WARPS, num_stages=plan.scan_stages,
        )
        o = torch.empty_like(v)
        _output_kernel[(plan.NT, H * plan.NV)](
            v, pre["qh"], pre["Wm"], pre["U"], pre["Mqk"], pre["Mqb"], hs, o, plan.cu, plan.chunk_info, plan.NV,
            H=H, K=K, V=V, BT=plan.BT, BK=plan.BK, BV=plan.BV, PREC=plan.prec, num_warps=NUM_WARPS,
        )
        if need_grad:
            ctx.save_for_backward(r, w, k, v, a, b, hs)
            ctx.plan = plan
            ctx.scale = scale
            ctx.has_h0 = initial_state is not None
            ctx.pre = pre if cache_intermediates else None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, w, k, v, a, b, hs = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        H, K, V = plan.H, plan.K, plan.V
        pre = ctx.pre if ctx.pre is not None else _prepare(plan, r, w, k, v, a, b, scale, store_bwd=True)
        ctx.pre = None
        do = do.contiguous()
        dhs = torch.empty_like(hs)
        dh0 = r.new_empty(plan.N, H, K, V, dtype=torch.float32) if ctx.has_h0 else None
        _dstate_kernel[(plan.N * H, plan.NV)](
            do, pre["qh"], pre["Wm"], pre["bt"], pre["Mqb"], pre["gL"],
            dht.contiguous() if dht is not None else None, dhs, dh0, plan.cu, plan.chunk_offsets,
            H=H, K=K, V=V, BT=plan.BT, BK=plan.BK, BV=plan.BV, USE_DHT=dht is not None, STORE_DH0=ctx.has_h0,
            PREC=plan.prec, num_warps=NUM_WARPS, num_stages=plan.scan_stages,
        )
        dr, dw, dk, da, db = (torch.empty_like(x) for x in (r, w, k, a, b))
        dv = torch.empty_like(v)
        B, T, BT = plan.B, plan.T, plan.BT
        f32 = dict(dtype=torch.float32, device=r.device)
        g_qh, g_kt, g_bt, g_W = (torch.empty(B, T, H, K, **f32) for _ in range(4))
        g_Mqk, g_Mqb, g_G = (torch.empty(B, T, H, BT, **f32) for _ in range(3))
        s_sum = torch.empty(plan.NT, H, K, **f32)
        _backward_state_kernel[(plan.NT, H)](
            v, do, pre["kt"], pre["bt"], pre["Wm"], pre["U"], pre["Mqk"], pre["Mqb"], pre["Gm"], hs, dhs,
            plan.cu, plan.chunk_info, dv, g_qh, g_kt, g_bt, g_W, g_Mqk, g_Mqb, g_G, s_sum,
            H=H, K=K, V=V, BT=BT, BK=plan.BK, BV=32 if plan.BK <= 64 else 16, PREC=plan.prec, num_warps=NUM_WARPS,
            num_stages=1,
        )
        _backward_intra_kernel[(plan.NT, H)](
            r, w, k, a, b, plan.cu, plan.chunk_info, scale, plan.lower_bound,
            pre["Tm"], pre["Mak"], g_qh, g_kt, g_bt, g_W, g_Mqk, g_Mqb, g_G, s_sum,
            dr, dw, dk, da, db,
            H=H, K=K, BT=BT, BK=plan.BK, CENTRED=plan.centred, PREC=plan.prec,
            num_warps=NUM_WARPS, num_stages=1,
        )
        return dr, dw, dk, dv, da, db, None, dh0, None, None, None, None


def chunk_rwkv7_triton(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                       gate_lower_bound=None, cache_intermediates=False):
    """Chunked RWKV7 with Triton, forward and backward. Inputs are already validated.

    gate_lower_bound: a claim that w >= bound everywhere. It selects the centred tensor-core regime
    only if it passes the fp32 headroom rule, and each chunk re-checks it on its own gates before
    using it. cache_intermediates: keep the per-chunk forward intermediates for the backward instead
    of recomputing them (faster backward, more memory).
    Returns (o [B,T,H,V] in the input dtype, final state [N,H,K,V] fp32 or None).
    """
    _check_kernel_dtype("chunk_rwkv7", r)
    if r.shape[-1] > MAX_CHUNK_K:
        # the per-chunk tiles of the whole key dimension no longer fit one program (registers, shared
        # memory); the fused recurrent kernels compute the same function exactly, step by step
        from .fused_recurrent_triton import fused_recurrent_rwkv7_triton
        return fused_recurrent_rwkv7_triton(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
    return ChunkRWKV7Function.apply(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                                    gate_lower_bound, cache_intermediates)
