"""LayerNorm and RMSNorm over the last dimension in Triton: one pass over x forward, one pass over
x and dy backward that also sums the weight and bias gradients. In a pre-norm block the normed
tensor s is also the residual stream (s = x, or s = x + residual: the block's residual add, done
in the forward's pass); s's gradient from the stream joins the backward's pass, which writes the
sum of both gradients of s (`_StreamNorm`).

Per row of C channels, with x^ = (x - mean) rstd (RMSNorm: mean = 0), rstd = 1 / sqrt(var + eps)
and var the mean of (x - mean)^2:
    y  = x^ w + b
    dx = rstd (w dy - x^ mean(x^ w dy) - mean(w dy))     (RMSNorm: without the last term)
    dw = sum over rows of dy x^,  db = sum over rows of dy
The backward recomputes mean and rstd from x, which it reads anyway, so the forward saves nothing
but its input. A backward program walks `program_rows` rows in tiles of whole rows and keeps its
dw and db sums in registers; the per-program partial sums are added up afterwards (in a fixed
order: deterministic), by the caller, where torch.compile fuses that sum with what follows. Eager
and compiled PyTorch instead read x and dy a second time in a reduction kernel of their own for dw.
All arithmetic is fp32 (fp64 for fp64 inputs); outputs round once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.dtypes import accumulation_dtype
from ..utils.triton_dtypes import tl_accumulation_dtype

# Launch settings: the fastest of a sweep on an H100 at the 340M and 1B layer sizes (bench/RESULTS.md,
# kernels: "Norms"). A backward program takes about PROGRAM_ELEMENTS elements (32 rows of 1024
# channels, 16 of 2048): fewer rows a program leave too few programs in flight to hide the load
# latency, more leave the partial sums to add up.
TILE_ELEMENTS = 2048      # rows per tile: as many whole rows as fit this many elements (at least one)
PROGRAM_ELEMENTS = 32768  # backward: rows per program, as many as fit this many elements
MAX_PROGRAM_ROWS = 64
FWD_WARPS = 4
BWD_WARPS = 4


@triton.jit
def _normalized(b_x, m_col, C, eps, RMS: tl.constexpr):
    """(x^, rstd) of a [BR, BC] tile of whole rows (columns past C masked to 0 by `m_col`)."""
    if RMS:
        centred = b_x
    else:
        centred = tl.where(m_col[None, :], b_x - (tl.sum(b_x, axis=1) / C)[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / C + eps)
    return centred * rstd[:, None], rstd


@triton.jit
def _norm_fwd_kernel(x, res, s, w, b, y, N_ROWS, C, eps, RMS: tl.constexpr, HAS_RES: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BC)
    m_col = cols < C
    mask = (rows < N_ROWS)[:, None] & m_col[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    b_x = tl.load(x + offs, mask=mask, other=0)
    if HAS_RES:  # the sum rounds to x's dtype, as the unfused add would, before the norm reads it
        b_x = (b_x.to(ACC) + tl.load(res + offs, mask=mask, other=0).to(ACC)).to(s.dtype.element_ty)
        tl.store(s + offs, b_x, mask=mask)
    x_hat, _ = _normalized(b_x.to(ACC), m_col, C, eps, RMS)
    out = x_hat
    if HAS_W:
        out = out * tl.load(w + cols, mask=m_col, other=0).to(ACC)[None, :]
    if HAS_B:
        out = out + tl.load(b + cols, mask=m_col, other=0).to(ACC)[None, :]
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(x, w, dy, ds, dx, dw_part, db_part, N_ROWS, C, eps, RMS: tl.constexpr, HAS_DS: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, ROWS: tl.constexpr):
    i_p = tl.program_id(0)
    cols = tl.arange(0, BC)
    m_col = cols < C
    if HAS_W:
        b_w = tl.load(w + cols, mask=m_col, other=0).to(ACC)
    acc_w = tl.zeros([BR, BC], dtype=ACC)
    acc_b = tl.zeros([BR, BC], dtype=ACC)
    for i in range(0, ROWS, BR):
        rows = i_p * ROWS + i + tl.arange(0, BR)
        mask = (rows < N_ROWS)[:, None] & m_col[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x_hat, rstd = _normalized(tl.load(x + offs, mask=mask, other=0).to(ACC), m_col, C, eps, RMS)
        b_dy = tl.load(dy + offs, mask=mask, other=0).to(ACC)
        wdy = b_dy * b_w[None, :] if HAS_W else b_dy
        grad = wdy - x_hat * (tl.sum(x_hat * wdy, axis=1) / C)[:, None]
        if not RMS:
            grad = grad - (tl.sum(wdy, axis=1) / C)[:, None]
        grad = grad * rstd[:, None]
        if HAS_DS:
            grad = grad + tl.load(ds + offs, mask=mask, other=0).to(ACC)
        tl.store(dx + offs, grad.to(dx.dtype.element_ty), mask=mask)
        acc_w += b_dy * x_hat
        acc_b += b_dy
    if HAS_W:
        tl.store(dw_part + i_p * C + cols, tl.sum(acc_w, axis=0), mask=m_col)
    if HAS_B:
        tl.store(db_part + i_p * C + cols, tl.sum(acc_b, axis=0), mask=m_col)


def tile_rows(C: int) -> int:
    """Rows in a tile of whole rows of C channels."""
    return max(1, TILE_ELEMENTS // triton.next_power_of_2(C))


def program_rows(C: int) -> int:
    """Rows of one backward program: whole tiles of about PROGRAM_ELEMENTS elements, at most
    MAX_PROGRAM_ROWS rows, at least one tile (powers of two, so a multiple of the tile's rows)."""
    return max(tile_rows(C), min(MAX_PROGRAM_ROWS, PROGRAM_ELEMENTS // triton.next_power_of_2(C)))


def backward_programs(n_rows: int, C: int) -> int:
    """Backward programs over `n_rows` rows: each sums its rows' dw and db into one partial row."""
    return triton.cdiv(n_rows, program_rows(C))


def norm_forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, eps: float, rms: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(s, y): s = x + residual and y its norm, both in x's dtype; without a residual, (None, the
    norm of x). x and residual [..., C] contiguous."""
    C = x.shape[-1]
    n_rows = x.numel() // C
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else None
    BR = tile_rows(C)
    _norm_fwd_kernel[(triton.cdiv(n_rows, BR),)](
        x, residual if residual is not None else x, s if s is not None else x,
        weight if weight is not None else x, bias if bias is not None else x, y, n_rows, C, eps,
        RMS=rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
        ACC=tl_accumulation_dtype(x.dtype), BR=BR, BC=triton.next_power_of_2(C), num_warps=FWD_WARPS,
    )
    return s, y


def norm_backward(x: torch.Tensor, weight: torch.Tensor | None, dy: torch.Tensor, ds: torch.Tensor | None,
                  eps: float, rms: bool, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw's and db's per-program partial sums [programs, C] in the accumulation
    dtype; an empty tensor for an absent weight or bias) of y = norm(x), plus `ds` in dx when given
    (the gradient that reaches x, the sum x + residual of the forward, by the residual stream); x,
    dy and ds [..., C] contiguous."""
    C = x.shape[-1]
    n_rows = x.numel() // C
    n_prog = backward_programs(n_rows, C)
    acc = accumulation_dtype(x.dtype)
    dx = torch.empty_like(x)
    dw_part = torch.empty(n_prog, C, dtype=acc, device=x.device) if weight is not None else x.new_empty(0, dtype=acc)
    db_part = torch.empty(n_prog, C, dtype=acc, device=x.device) if has_bias else x.new_empty(0, dtype=acc)
    BR = tile_rows(C)
    _norm_bwd_kernel[(n_prog,)](
        x, weight if weight is not None else x, dy, ds if ds is not None else x, dx, dw_part, db_part, n_rows, C, eps,
        RMS=rms, HAS_DS=ds is not None, HAS_W=weight is not None, HAS_B=has_bias,
        ACC=tl_accumulation_dtype(x.dtype), BR=BR, BC=triton.next_power_of_2(C), ROWS=program_rows(C),
        num_warps=BWD_WARPS,
    )
    return dx, dw_part, db_part


# custom ops: what torch.compile sees of the kernels (one opaque node each), and the autograd
# Function around them, which Dynamo traces into the block's graph

@torch.library.custom_op("flame::norm_fwd", mutates_args=())
def _norm_fwd_op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                 rms: bool) -> torch.Tensor:
    return norm_forward(x, None, weight, bias, eps, rms)[1]


@_norm_fwd_op.register_fake
def _(x, weight, bias, eps, rms):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("flame::add_norm_fwd", mutates_args=())
def _add_norm_fwd_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_forward(x, residual, weight, bias, eps, rms)


@_add_norm_fwd_op.register_fake
def _(x, residual, weight, bias, eps, rms):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.custom_op("flame::norm_bwd", mutates_args=())
def _norm_bwd_op(x: torch.Tensor, weight: torch.Tensor | None, dy: torch.Tensor, ds: torch.Tensor | None,
                 eps: float, rms: bool, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_backward(x, weight, dy, ds, eps, rms, has_bias)


@_norm_bwd_op.register_fake
def _(x, weight, dy, ds, eps, rms, has_bias):
    C = x.shape[-1]
    acc = accumulation_dtype(x.dtype)
    partial = (backward_programs(x.numel() // C, C), C)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(partial if weight is not None else (0,), dtype=acc),
            x.new_empty(partial if has_bias else (0,), dtype=acc))


class _StreamNorm(torch.autograd.Function):
    """(s, norm(s)) with s = x + residual, or s = x itself (a view) without a residual. The
    block takes s as its residual stream: s's gradient from there arrives here as `ds` and joins
    the norm's backward pass, and x (and the residual) take the sum. So the backward adds the
    stream's two gradients in the norm's pass, not in a kernel of its own."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        if residual is None:
            s, y = x.view_as(x), torch.ops.flame.norm_fwd(x, weight, bias, eps, rms)
        else:
            s, y = torch.ops.flame.add_norm_fwd(x, residual, weight, bias, eps, rms)
        ctx.save_for_backward(x if residual is None else s, weight)
        ctx.eps, ctx.rms, ctx.has_residual = eps, rms, residual is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight = ctx.saved_tensors
        dy = dy.contiguous() if dy is not None else torch.zeros_like(s)
        ds = ds.contiguous() if ds is not None else None
        has_bias = ctx.bias_dtype is not None
        dx, dw_part, db_part = torch.ops.flame.norm_bwd(s, weight, dy, ds, ctx.eps, ctx.rms, has_bias)
        dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
        db = db_part.sum(0).to(ctx.bias_dtype) if has_bias else None
        return dx, (dx if ctx.has_residual else None), dw, db, None, None


def norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s)), s = x + residual or x, through the Triton kernels (`_StreamNorm`); inputs
    validated by flame.ops.norm.norm."""
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    return _StreamNorm.apply(x.contiguous(), residual.contiguous() if residual is not None else None,
                             weight, bias, float(eps), rms)
