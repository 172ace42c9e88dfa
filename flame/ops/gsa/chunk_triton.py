"""Triton chunked GSA: two gated-linear-attention passes around an fp32 softmax
(docs/kernels.md#gsa-chunked-forward, #gsa-chunked-backward).

Both passes share the gate g on the slot axis M and its fp32 chunk-local cumsum (flame.ops.common.chunk_triton).

Pass V (slots -> values, gate on the slot ROWS of Hv [M, V]) is exactly the core's key-side GLA,
inclusive, with q = p (fp32 slot probabilities), k = s, v = v, scale 1: forward and backward are the
core's staged kernels, unchanged (the intra matrix A recomputed in the backward rather than kept).

Pass K (keys -> slots, gate on the slot COLUMNS of Hk [K, M]) is run on the transposed state
Hk^T [M, K] = diag(a_t) Hk^T_{t-1} + s_t k_t^T, which is again a key-side GLA state, so
- the state pass is the core's `chunk_state_fwd(k=s, v=k)`;
- the reverse state-gradient pass is the core's `chunk_states_fwd_bwd(q=dz, k=s, v=k, do=q)`, because
  dHk^T_in = e^{G_L} dHk^T_out + scale sum_tau (dz_tau e^{G_tau}) q_tau^T;
- dA_{tau j} = sum_m dz_tau[m] s_j[m] e^{G_tau[m] - G_j[m]} is the core's `intra_chunk_matrix(dz, s)`.
What the core does not have (its docstring says so) is the READ of a column-gated state: the slot
scores z_tau[m] = e^{G_tau[m]} (scale q_tau^T Hk_in)[m] + sum_{j<=tau} A_{tau j} s_j[m] e^{G_tau[m]-G_j[m]}
with the plain A = scale tril(q k^T), and its backward. Those two kernels live here, built from the
core's helpers and its sub-chunk reference points (every exponent <= 0, padding rows selected out):
- `_slots_fwd_kernel`: z, then p = softmax(z) over the M slots, max-stabilised in fp32;
- `_slots_bwd_kernel`: dq, dk, the pass-K part of ds and of dg (identity I2: reverse cumsum of
  z dz - s ds, plus the chunk term e^{G_L} colsum(Hk_in dHk_out) + sum_j s_j ds^state_j).
Both multiply in fp32 for M <= 32 slots, whatever the input dtype (see _SLOT_FP32_MAX_M).

Grouped queries: the core has one head count, so k, v, s, g and the states are repeated over each
query group (only when HQ > H); gradients of the repeated tensors are summed over the group
afterwards (a reshape-sum, deterministic). The final-state gradient goes to one copy of the group.

Recompute levels (memory): 0 saves the cumsum and both passes' per-chunk states, 1 recomputes the
cumsum, 2 (default) recomputes the cumsum and the states. z and p are always saved (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.backend import run_eager
from ..common.chunk_triton import (block_sizes, chunk_dqkg_from_dA, chunk_dv_dA_bwd, chunk_intra_fwd, chunk_layout,
                      chunk_local_cumsum, chunk_output, chunk_state_fwd, chunk_states_fwd_bwd, dot_dtype,
                      fuses_softmax_bwd)
from ..common.chunk_triton.intra import (diagonal_masks, intra_chunk_matrix, load_column, load_row, load_rows, load_rows3,
                                        mm, sub_chunks)
from ..common.chunk_triton.layout import chunk_span


@triton.jit
def _plain_scores(q, k, t0, Tc, i_h, scale, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, DT: tl.constexpr):
    """A [BT, BT] fp32 = scale tril_incl(q k^T), zero outside the valid rows and columns."""
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = rows < Tc
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
        A += mm(qq, tl.trans(kk), DT)
    return tl.where((cols[None, :] <= rows[:, None]) & m_t[:, None] & m_t[None, :], A * scale, 0.0)


@triton.jit
def _diagonal_blocks(A, BT: tl.constexpr, BC: tl.constexpr):
    """The BT // BC diagonal BC x BC sub-blocks of A [BT, BT]: D [NB, BC, BC], D[s, i, j] = A[sBC + i, sBC + j].
    The pair-by-pair loops of the diagonal sub-blocks read their entries of A from D, an eighth of A's
    registers at BT = 64, BC = 16, so that A itself need not stay live through them."""
    NB: tl.constexpr = BT // BC
    A4 = tl.reshape(A, [NB, BC, NB, BC])
    same = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]
    return tl.sum(tl.where(same, A4, 0.0), axis=2)


@triton.jit
def _column_gated_read(A, x, gc, t0, Tc, i_h, H: tl.constexpr, M: tl.constexpr,
                       BT: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, DT: tl.constexpr):
    """Y[tau, m] = sum_{j <= tau} A[tau, j] x[j, m] exp(G[tau, m] - G[j, m])   (A lower triangular).

    Off-diagonal sub-blocks: reference n = the row before query sub-chunk s, so that
    exp(G_tau - G_n) <= 1 (tau >= n) and exp(G_n - G_j) <= 1 (j <= n); diagonal sub-blocks pair by pair.
    """
    rows = tl.arange(0, BT)
    m_t = rows < Tc
    blk = rows // BC
    cm = tl.arange(0, BM)
    m_m = cm < M
    D = _diagonal_blocks(A, BT, BC)
    A = A.to(DT)  # from here an operand of `mm` only, which rounds it to DT
    gq = load_rows(gc, t0, rows, m_t, i_h, cm, m_m, H, M)
    xx = load_rows(x, t0, rows, m_t, i_h, cm, m_m, H, M)
    Y = tl.zeros([BT, BM], dtype=tl.float32)
    for s in tl.static_range(1, BT // BC):
        ref = tl.minimum(s * BC - 1, Tc - 1)
        gn = load_row(gc, t0, ref, i_h, cm, m_m, H, M)
        xs = xx * tl.exp2(tl.where(((rows < s * BC) & m_t)[:, None], gn[None, :] - gq, float("-inf")))
        Y += mm(A, xs, DT) * tl.exp2(tl.where(((blk == s) & m_t)[:, None], gq - gn[None, :], float("-inf")))
    # diagonal sub-blocks in the [NB, BC, BM] view: key column c of every sub-chunk at once, the loads of
    # column c + 1 issued before column c's products
    NB: tl.constexpr = BT // BC
    nb, ic, r3, m3 = sub_chunks(Tc, BT, BC)
    Y3 = tl.reshape(Y, [NB, BC, BM])
    gq3 = load_rows3(gc, t0, r3, m3, i_h, cm, m_m, H, M)
    xj_n, gj_n = load_column(x, gc, t0, Tc, nb * BC, i_h, cm, m_m, H, M)
    for c in range(0, BC):
        xj, gj = xj_n, gj_n
        xj_n, gj_n = load_column(x, gc, t0, Tc, nb * BC + tl.minimum(c + 1, BC - 1), i_h, cm, m_m, H, M)
        m_j, _ = diagonal_masks(c, ic, m3, nb * BC + c < Tc, False)
        a_j = tl.sum(tl.where(ic[None, None, :] == c, D, 0.0), axis=2)  # A[(s, i), s BC + c]
        Y3 += a_j[:, :, None] * xj[:, None, :] * tl.exp2(
            tl.where(m_j[:, :, None], gq3 - gj[:, None, :], float("-inf")))
    return tl.reshape(Y3, [BT, BM])


@triton.jit
def _column_gated_read_t(A, x, Y, gc, t0, Tc, i_h, H: tl.constexpr, M: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, DT: tl.constexpr):
    """Y + Y'[j, m] with Y'[j, m] = sum_{tau >= j} A[tau, j] x[tau, m] exp(G[tau, m] - G[j, m]) (the transposed
    read; Y [BT, BM] fp32 is the caller's accumulator, so that no other tile of it stays live here).

    Off-diagonal sub-blocks: reference n = the last row of key sub-chunk s (tau > n >= j).
    """
    rows = tl.arange(0, BT)
    m_t = rows < Tc
    blk = rows // BC
    cm = tl.arange(0, BM)
    m_m = cm < M
    D = _diagonal_blocks(A, BT, BC)
    A = A.to(DT)  # from here an operand of `mm` only, which rounds it to DT
    gk = load_rows(gc, t0, rows, m_t, i_h, cm, m_m, H, M)
    xx = load_rows(x, t0, rows, m_t, i_h, cm, m_m, H, M)
    for s in tl.static_range(0, BT // BC - 1):
        ref = tl.minimum(s * BC + BC - 1, Tc - 1)
        gn = load_row(gc, t0, ref, i_h, cm, m_m, H, M)
        xs = xx * tl.exp2(tl.where(((rows >= (s + 1) * BC) & m_t)[:, None], gk - gn[None, :], float("-inf")))
        Y += mm(tl.trans(A), xs, DT) * tl.exp2(
            tl.where(((blk == s) & m_t)[:, None], gn[None, :] - gk, float("-inf")))
    # diagonal sub-blocks in the [NB, BC, BM] view: query row c of every sub-chunk at once, the loads of
    # row c + 1 issued before row c's products
    NB: tl.constexpr = BT // BC
    nb, ic, r3, m3 = sub_chunks(Tc, BT, BC)
    Y3 = tl.reshape(Y, [NB, BC, BM])
    gk3 = load_rows3(gc, t0, r3, m3, i_h, cm, m_m, H, M)
    xi_n, gi_n = load_column(x, gc, t0, Tc, nb * BC, i_h, cm, m_m, H, M)
    for c in range(0, BC):
        xi, gi = xi_n, gi_n
        xi_n, gi_n = load_column(x, gc, t0, Tc, nb * BC + tl.minimum(c + 1, BC - 1), i_h, cm, m_m, H, M)
        _, m_i = diagonal_masks(c, ic, m3, nb * BC + c < Tc, False)
        a_i = tl.sum(tl.where(ic[None, :, None] == c, D, 0.0), axis=1)  # A[s BC + c, (s, j)]
        Y3 += a_i[:, :, None] * xi[:, None, :] * tl.exp2(
            tl.where(m_i[:, :, None], gi[:, None, :] - gk3, float("-inf")))
    return tl.reshape(Y3, [BT, BM])


@triton.jit
def _slots_fwd_kernel(q, k, s, gc, h, z, p, cu_seqlens, chunk_indices, scale,
                      H: tl.constexpr, K: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, BM: tl.constexpr, DT: tl.constexpr, STORE_Z: tl.constexpr):
    """Slot scores z of one chunk and head, and p = softmax(z) over the slots (fp32, max-stabilised);
    z is stored only with STORE_Z (the backward reads it)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    m_t = rows < Tc
    cm = tl.arange(0, BM)
    m_m = cm < M

    A = _plain_scores(q, k, t0, Tc, i_h, scale, H, K, BT, BK, DT)
    Z = _column_gated_read(A, s, gc, t0, Tc, i_h, H, M, BT, BC, BM, DT)
    inter = tl.zeros([BT, BM], dtype=tl.float32)
    state = (i_c.to(tl.int64) * H + i_h) * M * K
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        hT = tl.load(h + state + cm[:, None] * K + ck[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        inter += mm(qq, tl.trans(hT), DT)
    gq = load_rows(gc, t0, rows, m_t, i_h, cm, m_m, H, M)
    Z += inter * scale * tl.exp2(tl.where(m_t[:, None], gq, float("-inf")))

    off = ((t0 + rows)[:, None] * H + i_h) * M + cm[None, :]
    m = m_t[:, None] & m_m[None, :]
    if STORE_Z:
        tl.store(z + off, Z, mask=m)
    Zm = tl.where(m_m[None, :], Z, float("-inf"))
    E = tl.exp(Zm - tl.max(Zm, axis=1)[:, None])
    E = tl.where(m_m[None, :], E, 0.0)
    tl.store(p + off, E / tl.sum(E, axis=1)[:, None], mask=m)


@triton.jit
def _to_chunk_end(gl, gq, m_t):
    """e^{G_L - G_j} [BT, M] for the chunk's rows j (0 on rows past the chunk's end)."""
    return tl.exp2(tl.where(m_t[:, None], gl[None, :] - gq, float("-inf")))


@triton.jit
def _slots_bwd_kernel(q, k, s, gc, h, dh, z, dz, ds_v, dg_v, dq, dk, ds, dg, cu_seqlens, chunk_indices, scale,
                      H: tl.constexpr, K: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, BM: tl.constexpr, DT: tl.constexpr):
    """dq, dk, and ds and dg of one chunk and head: the pass-K parts, plus pass V's ds_v and dg_v (fp32),
    stored in the dtypes of ds and dg."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    m_t = rows < Tc
    cm = tl.arange(0, BM)
    m_m = cm < M

    # dA[tau, j] = sum_m dz[tau, m] s[j, m] exp(G[tau, m] - G[j, m]), j <= tau: the core's intra matrix
    dA = intra_chunk_matrix(dz, s, gc, s, t0, Tc, i_h, 1.0, H, M, BT, BC, BM, False, False, DT).to(DT)
    # Only the tiles the K loop reads are live over it, and those that enter its products only are held
    # in the product dtype DT (`mm` rounds its operands to DT: the same numbers, half the registers for
    # 16-bit DT). s, z, dz and the gates are loaded again after the loop (cache hits), and the plain
    # scores A are formed there: holding them over the loop spills registers.
    gq = load_rows(gc, t0, rows, m_t, i_h, cm, m_m, H, M)
    gl = load_row(gc, t0, Tc - 1, i_h, cm, m_m, H, M)
    e_gq = tl.exp2(tl.where(m_t[:, None], gq, float("-inf")))
    dz_in = (load_rows(dz, t0, rows, m_t, i_h, cm, m_m, H, M) * e_gq * scale).to(DT)
    s_end = (load_rows(s, t0, rows, m_t, i_h, cm, m_m, H, M) * _to_chunk_end(gl, gq, m_t)).to(DT)
    ds_state = tl.zeros([BT, BM], dtype=tl.float32)
    h_dh = tl.zeros([BM], dtype=tl.float32)
    state = (i_c.to(tl.int64) * H + i_h) * M * K
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        m_mk = m_m[:, None] & m_k[None, :]
        s_off = state + cm[:, None] * K + ck[None, :]
        hT = tl.load(h + s_off, mask=m_mk, other=0.0)
        dhT = tl.load(dh + s_off, mask=m_mk, other=0.0)
        h_dh += tl.sum(hT * dhT, axis=1)
        hT = hT.to(DT)
        dhT = dhT.to(DT)
        kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K).to(DT)
        ds_state += mm(kk, tl.trans(dhT), DT)
        dq_ = mm(dA, kk, DT) * scale + mm(dz_in, hT, DT)
        off = ((t0 + rows)[:, None] * H + i_h) * K + ck[None, :]
        m = m_t[:, None] & m_k[None, :]
        tl.store(dq + off, dq_.to(dq.dtype.element_ty), mask=m)
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K).to(DT)
        dk_ = mm(tl.trans(dA), qq, DT) * scale + mm(s_end, dhT, DT)
        tl.store(dk + off, dk_.to(dk.dtype.element_ty), mask=m)
    gq = load_rows(gc, t0, rows, m_t, i_h, cm, m_m, H, M)
    ds_state = ds_state * _to_chunk_end(gl, gq, m_t)
    g_last = tl.exp2(gl) * h_dh + tl.sum(load_rows(s, t0, rows, m_t, i_h, cm, m_m, H, M) * ds_state, axis=0)
    ds_ = _column_gated_read_t(_plain_scores(q, k, t0, Tc, i_h, scale, H, K, BT, BK, DT), dz, ds_state, gc, t0, Tc,
                               i_h, H, M, BT, BC, BM, DT)
    ss = load_rows(s, t0, rows, m_t, i_h, cm, m_m, H, M)
    zz_dz = load_rows(z, t0, rows, m_t, i_h, cm, m_m, H, M) * load_rows(dz, t0, rows, m_t, i_h, cm, m_m, H, M)
    dg_ = tl.cumsum(zz_dz - ss * ds_, axis=0, reverse=True) + g_last[None, :]
    off = ((t0 + rows)[:, None] * H + i_h) * M + cm[None, :]
    m = m_t[:, None] & m_m[None, :]
    ds_ += tl.load(ds_v + off, mask=m, other=0.0)
    dg_ += tl.load(dg_v + off, mask=m, other=0.0)
    tl.store(ds + off, ds_.to(ds.dtype.element_ty), mask=m)
    tl.store(dg + off, dg_.to(dg.dtype.element_ty), mask=m)


@triton.jit
def _softmax_bwd_kernel(p, dp, dz, rows, M: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr):
    """dz = p (dp - sum_m p dp) over the M slots of BR rows (fp32)."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cm = tl.arange(0, BM)
    m = (r < rows)[:, None] & (cm < M)[None, :]
    off = r[:, None] * M + cm[None, :]
    pp = tl.load(p + off, mask=m, other=0.0)
    dpp = tl.load(dp + off, mask=m, other=0.0)
    tl.store(dz + off, pp * (dpp - tl.sum(pp * dpp, axis=1)[:, None]), mask=m)


# V-block width of the pass-V output and dv kernels of the core: each V-block loads the intra-chunk
# matrix and the query or key tiles again, so wider blocks load them less often (at more registers)
_VALUE_BLOCK = 128


# Operand dtype of the column-gated read kernels (_slots_fwd_kernel, _slots_bwd_kernel): fp32 for
# M <= _SLOT_FP32_MAX_M slots, else the input dtype. With bf16 operands at M = 32 (K = 64), triton 3.6
# on the H100 compiles them into code that crashes a bf16 GSA model
# (tests/models/test_gpu.py::test_fresh_model_is_finite_in_bf16_on_cuda_triton[gsa], an illegal memory access, at any warp
# count of the core kernels and at num_stages 1 or 3). compute-sanitizer reports out-of-bounds
# __shared__ reads of 1024 bytes inside their tl.dot (intra.mm) at num_stages 3, none at 1 (where the
# plain run still crashes); an op-level run with the model's shapes and random inputs does not crash,
# and the interpreter's bounds checker sees nothing, so the root cause is not known. With fp32
# operands the model test passes (H100). fp32 is not used for every M: at K = 256, M = 64
# (gsa_340M) the fp32 kernels take minutes to compile and spill ~16 KB per thread (ptxas sm_90),
# and bf16 has passed every op test and benchmark at that shape.
_SLOT_FP32_MAX_M = 32
_SLOT_WARPS = 4
_SLOT_STAGES = 1
# 8 warps for the common core's intra (A) kernel in GSA's wide value pass (slots -> values): faster
# than the core's default 4 at the 340M shapes (bench/RESULTS.md, kernels: chunk_gsa); the dq/dk/dg
# kernel and the core's others keep their defaults, the fastest there (bench/RESULTS.md, kernels:
# "Chunk kernels' launch settings").
_CORE_WARPS = 8


def _value_block(V: int) -> int:
    return min(_VALUE_BLOCK, max(16, triton.next_power_of_2(V)))


def _value_intra(p, s, gc, layout, DT, BM):
    """Pass V's intra-chunk matrix A [B, T, H, BT] fp32 (p against s, inclusive, scale 1)."""
    A, _ = chunk_intra_fwd(p, s, gc, None, layout, 1.0, False, DT, BM, num_warps=_CORE_WARPS)
    return A


def _slot_blocks(K: int, M: int) -> tuple[int, int]:
    return min(64, max(16, triton.next_power_of_2(K))), max(16, triton.next_power_of_2(M))


def _slot_dot_dtype(M: int, DT):
    return tl.float32 if M <= _SLOT_FP32_MAX_M else DT


def slots_fwd(q, k, s, gc, hk, layout, scale, DT, keep_scores=True):
    """z and p [B, T, H, M] fp32 from the per-chunk transposed key states hk [num_chunks, H, M, K];
    z is None without keep_scores (only the backward reads it)."""
    B, T, H, K = q.shape
    M = s.shape[-1]
    BK, BM = _slot_blocks(K, M)
    p = torch.empty(B, T, H, M, device=q.device, dtype=torch.float32)
    z = torch.empty_like(p) if keep_scores else None
    _slots_fwd_kernel[(layout.num_chunks, H)](
        q, k, s, gc, hk, z if keep_scores else p, p, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, M=M, BT=layout.chunk_size, BC=16, BK=BK, BM=BM, DT=_slot_dot_dtype(M, DT), STORE_Z=keep_scores,
        num_warps=_SLOT_WARPS, num_stages=_SLOT_STAGES)
    return z, p


def softmax_bwd(p, dp):
    """dz = p (dp - sum_m p dp), the softmax's backward over the slots (last axis), fp32, one kernel: for
    more slots than one block of the dq/dk/dg kernel holds (else its epilogue does it)."""
    M = p.shape[-1]
    rows = p.numel() // M
    BM = max(16, triton.next_power_of_2(M))
    BR = max(1, 2048 // BM)
    dz = torch.empty_like(p)
    _softmax_bwd_kernel[(triton.cdiv(rows, BR),)](p, dp, dz, rows, M=M, BR=BR, BM=BM)
    return dz


def slots_bwd(q, k, s, gc, hk, dhk, z, dz, ds_v, dg_v, layout, scale, DT, out_dtype):
    """dq, dk (dtypes of q, k), and ds, dg in out_dtype: the pass-K parts plus pass V's ds_v, dg_v (fp32)."""
    B, T, H, K = q.shape
    M = s.shape[-1]
    BK, BM = _slot_blocks(K, M)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    ds = torch.empty(B, T, H, M, device=q.device, dtype=out_dtype)
    dg = torch.empty_like(ds)
    _slots_bwd_kernel[(layout.num_chunks, H)](
        q, k, s, gc, hk, dhk, z, dz, ds_v, dg_v, dq, dk, ds, dg, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, M=M, BT=layout.chunk_size, BC=16, BK=BK, BM=BM, DT=_slot_dot_dtype(M, DT), num_warps=_SLOT_WARPS,
        num_stages=_SLOT_STAGES)
    return dq, dk, ds, dg


def _repeat(x, NG, dim):
    return x if x is None or NG == 1 else x.repeat_interleave(NG, dim=dim)


def _group_sum(x, NG, dim):
    """Sum the NG consecutive copies of each key/value head along `dim` (the inverse of _repeat)."""
    if NG == 1:
        return x
    shape = list(x.shape)
    shape[dim:dim + 1] = [shape[dim] // NG, NG]
    return x.reshape(shape).sum(dim + 1)


def _first_of_group(dht, NG):
    """A final-state gradient [N, H, ...] placed on the first copy of each group of [N, H*NG, ...]."""
    if NG == 1:
        return dht
    out = dht.new_zeros(dht.shape[0], dht.shape[1] * NG, *dht.shape[2:])
    out[:, ::NG] = dht
    return out


def _forward(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, chunk_size, recompute_level,
             need_grad=True):
    """o, the final state pair (hk [N, H, K, M], hv [N, H, M, V] fp32, or None, None) and what the backward
    reads: (hk0^T and hv0 repeated over the query groups, z, p, then the cumsum and the per-chunk states
    as the recompute level keeps them, else None). Without need_grad the slot scores z are not
    stored (None)."""
    B, T, HQ, K = q.shape
    H, V, M = k.shape[2], v.shape[-1], s.shape[-1]
    NG = HQ // H
    k_, v_, s_, g_ = (_repeat(x, NG, 2) for x in (k, v, s, g))
    hk0T = None if hk0 is None else _repeat(hk0.transpose(-1, -2), NG, 1).contiguous()
    hv0_ = None if hv0 is None else _repeat(hv0, NG, 1).contiguous()
    layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
    DT = dot_dtype(q.dtype)
    gc = chunk_local_cumsum(g_, layout)
    hk, hkT = chunk_state_fwd(s_, k_, gc, layout, hk0T, output_final_state, DT)
    hv, hvT = chunk_state_fwd(s_, v_, gc, layout, hv0_, output_final_state, DT)
    z, p = slots_fwd(q, k_, s_, gc, hk, layout, scale, DT, keep_scores=need_grad)
    BM, _ = block_sizes(M, V)
    A = _value_intra(p, s_, gc, layout, DT, BM)
    o = chunk_output(p, v_, gc, hv, A, layout, 1.0, False, DT, BM, _value_block(V))
    if output_final_state:
        hkT = hkT[:, ::NG].transpose(-1, -2).contiguous()
        hvT = hvT[:, ::NG].contiguous()
    saved_gc = gc if recompute_level <= 0 else None
    saved_h = (hk, hv) if recompute_level <= 1 else (None, None)
    return o, hkT, hvT, (hk0T, hv0_, z, p, saved_gc, *saved_h)


def _backward(q, k, v, s, g, hk0T, hv0_, z, p, gc, hk, hv, scale, cu_seqlens, chunk_size, do, dhkT, dhvT):
    """dq, dk, dv, ds, dg in the inputs' dtypes and dhk0, dhv0 (fp32, or None without initial states)."""
    B, T, HQ, K = q.shape
    H, M, V = k.shape[2], s.shape[-1], v.shape[-1]
    NG = HQ // H
    k_, v_, s_, g_ = (_repeat(x, NG, 2) for x in (k, v, s, g))
    layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
    DT = dot_dtype(q.dtype)
    gc = chunk_local_cumsum(g_, layout) if gc is None else gc
    do = do.contiguous()
    dhkT_ = None if dhkT is None else _first_of_group(dhkT.float().transpose(-1, -2).contiguous(), NG)
    dhvT_ = None if dhvT is None else _first_of_group(dhvT.float().contiguous(), NG)
    BM, BV = block_sizes(M, V)

    # pass V: the core's key-side GLA backward with q = p, k = s (fp32 copies give fp32 ds, dg); the
    # states come from the forward (recompute levels 0 and 1) or again with their gradients (level 2)
    hv, dhv, dhv0 = chunk_states_fwd_bwd(p, s_, v_, do, gc, layout, hv0_, dhvT_, 1.0, False, hv0_ is not None, DT,
                                         h=hv)
    # dv over the wide value blocks; dA alone, over the V-blocks of the dq/dk/dg kernel that reads it
    A = _value_intra(p, s_, gc, layout, DT, BM)
    dv, _, _ = chunk_dv_dA_bwd(s_, v_, gc, A, do, dhv, layout, 1.0, False, False, DT, BM, _value_block(V),
                               with_dA=False)
    _, dA, _ = chunk_dv_dA_bwd(None, v_, None, None, do, None, layout, 1.0, False, False, DT, BM, BV, with_dv=False)
    # the softmax's backward (dp -> dz) in the same kernel's epilogue when one K block holds the M slots
    fused = fuses_softmax_bwd(M, BM)
    dp_or_dz, ds_v, dg_v, _ = chunk_dqkg_from_dA(p, s_, v_, gc, gc, None, hv, do, dhv, dA, None, layout, 1.0,
                                                 False, DT, BM, BV, dk_dtype=torch.float32, softmax_bwd=fused)
    dz = dp_or_dz if fused else softmax_bwd(p, dp_or_dz)
    # pass K: transposed states and state gradients from the core, then the column-gated read backward
    hk, dhk, dhk0T = chunk_states_fwd_bwd(dz, s_, k_, q, gc, layout, hk0T, dhkT_, scale, False, hk0T is not None,
                                          DT, h=hk)
    # ds and dg in the inputs' dtype straight from the kernel, or fp32 until the sum over query groups
    grads_dtype = s.dtype if NG == 1 and s.dtype == g.dtype else torch.float32
    dq, dk, ds, dg = slots_bwd(q, k_, s_, gc, hk, dhk, z, dz, ds_v, dg_v, layout, scale, DT, grads_dtype)

    dk = _group_sum(dk, NG, 2)
    dv = _group_sum(dv, NG, 2)
    ds = _group_sum(ds, NG, 2).to(s.dtype)
    dg = _group_sum(dg, NG, 2).to(g.dtype)
    dhk0 = None if dhk0T is None else _group_sum(dhk0T, NG, 1).transpose(-1, -2).contiguous()
    dhv0 = None if dhv0 is None else _group_sum(dhv0, NG, 1)
    return dq, dk.to(k.dtype), dv.to(v.dtype), ds, dg, dhk0, dhv0


class ChunkGSAFunction(torch.autograd.Function):
    """The autograd path for calls the custom ops below do not take (varlen, recompute levels 0 and 1)."""

    @staticmethod
    def forward(ctx, q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, chunk_size, recompute_level):
        need_grad = any(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 4, 6, 7))
        o, hkT, hvT, saved = _forward(q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens, chunk_size,
                                      recompute_level, need_grad)
        ctx.save_for_backward(q, k, v, s, g, *saved)
        ctx.meta = (scale, cu_seqlens, chunk_size)
        return o, hkT, hvT

    @staticmethod
    def backward(ctx, do, dhkT, dhvT):
        scale, cu_seqlens, chunk_size = ctx.meta
        dq, dk, dv, ds, dg, dhk0, dhv0 = _backward(*ctx.saved_tensors, scale, cu_seqlens, chunk_size, do, dhkT,
                                                   dhvT)
        return dq, dk, dv, ds, dg, None, dhk0, dhv0, None, None, None, None


# ------------------------------------------------------------------------------------------------
# custom ops: what torch.compile sees for fixed-length calls at the default recompute level (one
# opaque node each way, so Inductor fuses the glue on both sides and the block stays one graph). The
# forward returns the slot scores z and probabilities p, which the backward reads (z comes back empty
# without need_grad: inference stores no scores); every shape follows from the inputs' shapes.
# ------------------------------------------------------------------------------------------------

_EMPTY = (0,)


def _or_empty(x, like):
    return x if x is not None else like.new_empty(_EMPTY, dtype=torch.float32)


@torch.library.custom_op("flame::chunk_gsa_fwd", mutates_args=())
def _chunk_gsa_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
                      hk0: torch.Tensor | None, hv0: torch.Tensor | None, scale: float, output_final_state: bool,
                      chunk_size: int, need_grad: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    o, hkT, hvT, (_, _, z, p, _, _, _) = _forward(q, k, v, s, g, scale, hk0, hv0, output_final_state, None,
                                                  chunk_size, 2, need_grad)
    return o, _or_empty(hkT, q), _or_empty(hvT, q), _or_empty(z, q), p


@_chunk_gsa_fwd_op.register_fake
def _(q, k, v, s, g, hk0, hv0, scale, output_final_state, chunk_size, need_grad=True):
    B, T, HQ, K = q.shape
    H, V, M = k.shape[2], v.shape[-1], s.shape[-1]
    N = B if output_final_state else 0
    f32 = dict(dtype=torch.float32)
    return (q.new_empty((B, T, HQ, V)), q.new_empty((B, H, K, M) if N else _EMPTY, **f32),
            q.new_empty((B, H, M, V) if N else _EMPTY, **f32),
            q.new_empty((B, T, HQ, M) if need_grad else _EMPTY, **f32), q.new_empty((B, T, HQ, M), **f32))


@torch.library.custom_op("flame::chunk_gsa_bwd", mutates_args=())
def _chunk_gsa_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, g: torch.Tensor,
                      hk0: torch.Tensor | None, hv0: torch.Tensor | None, z: torch.Tensor, p: torch.Tensor,
                      do: torch.Tensor, dhk: torch.Tensor | None, dhv: torch.Tensor | None, scale: float,
                      chunk_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor]:
    NG = q.shape[2] // k.shape[2]
    hk0T = None if hk0 is None else _repeat(hk0.transpose(-1, -2), NG, 1).contiguous()
    hv0_ = None if hv0 is None else _repeat(hv0, NG, 1).contiguous()
    dq, dk, dv, ds, dg, dhk0, dhv0 = _backward(q, k, v, s, g, hk0T, hv0_, z, p, None, None, None, scale, None,
                                               chunk_size, do, dhk, dhv)
    return dq, dk, dv, ds, dg, _or_empty(dhk0, q), _or_empty(dhv0, q)


@_chunk_gsa_bwd_op.register_fake
def _(q, k, v, s, g, hk0, hv0, z, p, do, dhk, dhv, scale, chunk_size):
    grads = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, s, g))
    return (*grads, _or_empty(None if hk0 is None else torch.empty_like(hk0, dtype=torch.float32), q),
            _or_empty(None if hv0 is None else torch.empty_like(hv0, dtype=torch.float32), q))


def _setup_context(ctx, inputs, output):
    q, k, v, s, g, hk0, hv0, scale, output_final_state, chunk_size, _ = inputs
    ctx.save_for_backward(q, k, v, s, g, hk0, hv0, output[3], output[4])
    ctx.scale, ctx.chunk_size, ctx.output_final_state = scale, chunk_size, output_final_state


def _backward_op(ctx, do, dhk, dhv, dz, dp):
    q, k, v, s, g, hk0, hv0, z, p = ctx.saved_tensors
    final = ctx.output_final_state
    dq, dk, dv, ds, dg, dhk0, dhv0 = torch.ops.flame.chunk_gsa_bwd(
        q, k, v, s, g, hk0, hv0, z, p, do, dhk if final else None, dhv if final else None, ctx.scale,
        ctx.chunk_size)
    has_h0 = hk0 is not None
    return dq, dk, dv, ds, dg, (dhk0 if has_h0 else None), (dhv0 if has_h0 else None), None, None, None, None


_chunk_gsa_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


def chunk_gsa_triton(q, k, v, s, g, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                     chunk_size=64, recompute_level=2):
    """Triton chunked GSA on validated inputs; returns (o in q's dtype, (hk, hv) fp32 or None).

    chunk_size: 16, 32 or 64 tokens per chunk. recompute_level: 0 saves cumsum and chunk states
    for the backward, 1 recomputes the cumsum, 2 recomputes cumsum and states (least memory).
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if recompute_level not in (0, 1, 2):
        raise ValueError(f"recompute_level must be 0, 1 or 2, got {recompute_level}")
    hk0, hv0 = (None, None) if initial_state is None else initial_state
    if (hk0 is None) != (hv0 is None):
        raise ValueError("initial_state must be the pair (hk, hv), both tensors or both None")
    q, k, v, s, g = (x.contiguous() for x in (q, k, v, s, g))
    if cu_seqlens is None and recompute_level == 2:
        need_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, s, g, hk0, hv0))
        hk0, hv0 = (None, None) if hk0 is None else (hk0.float().contiguous(), hv0.float().contiguous())
        o, hkT, hvT, _, _ = torch.ops.flame.chunk_gsa_fwd(q, k, v, s, g, hk0, hv0, float(scale),
                                                          bool(output_final_state), chunk_size, need_grad)
    else:
        o, hkT, hvT = run_eager(ChunkGSAFunction.apply, q, k, v, s, g, float(scale), hk0, hv0,
                                bool(output_final_state), cu_seqlens, chunk_size, recompute_level)
    return o, ((hkT, hvT) if output_final_state else None)
