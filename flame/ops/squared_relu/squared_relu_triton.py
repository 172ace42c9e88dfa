"""squared_relu in Triton: an elementwise forward y = relu(x)^2 and backward dx = 2 sqrt(y) dy, both
in fp32 with one rounding to the output dtype, as the custom ops flame::squared_relu_fwd/_bwd
(the backward saves only y)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _fwd_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b_x = tl.maximum(tl.load(x + offs, mask=mask, other=0).to(tl.float32), 0.0)
    tl.store(y + offs, (b_x * b_x).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(y, dy, dx, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b_y = tl.load(y + offs, mask=mask, other=0).to(tl.float32)
    b_dy = tl.load(dy + offs, mask=mask, other=0).to(tl.float32)
    tl.store(dx + offs, (2.0 * tl.sqrt(b_y) * b_dy).to(dx.dtype.element_ty), mask=mask)


@torch.library.custom_op("flame::squared_relu_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _fwd_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK=BLOCK, num_warps=8)
    return y


@_fwd_op.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("flame::squared_relu_bwd", mutates_args=())
def _bwd_op(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(y)
    _bwd_kernel[(triton.cdiv(y.numel(), BLOCK),)](y, dy, dx, y.numel(), BLOCK=BLOCK, num_warps=8)
    return dx


@_bwd_op.register_fake
def _(y, dy):
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.flame.squared_relu_bwd(y, dy.contiguous())


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def squared_relu_triton(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.flame.squared_relu_fwd(x.contiguous())
