"""The sequential passes over chunks: the forward state pass and the reverse state-gradient pass.

One program per (sequence * head, K-block x V-block) walks the chunks of its sequence, keeping an
fp32 state tile in registers and storing it once per chunk (kernels.md 1.2 stage 2, 1.4 step 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .intra import load_query_gate, load_row, load_rows, mm
from .layout import ChunkLayout


@triton.jit
def _state_fwd_kernel(k, v, gc, h0, h, ht, cu_seqlens, chunk_offsets,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr,
                      USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DT: tl.constexpr):
    i_nh = tl.program_id(0).to(tl.int64)
    i_kv = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    i_k = i_kv // tl.cdiv(V, BV)
    i_v = i_kv % tl.cdiv(V, BV)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k = ck < K
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = ck[:, None] * V + cv[None, :]
    rows = tl.arange(0, BT)

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_n * H + i_h) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        Tc = tl.minimum(eos - t0, BT)
        m_t = rows < Tc
        tl.store(h + ((c0 + i_t) * H + i_h) * K * V + s_off, S, mask=m_kv)
        kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
        vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
        gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
        gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
        kg = kk * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gk, float("-inf")))
        S = S * tl.exp2(gl)[:, None] + mm(tl.trans(kg), vv, DT)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h) * K * V + s_off, S, mask=m_kv)


@triton.jit
def _state_bwd_kernel(q, do, gc, dht, dh, dh0, cu_seqlens, chunk_offsets, scale,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr,
                      USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DT: tl.constexpr):
    i_nh = tl.program_id(0).to(tl.int64)
    i_kv = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    i_k = i_kv // tl.cdiv(V, BV)
    i_v = i_kv % tl.cdiv(V, BV)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k = ck < K
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = ck[:, None] * V + cv[None, :]
    rows = tl.arange(0, BT)

    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dht + (i_n * H + i_h) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for i in range(0, NT):
        i_t = NT - 1 - i
        t0 = bos + i_t * BT
        Tc = tl.minimum(eos - t0, BT)
        m_t = rows < Tc
        tl.store(dh + ((c0 + i_t) * H + i_h) * K * V + s_off, dS, mask=m_kv)
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
        dd = load_rows(do, t0, rows, m_t, i_h, cv, m_v, H, V)
        gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
        qg = qq * tl.exp2(tl.where(m_t[:, None], gq, float("-inf"))) * scale
        dS = dS * tl.exp2(gl)[:, None] + mm(tl.trans(qg), dd, DT)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h) * K * V + s_off, dS, mask=m_kv)


def _state_blocks(num_seqs: int, H: int, K: int, V: int) -> tuple[int, int, int, tuple[int, int]]:
    """State tile BK x BV, warps and grid. The passes are sequential over chunks, so the parallelism
    is N*H*(K/BK)*(V/BV) programs, and the time is (number of chunks) x (latency of one step).
    Tiles shrink from 64 x 64 to at least 32 x 32 until about two programs per SM of a large GPU
    are busy; smaller tiles with fewer warps made each step slower (H100, bf16: 64 x 32 with 4
    warps took 2.8 us per chunk, 32 x 16 with 2 warps 3.8 us)."""
    BK = min(64, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    while num_seqs * H * triton.cdiv(K, BK) * triton.cdiv(V, BV) < 256 and max(BK, BV) > 32:
        if BV >= BK:
            BV //= 2
        else:
            BK //= 2
    return BK, BV, 4, (num_seqs * H, triton.cdiv(K, BK) * triton.cdiv(V, BV))


def chunk_state_fwd(k, v, gc, layout: ChunkLayout, h0, output_final_state: bool, dot_dtype):
    """Per-chunk entering states h [num_chunks, H, K, V] fp32 and the final state [N, H, K, V] (or None).

    S_out = exp(Γ_L) * S_in + Σ_j (k_j * exp(Γ_L - Γ_j)) v_j^T over the chunk (identity I1).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    h = torch.empty(layout.num_chunks, H, K, V, device=k.device, dtype=torch.float32)
    ht = torch.empty(layout.num_seqs, H, K, V, device=k.device, dtype=torch.float32) if output_final_state else None
    BK, BV, warps, grid = _state_blocks(layout.num_seqs, H, K, V)
    _state_fwd_kernel[grid](
        k, v, gc, h0, h, ht, layout.cu_seqlens, layout.chunk_offsets, H=H, K=K, V=V, BT=layout.chunk_size,
        BK=BK, BV=BV, num_warps=warps, num_stages=2,
        USE_H0=h0 is not None, STORE_HT=output_final_state, DT=dot_dtype)
    return h, ht


def chunk_state_bwd(q, do, gc, layout: ChunkLayout, dht, scale: float, exclusive: bool, need_dh0: bool, dot_dtype):
    """Per-chunk gradients of the leaving states dh [num_chunks, H, K, V] fp32, and dh0 (or None).

    dS_in = exp(Γ_L) * dS_out + scale (q * exp(Γq))^T do, starting from dht (or 0) at the end.
    """
    B, T, H, K = q.shape
    V = do.shape[-1]
    dh = torch.empty(layout.num_chunks, H, K, V, device=q.device, dtype=torch.float32)
    dh0 = torch.empty(layout.num_seqs, H, K, V, device=q.device, dtype=torch.float32) if need_dh0 else None
    BK, BV, warps, grid = _state_blocks(layout.num_seqs, H, K, V)
    _state_bwd_kernel[grid](
        q, do, gc, dht, dh, dh0, layout.cu_seqlens, layout.chunk_offsets, scale,
        H=H, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, num_warps=warps, num_stages=2, EXCLUSIVE=exclusive,
        USE_DHT=dht is not None, STORE_DH0=need_dh0, DT=dot_dtype)
    return dh, dh0
