"""Token shift: the previous token's features, x_{t-1}, with x_0 = 0 at every sequence start.

The RWKV families mix each token with its predecessor (docs/kernels.md#token-shift). In packed varlen
mode (`cu_seqlens`, batch 1) every document starts afresh: the token right after a boundary sees
zeros, never the last token of the previous document. In decoding, `previous` carries the last
token of the preceding call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequence_starts(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len] bool: True at every position where a packed document starts (position 0 included)."""
    positions = torch.arange(seq_len, device=cu_seqlens.device)
    return torch.isin(positions, cu_seqlens[:-1].to(dtype=positions.dtype))


def token_shift(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                previous: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, C] -> the previous token's features [B, T, C]: at t = 0 `previous` [B, C] (zeros
    when None) and, with cu_seqlens, zeros at every other document start."""
    if previous is None:
        shifted = F.pad(x, (0, 0, 1, -1))
    else:
        shifted = torch.cat([previous[:, None].to(x.dtype), x[:, :-1]], dim=1)
    if cu_seqlens is None:
        return shifted
    starts = sequence_starts(cu_seqlens.to(x.device), x.shape[1])
    if previous is not None:
        starts[0] = False
    return torch.where(starts[None, :, None], torch.zeros_like(shifted), shifted)
