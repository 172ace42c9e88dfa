"""The UT/WY inverse Tm = (I - L)^-1 of a strictly lower-triangular chunk matrix L, in fp32.

No serial forward substitution: block merges on the tensor cores, from 1x1 blocks up. If D is the
inverse of the block-diagonal part of one level (blocks of size s) and L_o the blocks of L just
below D's blocks within each merged block of size 2s, then
    (I - L)^-1 on the merged blocks = D + D L_o D
because (I - L) = (I - L_d)(I - D L_o) and (D L_o)^2 = 0 within one merge level. log2(BT) levels of
two products each, starting from D = I (the 1x1 blocks of I - L are 1), so that the first level is
I + L_o itself, formed by a select (exact, and two products shorter on the serial chain).

Why not the nilpotent product (I + L_d)(I + L_d^2)(I + L_d^4)(I + L_d^8) on 16x16 blocks
(docs/kernels.md#rwkv7-chunked-form, fewer products): with the trained RWKV7-340M head's aligned
kappa, |M^ab| reaches 0.82 and the powers grow binomially (|L_d^8| up to 6e2) while the inverse
stays <= 1, so their sum cancels: 1.5e-5 relative error in 3xTF32 and 25% with one-pass TF32
products. Every factor of the merges is an inverse block or a block of L (both <= 1 there): 1e-7 in
3xTF32, 8e-4 in TF32, 7e-7 after the Newton step of `unit_lower_inverse`
(tests/ops/test_rwkv7_triton.py).

Every product is a tensor-core tl.dot on the whole [BT, BT] tile with block masks (selects), so
BT in {16, 32, 64}. `unit_lower_inverse` is the @triton.jit helper the chunk kernels call;
`unit_lower_inverse_triton` runs it on a batch of matrices (used by the accuracy tests).
"""

import torch
import triton
import triton.language as tl

from ..common.chunk_triton.intra import mm_prec, mm_tf32_if


@triton.jit
def _block_doubling_inverse(L, BT: tl.constexpr, TF32: tl.constexpr, PREC: tl.constexpr):
    """(I - L)^-1 by block merges from 1x1 blocks up, every product mm_tf32_if(TF32, PREC)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    # level 0 (1x1 -> 2x2 blocks) needs no product: from D = I, D + D L_o D = I + L_o, taken exactly
    Tm = tl.where(rows == cols, 1.0, tl.where((rows // 2 == cols // 2) & (rows != cols), L, 0.0))
    for lvl in tl.static_range(1, 7):
        if (1 << lvl) < BT:
            # the blocks of this level below the diagonal of their merged (twice as large) block
            Lo = tl.where((rows // (2 << lvl) == cols // (2 << lvl)) & (rows // (1 << lvl) != cols // (1 << lvl)),
                          L, 0.0)
            Tm = Tm + mm_tf32_if(mm_tf32_if(Tm, Lo, TF32, PREC), Tm, TF32, PREC)
    return Tm


@triton.jit
def unit_lower_inverse(L, BT: tl.constexpr, TF32: tl.constexpr, PREC: tl.constexpr):
    """(I - L)^-1 for a strictly lower-triangular fp32 [BT, BT] tile L (BT in 16, 32, 64).

    TF32 0: every product `mm_prec` at PREC. TF32 1 (2: emulated under the interpreter): the merges in
    one TF32 pass, then one Newton step T1 = T0 + T0 R with the residual R = I - (I - L) T0 from one
    PREC product: R is of the size of T0's TF32 error, so its one-pass product T0 R adds only that
    error squared. At BT = 32: 12 passes of [BT, BT] products instead of 24. On the trained head's
    aligned chunks the result is within 7e-7 of fp64 with a 3xTF32 residual and 1.1e-5 with the bf16x3
    one that 16-bit inputs use (tests/ops/test_rwkv7_triton.py); a 3xTF32 residual is slower and leaves
    the trained head's outputs and gradients unchanged."""
    if TF32 == 0:
        return _block_doubling_inverse(L, BT, 0, PREC)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    T0 = _block_doubling_inverse(L, BT, TF32, PREC)
    R = tl.where(rows == cols, 1.0, 0.0) - T0 + mm_prec(L, T0, PREC)
    return T0 + mm_tf32_if(T0, R, TF32, PREC)


@triton.jit
def _unit_lower_inverse_kernel(L, Tm, BT: tl.constexpr, TF32: tl.constexpr, PREC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BT)[:, None] * BT + tl.arange(0, BT)[None, :]
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_L = tl.load(L + i * BT * BT + offs)
    b_L = tl.where(rows > cols, b_L, 0.0)
    tl.store(Tm + i * BT * BT + offs, unit_lower_inverse(b_L, BT, TF32, PREC))


def unit_lower_inverse_triton(L: torch.Tensor, precision: str = "tf32x3", tf32: int = 0) -> torch.Tensor:
    """(I - strict_lower(L))^-1 for a batch L [..., BT, BT] (BT in 16, 32, 64), fp32; tf32 as TF32 in
    `unit_lower_inverse` (0: products at `precision`; 1: TF32 and a Newton step; 2: 1 emulated)."""
    BT = L.shape[-1]
    if L.shape[-2] != BT or BT not in (16, 32, 64):
        raise ValueError(f"unit_lower_inverse_triton needs [..., BT, BT] with BT in 16/32/64, got {tuple(L.shape)}")
    Lf = L.reshape(-1, BT, BT).to(torch.float32).contiguous()
    out = torch.empty_like(Lf)
    _unit_lower_inverse_kernel[(Lf.shape[0],)](Lf, out, BT=BT, TF32=tf32, PREC=precision)
    return out.reshape(L.shape)
