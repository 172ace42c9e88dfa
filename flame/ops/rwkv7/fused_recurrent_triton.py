"""Triton fused recurrent RWKV7 (DPLR delta rule), forward and backward.

One program per (sequence * head, V-block) holds an fp32 state tile S [K, BV] and walks the tokens:
    p_t = a_t^T S_{t-1};  S_t = e^{w_t} * S_{t-1} + b_t p_t + k_t v_t^T;  o_t = S_t^T (scale * r_t)
Every column of S evolves independently, so the V-blocks never talk to each other.

Backward: the forward keeps a checkpoint of the state every `CKPT` tokens. The backward walks the
segments from last to first; for each it replays the forward from the checkpoint, parking the
states S_{t-1} of the segment in a per-program fp32 scratch buffer, then runs the adjoint
recurrence backwards over the segment:
    dS_t += scale * r_t do_t^T
    dr_t = scale * S_t do_t        dk_t = dS_t v_t        dv_t = dS_t^T k_t
    db_t = dS_t p_t^T               dp_t = b_t^T dS_t      dw_t = e^{w_t} * rowsum(S_{t-1} * dS_t)
    da_t = S_{t-1} dp_t^T           dS_{t-1} = e^{w_t} * dS_t + a_t dp_t
Gradients that sum over V (dr, dk, da, db, dw) are written per V-block and reduced afterwards in
PyTorch (deterministic, no atomics).
"""

import torch
import triton
import triton.language as tl

CKPT = 16  # tokens between stored states in the forward; the backward replays one segment at a time


@triton.jit
def _program(cu_seqlens, H, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """(i_nh, i_v, i_n, i_h, bos, seq_len, o_k, o_v, m_k, m_v): this program's sequence-and-head
    index (program_id 0, i_n * H + i_h), its block i_v of value lanes, its sequence's first token
    and length, and its key and value lanes with their masks."""
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    return i_nh, i_v, i_n, i_h, bos, eos - bos, o_k, o_v, o_k < K, o_v < V


@triton.jit
def _token(w, k, a, b, v, t, i_h, o_k, o_v, m_k, m_v, H, K, V):
    """Token t's row offsets in the [tokens, H, K] and [tokens, H, V] inputs, and its w, k, a, b, v
    in fp32."""
    row_k = (t * H + i_h) * K
    row_v = (t * H + i_h) * V
    w_t = tl.load(w + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
    k_t = tl.load(k + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
    a_t = tl.load(a + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_t = tl.load(b + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
    v_t = tl.load(v + row_v + o_v, mask=m_v, other=0.0).to(tl.float32)
    return row_k, row_v, w_t, k_t, a_t, b_t, v_t


@triton.jit
def _state_step(S, w_t, k_t, a_t, b_t, v_t):
    """S_t = S_{t-1} diag(exp(w_t)) + b_t (a_t^T S_{t-1}) + k_t v_t^T, with S [K, V] in fp32."""
    p_t = tl.sum(a_t[:, None] * S, 0)
    return tl.exp(w_t)[:, None] * S + b_t[:, None] * p_t[None, :] + k_t[:, None] * v_t[None, :]


@triton.jit
def _fused_recurrent_fwd_kernel(
    r, w, k, v, a, b, o, h0, ht, hckpt, cu_seqlens, ckpt_offsets, scale,
    H, K, V, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_CKPT: tl.constexpr,
):
    i_nh, i_v, i_n, i_h, bos, seq_len, o_k, o_v, m_k, m_v = _program(cu_seqlens, H, K, V, BK, BV)
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = o_k[:, None] * V + o_v[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + state_off, mask=m_kv, other=0.0).to(tl.float32)
    ck_base = tl.load(ckpt_offsets + i_n).to(tl.int64)

    for t in range(0, seq_len):
        if STORE_CKPT:
            if t % CK == 0:
                p_ck = hckpt + ((ck_base + t // CK) * H + i_h) * K * V
                tl.store(p_ck + state_off, S, mask=m_kv)
        row_k, row_v, w_t, k_t, a_t, b_t, v_t = _token(w, k, a, b, v, bos + t, i_h, o_k, o_v, m_k, m_v, H, K, V)
        r_t = tl.load(r + row_k + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        S = _state_step(S, w_t, k_t, a_t, b_t, v_t)
        o_t = tl.sum(r_t[:, None] * S, 0)
        tl.store(o + row_v + o_v, o_t.to(o.dtype.element_ty), mask=m_v)

    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + state_off, S, mask=m_kv)


@triton.jit
def _fused_recurrent_bwd_kernel(
    r, w, k, v, a, b, do, dht, hckpt, scratch, cu_seqlens, ckpt_offsets,
    dr, dw, dk, dv, da, db, dh0, scale, NV, total_tokens,
    H, K, V, BK: tl.constexpr, BV: tl.constexpr,
    CK: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):
    # the program's indices and lanes as _program gives them, written out: through _program the
    # backward takes two more registers on sm_90
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    seq_len = eos - bos

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = o_k[:, None] * V + o_v[None, :]
    tile_off = o_k[:, None] * BV + tl.arange(0, BV)[None, :]
    p_scratch = scratch + (i_nh.to(tl.int64) * NV + i_v) * CK * BK * BV
    # partial (per V-block) gradients over K live in [NV, tokens, H, K]
    part_base = i_v.to(tl.int64) * total_tokens * H * K

    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + state_off, mask=m_kv, other=0.0).to(tl.float32)
    ck_base = tl.load(ckpt_offsets + i_n).to(tl.int64)
    n_seg = tl.cdiv(seq_len, CK)

    for i_s in range(0, n_seg):
        seg = n_seg - 1 - i_s
        t0 = seg * CK
        t1 = tl.minimum(t0 + CK, seq_len)
        S = tl.load(hckpt + ((ck_base + seg) * H + i_h) * K * V + state_off, mask=m_kv, other=0.0)
        # replay the segment, parking S_{t-1} of each step
        for t in range(t0, t1):
            tl.store(p_scratch + (t - t0) * BK * BV + tile_off, S)
            _, _, w_t, k_t, a_t, b_t, v_t = _token(w, k, a, b, v, bos + t, i_h, o_k, o_v, m_k, m_v, H, K, V)
            S = _state_step(S, w_t, k_t, a_t, b_t, v_t)
        tl.debug_barrier()
        for i_t in range(0, t1 - t0):
            t = t1 - 1 - i_t
            S_prev = tl.load(p_scratch + (t - t0) * BK * BV + tile_off)
            row_k = ((bos + t) * H + i_h) * K
            row_v = ((bos + t) * H + i_h) * V
            r_t = tl.load(r + row_k + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
            w_t = tl.load(w + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
            k_t = tl.load(k + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
            a_t = tl.load(a + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_t = tl.load(b + row_k + o_k, mask=m_k, other=0.0).to(tl.float32)
            v_t = tl.load(v + row_v + o_v, mask=m_v, other=0.0).to(tl.float32)
            do_t = tl.load(do + row_v + o_v, mask=m_v, other=0.0).to(tl.float32)
            d_t = tl.exp(w_t)
            p_t = tl.sum(a_t[:, None] * S_prev, 0)
            S_t = d_t[:, None] * S_prev + b_t[:, None] * p_t[None, :] + k_t[:, None] * v_t[None, :]
            dS += r_t[:, None] * do_t[None, :]
            dr_t = tl.sum(S_t * do_t[None, :], 1) * scale
            dk_t = tl.sum(dS * v_t[None, :], 1)
            dv_t = tl.sum(dS * k_t[:, None], 0)
            db_t = tl.sum(dS * p_t[None, :], 1)
            dp_t = tl.sum(dS * b_t[:, None], 0)
            dw_t = d_t * tl.sum(S_prev * dS, 1)
            da_t = tl.sum(S_prev * dp_t[None, :], 1)
            dS = d_t[:, None] * dS + a_t[:, None] * dp_t[None, :]
            tl.store(dr + part_base + row_k + o_k, dr_t, mask=m_k)
            tl.store(dw + part_base + row_k + o_k, dw_t, mask=m_k)
            tl.store(dk + part_base + row_k + o_k, dk_t, mask=m_k)
            tl.store(da + part_base + row_k + o_k, da_t, mask=m_k)
            tl.store(db + part_base + row_k + o_k, db_t, mask=m_k)
            tl.store(dv + row_v + o_v, dv_t.to(dv.dtype.element_ty), mask=m_v)
        tl.debug_barrier()

    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + state_off, dS, mask=m_kv)


def _sequence_layout(B, T, cu_seqlens, device):
    """cu_seqlens as int64 on device, the number of sequences, and their lengths on the host."""
    if cu_seqlens is None:
        cu = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
        return cu, B, [T] * B
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = (cu[1:] - cu[:-1]).tolist()
    return cu, len(lengths), lengths


def _block_sizes(K, V):
    BK = max(triton.next_power_of_2(K), 16)
    BV = min(max(triton.next_power_of_2(V), 16), 64 if BK <= 64 else 32)
    return BK, BV


class FusedRecurrentRWKV7Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens):
        r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
        B, T, H, K = r.shape
        V = v.shape[-1]
        cu, N, lengths = _sequence_layout(B, T, cu_seqlens, r.device)
        BK, BV = _block_sizes(K, V)
        NV = triton.cdiv(V, BV)
        need_grad = any(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 4, 5, 7))
        n_ckpt = [triton.cdiv(L, CKPT) for L in lengths]
        ckpt_offsets = torch.tensor([0] + n_ckpt, dtype=torch.int64).cumsum(0).to(r.device)
        hckpt = r.new_empty(sum(n_ckpt) if need_grad else 1, H, K, V, dtype=torch.float32)
        o = torch.empty(B, T, H, V, dtype=r.dtype, device=r.device)
        ht = r.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
        h0 = initial_state.contiguous() if initial_state is not None else None
        _fused_recurrent_fwd_kernel[(N * H, NV)](
            r, w, k, v, a, b, o, h0, ht, hckpt, cu, ckpt_offsets, scale,
            H=H, K=K, V=V, BK=BK, BV=BV, CK=CKPT, HAS_H0=h0 is not None, STORE_HT=output_final_state,
            STORE_CKPT=need_grad, num_warps=4,
        )
        ctx.save_for_backward(r, w, k, v, a, b, hckpt, cu, ckpt_offsets)
        ctx.meta = (scale, N, BK, BV, NV, initial_state is not None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, w, k, v, a, b, hckpt, cu, ckpt_offsets = ctx.saved_tensors
        scale, N, BK, BV, NV, has_h0 = ctx.meta
        B, T, H, K = r.shape
        V = v.shape[-1]
        do = do.contiguous()
        tokens = B * T
        parts = [torch.empty(NV, B, T, H, K, dtype=torch.float32, device=r.device) for _ in range(5)]
        dv = torch.empty_like(v)
        dh0 = r.new_empty(N, H, K, V, dtype=torch.float32) if has_h0 else None
        scratch = r.new_empty(N * H * NV * CKPT * BK * BV, dtype=torch.float32)
        _fused_recurrent_bwd_kernel[(N * H, NV)](
            r, w, k, v, a, b, do, dht.contiguous() if dht is not None else None, hckpt, scratch, cu, ckpt_offsets,
            *parts[:3], dv, *parts[3:], dh0, scale, NV, tokens,
            H=H, K=K, V=V, BK=BK, BV=BV, CK=CKPT, HAS_DHT=dht is not None, STORE_DH0=has_h0, num_warps=4,
        )
        dr, dw, dk, da, db = (p.sum(0).to(x.dtype) for p, x in zip(parts, (r, w, k, a, b)))
        return dr, dw, dk, dv, da, db, None, dh0, None, None


def fused_recurrent_rwkv7_triton(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                                 cu_seqlens=None):
    """Fused recurrent RWKV7 with Triton, forward and backward. Inputs are already validated.

    Returns (o [B,T,H,V] in the input dtype, final state [N,H,K,V] fp32 or None).
    """
    if r.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fused_recurrent_rwkv7: the Triton kernels take float32, float16 or bfloat16 inputs, got "
                        f"{r.dtype}; use backend='torch' for float64")
    return FusedRecurrentRWKV7Function.apply(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
