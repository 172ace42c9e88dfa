"""Triton kernels of the step-by-step GSA recurrence (docs/kernels.md#gsa-recurrent-kernel), forward and backward.

Per (sequence, key/value head), with the slot gate a_t = exp(g_t) and inclusive reads:

    Hk_t = Hk_{t-1} diag(a_t) + k_t s_t^T        z_t = Hk_t^T (scale q_t),  p_t = softmax(z_t)
    Hv_t = diag(a_t) Hv_{t-1} + s_t v_t^T        o_t = Hv_t^T p_t

Grouped queries: query heads h*NG .. h*NG+NG-1 read the states of key/value head h; every
program of a key/value head loops over its group, so gradients of the shared tensors are summed
in registers (no atomics, deterministic).

Forward: kernel `_fwd_slots` (pass K + the max-stabilised fp32 softmax, in registers, full K and
M per program) stores p in fp32; kernel `_fwd_values` (pass V, tiled over V) gives o.

Backward (states and state gradients in fp32):
  1. `_bwd_dp`: forward in time over pass V, dp_t = Hv_t do_t, partial per V-block;
  2. `_bwd_dz`: forward in time over pass K, dz = p (dp - <p, dp>), dq = scale Hk_t dz, and the
     query-side gate term z dz + p dp summed over the group;
  3. `_bwd_values`: reverse in time over pass V, dHv, dv, the V-side ds per V-block and dHv0;
  4. `_bwd_slots`: reverse in time over pass K, dHk, dk, ds, dHk0, and dg by identity I2
     (docs/kernels.md#gate-gradients-by-reverse-cumsum-i2):
     dg_t = sum_{tau >= t} (z dz + p dp - s ds)_tau + the final-state term
     colsum(HkT * dHkT) + rowsum(HvT * dHvT), accumulated in fp32 in registers.
"""

import torch
import triton
import triton.language as tl


def _next_pow2(x: int) -> int:
    return triton.next_power_of_2(int(x))


@triton.jit
def _program_head(cu_seqlens, T, H: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(i_nh, i_h, bos, eos): this program's sequence-and-key/value-head index, its head, and its
    sequence's tokens [bos, eos) (from cu_seqlens when packed)."""
    i_nh = tl.program_id(0).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return i_nh, i_h, bos, eos


@triton.jit
def _state_tile(state, i_nh, o_r, o_c, R: tl.constexpr, C: tl.constexpr):
    """Pointers to program i_nh's [R, C] state (rows o_r, columns o_c) in `state` [N*H, R, C]."""
    return state + i_nh * R * C + o_r[:, None] * C + o_c[None, :]


@triton.jit
def _start_state(h0, i_nh, o_r, o_c, m_r, m_c, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr, HAS: tl.constexpr):
    """Program i_nh's [BR, BC] fp32 state to start from: its tile of h0 [N*H, R, C] if HAS, else zeros."""
    b_h = tl.zeros([BR, BC], dtype=tl.float32)
    if HAS:
        b_h += tl.load(_state_tile(h0, i_nh, o_r, o_c, R, C), mask=m_r[:, None] & m_c[None, :],
                       other=0.).to(tl.float32)
    return b_h


@triton.jit
def _token_vector(x, t, i_h, o, mask, H: tl.constexpr, D: tl.constexpr):
    """Token t's [D] vector of head i_h in x [.., T, H, D] (the lanes `o` under `mask`), fp32."""
    return tl.load(x + (t * H + i_h) * D + o, mask=mask, other=0.).to(tl.float32)


@triton.jit
def _slot_state_step(b_h, k, s, g, t, i_h, o_k, o_m, m_k, m_m,
                     H: tl.constexpr, K: tl.constexpr, M: tl.constexpr):
    """Pass K's step: Hk_t = Hk_{t-1} diag(exp(g_t)) + k_t s_t^T, [BK, BM] in fp32."""
    b_k = _token_vector(k, t, i_h, o_k, m_k, H, K)
    b_s = _token_vector(s, t, i_h, o_m, m_m, H, M)
    b_g = _token_vector(g, t, i_h, o_m, m_m, H, M)
    return b_h * tl.exp(b_g)[None, :] + b_k[:, None] * b_s[None, :]


@triton.jit
def _value_state_step(b_h, s, g, v, t, i_h, o_m, o_v, m_m, m_v,
                      H: tl.constexpr, M: tl.constexpr, V: tl.constexpr):
    """Pass V's step: Hv_t = diag(exp(g_t)) Hv_{t-1} + s_t v_t^T, [BM, BV] in fp32."""
    b_s = _token_vector(s, t, i_h, o_m, m_m, H, M)
    b_g = _token_vector(g, t, i_h, o_m, m_m, H, M)
    b_v = _token_vector(v, t, i_h, o_v, m_v, H, V)
    return b_h * tl.exp(b_g)[:, None] + b_s[:, None] * b_v[None, :]


@triton.jit
def _fwd_slots(q, k, s, g, hk0, p, hkT, cu_seqlens, scale, T,
               H: tl.constexpr, NG: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
               BK: tl.constexpr, BM: tl.constexpr,
               HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_nh, i_h, bos, eos = _program_head(cu_seqlens, T, H, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_m = tl.arange(0, BM)
    m_k = o_k < K
    m_m = o_m < M
    m_km = m_k[:, None] & m_m[None, :]
    b_h = _start_state(hk0, i_nh, o_k, o_m, m_k, m_m, K, M, BK, BM, HAS_H0)
    for t in range(bos, eos):
        b_h = _slot_state_step(b_h, k, s, g, t, i_h, o_k, o_m, m_k, m_m, H, K, M)
        for i_g in tl.static_range(NG):
            i_hq = i_h * NG + i_g
            b_q = _token_vector(q, t, i_hq, o_k, m_k, H * NG, K) * scale
            b_z = tl.sum(b_h * b_q[:, None], 0)
            b_z = tl.where(m_m, b_z, float('-inf'))
            b_e = tl.exp(b_z - tl.max(b_z, 0))
            b_e = tl.where(m_m, b_e, 0.)
            b_p = b_e / tl.sum(b_e, 0)
            tl.store(p + (t * H * NG + i_hq) * M + o_m, b_p, mask=m_m)
    if STORE_HT:
        tl.store(_state_tile(hkT, i_nh, o_k, o_m, K, M), b_h, mask=m_km)


@triton.jit
def _fwd_values(s, g, v, p, hv0, o, hvT, cu_seqlens, T,
                H: tl.constexpr, NG: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                BM: tl.constexpr, BV: tl.constexpr,
                HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_nh, i_h, bos, eos = _program_head(cu_seqlens, T, H, IS_VARLEN)
    i_v = tl.program_id(1)
    o_m = tl.arange(0, BM)
    o_v = i_v * BV + tl.arange(0, BV)
    m_m = o_m < M
    m_v = o_v < V
    m_mv = m_m[:, None] & m_v[None, :]
    b_h = _start_state(hv0, i_nh, o_m, o_v, m_m, m_v, M, V, BM, BV, HAS_H0)
    for t in range(bos, eos):
        b_h = _value_state_step(b_h, s, g, v, t, i_h, o_m, o_v, m_m, m_v, H, M, V)
        for i_g in tl.static_range(NG):
            i_hq = i_h * NG + i_g
            b_p = tl.load(p + (t * H * NG + i_hq) * M + o_m, mask=m_m, other=0.)
            b_o = tl.sum(b_h * b_p[:, None], 0)
            tl.store(o + (t * H * NG + i_hq) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(_state_tile(hvT, i_nh, o_m, o_v, M, V), b_h, mask=m_mv)


@triton.jit
def _bwd_dp(s, g, v, do, hv0, dp_part, cu_seqlens, T,
            H: tl.constexpr, NG: tl.constexpr, M: tl.constexpr, V: tl.constexpr, NV: tl.constexpr,
            BM: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_nh, i_h, bos, eos = _program_head(cu_seqlens, T, H, IS_VARLEN)
    i_v = tl.program_id(1)
    o_m = tl.arange(0, BM)
    o_v = i_v * BV + tl.arange(0, BV)
    m_m = o_m < M
    m_v = o_v < V
    b_h = _start_state(hv0, i_nh, o_m, o_v, m_m, m_v, M, V, BM, BV, HAS_H0)
    # dp_part: [B * T, NV, HQ, M] fp32, token-major (int64 offsets through t)
    for t in range(bos, eos):
        b_h = _value_state_step(b_h, s, g, v, t, i_h, o_m, o_v, m_m, m_v, H, M, V)
        for i_g in tl.static_range(NG):
            i_hq = i_h * NG + i_g
            b_do = _token_vector(do, t, i_hq, o_v, m_v, H * NG, V)
            b_dp = tl.sum(b_h * b_do[None, :], 1)
            tl.store(dp_part + ((t * NV + i_v) * H * NG + i_hq) * M + o_m, b_dp, mask=m_m)


@triton.jit
def _bwd_dz(q, k, s, g, hk0, p, dp_part, dq, dz, qside, cu_seqlens, scale, T,
            H: tl.constexpr, NG: tl.constexpr, K: tl.constexpr, M: tl.constexpr, NV: tl.constexpr,
            BK: tl.constexpr, BM: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_nh, i_h, bos, eos = _program_head(cu_seqlens, T, H, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_m = tl.arange(0, BM)
    m_k = o_k < K
    m_m = o_m < M
    b_h = _start_state(hk0, i_nh, o_k, o_m, m_k, m_m, K, M, BK, BM, HAS_H0)
    for t in range(bos, eos):
        b_h = _slot_state_step(b_h, k, s, g, t, i_h, o_k, o_m, m_k, m_m, H, K, M)
        b_qside = tl.zeros([BM], dtype=tl.float32)
        for i_g in tl.static_range(NG):
            i_hq = i_h * NG + i_g
            off_m = (t * H * NG + i_hq) * M + o_m
            b_p = tl.load(p + off_m, mask=m_m, other=0.)
            b_dp = tl.zeros([BM], dtype=tl.float32)
            for i_v in tl.static_range(NV):
                b_dp += tl.load(dp_part + ((t * NV + i_v) * H * NG + i_hq) * M + o_m, mask=m_m, other=0.)
            b_dz = b_p * (b_dp - tl.sum(b_p * b_dp, 0))
            b_q = _token_vector(q, t, i_hq, o_k, m_k, H * NG, K)
            b_z = tl.sum(b_h * b_q[:, None], 0) * scale
            b_dq = tl.sum(b_h * b_dz[None, :], 1) * scale
            tl.store(dq + (t * H * NG + i_hq) * K + o_k, b_dq.to(dq.dtype.element_ty), mask=m_k)
            tl.store(dz + off_m, b_dz, mask=m_m)
            b_qside += b_z * b_dz + b_p * b_dp
        tl.store(qside + (t * H + i_h) * M + o_m, b_qside, mask=m_m)


@triton.jit
def _bwd_values(s, g, v, p, do, dhvT, dv, dsv_part, dhv0, cu_seqlens, T,
                H: tl.constexpr, NG: tl.constexpr, M: tl.constexpr, V: tl.constexpr, NV: tl.constexpr,
                BM: tl.constexpr, BV: tl.constexpr,
                HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_nh, i_h, bos, eos = _program_head(cu_seqlens, T, H, IS_VARLEN)
    i_v = tl.program_id(1)
    o_m = tl.arange(0, BM)
    o_v = i_v * BV + tl.arange(0, BV)
    m_m = o_m < M
    m_v = o_v < V
    m_mv = m_m[:, None] & m_v[None, :]
    b_dh = _start_state(dhvT, i_nh, o_m, o_v, m_m, m_v, M, V, BM, BV, HAS_DHT)
    for i_t in range(0, eos - bos):
        t = eos - 1 - i_t
        for i_g in tl.static_range(NG):
            i_hq = i_h * NG + i_g
            b_p = tl.load(p + (t * H * NG + i_hq) * M + o_m, mask=m_m, other=0.)
            b_do = _token_vector(do, t, i_hq, o_v, m_v, H * NG, V)
            b_dh += b_p[:, None] * b_do[None, :]
        b_s = _token_vector(s, t, i_h, o_m, m_m, H, M)
        b_g = _token_vector(g, t, i_h, o_m, m_m, H, M)
        b_v = _token_vector(v, t, i_h, o_v, m_v, H, V)
        b_dv = tl.sum(b_dh * b_s[:, None], 0)
        tl.store(dv + (t * H + i_h) * V + o_v, b_dv.to(dv.dtype.element_ty), mask=m_v)
        b_ds = tl.sum(b_dh * b_v[None, :], 1)
        tl.store(dsv_part + ((t * NV + i_v) * H + i_h) * M + o_m, b_ds, mask=m_m)
        b_dh = b_dh * tl.exp(b_g)[:, None]
    if STORE_DH0:
        tl.store(_state_tile(dhv0, i_nh, o_m, o_v, M, V), b_dh, mask=m_mv)


@triton.jit
def _bwd_slots(q, k, s, g, dz, qside, dsv_part, dhkT, dg_last, dk, ds, dg, dhk0, cu_seqlens, scale, T,
               H: tl.constexpr, NG: tl.constexpr, K: tl.constexpr, M: tl.constexpr, NV: tl.constexpr,
               BK: tl.constexpr, BM: tl.constexpr,
               HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_nh, i_h, bos, eos = _program_head(cu_seqlens, T, H, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_m = tl.arange(0, BM)
    m_k = o_k < K
    m_m = o_m < M
    m_km = m_k[:, None] & m_m[None, :]
    b_dh = tl.zeros([BK, BM], dtype=tl.float32)
    # running reverse sum of the gate gradient, started from the final-state term
    b_acc = tl.zeros([BM], dtype=tl.float32)
    if HAS_DHT:
        b_dh += tl.load(_state_tile(dhkT, i_nh, o_k, o_m, K, M), mask=m_km, other=0.).to(tl.float32)
        b_acc += tl.load(dg_last + i_nh * M + o_m, mask=m_m, other=0.)
    for i_t in range(0, eos - bos):
        t = eos - 1 - i_t
        for i_g in tl.static_range(NG):
            i_hq = i_h * NG + i_g
            b_q = _token_vector(q, t, i_hq, o_k, m_k, H * NG, K) * scale
            b_dz = tl.load(dz + (t * H * NG + i_hq) * M + o_m, mask=m_m, other=0.)
            b_dh += b_q[:, None] * b_dz[None, :]
        off_m = (t * H + i_h) * M + o_m
        b_k = _token_vector(k, t, i_h, o_k, m_k, H, K)
        b_s = tl.load(s + off_m, mask=m_m, other=0.).to(tl.float32)
        b_g = tl.load(g + off_m, mask=m_m, other=0.).to(tl.float32)
        b_dk = tl.sum(b_dh * b_s[None, :], 1)
        tl.store(dk + (t * H + i_h) * K + o_k, b_dk.to(dk.dtype.element_ty), mask=m_k)
        b_ds = tl.sum(b_dh * b_k[:, None], 0)
        for i_v in tl.static_range(NV):
            b_ds += tl.load(dsv_part + ((t * NV + i_v) * H + i_h) * M + o_m, mask=m_m, other=0.)
        tl.store(ds + off_m, b_ds.to(ds.dtype.element_ty), mask=m_m)
        b_acc += tl.load(qside + off_m, mask=m_m, other=0.) - b_s * b_ds
        tl.store(dg + off_m, b_acc.to(dg.dtype.element_ty), mask=m_m)
        b_dh = b_dh * tl.exp(b_g)[None, :]
    if STORE_DH0:
        tl.store(_state_tile(dhk0, i_nh, o_k, o_m, K, M), b_dh, mask=m_km)


def _block_v(V: int) -> int:
    return min(_next_pow2(V), 64)


def _warps(elements: int) -> int:
    return 8 if elements >= 8192 else 4


def _dims(q, k, v, s, cu_seqlens):
    B, T, HQ, K = q.shape
    H, V, M = k.shape[2], v.shape[-1], s.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    return B, T, H, HQ // H, K, V, M, N


def fused_recurrent_gsa_fwd(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens):
    """Returns o (input dtype), p (fp32 softmax over slots) and the fp32 final states (or None)."""
    B, T, H, NG, K, V, M, N = _dims(q, k, v, s, cu_seqlens)
    BK, BM, BV = max(_next_pow2(K), 16), max(_next_pow2(M), 16), _block_v(V)
    NV = triton.cdiv(V, BV)
    varlen = cu_seqlens is not None
    p = torch.empty(B, T, H * NG, M, device=q.device, dtype=torch.float32)
    o = torch.empty(B, T, H * NG, V, device=q.device, dtype=q.dtype)
    hkT = q.new_empty(N, H, K, M, dtype=torch.float32) if output_final_state else None
    hvT = q.new_empty(N, H, M, V, dtype=torch.float32) if output_final_state else None
    _fwd_slots[(N * H,)](
        q, k, s, g, hk0, p, hkT, cu_seqlens, scale, T,
        H=H, NG=NG, K=K, M=M, BK=BK, BM=BM,
        HAS_H0=hk0 is not None, STORE_HT=output_final_state, IS_VARLEN=varlen,
        num_warps=_warps(BK * BM))
    _fwd_values[(N * H, NV)](
        s, g, v, p, hv0, o, hvT, cu_seqlens, T,
        H=H, NG=NG, M=M, V=V, BM=BM, BV=BV,
        HAS_H0=hv0 is not None, STORE_HT=output_final_state, IS_VARLEN=varlen,
        num_warps=_warps(BM * BV))
    return o, p, hkT, hvT


def fused_recurrent_gsa_bwd(q, k, v, s, g, scale, hk0, hv0, p, do, dhkT, dhvT, dg_last, cu_seqlens):
    B, T, H, NG, K, V, M, N = _dims(q, k, v, s, cu_seqlens)
    BK, BM, BV = max(_next_pow2(K), 16), max(_next_pow2(M), 16), _block_v(V)
    NV = triton.cdiv(V, BV)
    varlen = cu_seqlens is not None
    f32 = dict(device=q.device, dtype=torch.float32)
    dp_part = torch.empty(B, T, NV, H * NG, M, **f32)
    dz = torch.empty(B, T, H * NG, M, **f32)
    qside = torch.empty(B, T, H, M, **f32)
    dsv_part = torch.empty(B, T, NV, H, M, **f32)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ds = torch.empty_like(s)
    dg = torch.empty_like(g)
    dhk0 = torch.empty(N, H, K, M, **f32) if hk0 is not None else None
    dhv0 = torch.empty(N, H, M, V, **f32) if hv0 is not None else None
    has_dht = dhkT is not None
    _bwd_dp[(N * H, NV)](
        s, g, v, do, hv0, dp_part, cu_seqlens, T,
        H=H, NG=NG, M=M, V=V, NV=NV, BM=BM, BV=BV, HAS_H0=hv0 is not None, IS_VARLEN=varlen,
        num_warps=_warps(BM * BV))
    _bwd_dz[(N * H,)](
        q, k, s, g, hk0, p, dp_part, dq, dz, qside, cu_seqlens, scale, T,
        H=H, NG=NG, K=K, M=M, NV=NV, BK=BK, BM=BM, HAS_H0=hk0 is not None, IS_VARLEN=varlen,
        num_warps=_warps(BK * BM))
    _bwd_values[(N * H, NV)](
        s, g, v, p, do, dhvT, dv, dsv_part, dhv0, cu_seqlens, T,
        H=H, NG=NG, M=M, V=V, NV=NV, BM=BM, BV=BV,
        HAS_DHT=has_dht, STORE_DH0=hv0 is not None, IS_VARLEN=varlen,
        num_warps=_warps(BM * BV))
    _bwd_slots[(N * H,)](
        q, k, s, g, dz, qside, dsv_part, dhkT, dg_last, dk, ds, dg, dhk0, cu_seqlens, scale, T,
        H=H, NG=NG, K=K, M=M, NV=NV, BK=BK, BM=BM,
        HAS_DHT=has_dht, STORE_DH0=hk0 is not None, IS_VARLEN=varlen,
        num_warps=_warps(BK * BM))
    return dq, dk, dv, ds, dg, dhk0, dhv0


class FusedRecurrentGSAFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens):
        o, p, hkT, hvT = fused_recurrent_gsa_fwd(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, s, g, hk0, hv0, p, hkT, hvT, cu_seqlens)
        ctx.scale = scale
        return o, hkT, hvT

    @staticmethod
    def backward(ctx, do, dhkT, dhvT):
        q, k, v, s, g, hk0, hv0, p, hkT, hvT, cu_seqlens = ctx.saved_tensors
        dg_last = None
        if dhkT is not None or dhvT is not None:
            dhkT = torch.zeros_like(hkT) if dhkT is None else dhkT.float().contiguous()
            dhvT = torch.zeros_like(hvT) if dhvT is None else dhvT.float().contiguous()
            # d/dG_T of the final states: colsum(HkT * dHkT) + rowsum(HvT * dHvT), per slot
            dg_last = (hkT * dhkT).sum(-2) + (hvT * dhvT).sum(-1)
        dq, dk, dv, ds, dg, dhk0, dhv0 = fused_recurrent_gsa_bwd(
            q, k, v, s, g, ctx.scale, hk0, hv0, p, do.contiguous(), dhkT, dhvT, dg_last, cu_seqlens)
        if dhk0 is not None:
            dhk0 = dhk0.to(hk0.dtype)
            dhv0 = dhv0.to(hv0.dtype)
        return dq, dk, dv, ds, dg, None, dhk0, dhv0, None, None


def fused_recurrent_gsa_triton(q, k, v, s, g, scale=1.0, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
    """Triton fused-recurrent GSA on validated inputs; returns (o, (hk, hv) fp32 or None)."""
    hk0, hv0 = (None, None) if initial_state is None else initial_state
    if (hk0 is None) != (hv0 is None):
        raise ValueError("initial_state must be the pair (hk, hv), both tensors or both None")
    contiguous = [t.contiguous() for t in (q, k, v, s, g)]
    hk0 = None if hk0 is None else hk0.contiguous()
    hv0 = None if hv0 is None else hv0.contiguous()
    o, hkT, hvT = FusedRecurrentGSAFunction.apply(
        *contiguous, float(scale), hk0, hv0, bool(output_final_state), cu_seqlens)
    return o, ((hkT, hvT) if output_final_state else None)
