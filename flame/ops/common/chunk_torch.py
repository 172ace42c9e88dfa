"""The chunk core of the PyTorch chunked backends: chunk layout and stable decayed intra-chunk products.

Every exp() argument here is <= 0 (docs/kernels.md#stable-exponent-placement-i3): inside a chunk of
C positions cut into sub-chunks of S, pairs in the same sub-chunk get their exact exponent, and
pairs across sub-chunks use the reference-point factorisation of
docs/kernels.md#stable-decay-placement, with the reference at the last position before the query
sub-chunk, so that both factors are <= 1 for any decay. Masked pairs get an exponent of -inf by a
select before exp(), so neither values nor gradients can turn into NaN. decayed_scores has a
hand-written backward that recomputes the factors instead of saving the [S, S, K] pair tensors, and
gets the gate gradients from identity I2 (docs/kernels.md#gate-gradients-by-reverse-cumsum-i2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 32
DEFAULT_SUB_CHUNK = 8


def to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, NC, C, D] in dtype, zero-padding T up to a multiple of C."""
    B, T, H, D = x.shape
    pad = -T % chunk_size
    x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad))
    return x.reshape(B, (T + pad) // chunk_size, chunk_size, H, D).permute(0, 3, 1, 2, 4)


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, NC, C, D] -> [B, T, H, D], dropping the padding."""
    B, H, NC, C, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, NC * C, H, D)[:, :T]


def per_sequence(run, xs: tuple[torch.Tensor, ...], state, cu_seqlens: torch.Tensor | None):
    """run(*xs, state) -> (o, final state) on the whole batch, or with cu_seqlens on each packed
    sequence on its own, so that chunks never cross a boundary.

    xs: [B, T, ...] tensors, cut along T; state: [N, ...] or a tuple of such (GSA's pair), cut along
    N. Returns (o, final state) with the per-sequence results concatenated along T and N.
    """
    if cu_seqlens is None:
        return run(*xs, state)
    offsets = cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(offsets) - 1):
        seq = slice(offsets[n], offsets[n + 1])
        state_n = tuple(h[n:n + 1] for h in state) if isinstance(state, tuple) else state[n:n + 1]
        o_n, final_n = run(*(x[:, seq] for x in xs), state_n)
        outs.append(o_n)
        finals.append(final_n)
    if isinstance(state, tuple):
        return torch.cat(outs, dim=1), tuple(torch.cat(parts, dim=0) for parts in zip(*finals))
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0)


def _split(x: torch.Tensor, sub: int) -> torch.Tensor:
    """[..., C, D] -> [..., C/sub, sub, D]."""
    return x.reshape(*x.shape[:-2], x.shape[-2] // sub, sub, x.shape[-1])


def _references(g: torch.Tensor, sub: int) -> torch.Tensor:
    """Per sub-chunk i, the cumsum at the last position before it ([..., NS, D]); 0 for i = 0."""
    return torch.cat([torch.zeros_like(g[..., :1, :]), g[..., sub - 1: -1: sub, :]], dim=-2)


def _masks(C: int, sub: int, inclusive: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(within-sub-chunk causal mask [S, S], earlier-sub-chunk mask [NS, C])."""
    pos = torch.arange(sub, device=device)
    within = pos[None, :] <= pos[:, None] if inclusive else pos[None, :] < pos[:, None]
    starts = torch.arange(0, C, sub, device=device)
    earlier = torch.arange(C, device=device)[None, :] < starts[:, None]
    return within, earlier


def _score_factors(x, gx, g, inclusive, sub):
    """The decay factors of decayed_scores, every exponent <= 0 (masked ones -inf).

    Returns (E [..., NS, S, S, K] exact pair factors inside a sub-chunk, Q [..., NS, S, K] query
    factors to the sub-chunk reference, R [..., NS, C, K] key factors to each reference)."""
    C = x.shape[-2]
    NS = C // sub
    within, earlier = _masks(C, sub, inclusive, x.device)
    gxs, gs = _split(gx, sub), _split(g, sub)
    E = torch.exp(torch.where(within[:, :, None], gxs[..., :, None, :] - gs[..., None, :, :], float("-inf")))
    ref = _references(g, sub)                                                 # [..., NS, K]
    Q = torch.exp(gxs - ref[..., :, None, :])
    R = torch.exp(torch.where(earlier[:, :, None], ref[..., :, None, :] - g[..., None, :, :], float("-inf")))
    return E, Q, R, NS


class _DecayedScores(torch.autograd.Function):
    """decayed_scores with a hand-written backward: the factors are recomputed (not saved), and
    the gate gradients follow identity I2 (docs/kernels.md#gate-gradients-by-reverse-cumsum-i2):
    dgx = x * dx and dg = -sum_y y * dy."""

    @staticmethod
    def forward(ctx, x, gx, g, inclusive, sub, *ys):
        ctx.save_for_backward(x, gx, g, *ys)
        ctx.inclusive, ctx.sub = inclusive, sub
        C = x.shape[-2]
        E, Q, R, NS = _score_factors(x, gx, g, inclusive, sub)
        xs = _split(x, sub)
        x_pair = xs[..., :, None, :] * E                                      # [..., NS, S, S, K]
        x_ref = xs * Q                                                        # [..., NS, S, K]
        same_block = torch.eye(NS, dtype=torch.bool, device=x.device)[:, None, :, None]
        lead = x.shape[:-2]
        scores = []
        for y in ys:
            diag = (x_pair * _split(y, sub)[..., None, :, :]).sum(-1)         # [..., NS, S, S]
            off = x_ref @ (y[..., None, :, :] * R).transpose(-1, -2)          # [..., NS, S, C]
            off = off.reshape(*lead, NS, sub, NS, sub)
            scores.append(torch.where(same_block, diag[..., :, :, None, :], off).reshape(*lead, C, C))
        return tuple(scores)

    @staticmethod
    def backward(ctx, *dMs):
        x, gx, g, *ys = ctx.saved_tensors
        sub = ctx.sub
        C, K = x.shape[-2:]
        lead = x.shape[:-2]
        E, Q, R, NS = _score_factors(x, gx, g, ctx.inclusive, sub)
        xs = _split(x, sub)
        x_pair = xs[..., :, None, :] * E
        x_ref = xs * Q
        dx_pair = torch.zeros_like(x_pair)
        dx_ref = torch.zeros_like(x_ref)
        dys = []
        dg = torch.zeros_like(g)
        for y, dM in zip(ys, dMs):
            if dM is None:
                dys.append(None)
                continue
            blocks = dM.reshape(*lead, NS, sub, NS, sub)
            dD = torch.diagonal(blocks, dim1=-4, dim2=-2).movedim(-1, -3)    # [..., NS, S(t), S(j)]
            dO = dM.reshape(*lead, NS, sub, C)                                # off-block part; R is 0 elsewhere
            ys_ = _split(y, sub)
            dx_pair = dx_pair + dD[..., None] * ys_[..., None, :, :]
            dy = (dD[..., None] * x_pair).sum(-3).reshape(*lead, C, K)
            y_ref = y[..., None, :, :] * R                                    # [..., NS, C, K]
            dx_ref = dx_ref + dO @ y_ref
            dy = dy + ((dO.transpose(-1, -2) @ x_ref) * R).sum(-3)
            dys.append(dy)
            dg = dg - y * dy
        dx = ((dx_pair * E).sum(-2) + dx_ref * Q).reshape(*lead, C, K)
        return (dx, x * dx, dg, None, None, *dys)


def decayed_scores(x: torch.Tensor, gx: torch.Tensor, g: torch.Tensor, ys: tuple[torch.Tensor, ...],
                   inclusive: bool, sub: int = DEFAULT_SUB_CHUNK) -> list[torch.Tensor]:
    """For each y of ys: M[t, j] = sum_i x[t,i] y[j,i] exp(gx[t,i] - g[j,i]) for j <= t (inclusive)
    or j < t, else 0.

    x, gx, g and every y: [..., C, K], all of one shape; g is the inclusive chunk-local cumsum of
    the log-decay and gx is g (inclusive queries) or the exclusive cumsum (exclusive queries).
    Returns one [..., C, C] per y. Pairs inside a sub-chunk use their exact exponent; pairs across
    sub-chunks use the reference at the last position before the query sub-chunk.
    """
    C = x.shape[-2]
    sub = min(sub, C)
    if C % sub:
        raise ValueError(f"chunk size {C} must be a multiple of the sub-chunk size {sub}")
    return list(_DecayedScores.apply(x, gx, g, inclusive, sub, *ys))


def decayed_mix(A: torch.Tensor, y: torch.Tensor, g: torch.Tensor, sub: int = DEFAULT_SUB_CHUNK) -> torch.Tensor:
    """out[t, m] = sum_{j <= t} A[t, j] y[j, m] exp(g[t, m] - g[j, m]): a value-side gated product.

    A: [..., C, C], finite (entries above the diagonal are ignored); y, g: [..., C, M], g the inclusive
    chunk-local cumsum. Returns [..., C, M]. This is GSA's key pass (docs/kernels.md#gsa-chunked-forward).
    """
    C = A.shape[-1]
    sub = min(sub, C)
    if C % sub:
        raise ValueError(f"chunk size {C} must be a multiple of the sub-chunk size {sub}")
    NS = C // sub
    within, earlier = _masks(C, sub, True, A.device)
    ys, gs = _split(y, sub), _split(g, sub)

    blocks = A.reshape(*A.shape[:-2], NS, sub, NS, sub)
    A_diag = torch.diagonal(blocks, dim1=-4, dim2=-2).movedim(-1, -3)         # [..., NS, S, S]
    A_diag = torch.where(within, A_diag, 0.0)
    expo = torch.where(within[:, :, None], gs[..., :, None, :] - gs[..., None, :, :], float("-inf"))
    diag = (A_diag[..., None] * ys[..., None, :, :] * torch.exp(expo)).sum(-2)  # [..., NS, S, M]

    ref = _references(g, sub)                                                 # [..., NS, M]
    expo_k = torch.where(earlier[:, :, None], ref[..., :, None, :] - g[..., None, :, :], float("-inf"))
    yk = y[..., None, :, :] * torch.exp(expo_k)                               # [..., NS, C, M]
    rows = A.reshape(*A.shape[:-2], NS, sub, C)
    off = (rows @ yk) * torch.exp(gs - ref[..., :, None, :])                  # [..., NS, S, M]
    return (diag + off).reshape(*y.shape)
