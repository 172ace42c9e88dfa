"""Triton device helpers of the chunked RWKV7 kernels: the four intra-chunk matrices M^ak, M^ab, M^qk, M^qb
and their backward in both intra regimes (exact per-pair exponents, centred factors), products with
16-bit operands, tile loads and gate cumsums, and the per-chunk regime record that the prepare and
backward kernels share (chunk_triton.py describes the kernels)."""

import triton
import triton.language as tl

from ..common.chunk_triton.intra import mm_prec, round_to_bf16


@triton.jit
def cast_to(x, ptr, LOWP: tl.constexpr):
    """x in the element type of ptr (rounded to nearest also under the interpreter)."""
    if LOWP == 2:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = round_to_bf16(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def dot_lowp(x, y, LOWP: tl.constexpr, PREC: tl.constexpr):
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
def pairwise_a_side(a, k, b, Gi, Ge, BT: tl.constexpr, PREC: tl.constexpr):
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
def pairwise_q_side(q, k, b, Gi, BT: tl.constexpr, PREC: tl.constexpr):
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
def pairwise_cols_bwd(q, a, Gi, Ge, dMqk, dMak, dMqb, dMab, BT: tl.constexpr, BK: tl.constexpr,
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
def centre_factors(Gi, Ge, BT: tl.constexpr):
    """exp2 factors around the middle row m: q side e^{Γ-Γm}, k/b side e^{Γm-Γ}, a side e^{Γ̄-Γm}."""
    rows = tl.arange(0, BT)
    g_m = tl.sum(tl.where((rows == BT // 2)[:, None], Gi, 0.0), 0)[None, :]
    return tl.exp2(Gi - g_m), tl.exp2(g_m - Gi), tl.exp2(Ge - g_m)


@triton.jit
def rows_bwd(dMk, dMb, k, b, p_k, m_rk, Gi, Ge, STRICT: tl.constexpr, CENTRED: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr, PREC: tl.constexpr):
    """Row-side gradient of M^·k and M^·b (gradients dMk, dMb; k, b point at the chunk's first row):
    out_τ = Σ_j (dMk[τ,j] k_j + dMb[τ,j] b_j) e^{Gr_τ - Γ_j}, for dq (inclusive, Gr = Γ) or da (STRICT,
    Gr = Γ̄), from the centred factors or exactly per pair."""
    if CENTRED:
        e_q, e_k, e_a = centre_factors(Gi, Ge, BT)
        out = mm_prec(dMk, load_tile(k, p_k, m_rk) * e_k, PREC) + mm_prec(dMb, load_tile(b, p_k, m_rk) * e_k, PREC)
        if STRICT:
            out = out * e_a
        else:
            out = out * e_q
    else:
        if STRICT:
            Gr = Ge
        else:
            Gr = Gi
        out = _pairwise_rows_bwd(dMk, load_tile(k, p_k, m_rk), dMb, load_tile(b, p_k, m_rk), Gr, Gi, STRICT, BT, BK,
                                 PREC)
    return out


@triton.jit
def centred_a_side(ac, kc, bc, BT: tl.constexpr, PREC: tl.constexpr):
    """M^ak, M^ab from the centred factors (fp32 operands: they feed the inverse)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    Mak = tl.where(rows > cols, mm_prec(ac, tl.trans(kc), PREC), 0.0)
    Mab = tl.where(rows > cols, mm_prec(ac, tl.trans(bc), PREC), 0.0)
    return Mak, Mab


@triton.jit
def centred_q_side(qc, kc, bc, BT: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr):
    """M^qk, M^qb from the centred factors (bf16 operands for bf16 inputs)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    Mqk = dot_lowp(qc, tl.trans(kc), LOWP, PREC)
    Mqb = dot_lowp(qc, tl.trans(bc), LOWP, PREC)
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
def load_tile(x, p, m):
    return tl.load(x + p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def cumsums_of(b_w):
    """Inclusive and exclusive chunk-local cumsums of the loaded gate tile b_w times log2 e, and the
    chunk total [BK]."""
    wl = b_w * 1.4426950408889634
    Gi = tl.cumsum(wl, 0)
    return Gi, Gi - wl, tl.sum(wl, 0)


@triton.jit
def gate_cumsums(w, p_k, m_rk):
    """`cumsums_of` the chunk's gates."""
    return cumsums_of(load_tile(w, p_k, m_rk))


@triton.jit
def gates_keep_bound(b_w, m_rk, lower_bound):
    """Whether this chunk (gate tile b_w) takes the centred regime: where every gate of the chunk keeps
    the promise w >= lower_bound (the chunks that break it take the exact per-pair path at the same chunk
    size). Checked once per chunk, by `_prepare_kernel`, which records the answer in `regime` for the
    backward's kernels."""
    return tl.min(tl.where(m_rk, b_w, 0.0)) >= lower_bound


@triton.jit
def regime_selected(regime, i_c, i_h, H, MODE: tl.constexpr):
    """For the kernels launched once per regime (a program holding both paths spills registers and is
    slower), whether this launch takes chunk i_c of head i_h, by the regime `_prepare_kernel` recorded.
    MODE 0: every chunk (exact regime); 1: the centred chunks; 2: the chunks that broke the bound (exact
    per-pair fallback at the centred chunk size)."""
    if MODE == 0:  # (no regime record then: the other branch must not be compiled)
        return True
    else:
        centred = tl.load(regime + i_c.to(tl.int64) * H + i_h) != 0
        if MODE == 1:
            return centred
        else:
            return centred == 0


@triton.jit
def fallback_heads(regime, i_c, H, HP: tl.constexpr):
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
def chunk_tile(cu_seqlens, chunk_info, i_c, i_h, H, K, BT: tl.constexpr, BK: tl.constexpr):
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

