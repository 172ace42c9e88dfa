"""Recurrent decoding state: what a layer carries from one `CausalLM.forward_with_state` call to the next.

A linear-attention layer needs only a fixed-size summary of the tokens it has seen: the last
token's (normed) input of its time mix and of its channel mix, which the next token's token shift
reads, and the matrix state of its attention (fp32 [B, H, K, V]; GSA: the pair hk [B, H, K, M],
hv [B, H, M, V]). RWKV7's v_first is layer 0's value of the same token, recomputed on every call,
so it carries nothing. A fresh `LayerState()` (every field None) stands for the empty prefix:
zeros for the token shift and for the attention state.

The layers replace the fields of the state they are given (never modify its tensors in place), so
`forward_with_state` can hand each call copies and leave the caller's state valid.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class LayerState:
    """One layer's state for a batch of B independent sequences."""

    attn_shift: torch.Tensor | None = None
    """[B, C]: the last token's input to the time mix (after the block's norm)."""
    ffn_shift: torch.Tensor | None = None
    """[B, C]: the last token's input to the channel mix (RWKV only)."""
    recurrent: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
    """The attention's matrix state, fp32 (fp64 in an fp64 model)."""

    def previous_token(self, x: torch.Tensor, field: str) -> torch.Tensor | None:
        """The stored last token [B, C] that precedes x [B, T, C] in the token shift (None: the
        empty prefix, zeros), for `field` "attn_shift" or "ffn_shift"; stores x's last token for the
        next call."""
        last = getattr(self, field)
        setattr(self, field, x[:, -1])
        return last

    def attend(self, chunk_op, step_op, *args, **kwargs) -> torch.Tensor:
        """Run a linear-attention op from the stored state and store its final state: the chunked
        op for T > 1 (a prompt), the fused recurrent op for one token. Returns the output."""
        op = step_op if args[0].shape[1] == 1 else chunk_op
        o, self.recurrent = op(*args, initial_state=self.recurrent, output_final_state=True, **kwargs)
        return o



def concat_states(states: list[list[LayerState]]) -> list[LayerState]:
    """Model states of several batches (each one `LayerState` per layer, every field set) joined
    along the batch dimension, in order: e.g. prompts of different lengths prefilled one by one,
    then decoded together."""

    def cat(parts):
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(p, dim=0) for p in zip(*parts))
        return torch.cat(parts, dim=0)

    fields = [f.name for f in dataclasses.fields(LayerState)]
    return [LayerState(**{name: None if getattr(layer[0], name) is None else cat([getattr(s, name) for s in layer])
                          for name in fields})
            for layer in zip(*states)]
