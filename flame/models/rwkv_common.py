"""Pieces shared by the two RWKV families: head geometry, free-parameter constructors, the pre-LN
block around a family's time mix and channel mix (and its one-token decoding path), and the
language-model shell with the official embedding/head initialisation."""

from __future__ import annotations

import math

import torch
from torch import nn

from flame.models import init
from flame.models.causal_lm import CausalLM, prologue_args
from flame.models.precision import LayerNorm
from flame.models.state import LayerState


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


class RWKVBlock(nn.Module):
    """Pre-LN block: x += attn(attn_norm x); x += ffn(ffn_norm x); layer 0 first applies
    `pre_norm` (the official ln0). The family passes its time mix `attn` and channel mix `ffn`
    and writes `forward` (RWKV7 threads v_first through its blocks), where each norm also
    returns the residual stream (`LayerNorm`'s `stream` and `residual`): `ffn_norm` takes the
    first residual add with it, and both sum the stream's gradients in their backward pass.

    `forward` branches on the bool `is_first`, never on `layer_id`: torch.compile treats an int
    attribute of a module as a constant, so a branch on it compiles a graph per layer and, past
    Dynamo's recompile limit (8), leaves the remaining layers eager; a bool gives two graphs."""

    def __init__(self, args, layer_id: int, attn: nn.Module, ffn: nn.Module):
        super().__init__()
        self.layer_id = layer_id
        self.is_first = layer_id == 0
        C, eps = args.hidden_size, args.norm_eps
        if layer_id == 0:
            self.pre_norm = LayerNorm(C, eps=eps, backend=args.backend)
        self.attn_norm = LayerNorm(C, eps=eps, backend=args.backend)
        self.attn = attn
        self.ffn_norm = LayerNorm(C, eps=eps, backend=args.backend)
        self.ffn = ffn

    @torch.no_grad()
    def init_weights(self) -> None:
        if self.layer_id == 0:
            self.pre_norm.reset_parameters()
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attn.init_weights()
        self.ffn.init_weights()

    def state_flops_per_token(self) -> int:
        return self.attn.state_flops_per_token()

    def new_decode_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> LayerState:
        C = self.attn_norm.weight.numel()
        H, N = self.attn.num_heads, self.attn.head_dim
        return LayerState(attn_shift=torch.zeros(batch_size, C, device=device, dtype=dtype),
                          ffn_shift=torch.zeros(batch_size, C, device=device, dtype=dtype),
                          recurrent=torch.zeros(batch_size, H, N, N, device=device,
                                                dtype=torch.promote_types(dtype, torch.float32)))

    def decode_weights(self) -> dict[str, torch.Tensor]:
        return {**self.attn.decode_weights(), **self.ffn.decode_weights()}

    def decode(self, x: torch.Tensor, state: LayerState, weights: dict, *carry):
        """One token of the block over static buffers (CausalLM.decode_step): x [B, C] is the
        residual stream, which each sub-layer's last launch adds to in place; returns x, or with a
        `carry` (what the time mix passes on to the next layer) (x, *carry)."""
        if self.is_first:
            x = self.pre_norm(x)
        carry = self.attn.decode(x, prologue_args(self.attn_norm), state, weights, *carry)
        self.ffn.decode(x, prologue_args(self.ffn_norm), state, weights)
        return (x, *carry) if carry else x


def stack_padded(mats: list[torch.Tensor], rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """Matrices of different shapes stacked into one [n, rows, cols] tensor (zero-padded at the end
    of each dimension), so that their products run as one batched matmul: padded input columns
    meet zero rows and add nothing."""
    rows = max(m.shape[0] for m in mats) if rows is None else rows
    cols = max(m.shape[1] for m in mats) if cols is None else cols
    out = mats[0].new_zeros(len(mats), rows, cols)
    for i, m in enumerate(mats):
        out[i, :m.shape[0], :m.shape[1]] = m
    return out


class RWKVCausalLM(CausalLM):
    """The RWKV language model: LayerNorm final norm; the family builds its blocks. The loss adds
    L2Wrap with `args.l2wrap`, as RWKV-LM's training step does for RWKV6 (x060) and RWKV7 (x070)."""

    def __init__(self, args):
        super().__init__(args)
        self.l2wrap = bool(getattr(args, "l2wrap", False))

    def _build_norm(self, args) -> nn.Module:
        return LayerNorm(args.hidden_size, eps=args.norm_eps, backend=args.backend)

    def _init_embeddings_and_head(self) -> None:
        """Official RWKV: embeddings U(+-1e-4); head orthogonal with gain 0.5 sqrt(vocab / C) when
        vocab > C, else 0.5 (skipped when the head is tied to the embeddings)."""
        init.uniform_(self.embeddings.weight, 1e-4)
        if not self.tie_word_embeddings:
            V, C = self.vocab_size, self.hidden_size
            init.orthogonal_(self.lm_head.weight, 0.5 * math.sqrt(V / C) if V > C else 0.5)
