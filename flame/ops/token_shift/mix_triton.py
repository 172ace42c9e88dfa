"""token_shift_mix in Triton: one pass over x forward, one backward, for up to MAX_BRANCHES lerps.

Forward, per [BR rows, BC channels] tile: x and its predecessor row (zero at a sequence start)
give delta = x_{t-1} - x_t once, and every branch i writes x + delta * (mu_i + m_i). Eager or
compiled PyTorch reads x and delta once per branch and, in the backward, stacks the branch
gradients into one tensor before it multiplies them by delta; here each branch's output and
gradient are tensors of their own and nothing is stacked.

Backward, with out_i[t] = x[t] (1 - c_i[t]) + x[t-1] c_i[t] and c_i = mu_i + m_i:
    dx[t]   = sum_i d_i[t] (1 - c_i[t]) + sum_i d_i[t+1] c_i[t+1]   (the second sum only where
              t+1 continues t's sequence)
    dm_i[t] = d_i[t] delta[t]
    dmu_i   = sum_t d_i[t] delta[t]
A program walks ROWS rows of one channel block, one row at a time, with the row before in
registers: row r's x gives delta[r] against the x carried from row r - 1, its sums of d_i and of
d_i c_i give dx[r - 1] (held back one row until then), and d_i delta accumulates per channel in
registers. The program's last row takes the sum of d_i c_i of the row after its rows, loaded on its
own. The per-program dmu sums are added up afterwards (fp32, in a fixed order: deterministic). All
arithmetic is fp32 (fp64 for fp64 inputs); outputs round once.

With the norm (`norm_token_shift_mix`: the lerps of y = layer_norm(s), s = x + residual or x), the
forward's tiles hold whole rows: each tile normalises its rows and the rows above them (the
predecessors' y, recomputed rather than read) and writes s (with a residual) and the lerps; y never
reaches memory. The backward (`_norm_mix_bwd_kernel`) takes [BR, BC] tiles of whole rows with the
tile one row below: dy from the d_i of both, the norm's backward from dy and the stream's gradient
ds, dmu, dw and db per program, all reductions over a tile's rows at once.

Launch shapes: the forward's tile is memory-bound at every shape tried. The backward's
(`bwd_launch`) are the fastest of thirteen shapes timed on an H100 at the 340M layer size for each
case the models launch: one, two and six static lerps, and five with dynamic terms (bench/RESULTS.md,
kernels: "Token-shift lerps' backward"). A row walk holds [BC] vectors only: no shape spills.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..norm.norm_triton import _affine, _input_grad, _normalized, _normed_rows, _weight
from ..utils.dtypes import accumulation_dtype
from ..utils.triton_dtypes import tl_accumulation_dtype

MAX_BRANCHES = 6
BLOCK_CHANNELS, BLOCK_ROWS, WARPS = 128, 32, 4  # forward
# backward (channels, rows, warps) per program, by case (`bwd_launch`)
BWD_LAUNCH_ONE = (1024, 16, 4)      # one static lerp
BWD_LAUNCH_TWO = (256, 32, 2)       # two static lerps
BWD_LAUNCH_MANY = (256, 64, 4)      # three or more static lerps
BWD_LAUNCH_DYNAMIC = (1024, 16, 4)  # lerps with dynamic terms m
BWD_LAUNCHES = (BWD_LAUNCH_ONE, BWD_LAUNCH_TWO, BWD_LAUNCH_MANY, BWD_LAUNCH_DYNAMIC)
# with the norm, whole rows: the forward's and the backward's tiles have about NORM_FWD_ELEMENTS and
# NORM_BWD_TILE_ELEMENTS elements (at least one row); a backward program takes about
# NORM_BWD_ELEMENTS elements, enough rows that the partial sums of dmu, dw and db stay small
NORM_FWD_ELEMENTS, NORM_FWD_WARPS = 4096, 8
NORM_BWD_TILE_ELEMENTS, NORM_BWD_ELEMENTS, NORM_BWD_WARPS = 2048, 65536, 8


@triton.jit
def _has_previous(rows, T, N_ROWS, starts, HAS_STARTS: tl.constexpr):
    """Whether row `rows` (flattened b * T + t) continues a sequence from the row before it."""
    t = rows % T
    keep = (t > 0) & (rows < N_ROWS)
    if HAS_STARTS:
        keep = keep & (tl.load(starts + t, mask=rows < N_ROWS, other=1) == 0)
    return keep


@triton.jit
def _coefficient(mu, m, stride_m, offs, mask, cols, m_col, C, I: tl.constexpr, N: tl.constexpr,
                 N_M: tl.constexpr, ACC: tl.constexpr):
    """c_I = mu_I (+ m_J for the last N_M branches, J = I - (N - N_M)) at `offs`: a [BR, BC] tile or
    one row [BC] (mu_I's [BC] broadcasts over a tile's rows)."""
    coef = tl.load(mu + I * C + cols, mask=m_col, other=0).to(ACC)
    if I >= N - N_M:
        J: tl.constexpr = I - (N - N_M)
        coef = coef + tl.load(m + J * stride_m + offs, mask=mask, other=0).to(ACC)
    return coef


@triton.jit
def _fwd_branch(o, b_x, delta, mu, m, stride_m, offs, mask, cols, m_col, C, I: tl.constexpr, N: tl.constexpr,
                N_M: tl.constexpr, ACC: tl.constexpr):
    coef = _coefficient(mu, m, stride_m, offs, mask, cols, m_col, C, I, N, N_M, ACC)
    tl.store(o + offs, (b_x + delta * coef).to(o.dtype.element_ty), mask=mask)


@triton.jit
def _mix_fwd_kernel(x, res, s, nw, nb, starts, mu, m, o0, o1, o2, o3, o4, o5, T, C, N_ROWS, stride_m, eps,
                    N: tl.constexpr, N_M: tl.constexpr, HAS_STARTS: tl.constexpr, NORM: tl.constexpr,
                    HAS_RES: tl.constexpr, HAS_NW: tl.constexpr, HAS_NB: tl.constexpr, ACC: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr):
    i_c, i_r = tl.program_id(0), tl.program_id(1)
    rows = i_r * BR + tl.arange(0, BR)
    cols = i_c * BC + tl.arange(0, BC)
    m_col = cols < C
    mask = (rows < N_ROWS)[:, None] & m_col[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    prev = _has_previous(rows, T, N_ROWS, starts, HAS_STARTS)
    if NORM:  # whole rows (BC >= C): the lerps' input is norm(x (+ res)), of each row and its predecessor
        b_x = _normed_rows(x, res, s, nw, nb, offs, mask, cols, m_col, C, eps, False, HAS_RES, True, HAS_NW,
                           HAS_NB, ACC)
        b_p = _normed_rows(x, res, s, nw, nb, offs - C, mask & prev[:, None], cols, m_col, C, eps, False, HAS_RES,
                           False, HAS_NW, HAS_NB, ACC)
        b_p = tl.where(prev[:, None], b_p, 0.0)
    else:
        b_x = tl.load(x + offs, mask=mask, other=0).to(ACC)
        b_p = tl.load(x + offs - C, mask=mask & prev[:, None], other=0).to(ACC)
    delta = b_p - b_x
    _fwd_branch(o0, b_x, delta, mu, m, stride_m, offs, mask, cols, m_col, C, 0, N, N_M, ACC)
    if N > 1:
        _fwd_branch(o1, b_x, delta, mu, m, stride_m, offs, mask, cols, m_col, C, 1, N, N_M, ACC)
    if N > 2:
        _fwd_branch(o2, b_x, delta, mu, m, stride_m, offs, mask, cols, m_col, C, 2, N, N_M, ACC)
    if N > 3:
        _fwd_branch(o3, b_x, delta, mu, m, stride_m, offs, mask, cols, m_col, C, 3, N, N_M, ACC)
    if N > 4:
        _fwd_branch(o4, b_x, delta, mu, m, stride_m, offs, mask, cols, m_col, C, 4, N, N_M, ACC)
    if N > 5:
        _fwd_branch(o5, b_x, delta, mu, m, stride_m, offs, mask, cols, m_col, C, 5, N, N_M, ACC)


@triton.jit
def _bwd_branch(d, mu, m, dm, stride_m, offs, mask, cols, m_col, C, delta, acc,
                I: tl.constexpr, N: tl.constexpr, N_M: tl.constexpr, ACC: tl.constexpr):
    """Branch I on one row: stores dm_I; returns (d, d c, acc + d delta)."""
    b_d = tl.load(d + offs, mask=mask, other=0).to(ACC)
    prod = b_d * delta
    if I >= N - N_M:
        tl.store(dm + (I - (N - N_M)) * stride_m + offs, prod.to(dm.dtype.element_ty), mask=mask)
    coef = _coefficient(mu, m, stride_m, offs, mask, cols, m_col, C, I, N, N_M, ACC)
    return b_d, b_d * coef, acc + prod


@triton.jit
def _row_term(d, mu, m, stride_m, offs, mask, cols, m_col, C, I: tl.constexpr, N: tl.constexpr,
              N_M: tl.constexpr, ACC: tl.constexpr):
    """d_I c_I of one row."""
    coef = _coefficient(mu, m, stride_m, offs, mask, cols, m_col, C, I, N, N_M, ACC)
    return tl.load(d + offs, mask=mask, other=0).to(ACC) * coef


@triton.jit
def _store_branch_sums(part, stride, acc0, acc1, acc2, acc3, acc4, acc5, m_col, N: tl.constexpr):
    """Branch i's per-channel sums at part + i * stride, i < N (a program's row of dmu's partials)."""
    tl.store(part, acc0, mask=m_col)
    if N > 1:
        tl.store(part + stride, acc1, mask=m_col)
    if N > 2:
        tl.store(part + 2 * stride, acc2, mask=m_col)
    if N > 3:
        tl.store(part + 3 * stride, acc3, mask=m_col)
    if N > 4:
        tl.store(part + 4 * stride, acc4, mask=m_col)
    if N > 5:
        tl.store(part + 5 * stride, acc5, mask=m_col)


@triton.jit
def _mix_bwd_kernel(x, starts, mu, m, d0, d1, d2, d3, d4, d5, dx, dm, dmu_part, T, C, N_ROWS, stride_m,
                    N: tl.constexpr, N_M: tl.constexpr, HAS_STARTS: tl.constexpr, ACC: tl.constexpr,
                    BC: tl.constexpr, ROWS: tl.constexpr):
    i_c, i_p = tl.program_id(0), tl.program_id(1)
    cols = i_c * BC + tl.arange(0, BC)
    m_col = cols < C
    zero = tl.zeros([BC], dtype=tl.int32)
    acc0 = tl.zeros([BC], dtype=ACC)
    acc1 = tl.zeros([BC], dtype=ACC)
    acc2 = tl.zeros([BC], dtype=ACC)
    acc3 = tl.zeros([BC], dtype=ACC)
    acc4 = tl.zeros([BC], dtype=ACC)
    acc5 = tl.zeros([BC], dtype=ACC)
    r_first = i_p * ROWS
    # the row before the program's rows: its x, and (below) the sums of d - d c that its dx waits for
    x_prev = tl.load(x + (r_first - 1).to(tl.int64) * C + cols,
                     mask=m_col & _has_previous(r_first + zero, T, N_ROWS, starts, HAS_STARTS), other=0).to(ACC)
    pending = tl.zeros([BC], dtype=ACC)
    for i in range(ROWS):
        r = r_first + i
        mask = m_col & (r + zero < N_ROWS)
        offs = r.to(tl.int64) * C + cols
        b_x = tl.load(x + offs, mask=mask, other=0).to(ACC)
        joined = _has_previous(r + zero, T, N_ROWS, starts, HAS_STARTS)  # row r continues row r - 1
        delta = tl.where(joined, x_prev, 0.0) - b_x
        s, g, acc0 = _bwd_branch(d0, mu, m, dm, stride_m, offs, mask, cols, m_col, C, delta, acc0, 0, N, N_M, ACC)
        if N > 1:
            s1, g1, acc1 = _bwd_branch(d1, mu, m, dm, stride_m, offs, mask, cols, m_col, C, delta, acc1, 1, N, N_M, ACC)
            s, g = s + s1, g + g1
        if N > 2:
            s2, g2, acc2 = _bwd_branch(d2, mu, m, dm, stride_m, offs, mask, cols, m_col, C, delta, acc2, 2, N, N_M, ACC)
            s, g = s + s2, g + g2
        if N > 3:
            s3, g3, acc3 = _bwd_branch(d3, mu, m, dm, stride_m, offs, mask, cols, m_col, C, delta, acc3, 3, N, N_M, ACC)
            s, g = s + s3, g + g3
        if N > 4:
            s4, g4, acc4 = _bwd_branch(d4, mu, m, dm, stride_m, offs, mask, cols, m_col, C, delta, acc4, 4, N, N_M, ACC)
            s, g = s + s4, g + g4
        if N > 5:
            s5, g5, acc5 = _bwd_branch(d5, mu, m, dm, stride_m, offs, mask, cols, m_col, C, delta, acc5, 5, N, N_M, ACC)
            s, g = s + s5, g + g5
        # dx of row r - 1, now that row r's sum of d c is known
        tl.store(dx + offs - C, (pending + tl.where(joined, g, 0.0)).to(dx.dtype.element_ty),
                 mask=m_col & (i > 0) & (r - 1 + zero < N_ROWS))
        pending = s - g
        x_prev = b_x
    # the program's last row takes the sum of d c of the row after its rows, loaded on its own
    r_end = r_first + ROWS
    offs = r_end.to(tl.int64) * C + cols
    mask = m_col & _has_previous(r_end + zero, T, N_ROWS, starts, HAS_STARTS)
    g = _row_term(d0, mu, m, stride_m, offs, mask, cols, m_col, C, 0, N, N_M, ACC)
    if N > 1:
        g += _row_term(d1, mu, m, stride_m, offs, mask, cols, m_col, C, 1, N, N_M, ACC)
    if N > 2:
        g += _row_term(d2, mu, m, stride_m, offs, mask, cols, m_col, C, 2, N, N_M, ACC)
    if N > 3:
        g += _row_term(d3, mu, m, stride_m, offs, mask, cols, m_col, C, 3, N, N_M, ACC)
    if N > 4:
        g += _row_term(d4, mu, m, stride_m, offs, mask, cols, m_col, C, 4, N, N_M, ACC)
    if N > 5:
        g += _row_term(d5, mu, m, stride_m, offs, mask, cols, m_col, C, 5, N, N_M, ACC)
    tl.store(dx + offs - C, (pending + g).to(dx.dtype.element_ty), mask=m_col & (r_end - 1 + zero < N_ROWS))
    _store_branch_sums(dmu_part + i_p * C + cols, tl.num_programs(1) * C, acc0, acc1, acc2, acc3, acc4, acc5, m_col, N)


@triton.jit
def _norm_mix_bwd_kernel(x, nw, nb, ds, starts, mu, d0, d1, d2, d3, d4, d5, dx, dmu_part, dnw_part, dnb_part,
                         T, C, N_ROWS, eps, N: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_DS: tl.constexpr,
                         HAS_NW: tl.constexpr, HAS_NB: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr,
                         BC: tl.constexpr, ROWS: tl.constexpr):
    """The backward of norm_token_shift_mix's static lerps, in [BR, BC] tiles of whole rows: with
    y = norm(x) and c_i = mu_i per channel, the gradient of y is
        dy[t] = sum_i d_i[t] (1 - c_i) + sum_i d_i[t+1] c_i   (the second sum where t+1 continues t)
    from the tile's d_i and the tile one row below; the norm's backward takes dy, and the stream's
    gradient ds joins dx. dmu_i = sum_t d_i[t] delta[t] with delta = y[t-1] - y[t] (y of the row
    above recomputed from x), and the norm's dw, db sum over the program's rows."""
    i_p = tl.program_id(0)
    cols = tl.arange(0, BC)
    m_col = cols < C
    b_nw = _weight(nw, cols, m_col, HAS_NW, ACC)
    acc0 = tl.zeros([BC], dtype=ACC)
    acc1 = tl.zeros([BC], dtype=ACC)
    acc2 = tl.zeros([BC], dtype=ACC)
    acc3 = tl.zeros([BC], dtype=ACC)
    acc4 = tl.zeros([BC], dtype=ACC)
    acc5 = tl.zeros([BC], dtype=ACC)
    acc_nw = tl.zeros([BC], dtype=ACC)
    acc_nb = tl.zeros([BC], dtype=ACC)
    for i in range(0, ROWS, BR):
        rows = i_p * ROWS + i + tl.arange(0, BR)
        mask = (rows < N_ROWS)[:, None] & m_col[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x_hat, rstd = _normalized(tl.load(x + offs, mask=mask, other=0).to(ACC), m_col, C, eps, False)
        b_y = _affine(x_hat, nw, nb, cols, m_col, HAS_NW, HAS_NB, ACC)
        prev = _has_previous(rows, T, N_ROWS, starts, HAS_STARTS)[:, None]
        b_p = _normed_rows(x, x, x, nw, nb, offs - C, mask & prev, cols, m_col, C, eps, False, False, False,
                           HAS_NW, HAS_NB, ACC)
        delta = tl.where(prev, b_p, 0.0) - b_y
        after = mask & _has_previous(rows + 1, T, N_ROWS, starts, HAS_STARTS)[:, None]  # row t+1 continues t
        dy, acc0 = _static_branch_grad(d0, mu, offs, mask, after, cols, m_col, C, delta, 0.0, acc0, 0, ACC)
        if N > 1:
            dy, acc1 = _static_branch_grad(d1, mu, offs, mask, after, cols, m_col, C, delta, dy, acc1, 1, ACC)
        if N > 2:
            dy, acc2 = _static_branch_grad(d2, mu, offs, mask, after, cols, m_col, C, delta, dy, acc2, 2, ACC)
        if N > 3:
            dy, acc3 = _static_branch_grad(d3, mu, offs, mask, after, cols, m_col, C, delta, dy, acc3, 3, ACC)
        if N > 4:
            dy, acc4 = _static_branch_grad(d4, mu, offs, mask, after, cols, m_col, C, delta, dy, acc4, 4, ACC)
        if N > 5:
            dy, acc5 = _static_branch_grad(d5, mu, offs, mask, after, cols, m_col, C, delta, dy, acc5, 5, ACC)
        grad = _input_grad(x_hat, rstd, dy, b_nw, C, False)
        if HAS_DS:
            grad = grad + tl.load(ds + offs, mask=mask, other=0).to(ACC)
        tl.store(dx + offs, grad.to(dx.dtype.element_ty), mask=mask)
        acc_nw += tl.sum(dy * x_hat, axis=0)
        acc_nb += tl.sum(dy, axis=0)
    _store_branch_sums(dmu_part + i_p * C + cols, tl.num_programs(0) * C, acc0, acc1, acc2, acc3, acc4, acc5, m_col, N)
    if HAS_NW:
        tl.store(dnw_part + i_p * C + cols, acc_nw, mask=m_col)
    if HAS_NB:
        tl.store(dnb_part + i_p * C + cols, acc_nb, mask=m_col)


@triton.jit
def _static_branch_grad(d, mu, offs, mask, after, cols, m_col, C, delta, dy, acc, I: tl.constexpr, ACC: tl.constexpr):
    """Static branch I of a tile: (dy + d_I (1 - c_I) + d_I[t+1] c_I, acc + column sums of d_I delta)."""
    coef = tl.load(mu + I * C + cols, mask=m_col, other=0).to(ACC)
    b_d = tl.load(d + offs, mask=mask, other=0).to(ACC)
    b_next = tl.load(d + offs + C, mask=after, other=0).to(ACC)
    return dy + b_d * (1.0 - coef) + b_next * coef, acc + tl.sum(b_d * delta, axis=0)


def _padded(tensors: list[torch.Tensor], filler: torch.Tensor) -> list[torch.Tensor]:
    """The branch tensors, padded with `filler` to MAX_BRANCHES kernel arguments."""
    return list(tensors) + [filler] * (MAX_BRANCHES - len(tensors))


def _or(t: torch.Tensor | None, filler: torch.Tensor) -> torch.Tensor:
    """`t`, or `filler` as the kernel argument of an absent tensor (never read)."""
    return t if t is not None else filler


class LerpNorm(NamedTuple):
    """The LayerNorm whose output the lerps read (`mix_forward`'s and `mix_backward`'s `norm`):
    weight and bias [C] or None, and eps."""
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float


def mix_forward(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None, starts: torch.Tensor | None,
                norm: LerpNorm | None = None, residual: torch.Tensor | None = None
                ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(the N outputs of token_shift_mix, s): the lerps of x, or with `norm` those of norm(s), s =
    x + residual (returned, in x's dtype) or x (None returned). x, residual [B, T, C] and m [N_M,
    B, T, C] contiguous, mu [N, C]."""
    B, T, C = x.shape
    N, N_M = mu.shape[0], (m.shape[0] if m is not None else 0)
    outs = [torch.empty_like(x) for _ in range(N)]
    s = torch.empty_like(x) if residual is not None else None
    n_rows = B * T
    if norm is None:
        channels, rows, warps = BLOCK_CHANNELS, BLOCK_ROWS, WARPS
    else:  # whole rows
        channels = triton.next_power_of_2(C)
        rows, warps = max(1, NORM_FWD_ELEMENTS // channels), NORM_FWD_WARPS
    grid = (triton.cdiv(C, channels), triton.cdiv(n_rows, rows))
    weight, bias, eps = norm if norm is not None else (None, None, 1.0)
    _mix_fwd_kernel[grid](
        x, _or(residual, x), _or(s, x), _or(weight, x), _or(bias, x), _or(starts, x), mu, _or(m, x),
        *_padded(outs, x), T, C, n_rows, n_rows * C, eps,
        N=N, N_M=N_M, HAS_STARTS=starts is not None, NORM=norm is not None, HAS_RES=residual is not None,
        HAS_NW=weight is not None, HAS_NB=bias is not None, ACC=tl_accumulation_dtype(x.dtype), BR=rows,
        BC=channels, num_warps=warps,
    )
    return outs, s


def bwd_launch(n_branches: int, n_dynamic: int) -> tuple[int, int, int]:
    """The backward's (channels, rows, warps) per program for `n_branches` lerps, `n_dynamic` of
    them with dynamic terms."""
    if n_dynamic:
        return BWD_LAUNCH_DYNAMIC
    return BWD_LAUNCH_ONE if n_branches == 1 else BWD_LAUNCH_TWO if n_branches == 2 else BWD_LAUNCH_MANY


def norm_bwd_launch(C: int) -> tuple[int, int, int]:
    """The norm's backward's (tile rows, rows, warps) per program at rows of C channels."""
    channels = triton.next_power_of_2(C)
    tile = max(1, NORM_BWD_TILE_ELEMENTS // channels)
    return tile, max(tile, NORM_BWD_ELEMENTS // channels), NORM_BWD_WARPS


def _bwd_programs(n_rows: int, n_branches: int, n_dynamic: int, norm_width: int | None = None) -> int:
    """Row programs of the backward: each sums its rows' dmu (and the norm's dw, db: rows of
    `norm_width` channels) into one partial row."""
    rows = bwd_launch(n_branches, n_dynamic)[1] if norm_width is None else norm_bwd_launch(norm_width)[1]
    return (n_rows + rows - 1) // rows


def mix_backward(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None, starts: torch.Tensor | None,
                 grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype, dmu's per-program partial sums fp32 (fp64 for fp64 x) [N, programs, C], dm
    in m's dtype or None) for the N output gradients `grads` (contiguous, x's shape). dmu is the
    partials' sum over dim 1, left to the caller: under torch.compile Inductor's reduction
    kernel, which it can fuse with what follows, sums them faster than an eager sum."""
    B, T, C = x.shape
    N, N_M = mu.shape[0], (m.shape[0] if m is not None else 0)
    n_rows = B * T
    channels, rows, warps = bwd_launch(N, N_M)
    n_prog = _bwd_programs(n_rows, N, N_M)
    acc = accumulation_dtype(x.dtype)
    dx = torch.empty_like(x)
    dm = torch.empty_like(m) if m is not None else None
    dmu_part = torch.empty(N, n_prog, C, dtype=acc, device=x.device)
    grid = (triton.cdiv(C, channels), n_prog)
    _mix_bwd_kernel[grid](
        x, _or(starts, x), mu, _or(m, x), *_padded(grads, x), dx, _or(dm, x), dmu_part, T, C, n_rows, n_rows * C,
        N=N, N_M=N_M, HAS_STARTS=starts is not None, ACC=tl_accumulation_dtype(x.dtype),
        BC=channels, ROWS=rows, num_warps=warps,
    )
    return dx, dmu_part, dm


def norm_mix_backward(s: torch.Tensor, mu: torch.Tensor, starts: torch.Tensor | None, grads: list[torch.Tensor],
                      norm: LerpNorm, ds: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward of the static lerps of norm(s): (ds_total, dmu's partial sums [N, programs, C],
    the norm's dw and db partial sums [programs, C] or None), with ds_total in s's dtype the whole
    gradient of s, the stream's `ds` included. Partial sums as mix_backward's."""
    B, T, C = s.shape
    N, n_rows = mu.shape[0], B * T
    tile, rows, warps = norm_bwd_launch(C)
    n_prog = _bwd_programs(n_rows, N, 0, C)
    acc = accumulation_dtype(s.dtype)
    dx = torch.empty_like(s)
    dmu_part = torch.empty(N, n_prog, C, dtype=acc, device=s.device)
    dnw_part = torch.empty(n_prog, C, dtype=acc, device=s.device) if norm.weight is not None else None
    dnb_part = torch.empty(n_prog, C, dtype=acc, device=s.device) if norm.bias is not None else None
    _norm_mix_bwd_kernel[(n_prog,)](
        s, _or(norm.weight, s), _or(norm.bias, s), _or(ds, s), _or(starts, s), mu, *_padded(grads, s), dx, dmu_part,
        _or(dnw_part, dmu_part), _or(dnb_part, dmu_part), T, C, n_rows, norm.eps,
        N=N, HAS_STARTS=starts is not None, HAS_DS=ds is not None, HAS_NW=norm.weight is not None,
        HAS_NB=norm.bias is not None, ACC=tl_accumulation_dtype(s.dtype), BR=tile, BC=triton.next_power_of_2(C),
        ROWS=rows, num_warps=warps,
    )
    return dx, dmu_part, dnw_part, dnb_part


# custom ops: what torch.compile sees (one opaque node each way, so the block stays one graph)

_EMPTY = (0,)


def _empty_or(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`t`, or an empty tensor for an absent output of a custom op."""
    return t if t is not None else like.new_empty(_EMPTY)


@torch.library.custom_op("flame::token_shift_mix_fwd", mutates_args=())
def _mix_fwd_op(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None, starts: torch.Tensor | None
                ) -> list[torch.Tensor]:
    return mix_forward(x, mu, m, starts)[0]


@_mix_fwd_op.register_fake
def _(x, mu, m, starts):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(mu.shape[0])]


@torch.library.custom_op("flame::token_shift_mix_bwd", mutates_args=())
def _mix_bwd_op(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None, starts: torch.Tensor | None,
                grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dmu_part, dm = mix_backward(x, mu, m, starts, grads)
    return dx, dmu_part, _empty_or(dm, x)


def _partials(x: torch.Tensor, n_branches: int, n_dynamic: int, norm_width: int | None = None) -> torch.Tensor:
    """A fake [N, programs, C] partial-sum tensor of the backward's dmu."""
    B, T, C = x.shape
    return x.new_empty((n_branches, _bwd_programs(B * T, n_branches, n_dynamic, norm_width), C),
                       dtype=accumulation_dtype(x.dtype))


@_mix_bwd_op.register_fake
def _(x, mu, m, starts, grads):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            _partials(x, mu.shape[0], m.shape[0] if m is not None else 0),
            torch.empty_like(m, memory_format=torch.contiguous_format) if m is not None else x.new_empty(_EMPTY))


def _setup_context(ctx, inputs, output):
    x, mu, m, starts = inputs
    ctx.save_for_backward(x, mu, m, starts)


def _dense(grads, like: torch.Tensor) -> list[torch.Tensor]:
    """The outputs' gradients, contiguous, zeros for an unused output."""
    return [g.contiguous() if g is not None else torch.zeros_like(like) for g in grads]


def _backward_op(ctx, grads):
    x, mu, m, starts = ctx.saved_tensors
    dx, dmu_part, dm = torch.ops.flame.token_shift_mix_bwd(x, mu, m, starts, _dense(grads, x))
    return dx, dmu_part.sum(1).to(mu.dtype), (dm if m is not None else None), None


_mix_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


def token_shift_mix_triton(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None,
                           starts: torch.Tensor | None) -> list[torch.Tensor]:
    """token_shift_mix through the Triton kernels; inputs validated by flame.ops.token_shift.mix."""
    x = x.contiguous()
    m = m.contiguous() if m is not None else None
    return torch.ops.flame.token_shift_mix_fwd(x, mu.contiguous(), m, _starts_int8(starts))


def _starts_int8(starts: torch.Tensor | None) -> torch.Tensor | None:
    return starts.to(torch.int8).contiguous() if starts is not None else None


# the lerps of a LayerNorm's output, the norm computed in the lerps' passes

@torch.library.custom_op("flame::norm_token_shift_mix_fwd", mutates_args=())
def _norm_mix_fwd_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, eps: float, mu: torch.Tensor, starts: torch.Tensor | None
                     ) -> list[torch.Tensor]:
    outs, s = mix_forward(x, mu, None, starts, LerpNorm(weight, bias, eps), residual)
    return outs + ([s] if s is not None else [])


@_norm_mix_fwd_op.register_fake
def _(x, residual, weight, bias, eps, mu, starts):
    return [torch.empty_like(x, memory_format=torch.contiguous_format)
            for _ in range(mu.shape[0] + (residual is not None))]


@torch.library.custom_op("flame::norm_token_shift_mix_bwd", mutates_args=())
def _norm_mix_bwd_op(s: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                     mu: torch.Tensor, starts: torch.Tensor | None, grads: list[torch.Tensor],
                     ds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dmu_part, dw_part, db_part = norm_mix_backward(s, mu, starts, grads, LerpNorm(weight, bias, eps), ds)
    return dx, dmu_part, _empty_or(dw_part, dmu_part), _empty_or(db_part, dmu_part)


@_norm_mix_bwd_op.register_fake
def _(s, weight, bias, eps, mu, starts, grads, ds):
    dmu_part = _partials(s, mu.shape[0], 0, s.shape[-1])
    return (torch.empty_like(s, memory_format=torch.contiguous_format), dmu_part,
            dmu_part[0].clone() if weight is not None else dmu_part.new_empty(_EMPTY),
            dmu_part[0].clone() if bias is not None else dmu_part.new_empty(_EMPTY))


class _NormLerps(torch.autograd.Function):
    """(s, *lerps of norm(s)) with s = x + residual, or s = x itself (a view) without a residual.
    The block carries s on as its residual stream: s's gradient from there arrives as `ds` and
    joins the backward's pass, as in flame.ops.norm's pre-norm forms. Saves s only: the backward
    recomputes the norm's statistics and output from it."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, mu, starts):
        outs = torch.ops.flame.norm_token_shift_mix_fwd(x, residual, weight, bias, eps, mu, starts)
        s, lerps = (x.view_as(x), outs) if residual is None else (outs[-1], outs[:-1])
        ctx.save_for_backward(x if residual is None else s, weight, bias, mu, starts)
        ctx.eps, ctx.has_residual = eps, residual is not None
        return (s, *lerps)

    @staticmethod
    def backward(ctx, ds, *grads):
        s, weight, bias, mu, starts = ctx.saved_tensors
        dx, dmu_part, dw_part, db_part = torch.ops.flame.norm_token_shift_mix_bwd(
            s, weight, bias, ctx.eps, mu, starts, _dense(grads, s), ds.contiguous() if ds is not None else None)
        dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, (dx if ctx.has_residual else None), dw, db, None, dmu_part.sum(1).to(mu.dtype), None


def norm_token_shift_mix_triton(x: torch.Tensor, mu: torch.Tensor, weight: torch.Tensor | None,
                                bias: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
                                starts: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(s, lerps of layer_norm(s)) through the Triton kernels (`_NormLerps`); inputs validated by
    flame.ops.token_shift.mix."""
    out = _NormLerps.apply(x.contiguous(), residual.contiguous() if residual is not None else None,
                           weight.contiguous() if weight is not None else None,
                           bias.contiguous() if bias is not None else None, float(eps), mu.contiguous(),
                           _starts_int8(starts))
    return out[0], list(out[1:])
