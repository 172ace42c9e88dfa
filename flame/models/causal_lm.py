"""The causal language-model shell shared by every family: embeddings -> blocks -> norm -> head.

A family subclasses `CausalLM`, builds its blocks and final norm, and says how its embeddings and
head are initialised. Everything else (the forward, the input checks, weight tying, parameter
and FLOP counts, meta-device friendly `init_weights`) lives here once.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from flame.models.init import default_init_skipped
from flame.models.state import LayerState
from flame.ops.utils.dtypes import to_compute_dtype
from flame.ops.linear_cross_entropy import linear_cross_entropy
from flame.models.varlen import check_cu_seqlens


class CausalLM(nn.Module):
    """`model(input_ids [B, T], cu_seqlens=None) -> logits [B, T, vocab]`;
    `model(input_ids, cu_seqlens, labels=labels [B, T], loss_scale=s) -> s * (sum of the token
    cross-entropies over labels != -100)`, a scalar, computed by the fused head
    (`flame.ops.linear_cross_entropy`) without the full logits; for inference,
    `forward_with_state(input_ids, state) -> (logits, state)` continues from a recurrent state.

    Attributes used by the trainer: `embeddings`, `layers` (one block per layer, the unit of
    sharding, checkpointing and compile), `norm`, `lm_head`. `l2wrap` (bool): the loss adds RWKV-LM's
    L2Wrap term to the gradient (`flame.models.l2wrap`, normalised by `loss_scale`); set by the
    family from its arguments, False unless the family uses it.

    Subclasses implement `_build_layers(args)`, `_build_norm(args)` and
    `_init_embeddings_and_head()`; blocks implement `init_weights()` and
    `state_flops_per_token()`. Blocks take `(x, cu_seqlens=..., state=None)`; a family whose
    blocks pass extra values between layers overrides `_run_layers`, `_run_layers_with_state` and
    `_decode_layers`.

    Decoding one token at a time over static buffers (`new_decode_state`, `decode_weights`,
    `decode_step`; flame.inference.decoder captures it in a CUDA graph): blocks implement
    `new_decode_state(batch, device, dtype)`, `decode_weights()` and `decode(x, state, weights)`
    (see `decode_step`).
    """

    def __init__(self, args):
        super().__init__()
        if args.vocab_size <= 0 or args.hidden_size <= 0 or args.num_layers <= 0:
            raise ValueError(
                f"vocab_size, hidden_size and num_layers must be > 0, got {args.vocab_size}, "
                f"{args.hidden_size}, {args.num_layers}"
            )
        self.vocab_size = args.vocab_size
        self.hidden_size = args.hidden_size
        self.num_layers = args.num_layers
        self.tie_word_embeddings = bool(args.tie_word_embeddings)
        self.l2wrap = False
        with default_init_skipped():
            self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
            self.layers = nn.ModuleList(self._build_layers(args))
            self.norm = self._build_norm(args)
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight
        if not self.embeddings.weight.is_meta:
            self.init_weights()

    # -- to be provided by each family ----------------------------------------------------------

    def _build_layers(self, args) -> list[nn.Module]:
        raise NotImplementedError

    def _build_norm(self, args) -> nn.Module:
        raise NotImplementedError

    def _init_embeddings_and_head(self) -> None:
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter with the family's scheme. Deterministic given the RNG
        state, and the same whether the model was built on CPU or on the meta device and
        materialised with `to_empty()`."""
        self._init_embeddings_and_head()
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()

    def _run_layers(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cu_seqlens=cu_seqlens)
        return x

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                labels: torch.Tensor | None = None, loss_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Logits [B, T, vocab]; with `labels` [B, T] (-100 = no label), the scalar fp32 loss
        `loss_scale * CE sum`. The loss is computed here, inside the model's forward, so that a
        wrapper such as FSDP has the head's weight gathered and takes its gradient back."""
        check_input_ids(input_ids)
        if labels is not None and tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
            )
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, input_ids.shape[0], input_ids.shape[1])
        x, = to_compute_dtype(self.embeddings(input_ids))
        x = self.norm(self._run_layers(x, cu_seqlens))
        if labels is None:
            return self.lm_head(x)
        return linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, labels.flatten(),
                                    scale=loss_scale, l2wrap=self.l2wrap)

    def _run_layers_with_state(self, x: torch.Tensor, states: list[LayerState],
                               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        for layer, state in zip(self.layers, states):
            x = layer(x, cu_seqlens=cu_seqlens, state=state)
        return x

    def forward_with_state(self, input_ids: torch.Tensor, state: list[LayerState] | None = None,
                           last_only: bool = False, cu_seqlens: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, list[LayerState]]:
        """`(logits [B, T, vocab], state)`: the B sequences of input_ids continued from `state`
        (one `LayerState` per layer, None for empty prefixes), and the state after them.

        T > 1 (a prompt) runs the chunked kernels from the state; T == 1 (a decoding step) runs
        the fused recurrent ones, O(1) in the length of the prefix. Any split of a text into
        calls gives the logits of one `forward` over it, up to rounding. The given state is left
        as it was. last_only: logits of the last position only ([B, 1, vocab]), which is all a
        prompt's prefill needs.

        cu_seqlens: N prompts of any lengths packed into input_ids [1, T] (offsets [0, ..., T],
        each prompt non-empty), prefilled from empty prefixes (state None) through the chunked
        kernels in one call; the state holds one row per prompt ([N, ...]) and last_only gives
        each prompt's last logits, [N, 1, vocab].
        """
        check_input_ids(input_ids)
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids must hold at least one token per sequence")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, input_ids.shape[0], input_ids.shape[1])
            if state is not None:
                raise ValueError("forward_with_state prefills packed prompts (cu_seqlens) from empty prefixes only; "
                                 "got a state")
            if bool((cu_seqlens[1:] == cu_seqlens[:-1]).any()):
                raise ValueError("every packed prompt must hold at least one token (cu_seqlens repeats an offset)")
        if state is None:
            states = [LayerState() for _ in self.layers]
        elif len(state) != len(self.layers):
            raise ValueError(f"state has {len(state)} layer states for a model of {len(self.layers)} layers")
        else:
            states = [dataclasses.replace(s) for s in state]
        x, = to_compute_dtype(self.embeddings(input_ids))
        x = self._run_layers_with_state(x, states, cu_seqlens)
        if last_only:
            x = x[:, -1:] if cu_seqlens is None else x[0, cu_seqlens[1:] - 1][:, None]
        return self.lm_head(self.norm(x)), states

    # -- decoding over static buffers -----------------------------------------------------------

    def new_decode_state(self, batch_size: int, device: torch.device | None = None,
                         dtype: torch.dtype | None = None) -> list[LayerState]:
        """Zeroed states of `batch_size` empty prefixes with every field allocated (the token-shift
        rows in the compute dtype `dtype`, default the embeddings' dtype; the attention states in
        fp32, fp64 for an fp64 model): the static buffers that `decode_step` updates in place."""
        device = self.embeddings.weight.device if device is None else device
        dtype = self.embeddings.weight.dtype if dtype is None else dtype
        return [layer.new_decode_state(batch_size, device, dtype) for layer in self.layers]

    @torch.no_grad()
    def decode_weights(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, the weights a decoding step reads stacked (projections that run as one
        batched matmul): copies, refreshed by the caller when the parameters change
        (flame.inference.decoder)."""
        return [layer.decode_weights() for layer in self.layers]

    def _decode_layers(self, x: torch.Tensor, state: list[LayerState], weights: list[dict]) -> torch.Tensor:
        for layer, layer_state, layer_weights in zip(self.layers, state, weights):
            x = layer.decode(x, layer_state, layer_weights)
        return x

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, state: list[LayerState], weights: list[dict]) -> torch.Tensor:
        """Logits [B, vocab] of one token per sequence (`tokens` [B]) continuing `state` (from
        `new_decode_state`, loaded with a prefill's state), which is updated in place; `weights`
        from `decode_weights()`.

        Equal to `forward_with_state(tokens[:, None], state)` up to rounding, with a block's work
        fused into a few launches (flame.ops.decode_matmul): the projections that read the same
        token run as one launch that also computes the sub-layer's norm and token-shift lerps
        before them and the activation after them; the last projection of a sub-layer adds its
        output to the residual stream x [B, C] in place (and writes the token shift); one kernel
        runs the whole attention of the token (flame.ops.<family>.decode_step). No host sync and
        no data-dependent Python: a CUDA graph can capture the step.
        """
        x, = to_compute_dtype(self.embeddings(tokens))
        x = self._decode_layers(x, state, weights)
        return self.lm_head(self.norm(x))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters; with exclude_embeddings, minus the input embedding
        (a tied head goes with it)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embeddings.weight.numel()
        return total

    def num_flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), the numerator of MFU and flame's one
        count of them (docs/architecture.md, "FLOPs per token and MFU"):

            6 * (non-embedding parameters, the head counted even when tied to the embedding)
            + sum over layers of the block's state-update FLOPs (`state_flops_per_token`).

        Independent of the sequence length: the recurrent state costs the same at every token.
        Activation-checkpoint recomputation and the chunked kernels' extra work are not counted."""
        matmul_params = self.num_params(exclude_embeddings=True)
        if self.tie_word_embeddings:
            matmul_params += self.lm_head.weight.numel()
        return 6 * matmul_params + sum(layer.state_flops_per_token() for layer in self.layers)


def prologue_args(norm: nn.Module) -> dict:
    """The `flame.ops.decode_matmul` norm-prologue arguments (norm, norm_weight, norm_bias, eps) of a
    LayerNorm or RMSNorm."""
    return {"norm": "rms" if isinstance(norm, nn.RMSNorm) else "layer", "norm_weight": norm.weight,
            "norm_bias": getattr(norm, "bias", None), "eps": norm.eps}


def check_input_ids(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"input_ids must be an integer tensor [batch, seq_len], got {input_ids.dtype} "
            f"of shape {tuple(input_ids.shape)}"
        )
