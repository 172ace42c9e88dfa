"""The UT/WY inverse Tm = (I - L)^-1 of a strictly lower-triangular chunk matrix L, in fp32.

No serial forward substitution: on each 16x16 diagonal block L_d is nilpotent (L_d^16 = 0), so
    (I - L_d)^-1 = (I + L_d)(I + L_d^2)(I + L_d^4)(I + L_d^8)        (6 matrix products)
Diagonal blocks are then merged 16 -> 32 -> 64 with the block-inverse rule: if D is the inverse of
the block-diagonal part and L_o the strictly-below-diagonal blocks of one merge level, then
    (I - L)^-1 = D + D L_o D
because (I - L) = (I - L_d)(I - D L_o) and (D L_o)^2 = 0 within one merge level.
Every product is a tensor-core tl.dot on the whole [BT, BT] tile with block masks (selects), so
BT in {16, 32, 64}. `unit_lower_inverse` is the @triton.jit helper the chunk kernels call;
`unit_lower_inverse_triton` runs it on a batch of matrices (used by the accuracy tests).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(L, BT: tl.constexpr, PREC: tl.constexpr):
    """(I - L)^-1 for a strictly lower-triangular fp32 [BT, BT] tile L (BT in 16, 32, 64)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    eye = tl.where(rows == cols, 1.0, 0.0)
    Ld = tl.where((rows // 16) == (cols // 16), L, 0.0)
    Tm = eye + Ld
    Pw = tl.dot(Ld, Ld, input_precision=PREC)  # L^2
    Tm = Tm + tl.dot(Tm, Pw, input_precision=PREC)
    Pw = tl.dot(Pw, Pw, input_precision=PREC)  # L^4
    Tm = Tm + tl.dot(Tm, Pw, input_precision=PREC)
    Pw = tl.dot(Pw, Pw, input_precision=PREC)  # L^8
    Tm = Tm + tl.dot(Tm, Pw, input_precision=PREC)
    if BT > 16:
        Lo = tl.where(((rows // 32) == (cols // 32)) & ((rows // 16) != (cols // 16)), L, 0.0)
        Tm = Tm + tl.dot(tl.dot(Tm, Lo, input_precision=PREC), Tm, input_precision=PREC)
    if BT > 32:
        Lo = tl.where((rows // 32) != (cols // 32), L, 0.0)
        Tm = Tm + tl.dot(tl.dot(Tm, Lo, input_precision=PREC), Tm, input_precision=PREC)
    return Tm


@triton.jit
def _unit_lower_inverse_kernel(L, Tm, BT: tl.constexpr, PREC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BT)[:, None] * BT + tl.arange(0, BT)[None, :]
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_L = tl.load(L + i * BT * BT + offs)
    b_L = tl.where(rows > cols, b_L, 0.0)
    tl.store(Tm + i * BT * BT + offs, unit_lower_inverse(b_L, BT, PREC))


def unit_lower_inverse_triton(L: torch.Tensor, precision: str = "tf32x3") -> torch.Tensor:
    """(I - strict_lower(L))^-1 for a batch L [..., BT, BT] (BT in 16, 32, 64), fp32."""
    BT = L.shape[-1]
    if L.shape[-2] != BT or BT not in (16, 32, 64):
        raise ValueError(f"unit_lower_inverse_triton needs [..., BT, BT] with BT in 16/32/64, got {tuple(L.shape)}")
    Lf = L.reshape(-1, BT, BT).to(torch.float32).contiguous()
    out = torch.empty_like(Lf)
    _unit_lower_inverse_kernel[(Lf.shape[0],)](Lf, out, BT=BT, PREC=precision)
    return out.reshape(L.shape)
