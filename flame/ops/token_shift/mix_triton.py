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

Launch shapes: the forward's tile is memory-bound at every shape tried. The backward's
(`bwd_launch`) are the fastest of thirteen shapes timed on an H100 at the 340M layer size for each
case the models launch: one, two and six static lerps, and five with dynamic terms (bench/RESULTS.md,
kernels: "Token-shift lerps' backward"). A row walk holds [BC] vectors only: no shape spills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _mix_fwd_kernel(x, starts, mu, m, o0, o1, o2, o3, o4, o5, T, C, N_ROWS, stride_m,
                    N: tl.constexpr, N_M: tl.constexpr, HAS_STARTS: tl.constexpr, ACC: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr):
    i_c, i_r = tl.program_id(0), tl.program_id(1)
    rows = i_r * BR + tl.arange(0, BR)
    cols = i_c * BC + tl.arange(0, BC)
    m_col = cols < C
    mask = (rows < N_ROWS)[:, None] & m_col[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    prev = _has_previous(rows, T, N_ROWS, starts, HAS_STARTS)
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
    n_prog = tl.num_programs(1)
    p_mu = dmu_part + i_p * C + cols
    tl.store(p_mu, acc0, mask=m_col)
    if N > 1:
        tl.store(p_mu + n_prog * C, acc1, mask=m_col)
    if N > 2:
        tl.store(p_mu + 2 * n_prog * C, acc2, mask=m_col)
    if N > 3:
        tl.store(p_mu + 3 * n_prog * C, acc3, mask=m_col)
    if N > 4:
        tl.store(p_mu + 4 * n_prog * C, acc4, mask=m_col)
    if N > 5:
        tl.store(p_mu + 5 * n_prog * C, acc5, mask=m_col)


def _padded(tensors: list[torch.Tensor], filler: torch.Tensor) -> list[torch.Tensor]:
    """The branch tensors, padded with `filler` to MAX_BRANCHES kernel arguments."""
    return list(tensors) + [filler] * (MAX_BRANCHES - len(tensors))


def _starts_arg(x: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    return starts if starts is not None else x


def mix_forward(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None, starts: torch.Tensor | None
                ) -> list[torch.Tensor]:
    """The N outputs of token_shift_mix; x [B, T, C] and m [N_M, B, T, C] contiguous, mu [N, C]."""
    B, T, C = x.shape
    N, N_M = mu.shape[0], (m.shape[0] if m is not None else 0)
    outs = [torch.empty_like(x) for _ in range(N)]
    n_rows = B * T
    grid = (triton.cdiv(C, BLOCK_CHANNELS), triton.cdiv(n_rows, BLOCK_ROWS))
    _mix_fwd_kernel[grid](
        x, _starts_arg(x, starts), mu, m if m is not None else x, *_padded(outs, x), T, C, n_rows, n_rows * C,
        N=N, N_M=N_M, HAS_STARTS=starts is not None, ACC=tl_accumulation_dtype(x.dtype), BR=BLOCK_ROWS, BC=BLOCK_CHANNELS,
        num_warps=WARPS,
    )
    return outs


def bwd_launch(n_branches: int, n_dynamic: int) -> tuple[int, int, int]:
    """The backward's (channels, rows, warps) per program for `n_branches` lerps, `n_dynamic` of
    them with dynamic terms."""
    if n_dynamic:
        return BWD_LAUNCH_DYNAMIC
    return BWD_LAUNCH_ONE if n_branches == 1 else BWD_LAUNCH_TWO if n_branches == 2 else BWD_LAUNCH_MANY


def _bwd_programs(n_rows: int, n_branches: int, n_dynamic: int) -> int:
    """Row programs of the backward: each sums its rows' dmu into one partial row."""
    rows = bwd_launch(n_branches, n_dynamic)[1]
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
        x, _starts_arg(x, starts), mu, m if m is not None else x, *_padded(grads, x), dx,
        dm if dm is not None else x, dmu_part, T, C, n_rows, n_rows * C,
        N=N, N_M=N_M, HAS_STARTS=starts is not None, ACC=tl_accumulation_dtype(x.dtype),
        BC=channels, ROWS=rows, num_warps=warps,
    )
    return dx, dmu_part, dm


# custom ops: what torch.compile sees (one opaque node each way, so the block stays one graph)

_EMPTY = (0,)


@torch.library.custom_op("flame::token_shift_mix_fwd", mutates_args=())
def _mix_fwd_op(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None, starts: torch.Tensor | None
                ) -> list[torch.Tensor]:
    return mix_forward(x, mu, m, starts)


@_mix_fwd_op.register_fake
def _(x, mu, m, starts):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(mu.shape[0])]


@torch.library.custom_op("flame::token_shift_mix_bwd", mutates_args=())
def _mix_bwd_op(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None, starts: torch.Tensor | None,
                grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dmu_part, dm = mix_backward(x, mu, m, starts, grads)
    return dx, dmu_part, dm if dm is not None else x.new_empty(_EMPTY)


@_mix_bwd_op.register_fake
def _(x, mu, m, starts, grads):
    acc = accumulation_dtype(x.dtype)
    B, T, C = x.shape
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            mu.new_empty((mu.shape[0], _bwd_programs(B * T, mu.shape[0], m.shape[0] if m is not None else 0), C),
                         dtype=acc),
            torch.empty_like(m, memory_format=torch.contiguous_format) if m is not None else x.new_empty(_EMPTY))


def _setup_context(ctx, inputs, output):
    x, mu, m, starts = inputs
    ctx.save_for_backward(x, mu, m, starts)


def _backward_op(ctx, grads):
    x, mu, m, starts = ctx.saved_tensors
    grads = [g.contiguous() if g is not None else torch.zeros_like(x) for g in grads]
    dx, dmu_part, dm = torch.ops.flame.token_shift_mix_bwd(x, mu, m, starts, grads)
    return dx, dmu_part.sum(1).to(mu.dtype), (dm if m is not None else None), None


_mix_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


def token_shift_mix_triton(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None,
                           starts: torch.Tensor | None) -> list[torch.Tensor]:
    """token_shift_mix through the Triton kernels; inputs validated by flame.ops.token_shift.mix."""
    x = x.contiguous()
    m = m.contiguous() if m is not None else None
    starts = starts.to(torch.int8).contiguous() if starts is not None else None
    return torch.ops.flame.token_shift_mix_fwd(x, mu.contiguous(), m, starts)
