"""`mm_prec`, the fp32-operand product of the chunk kernels, at each tl.dot input precision: its error
against the fp64 product sits at that precision's level, on a GPU and under the interpreter, which
emulates bf16x3 (bf16 splits) and TF32 (truncated operands)."""

import pytest
import torch
import triton
import triton.language as tl

from flame.ops.common.chunk_triton.intra import mm_prec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 32


@triton.jit
def _product_kernel(a, b, c, N: tl.constexpr, PREC: tl.constexpr):
    off = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(c + off, mm_prec(tl.load(a + off), tl.load(b + off), PREC))


def product(a, b, precision):
    c = torch.empty_like(a)
    _product_kernel[(1,)](a, b, c, N=N, PREC=precision)
    return c


# the relative error (max |error| / max |exact|) of one [32, 32] x [32, 32] product of normal entries:
# its floor tells a precision from a more exact one (fp32 1.5e-7, bf16x3 6e-6, TF32 8e-4 here)
BOUNDS = {"ieee": (0.0, 1e-6), "tf32x3": (0.0, 1e-6), "bf16x3": (1e-6, 5e-5), "tf32": (1e-4, 5e-3)}


@pytest.mark.parametrize("precision", list(BOUNDS))
def test_product_error_sits_at_its_precision(precision):
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(N, N, generator=gen) for _ in range(2))
    exact = a.double() @ b.double()
    out = product(a.to(DEVICE), b.to(DEVICE), precision).double().cpu()
    error = ((out - exact).abs().max() / exact.abs().max()).item()
    floor, bound = BOUNDS[precision]
    assert floor <= error < bound, f"{precision}: relative error {error:.2e} outside [{floor:.0e}, {bound:.0e})"
