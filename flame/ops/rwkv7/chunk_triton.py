"""Triton chunked RWKV7 (DPLR delta rule, UT/WY form), forward and backward
(docs/kernels.md#rwkv7-chunked-form to #rwkv7-chunked-backward).

Per chunk of BT tokens, with Γ the fp32 chunk-local inclusive cumsum of w (scaled by log2 e, so
every factor is an exp2 of a non-positive number) and Γ̄ the exclusive one:

    M^qk = tril_incl(sc q e^{Γ_τ-Γ_j} k^T)   M^qb = tril_incl(sc q e^{Γ_τ-Γ_j} b^T)
    M^ak = strict(a e^{Γ̄_τ-Γ_j} k^T)          M^ab = strict(a e^{Γ̄_τ-Γ_j} b^T)
    Tm = (I - M^ab)^-1,  W = Tm Â,  G = Tm M^ak,  P = G V + W S^in
    O = Q̂ S^in + M^qk V + M^qb P,  S^out = e^{Γ_L} S^in + K̃^T V + B̃^T P

A chunk is therefore one linear map of (S^in, V) with four per-chunk matrices that do not depend on
the state, which `_prepare` computes in parallel over all chunks, in one kernel (`_prepare_kernel`:
M^ak, M^ab, M^qk, M^qb, Tm, W, G, then the four maps; W and G stay in registers unless the backward
needs them, which is faster than two kernels passing them through global memory; launched once per
intra regime, see below):

    O     = Q' S^in + E V          Q' = Q̂ + M^qb W            [BT, K]
    S^out = A S^in + C^T V         E  = M^qk + M^qb G          [BT, BT]
                                   A  = diag(e^{Γ_L}) + B̃^T W  [K, K]
                                   C  = K̃ + G^T B̃              [BT, K]

The sequential scans then do two products per chunk and the output comes out of the forward scan:
    forward  (`_scan_fwd`): O = Q' S + E V;  S <- A S + C^T V
    backward (`_scan_bwd`): dV = E^T dO + C dS;  dS <- A^T dS + Q'^T dO     (dS = dS^out of the chunk)
The per-chunk backward (`_chunk_bwd`, one program per chunk and head in each of two kernels) takes
the chunk's S^in, dS^out, dO and V, forms dQ' = dO S^T, dE = dO V^T, dA = dS S^T, dC = V dS^T
(reductions over V) and carries them back through the four definitions to M^qk, M^qb, W, G, B̃
(`_bwd_maps`); then through the WY representation (dM^ab = strict(Tm^T dTm Tm^T),
docs/kernels.md#rwkv7-chunked-backward) to
da and through the intra products to dk, db and dw by the reverse cumsum of identity I2
(`_bwd_intra`). The two pass fp32 [BT, K] / [BT, BT] tiles through global memory, so that neither
holds the whole chain (a program that held it spilled kilobytes of registers per thread); four
kernels (output side, state side, WY, column side) would move more tiles through memory and were
slower. No atomics anywhere: the backward is deterministic. By
default the backward runs `_prepare` again, from the WY inverse Tm that the forward keeps; with
cache_intermediates the forward keeps all its intermediates instead (faster, more memory). Head dims
K > 128 do not fit one program's tiles and run on the fused recurrent kernels instead.

Intra regimes (docs/kernels.md#rwkv7-intra-chunk-regimes):
- exact per-pair exponents (any gate): a loop over the key column with exponents Γ_τ - Γ_j <= 0;
  the default, with BT = 16;
- centred tensor-core factorisation around the middle row m: taken only when the caller gives a
  gate_lower_bound that passes the fp32 headroom rule |lb| (BT/2 + 1) log2 e <= 124 (BT <= 32 in
  any case: [64, K] tiles cost twice the registers of [32, K] ones), and then
  only for chunks whose gates really are >= lb, checked per chunk by `_prepare_kernel` on the chunk's
  own gates, with no host sync, and recorded (int8 per chunk and head) for the backward, so both
  passes take the same regime; the chunks that break the promise take the exact per-pair path at the
  same chunk size. Every per-chunk kernel that depends on the regime launches twice, once per regime,
  each launch skipping the chunks of the other (`_regime_selected`: one byte per program, cheaper than
  reading the chunk's gates): a program holding both paths spills more and runs slower. `_prepare`'s first
  launch decides and records the regime. The scans do not depend on the regime.

Precision: fp32 decay cumsums, states, state gradients and intermediates everywhere. Products with
fp32 operands are 3xTF32 (fp32-accurate) for fp32 inputs and in the scans' state recurrence A S; for
16-bit inputs the per-chunk kernels run them in bf16x3 (`mm_prec`, ~2^-16 per product: half the work
and operand registers of 3xTF32, and no change in the trained head's errors, see _Plan.prec). And for
bf16 inputs:
- the q-side intra products M^qk, M^qb take bf16 operands, and the scans' per-token matrices Q', E, C
  are stored in bf16 and multiplied with bf16 operands (fp32 accumulation, `_dot` with LOWP)
  everywhere but in the recurrence A S itself;
- one TF32 pass (`mm_tf32_if` with TF32) in the WY inverse, followed by a Newton step
  (wy_inverse_triton.py), in the state side's products and the reductions over V of `_bwd_maps`
  and in the column side's products of `_bwd_intra` (see _Plan.tf32).
Plain TF32 in the state recurrence, or in an inverse by nilpotent products, overflows a trained
head (tests/ops/test_rwkv7_bf16_trained_head.py); bf16 in W, G or the backward's products costs up
to 4x the error there (interpreter replica of tests/ops/test_rwkv7_bf16_trained_head.py). fp16 inputs keep fp32
operands (the fp16 caveat of docs/kernels.md#rwkv7-intra-chunk-regimes; bf16x3 has fp32's exponent
range). Under the interpreter, whose bf16
tl.dot is wrong and whose bf16 cast truncates, LOWP = 2 reproduces the same round-to-nearest operand
rounding around fp32 products, TF32 = 2 truncates the operands of the one-pass TF32 products as the
tensor cores read them, and `mm_prec` emulates bf16x3 with the same operand splits.
"""

import math
import os

import torch
import triton
import triton.language as tl

from ..backend import run_eager
from ..common.intra import mm_prec, mm_tf32_if, round_to_bf16
from ..common.layout import fixed_length_tables
from .wy_inverse_triton import unit_lower_inverse

LOG2E = 1.4426950408889634
HEADROOM_LOG2 = 124.0  # fp32 exponent range (128) minus 4 bits of headroom
MAX_CHUNK_K = 128  # larger head dims go to the fused recurrent kernels
# warps per program: 4 everywhere. The per-chunk kernels compiled for 8 warps with 3xTF32 products
# give wrong results and illegal memory accesses on an H100 with triton 3.6 (BT = 64), although 8
# warps would halve their registers per thread.
WARPS_CHUNK = 4
WARPS_SCAN = 4


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
def _cast(x, ptr, LOWP: tl.constexpr):
    """x in the element type of ptr (rounded to nearest also under the interpreter)."""
    if LOWP == 2:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = round_to_bf16(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _dot(x, y, LOWP: tl.constexpr, PREC: tl.constexpr):
    """x @ y with fp32 accumulation. LOWP 0: fp32 operands (PREC); 1: bf16 operands on the tensor cores;
    2: the same bf16 rounding of the operands, then an fp32 product (the interpreter's stand-in for 1,
    whose bf16 tl.dot is wrong)."""
    if LOWP == 1:
        return tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16))
    if LOWP == 2:
        return tl.dot(round_to_bf16(x), round_to_bf16(y), input_precision="ieee")
    return mm_prec(x, y, PREC)


@triton.jit
def _row_of(X, j, BT: tl.constexpr):
    """A [BT, N] tile whose every row is row j of X, bit-exact (one-hot product in ieee fp32)."""
    cols = tl.arange(0, BT)[None, :]
    zero_tt = tl.zeros([BT, BT], dtype=tl.float32)
    return tl.dot(tl.where(cols == j, 1.0, 0.0) + zero_tt, X, input_precision="ieee")


@triton.jit
def _pairwise_a_side(a, k, b, Gi, Ge, BT: tl.constexpr, PREC: tl.constexpr):
    """M^ak, M^ab (strict) with exact per-pair exponents Γ̄_τ - Γ_j <= 0.

    One key column j per step: its exponents are <= 0 on the kept rows and set to 0 elsewhere before
    exp2, then the column comes from a product with the tile holding only row j of k (b), so every op
    stays a select, an exp2 or a tl.dot (no reductions in the loop)."""
    rows = tl.arange(0, BT)[:, None]
    Mak = tl.zeros([BT, BT], dtype=tl.float32)
    Mab = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(0, BT):
        strict = rows > j
        ae = a * tl.exp2(tl.where(strict, Ge - _row_of(Gi, j, BT), 0.0))
        Mak += tl.where(strict, mm_prec(ae, tl.trans(tl.where(rows == j, k, 0.0)), PREC), 0.0)
        Mab += tl.where(strict, mm_prec(ae, tl.trans(tl.where(rows == j, b, 0.0)), PREC), 0.0)
    return Mak, Mab


@triton.jit
def _pairwise_q_side(q, k, b, Gi, BT: tl.constexpr, PREC: tl.constexpr):
    """M^qk, M^qb (inclusive) with exact per-pair exponents Γ_τ - Γ_j <= 0; q is pre-scaled."""
    rows = tl.arange(0, BT)[:, None]
    Mqk = tl.zeros([BT, BT], dtype=tl.float32)
    Mqb = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(0, BT):
        incl = rows >= j
        qe = q * tl.exp2(tl.where(incl, Gi - _row_of(Gi, j, BT), 0.0))
        Mqk += tl.where(incl, mm_prec(qe, tl.trans(tl.where(rows == j, k, 0.0)), PREC), 0.0)
        Mqb += tl.where(incl, mm_prec(qe, tl.trans(tl.where(rows == j, b, 0.0)), PREC), 0.0)
    return Mqk, Mqb


@triton.jit
def _pairwise_rows_bwd(dM1, x1, dM2, x2, Gr, Gi, STRICT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       PREC: tl.constexpr):
    """Row-side gradient of two masked M matrices, exact per pair:
    out_τ = Σ_j (dM1[τ,j] x1_j + dM2[τ,j] x2_j) e^{Gr_τ - Γ_j}  (dq: Gr = Γ, incl; da: Gr = Γ̄, strict)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    out = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(0, BT):
        g_j = _row_of(Gi, j, BT)
        if STRICT:
            keep = rows > j
        else:
            keep = rows >= j
        e = tl.exp2(tl.where(keep, Gr - g_j, 0.0))
        x1_j = tl.where(rows == j, x1, 0.0)
        x2_j = tl.where(rows == j, x2, 0.0)
        d1 = tl.where(cols == j, dM1, 0.0)
        d2 = tl.where(cols == j, dM2, 0.0)
        out += (mm_prec(d1, x1_j, PREC) + mm_prec(d2, x2_j, PREC)) * e
    return out


@triton.jit
def _pairwise_cols_bwd(q, a, Gi, Ge, dMqk, dMak, dMqb, dMab, BT: tl.constexpr, BK: tl.constexpr,
                       PREC: tl.constexpr):
    """Column-side gradients, exact per pair: dk_j = Σ_τ dM^qk[τ,j] e^{Γ_τ-Γ_j} q_τ + dM^ak[τ,j] e^{Γ̄_τ-Γ_j} a_τ,
    and db_j the same with dM^qb, dM^ab."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    db = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(0, BT):
        g_j = _row_of(Gi, j, BT)
        qe = q * tl.exp2(tl.where(rows >= j, Gi - g_j, 0.0))
        ae = a * tl.exp2(tl.where(rows > j, Ge - g_j, 0.0))
        d_qk = tl.where(cols == j, dMqk, 0.0)
        d_ak = tl.where(cols == j, dMak, 0.0)
        d_qb = tl.where(cols == j, dMqb, 0.0)
        d_ab = tl.where(cols == j, dMab, 0.0)
        dk += mm_prec(tl.trans(d_qk), qe, PREC) + mm_prec(tl.trans(d_ak), ae, PREC)
        db += mm_prec(tl.trans(d_qb), qe, PREC) + mm_prec(tl.trans(d_ab), ae, PREC)
    return dk, db


@triton.jit
def _centre_factors(Gi, Ge, BT: tl.constexpr):
    """exp2 factors around the middle row m: q side e^{Γ-Γm}, k/b side e^{Γm-Γ}, a side e^{Γ̄-Γm}."""
    rows = tl.arange(0, BT)
    g_m = tl.sum(tl.where((rows == BT // 2)[:, None], Gi, 0.0), 0)[None, :]
    return tl.exp2(Gi - g_m), tl.exp2(g_m - Gi), tl.exp2(Ge - g_m)


@triton.jit
def _rows_bwd(dMk, dMb, k, b, p_k, m_rk, Gi, Ge, STRICT: tl.constexpr, CENTRED: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr, PREC: tl.constexpr):
    """Row-side gradient of M^·k and M^·b (gradients dMk, dMb; k, b point at the chunk's first row):
    out_τ = Σ_j (dMk[τ,j] k_j + dMb[τ,j] b_j) e^{Gr_τ - Γ_j}, for dq (inclusive, Gr = Γ) or da (STRICT,
    Gr = Γ̄), from the centred factors or exactly per pair."""
    if CENTRED:
        e_q, e_k, e_a = _centre_factors(Gi, Ge, BT)
        out = mm_prec(dMk, _load_rows(k, p_k, m_rk) * e_k, PREC) + mm_prec(dMb, _load_rows(b, p_k, m_rk) * e_k, PREC)
        if STRICT:
            out = out * e_a
        else:
            out = out * e_q
    else:
        if STRICT:
            Gr = Ge
        else:
            Gr = Gi
        out = _pairwise_rows_bwd(dMk, _load_rows(k, p_k, m_rk), dMb, _load_rows(b, p_k, m_rk), Gr, Gi, STRICT, BT, BK,
                                 PREC)
    return out


@triton.jit
def _centred_a_side(ac, kc, bc, BT: tl.constexpr, PREC: tl.constexpr):
    """M^ak, M^ab from the centred factors (fp32 operands: they feed the inverse)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    Mak = tl.where(rows > cols, mm_prec(ac, tl.trans(kc), PREC), 0.0)
    Mab = tl.where(rows > cols, mm_prec(ac, tl.trans(bc), PREC), 0.0)
    return Mak, Mab


@triton.jit
def _centred_q_side(qc, kc, bc, BT: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr):
    """M^qk, M^qb from the centred factors (bf16 operands for bf16 inputs)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    Mqk = _dot(qc, tl.trans(kc), LOWP, PREC)
    Mqb = _dot(qc, tl.trans(bc), LOWP, PREC)
    return tl.where(rows >= cols, Mqk, 0.0), tl.where(rows >= cols, Mqb, 0.0)


@triton.jit
def _chunk_bounds(cu_seqlens, chunk_info, i_c, BT: tl.constexpr):
    """First token (int64) of chunk i_c and the end of its sequence."""
    i_n = tl.load(chunk_info + 2 * i_c)
    i_t = tl.load(chunk_info + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos + i_t.to(tl.int64) * BT, eos


@triton.jit
def _load_rows(x, p, m):
    return tl.load(x + p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _cumsums_of(b_w):
    """Inclusive and exclusive chunk-local cumsums of the loaded gate tile b_w times log2 e, and the
    chunk total [BK]."""
    wl = b_w * 1.4426950408889634
    Gi = tl.cumsum(wl, 0)
    return Gi, Gi - wl, tl.sum(wl, 0)


@triton.jit
def _gate_cumsums(w, p_k, m_rk):
    """`_cumsums_of` the chunk's gates."""
    return _cumsums_of(_load_rows(w, p_k, m_rk))


# ------------------------------------------------------------------------------------------------
# forward kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def _gates_keep_bound(b_w, m_rk, lower_bound):
    """Whether this chunk (gate tile b_w) takes the centred regime: where every gate of the chunk keeps
    the promise w >= lower_bound (the chunks that break it take the exact per-pair path at the same chunk
    size). Checked once per chunk, by `_prepare_kernel`, which records the answer in `regime` for the
    backward's kernels."""
    return tl.min(tl.where(m_rk, b_w, 0.0)) >= lower_bound


@triton.jit
def _regime_selected(regime, i_c, i_h, H, MODE: tl.constexpr):
    """For the kernels launched once per regime (a program holding both paths spills registers and is
    slower), whether this launch takes chunk i_c of head i_h, by the regime `_prepare_kernel` recorded. MODE 0: every chunk
    (exact regime); 1: the centred chunks; 2: the chunks that broke the bound (exact per-pair fallback at
    the centred chunk size)."""
    if MODE == 0:  # (no regime record then: the other branch must not be compiled)
        return True
    else:
        centred = tl.load(regime + i_c.to(tl.int64) * H + i_h) != 0
        if MODE == 1:
            return centred
        else:
            return centred == 0


@triton.jit
def _fallback_heads(regime, i_c, H, HP: tl.constexpr):
    """How many heads a program of an exact-fallback launch (MODE 2) visits for chunk i_c: H when the
    chunk's regime row (H bytes, one vector load) has an exact head, else 0. Those launches run one
    program per chunk that visits its heads itself: a (chunks, heads) grid of programs that mostly
    return at once costs launch time in each of the five such launches. The visiting program
    serializes the exact chunks of up to H heads,
    which costs little where the grid has a few waves of chunks already. The centred launches keep one
    program per chunk and head, without a loop (a loop around their body made ptxas spill more)."""
    o_h = tl.arange(0, HP)
    row = tl.load(regime + i_c.to(tl.int64) * H + o_h, mask=o_h < H, other=1)
    return tl.where(tl.min(row.to(tl.int32)) == 0, H, 0)


@triton.jit
def _chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT: tl.constexpr, BK: tl.constexpr):
    """Chunk i_c of head i_h: row masks, the [BT, BK] offsets of K-wide and the [BT, BT] offsets of
    BT-wide token-major tensors from the chunk's first row, and those first rows' offsets bk, bT."""
    t0, eos = _chunk_bounds(cu_seqlens, chunk_info, i_c, BT)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_r = (rows < eos - t0)[:, None]
    m_rk = m_r & (o_k < K)[None, :]
    # int32 offsets within the chunk (an int64 [BT, BK] tile costs twice the registers),
    # int64 scalar bases of the chunk's first row
    p_k = (rows * H * K)[:, None] + o_k[None, :]
    p_t = (rows * H * BT)[:, None] + rows[None, :]
    base = t0 * H + i_h
    return t0, m_r, m_rk, p_k, p_t, base * K, base * BT


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
        t0, m_r, m_rk, p_k, p_t, bk, bT = _chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
        b_w = _load_rows(w + bk, p_k, m_rk)
        centred = _gates_keep_bound(b_w, m_rk, lower_bound)
        tl.store(regime + i_c.to(tl.int64) * H + i_h, centred.to(tl.int8))
        if centred:
            _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                           m_r, m_rk, p_k, p_t, bk, bT, BT, BK, True, STORE_BWD, TM_MODE, LOWP, TF32, PREC)
    elif MODE == 2:
        for i_h in range(0, _fallback_heads(regime, i_c, H, HP)):
            if _regime_selected(regime, i_c, i_h, H, MODE):
                t0, m_r, m_rk, p_k, p_t, bk, bT = _chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
                b_w = _load_rows(w + bk, p_k, m_rk)
                _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                               m_r, m_rk, p_k, p_t, bk, bT, BT, BK, False, STORE_BWD, TM_MODE, LOWP, TF32, PREC)
    else:
        i_h = tl.program_id(1)
        t0, m_r, m_rk, p_k, p_t, bk, bT = _chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
        b_w = _load_rows(w + bk, p_k, m_rk)
        _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                       m_r, m_rk, p_k, p_t, bk, bT, BT, BK, False, STORE_BWD, TM_MODE, LOWP, TF32, PREC)


@triton.jit
def _prepare_chunk(q, k, a, b, b_w, scale, Wm, Gm, Tm, Mak, Mqb, Qs, Es, Cs, As, i_c, i_h, H, K,
                   m_r, m_rk, p_k, p_t, bk, bT, BT: tl.constexpr, BK: tl.constexpr, CENTRED: tl.constexpr,
                   STORE_BWD: tl.constexpr, TM_MODE: tl.constexpr, LOWP: tl.constexpr, TF32: tl.constexpr,
                   PREC: tl.constexpr):
    """`_prepare_kernel`'s work on one chunk (gate tile b_w), in the centred regime if CENTRED."""
    Gi, Ge, g_L = _cumsums_of(b_w)
    b_a = _load_rows(a + bk, p_k, m_rk)
    if CENTRED:
        e_q, e_k, e_a = _centre_factors(Gi, Ge, BT)
        b_Mak, b_Mab = _centred_a_side(b_a * e_a, _load_rows(k + bk, p_k, m_rk) * e_k,
                                       _load_rows(b + bk, p_k, m_rk) * e_k, BT, PREC)
    else:
        b_Mak, b_Mab = _pairwise_a_side(b_a, _load_rows(k + bk, p_k, m_rk), _load_rows(b + bk, p_k, m_rk), Gi, Ge,
                                        BT, PREC)
    # the q side before the inverse, which it does not depend on: its products then fill the latency of
    # the inverse's serial chain. The centred factors and the k, b tiles are formed again from the
    # loads: one branch holding them for both sides spills more
    b_q = _load_rows(q + bk, p_k, m_rk) * scale
    if CENTRED:
        e_q, e_k, e_a = _centre_factors(Gi, Ge, BT)
        b_Mqk, b_Mqb = _centred_q_side(b_q * e_q, _load_rows(k + bk, p_k, m_rk) * e_k,
                                       _load_rows(b + bk, p_k, m_rk) * e_k, BT, LOWP, PREC)
    else:
        b_Mqk, b_Mqb = _pairwise_q_side(b_q, _load_rows(k + bk, p_k, m_rk), _load_rows(b + bk, p_k, m_rk), Gi,
                                        BT, PREC)
    if STORE_BWD:
        tl.store(Mqb + bT + p_t, b_Mqb, mask=m_r)
    if TM_MODE == 2:
        b_Tm = tl.load(Tm + bT + p_t, mask=m_r, other=0.0)
    else:
        b_Tm = unit_lower_inverse(b_Mab, BT, TF32, PREC)
        if TM_MODE == 1:
            tl.store(Tm + bT + p_t, b_Tm, mask=m_r)
    b_W = mm_prec(b_Tm, b_a * tl.exp2(Ge), PREC)
    b_G = mm_prec(b_Tm, b_Mak, PREC)
    if STORE_BWD:
        tl.store(Mak + bT + p_t, b_Mak, mask=m_r)
        tl.store(Wm + bk + p_k, b_W, mask=m_rk)
        tl.store(Gm + bT + p_t, b_G, mask=m_r)

    b_Q = b_q * tl.exp2(Gi) + mm_prec(b_Mqb, b_W, PREC)
    tl.store(Qs + bk + p_k, _cast(b_Q, Qs, LOWP), mask=m_rk)
    b_E = b_Mqk + mm_prec(b_Mqb, b_G, PREC)
    tl.store(Es + bT + p_t, _cast(b_E, Es, LOWP), mask=m_r)

    e_L = tl.exp2(g_L[None, :] - Gi)
    b_bt = _load_rows(b + bk, p_k, m_rk) * e_L
    b_C = _load_rows(k + bk, p_k, m_rk) * e_L + mm_prec(tl.trans(b_G), b_bt, PREC)
    tl.store(Cs + bk + p_k, _cast(b_C, Cs, LOWP), mask=m_rk)
    o_kr = tl.arange(0, BK)[:, None]
    o_kc = tl.arange(0, BK)[None, :]
    b_A = tl.where(o_kr == o_kc, tl.exp2(g_L)[None, :], 0.0) + mm_prec(tl.trans(b_bt), b_W, PREC)
    tl.store(As + (i_c.to(tl.int64) * H + i_h) * K * K + o_kr * K + o_kc, b_A, mask=(o_kr < K) & (o_kc < K))


@triton.jit
def _load_chunk_maps(Qs, Es, Cs, As, t0, i_c, i_h, H, K, BT: tl.constexpr, p_k0, p_t0, a_off, m_r, m_k):
    """The scans' per-chunk maps Q', E, C (rows of the chunk starting at token t0) and A (chunk i_c),
    fp32. int64 scalar offsets of the chunk's first row, int32 tile offsets."""
    base = t0 * H + i_h
    b_Q = _load_rows(Qs + base * K, p_k0, m_r & m_k[None, :])
    b_E = _load_rows(Es + base * BT, p_t0, m_r)
    b_C = _load_rows(Cs + base * K, p_k0, m_r & m_k[None, :])
    b_A = tl.load(As + (i_c * H + i_h) * K * K + a_off, mask=m_k[:, None] & m_k[None, :], other=0.0)
    return b_Q, b_E, b_C, b_A


@triton.jit
def _scan_fwd_kernel(
    v, Qs, Es, Cs, As, h0, hs, ht, o, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HS: tl.constexpr, STORE_HT: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """One sequence*head and V-block: O = Q' S + E V and S <- A S + C^T V, chunk after chunk."""
    _scan_fwd_program(v, Qs, Es, Cs, As, h0, hs, ht, o, cu_seqlens, chunk_offsets, tl.program_id(0), tl.program_id(1),
                      H, K, V, BT, BK, BV, USE_H0, STORE_HS, STORE_HT, True, LOWP, PREC)


@triton.jit
def _scan_fwd_program(
    v, Qs, Es, Cs, As, h0, hs, ht, o, cu_seqlens, chunk_offsets, i_nh, i_v,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HS: tl.constexpr, STORE_HT: tl.constexpr, STORE_O: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr,
):
    """The forward scan of sequence*head i_nh and V-block i_v; the states S^in of every chunk go to hs
    (STORE_HS), the output to o (STORE_O)."""
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
    a_off = o_k[:, None] * K + o_k[None, :]
    p_k0 = (rows * H * K)[:, None] + o_k[None, :]
    p_v0 = (rows * H * V)[:, None] + o_v[None, :]
    p_t0 = (rows * H * BT)[:, None] + rows[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        m_r = (rows < eos - t0)[:, None]
        if STORE_HS:
            tl.store(hs + ((c0 + i_t) * H + i_h) * K * V + s_off, S, mask=m_kv)
        bv = (t0 * H + i_h) * V
        b_v = _load_rows(v + bv, p_v0, m_r & m_v[None, :])
        b_Q, b_E, b_C, b_A = _load_chunk_maps(Qs, Es, Cs, As, t0, c0 + i_t, i_h, H, K, BT, p_k0, p_t0, a_off, m_r, m_k)
        if STORE_O:
            b_o = _dot(b_Q, S, LOWP, PREC) + _dot(b_E, b_v, LOWP, PREC)
            tl.store(o + bv + p_v0, _cast(b_o, o, LOWP), mask=m_r & m_v[None, :])
        S = mm_prec(b_A, S, PREC) + _dot(tl.trans(b_C), b_v, LOWP, PREC)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)


# ------------------------------------------------------------------------------------------------
# backward kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def _scan_bwd_kernel(
    do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """One sequence*head and V-block, last chunk first: dV = E^T dO + C dS and dS <- A^T dS + Q'^T dO;
    dS^out of every chunk goes to dhs."""
    _scan_bwd_program(do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets, tl.program_id(0),
                      tl.program_id(1), H, K, V, BT, BK, BV, USE_DHT, STORE_DH0, LOWP, PREC)


@triton.jit
def _scan_pair_kernel(
    v, do, Qs, Es, Cs, As, h0, hs, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """The backward's two scans in one launch, for a forward that did not keep its states: programs
    of grid axis 2 = 0 run the forward scan again for the states hs (no output), those of axis 2 = 1
    the backward scan. The two are independent and each is latency-bound (one program per sequence,
    head and V-block walks all chunks), so they share the GPU's SMs instead of running one after the
    other."""
    if tl.program_id(2) == 0:
        _scan_fwd_program(v, Qs, Es, Cs, As, h0, hs, None, None, cu_seqlens, chunk_offsets, tl.program_id(0),
                          tl.program_id(1), H, K, V, BT, BK, BV, USE_H0, True, False, False, LOWP, PREC)
    else:
        _scan_bwd_program(do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets, tl.program_id(0),
                          tl.program_id(1), H, K, V, BT, BK, BV, USE_DHT, STORE_DH0, LOWP, PREC)


@triton.jit
def _scan_bwd_program(
    do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets, i_nh, i_v,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """The backward scan of sequence*head i_nh and V-block i_v."""
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
    a_off = o_k[:, None] * K + o_k[None, :]
    p_k0 = (rows * H * K)[:, None] + o_k[None, :]
    p_v0 = (rows * H * V)[:, None] + o_v[None, :]
    p_t0 = (rows * H * BT)[:, None] + rows[None, :]

    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for i in range(0, NT):
        i_t = NT - 1 - i
        t0 = bos + i_t * BT
        m_r = (rows < eos - t0)[:, None]
        tl.store(dhs + ((c0 + i_t) * H + i_h) * K * V + s_off, dS, mask=m_kv)
        bv = (t0 * H + i_h) * V
        b_do = _load_rows(do + bv, p_v0, m_r & m_v[None, :])
        b_Q, b_E, b_C, b_A = _load_chunk_maps(Qs, Es, Cs, As, t0, c0 + i_t, i_h, H, K, BT, p_k0, p_t0, a_off, m_r, m_k)
        b_dv = _dot(tl.trans(b_E), b_do, LOWP, PREC) + _dot(b_C, dS, LOWP, PREC)
        tl.store(dv + bv + p_v0, _cast(b_dv, dv, LOWP), mask=m_r & m_v[None, :])
        dS = mm_prec(tl.trans(b_A), dS, PREC) + _dot(tl.trans(b_Q), b_do, LOWP, PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)


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
        for i_h in range(0, _fallback_heads(regime, i_c, H, HP)):
            if _regime_selected(regime, i_c, i_h, H, MODE):
                _bwd_maps_chunk(q, w, k, v, b, do, hs, dhs, Wm, Gm, Mqb, cu_seqlens, chunk_info, scale, dq, dEb,
                                dMqbb, gq, dWb, dGb, dks, dbs, glast, H, K, V, BT, BK, BV, MODE, LOWP, TF32, PREC,
                                i_c, i_h)
    else:
        i_h = tl.program_id(1)
        if _regime_selected(regime, i_c, i_h, H, MODE):
            _bwd_maps_chunk(q, w, k, v, b, do, hs, dhs, Wm, Gm, Mqb, cu_seqlens, chunk_info, scale, dq, dEb,
                            dMqbb, gq, dWb, dGb, dks, dbs, glast, H, K, V, BT, BK, BV, MODE, LOWP, TF32, PREC,
                            i_c, i_h)


@triton.jit
def _bwd_maps_chunk(q, w, k, v, b, do, hs, dhs, Wm, Gm, Mqb, cu_seqlens, chunk_info, scale, dq, dEb, dMqbb, gq,
                    dWb, dGb, dks, dbs, glast, H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    MODE: tl.constexpr, LOWP: tl.constexpr, TF32: tl.constexpr, PREC: tl.constexpr, i_c, i_h):
    """Chunk i_c of head i_h, in two passes over the V blocks of its state S^in, state gradient dS^out,
    V and dO.

    State side: dA = dS S^T and dC = V dS^T, then through A = diag(e^Γ_L) + B̃^T W and C = K̃ + G^T B̃ to
    dB̃ = G dC + W dA^T, the state-path parts of dk and db, the chunk-total gate term of I2, and the parts
    B̃ dA of dW and B̃ dC^T of dG, which stay in registers.
    Output side: dQ' = dO S^T and dE = dO V^T, then dW += M^qb^T dQ', dG += M^qb^T dE (stored for
    `_bwd_intra`), dM^qb = incl(dQ' W^T + dE G^T), dq (dQ̂ e^Γ + the row side of dM^qk = incl(dE) and
    dM^qb) and its I2 term q dq. Stores dE, dM^qb and q dq (fp32) for `_bwd_intra`.
    One kernel for both sides keeps dW and dG out of global memory between them and reads the chunk's
    gates, keys, W and G once; the second pass over S^in and V mostly hits L2. It is faster than one
    kernel per side, and than one pass accumulating all four reductions at once (more registers)."""
    t0, m_r, m_rk, p_k, p_t, bk, bT = _chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    h_base = (i_c.to(tl.int64) * H + i_h) * K * V
    bv = (t0 * H + i_h) * V
    # state side
    dA = tl.zeros([BK, BK], dtype=tl.float32)
    dC = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        s_off, m_s, p_v, m_v = _v_block(i_v, H, K, V, BT, BK, BV)
        S = tl.load(hs + h_base + s_off, mask=m_s, other=0.0)
        dS = tl.load(dhs + h_base + s_off, mask=m_s, other=0.0)
        dA += mm_tf32_if(dS, tl.trans(S), TF32, PREC)
        dC += mm_tf32_if(_load_rows(v + bv, p_v, m_r & m_v), tl.trans(dS), TF32, PREC)
    Gi, Ge, g_L = _gate_cumsums(w + bk, p_k, m_rk)
    e_L = tl.exp2(g_L[None, :] - Gi)
    dbt = mm_tf32_if(_load_rows(Gm + bT, p_t, m_r), dC, TF32, PREC) \
        + mm_tf32_if(_load_rows(Wm + bk, p_k, m_rk), tl.trans(dA), TF32, PREC)
    o_kr = tl.arange(0, BK)[:, None]
    s_sum = tl.sum(tl.where(o_kr == o_k[None, :], dA, 0.0), 0)  # diag(dA) = rowsum(S^in * dS^out)
    dk_s = dC * e_L
    db_s = dbt * e_L
    tl.store(dks + bk + p_k, dk_s, mask=m_rk)
    tl.store(dbs + bk + p_k, db_s, mask=m_rk)
    g_last = tl.exp2(g_L) * s_sum + tl.sum(_load_rows(k + bk, p_k, m_rk) * dk_s
                                           + _load_rows(b + bk, p_k, m_rk) * db_s, 0)
    tl.store(glast + (i_c.to(tl.int64) * H + i_h) * K + o_k, g_last, mask=o_k < K)
    b_bt = _load_rows(b + bk, p_k, m_rk) * e_L
    dW = mm_tf32_if(b_bt, dA, TF32, PREC)
    dG = mm_tf32_if(b_bt, tl.trans(dC), TF32, PREC)
    # output side
    incl = rows[:, None] >= rows[None, :]
    dQ = tl.zeros([BT, BK], dtype=tl.float32)
    dE = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        s_off, m_s, p_v, m_v = _v_block(i_v, H, K, V, BT, BK, BV)
        S = tl.load(hs + h_base + s_off, mask=m_s, other=0.0)
        b_do = _load_rows(do + bv, p_v, m_r & m_v)
        dQ += mm_tf32_if(b_do, tl.trans(S), TF32, PREC)
        dE += mm_tf32_if(b_do, tl.trans(_load_rows(v + bv, p_v, m_r & m_v)), TF32, PREC)
    tl.store(dEb + bT + p_t, dE, mask=m_r)
    b_Mqb = _load_rows(Mqb + bT, p_t, m_r)
    tl.store(dWb + bk + p_k, dW + mm_prec(tl.trans(b_Mqb), dQ, PREC), mask=m_rk)
    tl.store(dGb + bT + p_t, dG + mm_prec(tl.trans(b_Mqb), dE, PREC), mask=m_r)
    dMqb = tl.where(incl, mm_prec(dQ, tl.trans(_load_rows(Wm + bk, p_k, m_rk)), PREC)
                    + mm_prec(dE, tl.trans(_load_rows(Gm + bT, p_t, m_r)), PREC), 0.0)
    tl.store(dMqbb + bT + p_t, dMqb, mask=m_r)
    dMqk = tl.where(incl, dE, 0.0)
    # the gates loaded again rather than held over the second V pass (the exact-fallback launch spills
    # less so)
    Gi, Ge, g_L = _gate_cumsums(w + bk, p_k, m_rk)
    i_dq = _rows_bwd(dMqk, dMqb, k + bk, b + bk, p_k, m_rk, Gi, Ge, False, MODE == 1, BT, BK, PREC)
    b_dq = dQ * tl.exp2(Gi) + i_dq
    tl.store(dq + bk + p_k, _cast(b_dq * scale, dq, LOWP), mask=m_rk)
    tl.store(gq + bk + p_k, _load_rows(q + bk, p_k, m_rk) * scale * b_dq, mask=m_rk)


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
        for i_h in range(0, _fallback_heads(regime, i_c, H, HP)):
            if _regime_selected(regime, i_c, i_h, H, MODE):
                _bwd_intra_chunk(q, w, k, a, b, Tm, Mak, dWb, dGb, dEb, dMqbb, dks, dbs, gq, glast, cu_seqlens,
                                 chunk_info, scale, da, dw, dk, db, H, K, BT, BK, MODE, LOWP, TF32, PREC, i_c, i_h)
    else:
        i_h = tl.program_id(1)
        if _regime_selected(regime, i_c, i_h, H, MODE):
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
    program: faster than one kernel per part, although this one spills more registers."""
    t0, m_r, m_rk, p_k, p_t, bk, bT = _chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT, BK)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    strict = rows[:, None] > rows[None, :]
    Gi, Ge, g_L = _gate_cumsums(w + bk, p_k, m_rk)
    # WY backward
    b_Tm = tl.load(Tm + bT + p_t, mask=m_r, other=0.0)
    dG = _load_rows(dGb + bT, p_t, m_r)
    dW = _load_rows(dWb + bk, p_k, m_rk)
    e_Ge = tl.exp2(Ge)
    b_a = _load_rows(a + bk, p_k, m_rk)
    dTm = mm_prec(dG, tl.trans(_load_rows(Mak + bT, p_t, m_r)), PREC) \
        + mm_prec(dW, tl.trans(b_a * e_Ge), PREC)
    dMak = tl.where(strict, mm_prec(tl.trans(b_Tm), dG, PREC), 0.0)
    dAh = mm_prec(tl.trans(b_Tm), dW, PREC)
    dMab = mm_prec(mm_prec(tl.trans(b_Tm), dTm, PREC), tl.trans(b_Tm), PREC)
    dMab = tl.where(strict, dMab, 0.0)
    i_da = _rows_bwd(dMak, dMab, k + bk, b + bk, p_k, m_rk, Gi, Ge, True, MODE == 1, BT, BK, PREC)
    b_da = dAh * e_Ge + i_da
    tl.store(da + bk + p_k, _cast(b_da, da, LOWP), mask=m_rk)
    g_a = b_a * b_da
    # column side (the gates and a loaded again: cheaper than holding them in registers)
    Gi, Ge, g_L = _gate_cumsums(w + bk, p_k, m_rk)
    b_a = _load_rows(a + bk, p_k, m_rk)
    dMqk = tl.where(rows[:, None] >= rows[None, :], _load_rows(dEb + bT, p_t, m_r), 0.0)
    dMqb = _load_rows(dMqbb + bT, p_t, m_r)
    b_q = _load_rows(q + bk, p_k, m_rk) * scale
    if MODE == 1:
        e_q, e_k, e_a = _centre_factors(Gi, Ge, BT)
        qc = b_q * e_q
        ac = b_a * e_a
        i_dk = (mm_tf32_if(tl.trans(dMqk), qc, TF32, PREC)
                + mm_tf32_if(tl.trans(dMak), ac, TF32, PREC)) * e_k
        i_db = (mm_tf32_if(tl.trans(dMqb), qc, TF32, PREC)
                + mm_tf32_if(tl.trans(dMab), ac, TF32, PREC)) * e_k
    else:
        i_dk, i_db = _pairwise_cols_bwd(b_q, b_a, Gi, Ge, dMqk, dMak, dMqb, dMab, BT, BK, PREC)
    b_dk = _load_rows(dks + bk, p_k, m_rk) + i_dk
    b_db = _load_rows(dbs + bk, p_k, m_rk) + i_db
    tl.store(dk + bk + p_k, _cast(b_dk, dk, LOWP), mask=m_rk)
    tl.store(db + bk + p_k, _cast(b_db, db, LOWP), mask=m_rk)
    gam = _load_rows(gq + bk, p_k, m_rk) + g_a
    gam -= _load_rows(k + bk, p_k, m_rk) * b_dk + _load_rows(b + bk, p_k, m_rk) * b_db
    rev = tl.sum(gam, 0)[None, :] - tl.cumsum(gam, 0) + gam
    g_last = tl.load(glast + (i_c.to(tl.int64) * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
    tl.store(dw + bk + p_k, _cast(rev - g_a + g_last[None, :], dw, LOWP), mask=m_rk)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------

def _chunk_layout(B, T, BT, cu_seqlens, device):
    """cu_seqlens (int64), chunk_info [NT, 2] = (sequence, chunk-in-sequence), chunk_offsets [N+1]."""
    if cu_seqlens is None:
        return (*fixed_length_tables(B, T, BT, device), B)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    counts = [triton.cdiv(int(n), BT) for n in (cu[1:] - cu[:-1]).tolist()]
    info = [(n, i) for n, c in enumerate(counts) for i in range(c)]
    chunk_info = torch.tensor(info, dtype=torch.int32, device=device).reshape(-1, 2)
    offsets = torch.tensor([0] + counts, dtype=torch.int64, device=device).cumsum(0)
    return cu, chunk_info, offsets, len(counts)


def _scan_block_v(N, H, V):
    """V-block of the scans: the widest (<= 64) that still gives ~256 programs, at least 16 (the fastest
    of the widths and warp counts tried; the scans are latency-bound)."""
    bv = min(max(triton.next_power_of_2(V), 16), 64)
    while bv > 16 and N * H * triton.cdiv(V, bv) < 256:
        bv //= 2
    return bv


def _check_kernel_dtype(op, r):
    if r.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: the Triton kernels take float32, float16 or bfloat16 inputs, got {r.dtype}; "
                        "use backend='torch' for float64")


def _scan_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scans' per-token operands Q', E, C: bf16 for bf16 inputs, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _intermediate_specs(B, T, H, K, BT, NT, centred, scan_dtype) -> dict:
    """{name: (shape, dtype)} of every intermediate `_prepare` can write (shape None: not written, the
    regime outside the centred regime)."""
    f32 = torch.float32
    per_k, per_t = (B, T, H, K), (B, T, H, BT)
    return {"Qs": (per_k, scan_dtype), "Es": (per_t, scan_dtype), "Cs": (per_k, scan_dtype),
            "As": ((NT, H, K, K), f32), "regime": ((NT, H) if centred else None, torch.int8),
            "Wm": (per_k, f32), "Gm": (per_t, f32), "Mak": (per_t, f32), "Mqb": (per_t, f32), "Tm": (per_t, f32)}


class _Plan:
    """Everything the kernels need to know about one call's shapes and regime."""

    def __init__(self, r, v, cu_seqlens, gate_lower_bound):
        B, T, H, K = r.shape
        V = v.shape[-1]
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.BK = max(triton.next_power_of_2(K), 16)
        bt_centred = centred_chunk_size(gate_lower_bound)
        if bt_centred is not None:
            bt_centred = min(bt_centred, 32)  # C = 64 spills kilobytes per thread in the per-chunk kernels
        self.centred = bt_centred is not None
        self.BT = bt_centred if self.centred else 16
        self.lower_bound = float(gate_lower_bound) if self.centred else 0.0
        # launches of the per-chunk kernels that depend on the regime (`_regime_selected`): the centred
        # chunks, then those that break the bound
        self.modes = (1, 2) if self.centred else (0,)
        self.HP = triton.next_power_of_2(H)  # the regime row of a chunk, one vector load (`_fallback_heads`)
        self.cu, self.chunk_info, self.chunk_offsets, self.N = _chunk_layout(B, T, self.BT, cu_seqlens, r.device)
        self.NT = self.chunk_info.shape[0]
        self.BV = _scan_block_v(self.N, H, V)
        self.NV = triton.cdiv(V, self.BV)
        self.BV_bwd = min(max(triton.next_power_of_2(V), 16), 32)  # V block of the backward's reductions over V
        # the scans prefetch the next chunk's matrices (2 stages) where shared memory allows
        self.scan_stages = 2 if self.BK <= 64 else 1
        interp = _interpreting()
        # the state recurrence A S: 3xTF32 for every input dtype (plain TF32 overflows a trained head,
        # tests/ops/test_rwkv7_bf16_trained_head.py)
        self.prec_state = "tf32x3"
        # the per-chunk kernels' fp32-operand products: bf16x3 (half the work of 3xTF32, the trained head's
        # errors unchanged) for 16-bit inputs, 3xTF32 for fp32
        self.prec = "tf32x3" if r.dtype == torch.float32 else "bf16x3"
        # `_prepare`'s register cap at head dims <= 64: 3 programs per SM instead of 2, faster despite a
        # little spilling (the backward's kernels are faster uncapped)
        self.maxnreg = 168 if self.BK <= 64 else None
        # `_bwd_maps`'s pipeline stages over its V blocks: 3 the fastest tried; 1 at larger head dims,
        # whose tiles already fill shared memory
        self.stages_maps = 3 if self.BK <= 64 else 1
        # bf16 operands (fp32 accumulation) for the products outside the state recurrence, the a-side
        # intra products and the WY inverse and backward (`_dot`; emulated under the interpreter)
        self.lowp = (2 if interp else 1) if r.dtype == torch.bfloat16 else 0
        # Q', E, C (the scans' per-token operands) in bf16 for bf16 inputs; states, A and the backward's
        # W, G, Tm, M^ak, M^qb stay fp32 (bf16 there multiplies da's and db's errors on the trained head)
        self.scan_dtype = _scan_dtype(r.dtype)
        # one TF32 pass (not 3) for bf16 inputs (`mm_tf32_if`) where its error stays in one chunk's
        # gradients: `_bwd_maps`'s reductions over V and state side, `_bwd_intra`'s column side, and the WY
        # inverse (then brought back by a Newton step); elsewhere it costs the trained head accuracy
        self.tf32 = self.lowp  # the same switch: bf16 inputs, 1 on a GPU, 2 emulated under the interpreter

    def grid(self, mode):
        """The grid of a per-regime kernel's launch: (chunks, heads), or (chunks, 1) for the exact fallback
        after the centred launch, whose programs visit a chunk's heads themselves (`_fallback_heads`)."""
        return (self.NT, 1) if mode == 2 else (self.NT, self.H)


def _prepare(plan, q, w, k, a, b, scale, store_bwd, keep_tm, tm=None):
    """The per-chunk matrices of the scans (Q', E, C in plan.scan_dtype, A fp32) and, in the centred regime,
    each chunk's regime (int8 [NT, H], 1: centred); with store_bwd also W, G, M^ak, M^qb (fp32) for the
    backward; with keep_tm also the inverse Tm (fp32), or, given tm (a previous call's), that one."""
    H, K, BT = plan.H, plan.K, plan.BT
    specs = _intermediate_specs(plan.B, plan.T, H, K, BT, plan.NT, plan.centred, plan.scan_dtype)
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
            HP=plan.HP, num_warps=WARPS_CHUNK, num_stages=1, maxnreg=plan.maxnreg,
        )
    return out


def _chunk_bwd(plan, pre, q, w, k, v, a, b, do, hs, dhs, scale):
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
    common = dict(H=H, K=K, BT=BT, BK=plan.BK, PREC=plan.prec, num_warps=WARPS_CHUNK)
    for mode in plan.modes:
        _bwd_maps_kernel[plan.grid(mode)](q, w, k, v, b, do, hs, dhs, pre["Wm"], pre["Gm"], pre["Mqb"], plan.cu,
                                          plan.chunk_info, scale, pre["regime"], dq, dEb, dMqbb, gq, dWb, dGb, dks,
                                          dbs, glast, V=V, BV=plan.BV_bwd, MODE=mode, LOWP=plan.lowp, TF32=plan.tf32,
                                          HP=plan.HP, num_stages=plan.stages_maps, **common)
    for mode in plan.modes:
        _bwd_intra_kernel[plan.grid(mode)](q, w, k, a, b, pre["Tm"], pre["Mak"], dWb, dGb, dEb, dMqbb, dks, dbs, gq,
                                           glast, plan.cu, plan.chunk_info, scale, pre["regime"], da, dw, dk, db,
                                           MODE=mode, LOWP=plan.lowp, TF32=plan.tf32, HP=plan.HP, num_stages=1,
                                           **common)
    return dq, dw, dk, da, db


def _forward(r, w, k, v, a, b, scale, h0, output_final_state, cu_seqlens, gate_lower_bound, need_grad, cache,
             keep_states=True):
    """o, the final state (or None), and what the backward needs: the plan, the per-chunk states hs (None
    without need_grad or `keep_states`) and the intermediates (all of them with `cache`, else the WY
    inverse Tm alone; None without need_grad)."""
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    plan = _Plan(r, v, cu_seqlens, gate_lower_bound)
    H, K, V = plan.H, plan.K, plan.V
    cache = need_grad and cache
    # the backward needs Tm: the forward keeps it also when it recomputes the rest (C fp32 per token and
    # head; its inverse is the longest chain of the recomputation)
    pre = _prepare(plan, r, w, k, a, b, scale, store_bwd=cache, keep_tm=need_grad)
    hs = r.new_empty(plan.NT, H, K, V, dtype=torch.float32) if need_grad and keep_states else None
    ht = r.new_empty(plan.N, H, K, V, dtype=torch.float32) if output_final_state else None
    h0 = h0.contiguous() if h0 is not None else None
    o = torch.empty_like(v)
    _scan_fwd_kernel[(plan.N * H, plan.NV)](
        v, pre["Qs"], pre["Es"], pre["Cs"], pre["As"], h0, hs, ht, o, plan.cu, plan.chunk_offsets,
        H=H, K=K, V=V, BT=plan.BT, BK=plan.BK, BV=plan.BV, USE_H0=h0 is not None, STORE_HS=hs is not None,
        STORE_HT=output_final_state, LOWP=plan.lowp, PREC=plan.prec_state, num_warps=WARPS_SCAN,
        num_stages=plan.scan_stages,
    )
    saved = (pre if cache else {"Tm": pre["Tm"]}) if need_grad else None
    return o, ht, plan, hs, saved


def _backward(plan, saved, r, w, k, v, a, b, hs, scale, h0, has_h0, do, dht):
    """dr, dw, dk, dv, da, db and dh0 (None without an initial state) of one call. `hs` None: the forward
    did not keep its states, and the backward scan's launch runs the forward scan again for them
    (`_scan_pair_kernel`, from the initial state h0)."""
    H, K, V = plan.H, plan.K, plan.V
    pre = saved if "Qs" in saved else _prepare(plan, r, w, k, a, b, scale, store_bwd=True, keep_tm=True,
                                                 tm=saved["Tm"])
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    dhs = r.new_empty(plan.NT, H, K, V, dtype=torch.float32)
    dh0 = r.new_empty(plan.N, H, K, V, dtype=torch.float32) if has_h0 else None
    dv = torch.empty_like(v)
    maps = (pre["Qs"], pre["Es"], pre["Cs"], pre["As"])
    launch = dict(H=H, K=K, V=V, BT=plan.BT, BK=plan.BK, BV=plan.BV, USE_DHT=dht is not None, STORE_DH0=has_h0,
                  LOWP=plan.lowp, PREC=plan.prec_state, num_warps=WARPS_SCAN, num_stages=plan.scan_stages)
    if hs is None:
        hs = torch.empty_like(dhs)
        _scan_pair_kernel[(plan.N * H, plan.NV, 2)](
            v, do, *maps, h0.contiguous() if has_h0 else None, hs, dht, dhs, dh0, dv, plan.cu, plan.chunk_offsets,
            USE_H0=has_h0, **launch)
    else:
        _scan_bwd_kernel[(plan.N * H, plan.NV)](do, *maps, dht, dhs, dh0, dv, plan.cu, plan.chunk_offsets, **launch)
    dr, dw, dk, da, db = _chunk_bwd(plan, pre, r, w, k, v, a, b, do, hs, dhs, scale)
    return dr, dw, dk, dv, da, db, dh0


class ChunkRWKV7Function(torch.autograd.Function):
    """The autograd path for calls the custom ops below do not take (varlen)."""

    @staticmethod
    def forward(ctx, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, gate_lower_bound,
                cache_intermediates, recompute_states):
        need_grad = any(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 4, 5, 7))
        o, ht, plan, hs, saved = _forward(r, w, k, v, a, b, scale, initial_state, output_final_state,
                                          cu_seqlens, gate_lower_bound, need_grad, cache_intermediates,
                                          keep_states=not recompute_states)
        if need_grad:
            ctx.save_for_backward(*(x.contiguous() for x in (r, w, k, v, a, b)), hs,
                                  initial_state if recompute_states else None)
            ctx.plan, ctx.scale, ctx.saved = plan, scale, saved
            ctx.has_h0 = initial_state is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, w, k, v, a, b, hs, h0 = ctx.saved_tensors
        saved, ctx.saved = ctx.saved, None
        dr, dw, dk, dv, da, db, dh0 = _backward(ctx.plan, saved, r, w, k, v, a, b, hs, ctx.scale, h0, ctx.has_h0,
                                                do, dht)
        return dr, dw, dk, dv, da, db, None, dh0, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# custom ops: what torch.compile sees
# ------------------------------------------------------------------------------------------------
# A compiled block traces `torch.ops.flame.chunk_rwkv7_fwd` / `_bwd` as two opaque nodes, so Inductor
# fuses the glue on both sides of the attention and the block stays one graph. The forward returns
# every tensor its backward reads: the per-chunk states hs (empty with `recompute_states`) and the
# intermediates of `_prepare`, all of them with `cache`, else the WY inverse Tm alone (the others come
# back empty). Their shapes follow from the input shapes alone for fixed-length calls; varlen calls
# (chunk counts that depend on the offsets' values) keep the autograd.Function above.

_EMPTY = (0,)
# the intermediates of `_prepare` that a cached forward hands to the backward, in the ops' order
_INTERMEDIATES = ("Qs", "Es", "Cs", "As", "regime", "Wm", "Gm", "Mak", "Mqb", "Tm")


def _fixed_length_shapes(r, gate_lower_bound):
    """(chunk size, number of chunks, centred) of a fixed-length call, as _Plan chooses them."""
    B, T = r.shape[:2]
    bt = centred_chunk_size(gate_lower_bound)
    centred = bt is not None
    bt = min(bt, 32) if centred else 16
    return bt, B * triton.cdiv(T, bt), centred


def _intermediate_shapes(r, gate_lower_bound, cache):
    """{name: (shape, dtype)} of the intermediates that the forward op returns (empty ones included)."""
    B, T, H, K = r.shape
    bt, nt, centred = _fixed_length_shapes(r, gate_lower_bound)
    specs = _intermediate_specs(B, T, H, K, bt, nt, centred, _scan_dtype(r.dtype))
    return {name: (shape if shape is not None and (cache or name == "Tm") else _EMPTY, dtype)
            for name, (shape, dtype) in specs.items()}


@torch.library.custom_op("flame::chunk_rwkv7_fwd", mutates_args=())
def _chunk_rwkv7_fwd_op(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, h0: torch.Tensor | None, scale: float, gate_lower_bound: float | None,
                        output_final_state: bool, need_grad: bool, cache: bool,
                        recompute_states: bool) -> list[torch.Tensor]:
    o, ht, _, hs, saved = _forward(r, w, k, v, a, b, scale, h0, output_final_state, None, gate_lower_bound,
                                   need_grad, cache, keep_states=not recompute_states)
    saved = saved or {}
    empty = lambda dtype=torch.float32: r.new_empty(_EMPTY, dtype=dtype)  # noqa: E731
    shapes = _intermediate_shapes(r, gate_lower_bound, cache and need_grad)
    return [o, ht if ht is not None else empty(), hs if hs is not None else empty(),
            *(saved[name] if saved.get(name) is not None else empty(shapes[name][1]) for name in _INTERMEDIATES)]


@_chunk_rwkv7_fwd_op.register_fake
def _(r, w, k, v, a, b, h0, scale, gate_lower_bound, output_final_state, need_grad, cache, recompute_states):
    B, T, H, K = r.shape
    V = v.shape[-1]
    _, nt, _ = _fixed_length_shapes(r, gate_lower_bound)
    shapes = _intermediate_shapes(r, gate_lower_bound, cache)
    f32 = dict(dtype=torch.float32)
    return [torch.empty_like(v, memory_format=torch.contiguous_format),
            r.new_empty((B, H, K, V) if output_final_state else _EMPTY, **f32),
            r.new_empty((nt, H, K, V) if need_grad and not recompute_states else _EMPTY, **f32),
            *(r.new_empty(shape if need_grad else _EMPTY, dtype=dtype) for shape, dtype in
              (shapes[name] for name in _INTERMEDIATES))]


@torch.library.custom_op("flame::chunk_rwkv7_bwd", mutates_args=())
def _chunk_rwkv7_bwd_op(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, hs: torch.Tensor, h0: torch.Tensor | None, intermediates: list[torch.Tensor],
                        do: torch.Tensor, dht: torch.Tensor | None, scale: float, gate_lower_bound: float | None,
                        has_h0: bool, cache: bool, recompute_states: bool) -> list[torch.Tensor]:
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    plan = _Plan(r, v, None, gate_lower_bound)
    named = dict(zip(_INTERMEDIATES, intermediates))
    if cache:
        saved = {name: (x if x.numel() else None) for name, x in named.items()}
    else:
        saved = {"Tm": named["Tm"]}
    grads = _backward(plan, saved, r, w, k, v, a, b, None if recompute_states else hs, scale, h0, has_h0, do, dht)
    dh0 = grads[-1] if grads[-1] is not None else r.new_empty(_EMPTY, dtype=torch.float32)
    return [*grads[:-1], dh0]


@_chunk_rwkv7_bwd_op.register_fake
def _(r, w, k, v, a, b, hs, h0, intermediates, do, dht, scale, gate_lower_bound, has_h0, cache, recompute_states):
    B, _, H, K = r.shape
    V = v.shape[-1]
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (r, w, k, v, a, b)]
    return [*grads, r.new_empty((B, H, K, V) if has_h0 else _EMPTY, dtype=torch.float32)]


def _setup_context(ctx, inputs, output):
    r, w, k, v, a, b, h0, scale, gate_lower_bound, output_final_state, need_grad, cache, recompute_states = inputs
    # the backward's forward scan starts from h0 when the forward did not keep the states
    ctx.save_for_backward(r, w, k, v, a, b, h0 if recompute_states else None, *output[2:])
    ctx.scale, ctx.gate_lower_bound, ctx.cache = scale, gate_lower_bound, cache
    ctx.recompute_states = recompute_states
    ctx.has_h0, ctx.output_final_state = h0 is not None, output_final_state


def _backward_op(ctx, grads):
    do, dht = grads[0], grads[1]
    r, w, k, v, a, b, h0, hs, *intermediates = ctx.saved_tensors
    dr, dw, dk, dv, da, db, dh0 = torch.ops.flame.chunk_rwkv7_bwd(
        r, w, k, v, a, b, hs, h0, intermediates, do, dht if ctx.output_final_state else None, ctx.scale,
        ctx.gate_lower_bound, ctx.has_h0, ctx.cache, ctx.recompute_states)
    return dr, dw, dk, dv, da, db, (dh0 if ctx.has_h0 else None), None, None, None, None, None, None


_chunk_rwkv7_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


def chunk_rwkv7_triton(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                       gate_lower_bound=None, cache_intermediates=False, recompute_states=False):
    """Chunked RWKV7 with Triton, forward and backward. Inputs are already validated.

    gate_lower_bound: a claim that w >= bound everywhere. It selects the centred tensor-core regime
    only if it passes the fp32 headroom rule, and each chunk re-checks it on its own gates before
    using it. cache_intermediates (default off): keep the forward's per-chunk intermediates for the
    backward instead of running `_prepare` again: per token and head 2 K + C bf16 (Q', C, E) and
    K + 4 C fp32 (W, G, Tm, M^ak, M^qb), plus K*K fp32 (A) per chunk and head, held from the forward to
    the backward. Off: the backward recomputes them (`_prepare_kernel` once more) from the WY inverse Tm
    alone, which the forward keeps (C fp32 per token and head; the inverse is the longest chain of the
    recomputation). The cached backward is faster (bench/RESULTS.md, kernels: chunk_rwkv7_cached).
    recompute_states (default off): the forward does not keep the per-chunk states S^in (K*V fp32 per
    chunk and head); the backward runs the forward scan again for them, in the launch of its own scan
    (`_scan_pair_kernel`, so the two scans overlap instead of adding up).
    Returns (o [B,T,H,V] in the input dtype, final state [N,H,K,V] fp32 or None).
    """
    _check_kernel_dtype("chunk_rwkv7", r)
    if r.shape[-1] > MAX_CHUNK_K:
        # the per-chunk tiles of the whole key dimension no longer fit one program (registers, shared
        # memory); the fused recurrent kernels compute the same function exactly, step by step
        from .fused_recurrent_triton import fused_recurrent_rwkv7_triton
        return run_eager(fused_recurrent_rwkv7_triton, r, w, k, v, a, b, scale, initial_state, output_final_state,
                         cu_seqlens)
    if cu_seqlens is None:
        need_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (r, w, k, v, a, b, initial_state))
        o, ht, *_ = torch.ops.flame.chunk_rwkv7_fwd(
            r, w, k, v, a, b, initial_state, float(scale),
            None if gate_lower_bound is None else float(gate_lower_bound), bool(output_final_state), need_grad,
            bool(cache_intermediates), bool(recompute_states))
        return o, (ht if output_final_state else None)
    return run_eager(ChunkRWKV7Function.apply, r, w, k, v, a, b, scale, initial_state, output_final_state,
                     cu_seqlens, gate_lower_bound, cache_intermediates, bool(recompute_states))
