"""Packed varlen batches: documents concatenated into batch size 1, delimited by `cu_seqlens`.

Every document starts afresh: the token shift (flame.ops.token_shift) is zero at its first token
and the attention state starts from zero. The offsets are checked once per batch, here.
"""

from __future__ import annotations

import torch


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
