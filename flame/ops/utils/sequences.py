"""The step-by-step references' walk over a batch: whole, or one packed sequence at a time."""

from __future__ import annotations

from typing import Callable

import torch


def sequence_count(batch: int, cu_seqlens: torch.Tensor | None) -> int:
    """N, the number of sequences: the batch size, or len(cu_seqlens) - 1 for packed sequences."""
    return batch if cu_seqlens is None else cu_seqlens.numel() - 1


def per_sequence(steps: Callable[..., tuple[torch.Tensor, ...]], tokens: tuple[torch.Tensor, ...],
                 states: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor | None, **fixed) -> tuple[torch.Tensor, ...]:
    """`steps(*tokens, *states, **fixed)` -> (o, *final states), over the whole batch when cu_seqlens
    is None; else once per sequence that cu_seqlens packs into a batch of one (its tokens [1, T_n, ...]
    and its row n of each state [N, ...]), the outputs joined: o along the tokens, each state along N."""
    if cu_seqlens is None:
        return steps(*tokens, *states, **fixed)
    offsets = cu_seqlens.tolist()
    pieces = [steps(*(x[:, bos:eos] for x in tokens), *(h[n:n + 1] for h in states), **fixed)
              for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:]))]
    return (torch.cat([piece[0] for piece in pieces], dim=1),
            *(torch.cat([piece[i] for piece in pieces], dim=0) for i in range(1, len(pieces[0]))))
