"""Triton device helpers of the gated-linear-attention core: matrix products and the intra-chunk matrix.

Conventions shared by every kernel of flame.ops.common.chunk_triton (one (sequence, head, chunk) per program):
- tensors are token-major [B, T, H, D], addressed by the global token index t (over the flattened
  B*T axis): element (t, h, d) lives at (t * H + h) * D + d, computed in int64;
- `gc` is the fp32 chunk-local cumsum of the log-gate times log2(e) (cumsum.py); the exclusive
  sum of row τ is loaded as gc at row τ-1 (0 for the first row of a chunk);
- every exponent passed to exp2 is <= 0, or selected to -inf where it would not be (masks by
  select, never by multiplying).
"""

import triton
import triton.language as tl

from ...utils.backend import triton_interpreter_enabled

INTERPRET = tl.constexpr(triton_interpreter_enabled())


@triton.jit
def mm(a, b, DT: tl.constexpr):
    """a @ b with fp32 accumulation and operands rounded to DT (the input dtype). fp32 operands
    are multiplied in full fp32 (no TF32). Under the interpreter, where tl.dot on 16-bit operands
    is wrong, the operands are rounded to DT and multiplied in fp32: the same numbers as the GPU's
    tensor cores (exact products of 16-bit values, fp32 accumulation)."""
    if DT == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif INTERPRET:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def truncate_to_tf32(x):
    """x with its mantissa cut to TF32's 10 bits (the interpreter's stand-in for TF32 operands)."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def mm_tf32(a, b, DT: tl.constexpr):
    """a @ b for fp32 operands that should not be rounded to 16 bits (e.g. dA, A in the backward;
    docs/kernels.md#rwkv6-chunked-backward): TF32 products (10-bit mantissas, fp32 accumulation)
    for 16-bit inputs (`mm_prec`, which emulates TF32 under the interpreter), full fp32 for fp32 inputs."""
    return mm_prec(a.to(tl.float32), b.to(tl.float32), "ieee" if DT == tl.float32 else "tf32")


@triton.jit
def round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32: the GPU's fp32 -> bf16
    conversion, also under the interpreter (whose bf16 cast truncates)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def mm_prec(a, b, PREC: tl.constexpr):
    """a @ b for fp32 operands, fp32 accumulation, at tl.dot's input_precision PREC ("ieee", "tf32",
    "tf32x3" or "bf16x3"). "bf16x3" (Triton's split of each operand into a bf16 high part and a bf16
    low part, products hi hi + hi lo + lo hi on the bf16 tensor cores: ~16 mantissa bits, fp32 range)
    is emulated under the interpreter, which lacks it, with the same splits and fp32 products; "tf32" by
    truncating the operands, as the tensor cores read them."""
    if PREC == "bf16x3":
        if INTERPRET:
            a_hi = round_to_bf16(a)
            b_hi = round_to_bf16(b)
            lo = tl.dot(round_to_bf16(a - a_hi), b_hi, input_precision="ieee") \
                + tl.dot(a_hi, round_to_bf16(b - b_hi), input_precision="ieee")
            return tl.dot(a_hi, b_hi, input_precision="ieee") + lo
        else:
            return tl.dot(a, b, input_precision="bf16x3")
    elif PREC == "tf32" and INTERPRET:
        return tl.dot(truncate_to_tf32(a), truncate_to_tf32(b), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def mm_tf32_if(a, b, TF32: tl.constexpr, PREC: tl.constexpr):
    """a @ b for fp32 operands, fp32 accumulation: one TF32 pass where TF32 is 1 or 2 (the value the
    plans give under the interpreter; `mm_prec` emulates TF32 there), `mm_prec` with PREC (e.g.
    "tf32x3") where it is 0."""
    return mm_prec(a, b, "tf32" if TF32 != 0 else PREC)


@triton.jit
def load_rows_native(x, t0, rows, m_rows, i_h, cols, m_cols, H, D: tl.constexpr):
    """Rows `rows` (chunk-local) of x [.., H, D] for head i_h, columns `cols`, [len(rows), len(cols)] in
    x's own dtype: a tile held over a long stretch costs half the registers of fp32 in 16 bits, and
    every use promotes it to fp32 exactly."""
    off = ((t0 + rows)[:, None] * H + i_h) * D + cols[None, :]
    return tl.load(x + off, mask=m_rows[:, None] & m_cols[None, :], other=0.0)


@triton.jit
def load_rows(x, t0, rows, m_rows, i_h, cols, m_cols, H, D: tl.constexpr):
    """Rows `rows` (chunk-local) of x [.., H, D] for head i_h, columns `cols`, as fp32 [len(rows), len(cols)]."""
    return load_rows_native(x, t0, rows, m_rows, i_h, cols, m_cols, H, D).to(tl.float32)


@triton.jit
def load_query_gate(gc, t0, rows, m_rows, i_h, cols, m_cols, H, D: tl.constexpr,
                    EXCLUSIVE: tl.constexpr):
    """The query-side decay exponent: Γ̄ (row τ-1, 0 at the chunk start) if EXCLUSIVE, else Γ."""
    if EXCLUSIVE:
        return load_rows(gc, t0, rows - 1, m_rows & (rows >= 1), i_h, cols, m_cols, H, D)
    else:
        return load_rows(gc, t0, rows, m_rows, i_h, cols, m_cols, H, D)


@triton.jit
def load_row(x, t0, row, i_h, cols, m_cols, H, D: tl.constexpr):
    """One row (chunk-local index `row`) of x for head i_h, as an fp32 vector."""
    return tl.load(x + ((t0 + row) * H + i_h) * D + cols, mask=m_cols, other=0.0).to(tl.float32)


@triton.jit
def load_column(x, gc, t0, Tc, j, i_h, cols, m_cols, H, D: tl.constexpr):
    """Row j [NB] of every sub-chunk (chunk-local rows, zero past the chunk's end Tc) of x and of the
    gate cumsum gc, fp32 [NB, len(cols)]: one key column of the diagonal sub-blocks' pair loops."""
    m_j = j < Tc
    return load_rows(x, t0, j, m_j, i_h, cols, m_cols, H, D), load_rows(gc, t0, j, m_j, i_h, cols, m_cols, H, D)


@triton.jit
def sub_chunks(Tc, BT: tl.constexpr, BC: tl.constexpr):
    """The [NB, BC] view of a chunk's rows (NB = BT // BC sub-chunks): the sub-chunks nb [NB], the rows
    within one ic [BC], the chunk-local rows r3 = nb BC + ic [NB, BC] and their mask r3 < Tc."""
    nb = tl.arange(0, BT // BC)
    ic = tl.arange(0, BC)
    r3 = nb[:, None] * BC + ic[None, :]
    return nb, ic, r3, r3 < Tc


@triton.jit
def diagonal_masks(c, ic, m3, m_c, EXCLUSIVE: tl.constexpr):
    """Masks [NB, BC] of the diagonal sub-blocks' pairs with row c of each sub-chunk: (key c before
    query row (s, i), query c after key row (s, i)); m3 [NB, BC]: the valid rows; m_c [NB]: row c of
    sub-chunk s is a valid row."""
    if EXCLUSIVE:
        return (c < ic)[None, :] & m3, (c > ic)[None, :] & m_c[:, None]
    else:
        return (c <= ic)[None, :] & m3, (c >= ic)[None, :] & m_c[:, None]


@triton.jit
def diagonal_pairs(q, k, gc, t0, Tc, i_h, ck, m_k, H, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                   EXCLUSIVE: tl.constexpr):
    """The BC x BC diagonal sub-blocks of the intra-chunk matrix over the key columns ck, exact per pair:
    D [NB, BC, BC] fp32, D[s, i, c] = Σ_{ck} q[τ] k[j] exp(Γq[τ] - Γ[j]) for query row τ = s BC + i and key
    row j = s BC + c, j < τ (j <= τ if not EXCLUSIVE), zero elsewhere. Key column c of every sub-chunk at
    once (NB rows loaded per c), the loads of column c + 1 issued before column c's products, so that
    their latency overlaps them."""
    nb, ic, r3, m3 = sub_chunks(Tc, BT, BC)
    q3 = load_rows3(q, t0, r3, m3, i_h, ck, m_k, H, K)
    gq3 = load_query_gate3(gc, t0, r3, m3, i_h, ck, m_k, H, K, EXCLUSIVE)
    D = tl.zeros([BT // BC, BC, BC], dtype=tl.float32)
    kj_n, gj_n = load_column(k, gc, t0, Tc, nb * BC, i_h, ck, m_k, H, K)
    for c in range(0, BC):
        m_j, _ = diagonal_masks(c, ic, m3, nb * BC + c < Tc, EXCLUSIVE)
        kj, gj = kj_n, gj_n
        kj_n, gj_n = load_column(k, gc, t0, Tc, nb * BC + tl.minimum(c + 1, BC - 1), i_h, ck, m_k, H, K)
        e = tl.where(m_j[:, :, None], gq3 - gj[:, None, :], float("-inf"))
        val = tl.sum(q3 * kj[:, None, :] * tl.exp2(e), axis=2)
        D = tl.where(ic[None, None, :] == c, D + val[:, :, None], D)
    return D


@triton.jit
def intra_chunk_matrix(q, k, gc, u, t0, Tc, i_h, scale,
                       H, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                       EXCLUSIVE: tl.constexpr, HAS_U: tl.constexpr, DT: tl.constexpr):
    """A [BT, BT] fp32 with A[τ, j] = scale Σ_i q[τ,i] k[j,i] exp(Γq[τ,i] - Γ[j,i]) for j < τ
    (j <= τ if not EXCLUSIVE), plus the bonus scale Σ_i q[τ,i] u[i] k[τ,i] on the diagonal if HAS_U.
    Zero above the diagonal and in rows/columns >= Tc.

    Off-diagonal sub-blocks (query sub-chunk s, keys before it) factor the decay around the
    reference n = the row before sub-chunk s (clamped to the last valid row), so both factors
    exp(Γq - Γ_n) and exp(Γ_n - Γ_j) are <= 1 for any decay (docs/kernels.md#stable-decay-placement).
    The BC x BC diagonal sub-blocks use the exact per-pair exponent (`diagonal_pairs`), collected in an
    [NB, BC, BC] tile.
    """
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    m_t = rows < Tc
    blk = rows // BC
    NB: tl.constexpr = BT // BC
    nb = tl.arange(0, NB)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    A_diag = tl.zeros([NB, BC, BC], dtype=tl.float32)
    for i_k in tl.static_range(0, triton.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
        gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
        gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
        for s in tl.static_range(1, NB):
            ref = tl.minimum(s * BC - 1, Tc - 1)
            gn = load_row(gc, t0, ref, i_h, ck, m_k, H, K)
            qs = qq * tl.exp2(tl.where(((blk == s) & m_t)[:, None], gq - gn[None, :], float("-inf")))
            ks = kk * tl.exp2(tl.where(((rows < s * BC) & m_t)[:, None], gn[None, :] - gk, float("-inf")))
            A += mm(qs, tl.trans(ks), DT)
        if HAS_U:
            uu = tl.load(u + i_h * K + ck, mask=m_k, other=0.0).to(tl.float32)
            bonus = tl.sum(qq * uu[None, :] * kk, axis=1)
            A = tl.where(cols[None, :] == rows[:, None], A + bonus[:, None], A)
        A_diag += diagonal_pairs(q, k, gc, t0, Tc, i_h, ck, m_k, H, K, BT, BC, EXCLUSIVE)
    # the diagonal sub-blocks into A: A[s BC + i, s BC + j] += A_diag[s, i, j]
    A4 = tl.reshape(A, [NB, BC, NB, BC])
    same = nb[:, None, None, None] == nb[None, None, :, None]
    A = tl.reshape(tl.where(same, A4 + A_diag[:, :, None, :], A4), [BT, BT])
    return A * scale


@triton.jit
def load_rows3(x, t0, r3, m3, i_h, cols, m_cols, H, D: tl.constexpr):
    """Rows r3 [NB, BC] (chunk-local: sub-chunk s, row i -> s * BC + i) of x for head i_h, columns
    `cols`, as fp32 [NB, BC, len(cols)]: the per-sub-chunk view used by the diagonal sub-blocks."""
    off = ((t0 + r3)[:, :, None] * H + i_h) * D + cols[None, None, :]
    return tl.load(x + off, mask=m3[:, :, None] & m_cols[None, None, :], other=0.0).to(tl.float32)


@triton.jit
def load_query_gate3(gc, t0, r3, m3, i_h, cols, m_cols, H, D: tl.constexpr, EXCLUSIVE: tl.constexpr):
    """`load_query_gate` in the [NB, BC, len(cols)] view."""
    if EXCLUSIVE:
        return load_rows3(gc, t0, r3 - 1, m3 & (r3 >= 1), i_h, cols, m_cols, H, D)
    else:
        return load_rows3(gc, t0, r3, m3, i_h, cols, m_cols, H, D)
