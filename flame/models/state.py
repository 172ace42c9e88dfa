"""Recurrent decoding state: what a layer carries from one `CausalLM.forward_with_state` call to the next.

A linear-attention layer needs only a fixed-size summary of the tokens it has seen: the last
token's (normed) input of its time mix and of its channel mix, which the next token's token shift
reads, and the matrix state of its attention (fp32 [B, H, K, V]; GSA: the pair hk [B, H, K, M],
hv [B, H, M, V]). RWKV7's v_first is layer 0's value of the same token, recomputed on every call,
so it carries nothing. A fresh `LayerState()` (every field None) stands for the empty prefix:
zeros for the token shift and for the attention state.

The layers replace the fields of the state they are given (never modify its tensors in place), so
`forward_with_state` can hand each call copies and leave the caller's state valid.

`CausalLM.decode_step` is the exception, by design: it runs one token over a state whose tensors
are static buffers (`CausalLM.new_decode_state`, every field allocated) and updates them in place,
so that a CUDA graph captured once replays the step on the same memory (flame.inference.decoder).
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

    def previous_token(self, x: torch.Tensor, field: str, cu_seqlens: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """The stored last token [B, C] that precedes x [B, T, C] in the token shift (None: the
        empty prefix, zeros), for `field` "attn_shift" or "ffn_shift"; stores x's last token for the
        next call. With cu_seqlens (N sequences packed into B == 1, from empty prefixes) it stores
        each sequence's last token, [N, C]."""
        last = getattr(self, field)
        setattr(self, field, x[:, -1] if cu_seqlens is None else x[0, cu_seqlens[1:] - 1])
        return last

    def attend(self, chunk_op, step_op, *args, **kwargs) -> torch.Tensor:
        """Run a linear-attention op from the stored state and store its final state: the chunked
        op for T > 1 (a prompt) and for packed sequences (cu_seqlens), the fused recurrent op for
        one token. Returns the output."""
        op = step_op if args[0].shape[1] == 1 and kwargs.get("cu_seqlens") is None else chunk_op
        o, self.recurrent = op(*args, initial_state=self.recurrent, output_final_state=True, **kwargs)
        return o

    def copy_(self, other: "LayerState") -> None:
        """Copy `other`'s tensors into this state's buffers (every field of both set, same shapes)."""
        for field in ("attn_shift", "ffn_shift"):
            if getattr(self, field) is not None:
                getattr(self, field).copy_(getattr(other, field))
        if isinstance(self.recurrent, tuple):
            for mine, theirs in zip(self.recurrent, other.recurrent):
                mine.copy_(theirs)
        else:
            self.recurrent.copy_(other.recurrent)

