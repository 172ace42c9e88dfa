"""Pieces shared by the two RWKV families: head geometry, free-parameter constructors, and the
official embedding/head initialisation."""

from __future__ import annotations

import math

import torch
from torch import nn

from flame.models import init


def rwkv_heads(args) -> tuple[int, int]:
    """(heads, head_dim) of an RWKV layer, checked."""
    if args.head_dim <= 0 or args.hidden_size % args.head_dim:
        raise ValueError(f"hidden_size ({args.hidden_size}) must be a multiple of head_dim ({args.head_dim})")
    return args.hidden_size // args.head_dim, args.head_dim


def vector_param(size: int) -> nn.Parameter:
    """An uninitialised per-channel parameter (set by init_weights)."""
    return nn.Parameter(torch.empty(size))


def matrix_param(rows: int, cols: int) -> nn.Parameter:
    """An uninitialised LoRA matrix, applied as x @ W (set by init_weights)."""
    return nn.Parameter(torch.empty(rows, cols))


def init_rwkv_embeddings_and_head(model) -> None:
    """Official RWKV: embeddings U(+-1e-4); head orthogonal with gain 0.5 sqrt(vocab / C) when
    vocab > C, else 0.5 (skipped when the head is tied to the embeddings)."""
    init.uniform_(model.embeddings.weight, 1e-4)
    if not model.tie_word_embeddings:
        V, C = model.vocab_size, model.hidden_size
        init.orthogonal_(model.lm_head.weight, 0.5 * math.sqrt(V / C) if V > C else 0.5)
