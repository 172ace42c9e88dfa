"""Token shift: the previous token's features, x_{t-1}, with x_0 = 0 at every sequence start.

All three families mix each token with its predecessor (kernels.md section 4). In packed varlen
mode (`cu_seqlens`, batch 1) every document starts afresh: the token right after a boundary sees
zeros, never the last token of the previous document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch_size: int, seq_len: int) -> None:
    """Raise ValueError unless cu_seqlens is a valid set of document offsets for [1, seq_len]."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor of N+1 offsets (N >= 1), got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if batch_size != 1:
        raise ValueError(f"cu_seqlens needs the documents packed into batch size 1, got batch size {batch_size}")
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != seq_len:
        raise ValueError(f"cu_seqlens must start at 0 and end at the sequence length {seq_len}, got {first} .. {last}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")


def token_shift(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, C] -> the previous token's features [B, T, C]: zeros at t = 0 and, with cu_seqlens,
    at every document start."""
    previous = F.pad(x, (0, 0, 1, -1))
    if cu_seqlens is None:
        return previous
    positions = torch.arange(x.shape[1], device=x.device)
    starts = torch.isin(positions, cu_seqlens[:-1].to(device=x.device, dtype=positions.dtype))
    return torch.where(starts[None, :, None], torch.zeros_like(previous), previous)
