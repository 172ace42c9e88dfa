"""Triton fused recurrent RWKV6 (docs/kernels.md#rwkv6-recurrent-kernel): token by token, forward and backward.

Per (sequence, head), S in R^{K x V} fp32, sc the scale:
    o_t = S_{t-1}^T (sc r_t) + sc (r_t . (u * k_t)) v_t          S_t = exp(w_t) * S_{t-1} + k_t v_t^T

One program per (sequence * head, V-block) holds the state tile S [K, BV] (all of K) in registers.

Backward, three kernels, each deterministic (partials per V-block, reduced in PyTorch):
  1. `_bwd_dr` (forward in time): dr'_t = sc S_{t-1} do_t            (without the bonus, per V-block)
  2. `_bwd_dkv` (reverse in time, from dht): dk'_t = dS_t v_t (per V-block),
     dv_t = dS_t^T k_t + sc (r_t . (u * k_t)) do_t,  dS_{t-1} = exp(w_t) * dS_t + sc r_t do_t^T;  dh0
  3. `_bwd_dw` (reverse in time, one program per sequence * head, all of K): the bonus terms and
     dw by identity I2 over the whole sequence (docs/kernels.md#gate-gradients-by-reverse-cumsum-i2):
        dw_m = Σ_{τ > m} r_τ * dr'_τ - Σ_{j >= m} k_j * dk'_j + rowsum(S_T * dS_T)
     where the last term is the final-state gradient's share (zero without dht). dht is honoured
     everywhere (docs/kernels.md#rwkv6-recurrent-kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block_sizes(K: int, V: int) -> tuple[int, int]:
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), 64 if BK <= 64 else 32)
    return BK, BV


@triton.jit
def _program_lanes(cu_seqlens, i_v, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """(i_n, i_h, bos, eos, ck, cv, m_k, m_v): this program's sequence and head (program_id 0 is
    i_n * H + i_h), its sequence's tokens [bos, eos), the key lanes ck and the value lanes cv of
    block i_v with their masks."""
    i_nh = tl.program_id(0).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    return i_n, i_h, bos, eos, ck, cv, ck < K, cv < V


@triton.jit
def _fused_recurrent_fwd_kernel(r, k, v, w, u, o, h0, ht, cu_seqlens, scale,
                                H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    i_v = tl.program_id(1)
    i_n, i_h, bos, eos, ck, cv, m_k, m_v = _program_lanes(cu_seqlens, i_v, H, K, V, BK, BV)
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = (i_n * H + i_h) * K * V + ck[:, None] * V + cv[None, :]
    uu = tl.load(u + i_h * K + ck, mask=m_k, other=0.0).to(tl.float32)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + s_off, mask=m_kv, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        p_k = (t * H + i_h) * K + ck
        p_v = (t * H + i_h) * V + cv
        rt = tl.load(r + p_k, mask=m_k, other=0.0).to(tl.float32) * scale
        kt = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        wt = tl.load(w + p_k, mask=m_k, other=0.0).to(tl.float32)
        vt = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        ot = tl.sum(rt[:, None] * S, axis=0) + tl.sum(rt * uu * kt) * vt
        tl.store(o + p_v, ot.to(o.dtype.element_ty), mask=m_v)
        S = tl.exp(wt)[:, None] * S + kt[:, None] * vt[None, :]
    if STORE_HT:
        tl.store(ht + s_off, S, mask=m_kv)


@triton.jit
def _bwd_dr_kernel(k, v, w, do, h0, dr_part, cu_seqlens, scale,
                   H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   NV: tl.constexpr, HAS_H0: tl.constexpr):
    i_v = tl.program_id(1)
    i_n, i_h, bos, eos, ck, cv, m_k, m_v = _program_lanes(cu_seqlens, i_v, H, K, V, BK, BV)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_n * H + i_h) * K * V + ck[:, None] * V + cv[None, :],
                     mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    for t in range(bos, eos):
        p_k = (t * H + i_h) * K + ck
        p_v = (t * H + i_h) * V + cv
        p_part = ((t * H + i_h) * NV + i_v) * K + ck
        kt = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        wt = tl.load(w + p_k, mask=m_k, other=0.0).to(tl.float32)
        vt = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        dot = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
        tl.store(dr_part + p_part, tl.sum(S * dot[None, :], axis=1) * scale, mask=m_k)
        S = tl.exp(wt)[:, None] * S + kt[:, None] * vt[None, :]


@triton.jit
def _bwd_dkv_kernel(r, k, v, w, u, do, dht, dk_part, dv, dh0, cu_seqlens, scale,
                    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    NV: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr):
    i_v = tl.program_id(1)
    i_n, i_h, bos, eos, ck, cv, m_k, m_v = _program_lanes(cu_seqlens, i_v, H, K, V, BK, BV)
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = (i_n * H + i_h) * K * V + ck[:, None] * V + cv[None, :]
    uu = tl.load(u + i_h * K + ck, mask=m_k, other=0.0).to(tl.float32)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + s_off, mask=m_kv, other=0.0).to(tl.float32)
    for i in range(0, eos - bos):
        t = eos - 1 - i
        p_k = (t * H + i_h) * K + ck
        p_v = (t * H + i_h) * V + cv
        p_part = ((t * H + i_h) * NV + i_v) * K + ck
        rt = tl.load(r + p_k, mask=m_k, other=0.0).to(tl.float32) * scale
        kt = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        wt = tl.load(w + p_k, mask=m_k, other=0.0).to(tl.float32)
        vt = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        dot = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
        tl.store(dk_part + p_part, tl.sum(dS * vt[None, :], axis=1), mask=m_k)
        dvt = tl.sum(dS * kt[:, None], axis=0) + tl.sum(rt * uu * kt) * dot
        tl.store(dv + p_v, dvt.to(dv.dtype.element_ty), mask=m_v)
        dS = tl.exp(wt)[:, None] * dS + rt[:, None] * dot[None, :]
    if STORE_DH0:
        tl.store(dh0 + s_off, dS, mask=m_kv)


@triton.jit
def _bwd_dw_kernel(r, k, v, u, do, dr_part, dk_part, g_final, dr, dk, dw, du_part, cu_seqlens, scale,
                   H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
                   NV: tl.constexpr, HAS_DHT: tl.constexpr):
    i_n, i_h, bos, eos, ck, cv, m_k, m_v = _program_lanes(cu_seqlens, 0, H, K, V, BK, BVF)
    uu = tl.load(u + i_h * K + ck, mask=m_k, other=0.0).to(tl.float32)
    g = tl.zeros([BK], dtype=tl.float32)
    if HAS_DHT:
        g += tl.load(g_final + (i_n * H + i_h) * K + ck, mask=m_k, other=0.0)
    z = tl.zeros([BK], dtype=tl.float32)     # Σ_{τ >= t} (r * dr' - k * dk')_τ
    du = tl.zeros([BK], dtype=tl.float32)
    for i in range(0, eos - bos):
        t = eos - 1 - i
        p_k = (t * H + i_h) * K + ck
        p_v = (t * H + i_h) * V + cv
        rt = tl.load(r + p_k, mask=m_k, other=0.0).to(tl.float32)
        kt = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        vt = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        dot = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
        drt = tl.zeros([BK], dtype=tl.float32)
        dkt = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(0, NV):
            p_part = ((t * H + i_h) * NV + i_v) * K + ck
            drt += tl.load(dr_part + p_part, mask=m_k, other=0.0)
            dkt += tl.load(dk_part + p_part, mask=m_k, other=0.0)
        p = rt * drt
        z += p - kt * dkt
        tl.store(dw + p_k, (z - p + g).to(dw.dtype.element_ty), mask=m_k)
        bonus = tl.sum(dot * vt) * scale
        tl.store(dr + p_k, (drt + bonus * uu * kt).to(dr.dtype.element_ty), mask=m_k)
        tl.store(dk + p_k, (dkt + bonus * uu * rt).to(dk.dtype.element_ty), mask=m_k)
        du += bonus * rt * kt
    tl.store(du_part + (i_n * H + i_h) * K + ck, du, mask=m_k)


def _sequence_offsets(B: int, T: int, cu_seqlens, device):
    if cu_seqlens is None:
        return torch.arange(B + 1, device=device, dtype=torch.int64) * T, B
    return cu_seqlens.to(device=device, dtype=torch.int64).contiguous(), cu_seqlens.numel() - 1


class FusedRecurrentRWKV6Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens):
        B, T, H, K = r.shape
        V = v.shape[-1]
        cu, N = _sequence_offsets(B, T, cu_seqlens, r.device)
        BK, BV = _block_sizes(K, V)
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        o = torch.empty_like(v)
        ht = torch.empty(N, H, K, V, device=r.device, dtype=torch.float32) if output_final_state else None
        _fused_recurrent_fwd_kernel[(N * H, triton.cdiv(V, BV))](
            r, k, v, w, u, o, h0, ht, cu, scale, H=H, K=K, V=V, BK=BK, BV=BV,
            HAS_H0=h0 is not None, STORE_HT=output_final_state)
        ctx.save_for_backward(r, k, v, w, u, h0, ht, cu)
        ctx.scale, ctx.N = scale, N
        ctx.h0_dtype = initial_state.dtype if initial_state is not None else None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, k, v, w, u, h0, ht, cu = ctx.saved_tensors
        scale, N = ctx.scale, ctx.N
        B, T, H, K = r.shape
        V = v.shape[-1]
        BK, BV = _block_sizes(K, V)
        NV = triton.cdiv(V, BV)
        do = do.contiguous()
        has_dht = dht is not None and ht is not None
        dht = dht.float().contiguous() if has_dht else None
        dr_part = torch.empty(B, T, H, NV, K, device=r.device, dtype=torch.float32)
        dk_part = torch.empty(B, T, H, NV, K, device=r.device, dtype=torch.float32)
        dv = torch.empty_like(v)
        dh0 = torch.empty(N, H, K, V, device=r.device, dtype=torch.float32) if h0 is not None else None
        grid = (N * H, NV)
        _bwd_dr_kernel[grid](k, v, w, do, h0, dr_part, cu, scale, H=H, K=K, V=V, BK=BK, BV=BV, NV=NV,
                             HAS_H0=h0 is not None)
        _bwd_dkv_kernel[grid](r, k, v, w, u, do, dht, dk_part, dv, dh0, cu, scale, H=H, K=K, V=V,
                              BK=BK, BV=BV, NV=NV, HAS_DHT=has_dht, STORE_DH0=h0 is not None)
        g_final = (ht * dht).sum(-1).contiguous() if has_dht else None
        dr, dk, dw = torch.empty_like(r), torch.empty_like(k), torch.empty_like(w)
        du_part = torch.empty(N, H, K, device=r.device, dtype=torch.float32)
        _bwd_dw_kernel[(N * H,)](r, k, v, u, do, dr_part, dk_part, g_final, dr, dk, dw, du_part, cu, scale,
                                 H=H, K=K, V=V, BK=BK, BVF=max(16, triton.next_power_of_2(V)), NV=NV,
                                 HAS_DHT=has_dht)
        dh0 = dh0.to(ctx.h0_dtype) if dh0 is not None else None
        return dr, dk, dv, dw, du_part.sum(0).to(u.dtype), None, dh0, None, None


def fused_recurrent_rwkv6_triton(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False,
                                 cu_seqlens=None):
    """Token-by-token RWKV6 in Triton: (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None).

    Inputs are validated by flame.ops.rwkv6.fused_recurrent_rwkv6.
    """
    r, k, v, w, u = (x.contiguous() for x in (r, k, v, w, u))
    return FusedRecurrentRWKV6Function.apply(r, k, v, w, u, float(scale), initial_state, bool(output_final_state),
                                             cu_seqlens)
