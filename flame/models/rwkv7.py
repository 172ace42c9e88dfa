"""RWKV7 ("Goose"): time mix with the DPLR delta rule, squared-ReLU channel mix
(docs/kernels.md#rwkv7-layer).

Layer equations (x: the normed block input, delta = token_shift(x) - x):
    x_* = x + delta * mu_*                       * in r, w, k, v, a, g (static lerps)
    r = W_r x_r,  k = W_k x_k,  v = W_v x_v
    w = -e^{-1/2} sigmoid(w0 + tanh(x_w W1) W2)  log-decay in (-0.6065, 0]
    v <- v + (v_first - v) sigmoid(v0 + x_v V1 V2)   value residual; layer 0 sets v_first = v
    a = sigmoid(a0 + x_a A1 A2)                  in-context learning rate
    g = sigmoid(x_g G1) G2                       output gate
    kappa = L2normalize(k * k_k) per head;  k <- k * (1 + (a - 1) * k_a)
    o = chunk_rwkv7(r, w, k, v, a=-kappa, b=kappa * a, scale=1)
    o = GroupNorm_H(o) (eps group_norm_eps, officially 64e-5) + (sum_head(r * k * r_k)) v
    out = W_o (o * g)
Channel mix: out = W_v relu(W_k (x + delta * mu_k))^2.
Block: pre-LN, x += attn(ln1 x); x += ffn(ln2 x); layer 0 first applies ln0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flame.models import init
from flame.models.rwkv_common import RWKVBlock, RWKVCausalLM, matrix_param, rwkv_heads, stack_padded, vector_param
from flame.models.precision import GroupNorm, like
from flame.models.state import LayerState
from flame import ops
from flame.ops.decode_matmul import Segment, decode_matmul
from flame.ops.rwkv7.decode_step import rwkv7_decode_step

DECAY_BOUND = math.exp(-0.5)
"""|log-decay| <= e^{-1/2} = 0.6065306597126334: the official clamp of RWKV7's decay."""


class RWKV7Attention(nn.Module):
    """RWKV7 time mix. LoRA matrices are free parameters applied as x @ W (never weight-decayed);
    `w0` is the decay bias (the trainer gives it `decay_lr_multiplier`).

    Decoding one token (`decode`): the six lerps, in the order r, k, v, a, w, g, are the inputs of
    one decode_matmul launch that computes r, k, v and the LoRAs' first matrices."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.layer_id, self.num_layers = layer_id, args.num_layers
        self.defines_v_first = layer_id == 0  # a bool, not the int, in forward: see RWKVBlock
        self.num_heads, self.head_dim = rwkv_heads(args)
        self.backend = args.backend
        self.cache_intermediates = args.cache_intermediates
        self.recompute_states = args.recompute_states
        C = args.hidden_size
        ranks = init.rwkv7_lora_ranks(C)
        rank_w = args.decay_low_rank_dim or ranks["decay"]
        rank_a = args.a_low_rank_dim or ranks["a"]
        rank_v = args.v_low_rank_dim or ranks["v"]
        rank_g = args.gate_low_rank_dim or ranks["gate"]

        self.mu_r, self.mu_w, self.mu_k = vector_param(C), vector_param(C), vector_param(C)
        self.mu_v, self.mu_a, self.mu_g = vector_param(C), vector_param(C), vector_param(C)
        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.w0, self.w1, self.w2 = vector_param(C), matrix_param(C, rank_w), matrix_param(rank_w, C)
        self.a0, self.a1, self.a2 = vector_param(C), matrix_param(C, rank_a), matrix_param(rank_a, C)
        if layer_id > 0:  # layer 0 defines v_first and has no value residual
            self.v0, self.v1, self.v2 = vector_param(C), matrix_param(C, rank_v), matrix_param(rank_v, C)
        self.g1, self.g2 = matrix_param(C, rank_g), matrix_param(rank_g, C)
        self.k_k, self.k_a = vector_param(C), vector_param(C)
        self.r_k = nn.Parameter(torch.empty(self.num_heads, self.head_dim))
        self.ln_x = GroupNorm(self.num_heads, C, eps=args.group_norm_eps)

    @torch.no_grad()
    def init_weights(self) -> None:
        """RWKV-LM's RWKV7 init (docs/initialization.md): the formulas of RWKV_Tmix_x070, then
        generate_init_weight's projections (receptance and value orthogonal with gain 1, key 0.1,
        output 0) and GroupNorm weight ((l+1)/L)^0.7."""
        C = self.w0.numel()
        r0, r1 = init.layer_ratios(self.layer_id, self.num_layers)
        ramp = init.channel_ramps(C, self.head_dim)
        ddd, linear, zigzag = ramp["ddd"], ramp["linear"], ramp["zigzag"]
        init.assign_(self.mu_r, 1 - ddd ** (0.2 * r1))
        init.assign_(self.mu_w, 1 - ddd ** (0.9 * r1))
        init.assign_(self.mu_k, 1 - ddd ** (0.7 * r1))
        init.assign_(self.mu_v, 1 - ddd ** (0.7 * r1))
        init.assign_(self.mu_a, 1 - ddd ** (0.9 * r1))
        init.assign_(self.mu_g, 1 - ddd ** (0.2 * r1))
        # 0.5 because the official decay was once -softplus(-z) - 0.5
        init.assign_(self.w0, -6 + 6 * ramp["ramp"] ** (1 + r0**0.3) + 0.5 + 2.5 * zigzag)
        init.assign_(self.a0, -0.19 + 0.3 * zigzag + 0.4 * linear)
        init.assign_(self.k_k, 0.71 - 0.1 * linear)
        init.constant_(self.k_a, 1.02)
        init.constant_(self.r_k, -0.04)
        lora_pairs = [(self.w1, self.w2), (self.a1, self.a2), (self.g1, self.g2)]
        if self.layer_id > 0:
            init.assign_(self.v0, 0.73 - 0.4 * linear)
            lora_pairs.append((self.v1, self.v2))
        for first, second in lora_pairs:
            init.zeros_(first)
            init.lora_orthogonal_(second, 0.1)
        init.orthogonal_(self.receptance.weight, 1.0)
        init.orthogonal_(self.key.weight, 0.1)
        init.orthogonal_(self.value.weight, 1.0)
        init.zeros_(self.output.weight)
        init.constant_(self.ln_x.weight, ((self.layer_id + 1) / self.num_layers) ** 0.7)
        init.zeros_(self.ln_x.bias)

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None):
        B, T, C = x.shape
        H, N = self.num_heads, self.head_dim
        previous = None if state is None else state.previous_token(x, "attn_shift", cu_seqlens)
        mu = torch.stack([self.mu_r, self.mu_w, self.mu_k, self.mu_v, self.mu_a, self.mu_g])
        xr, xw, xk, xv, xa, xg = ops.token_shift_mix(x, mu, cu_seqlens=cu_seqlens, previous=previous,
                                                     backend=self.backend)

        r = self.receptance(xr)
        w = -DECAY_BOUND * torch.sigmoid(like(self.w0, x) + torch.tanh(xw @ self.w1) @ self.w2)
        k = self.key(xk)
        v = self.value(xv)
        if self.defines_v_first:
            v_first = v
        else:
            if v_first is None:
                raise ValueError(f"RWKV7 layer {self.layer_id} needs v_first from layer 0")
            # v + (v_first - v) * gate rather than torch.lerp, which refuses mixed dtypes under autocast
            v = v + (v_first - v) * torch.sigmoid(like(self.v0, x) + (xv @ self.v1) @ self.v2)
        a = torch.sigmoid(like(self.a0, x) + (xa @ self.a1) @ self.a2)
        g = torch.sigmoid(xg @ self.g1) @ self.g2

        kappa = F.normalize((k * like(self.k_k, k)).view(B, T, H, N), p=2.0, dim=-1).to(k.dtype)
        k = k * (1 + (a - 1) * like(self.k_a, k))
        r, w, k, v, a = (t.view(B, T, H, N) for t in (r, w, k, v, a))
        if state is None:
            o, _ = ops.chunk_rwkv7(
                r, w, k, v, -kappa, kappa * a,
                scale=1.0, cu_seqlens=cu_seqlens, backend=self.backend, gate_lower_bound=-DECAY_BOUND,
                cache_intermediates=self.cache_intermediates, recompute_states=self.recompute_states,
            )
        else:
            o = state.attend(ops.chunk_rwkv7, ops.fused_recurrent_rwkv7, r, w, k, v, -kappa, kappa * a,
                             scale=1.0, backend=self.backend, gate_lower_bound=-DECAY_BOUND, cu_seqlens=cu_seqlens)
        o = self.ln_x(o.reshape(B * T, C)).view(B, T, H, N)
        o = o + (r * k * like(self.r_k, r)).sum(dim=-1, keepdim=True) * v
        return self.output(o.reshape(B, T, C) * g), v_first

    @torch.no_grad()
    def decode_weights(self) -> dict[str, torch.Tensor]:
        """`attn_in`: the receptance, key and value weights and the LoRAs' first matrices
        (transposed, zero-padded to the largest rank R) in the branch order v, a, w, g, the rows of
        one decode_matmul launch [3C + 4R, C]; `lora_out`: the LoRAs' second matrices, transposed
        and zero-padded to R columns [4C, R]; `attn_mu`: the lerp coefficients in the order r, k,
        v, a, w, g. Layer 0 has no value residual: a zero LoRA in the v slot."""
        C = self.w0.numel()
        if self.defines_v_first:
            v1, v2 = self.w1.new_zeros(C, 1), self.w2.new_zeros(1, C)
        else:
            v1, v2 = self.v1, self.v2
        firsts, seconds = [v1, self.a1, self.w1, self.g1], [v2, self.a2, self.w2, self.g2]
        rank = max(m.shape[1] for m in firsts)
        return {
            "attn_mu": torch.stack([self.mu_r, self.mu_k, self.mu_v, self.mu_a, self.mu_w, self.mu_g]),
            "attn_in": torch.cat([self.receptance.weight, self.key.weight, self.value.weight,
                                  stack_padded([m.T for m in firsts], rows=rank).flatten(0, 1)]),
            "lora_out": stack_padded([m.T for m in seconds], cols=rank).flatten(0, 1),
        }

    def decode(self, x: torch.Tensor, norm: dict, state: LayerState, weights: dict, v_first: torch.Tensor):
        """One token: x [B, C] the residual stream, to which the time mix's output is added in
        place; norm: the block norm's decode_matmul prologue arguments. Returns (v_first,): layer 0
        writes v_first [B, C], the others read it. Four launches: the norm, lerps and projections
        (r, k, v and the LoRAs' first matrices with their tanh and sigmoid); the LoRAs' second
        matrices; the attention (rwkv7_decode_step); the output projection with the residual add
        and the token-shift write."""
        C = x.shape[1]
        rank = weights["lora_out"].shape[1]
        segments = (Segment(C, 0), Segment(C, 1), Segment(C, 2), Segment(rank, 2), Segment(rank, 3),
                    Segment(rank, 4, "tanh"), Segment(rank, 5, "sigmoid"))
        h = torch.empty_like(x)
        proj = decode_matmul(x, weights["attn_in"], segments, **norm, previous=state.attn_shift,
                             mu=weights["attn_mu"], h_out=h, backend=self.backend)
        hidden = proj[:, 3 * C:].unflatten(1, (4, rank)).transpose(0, 1)  # [4, B, R]: v, a, w, g
        lora = decode_matmul(hidden, weights["lora_out"], tuple(Segment(C, i) for i in range(4)),
                             backend=self.backend)  # v, a, w LoRA outputs and the gate
        y = rwkv7_decode_step(
            proj[:, :C], proj[:, C:2 * C], proj[:, 2 * C:3 * C], lora[:, 2 * C:3 * C], lora[:, C:2 * C],
            lora[:, :C], lora[:, 3 * C:], v_first,
            w0=self.w0, a0=self.a0, v0=None if self.defines_v_first else self.v0, k_k=self.k_k, k_a=self.k_a,
            r_k=self.r_k, ln_weight=self.ln_x.weight, ln_bias=self.ln_x.bias, ln_eps=self.ln_x.eps,
            state=state.recurrent, decay_bound=DECAY_BOUND, is_first=self.defines_v_first, backend=self.backend,
        )
        decode_matmul(y[None], self.output.weight, residual=x, commit=(h, state.attn_shift), backend=self.backend)
        return (v_first,)

    def state_flops_per_token(self) -> int:
        """FLOPs of the recurrence per token, forward + backward (docs/architecture.md, "FLOPs per
        token and MFU"). Per head (docs/kernels.md, "RWKV7 recurrence"), the forward computes
        p = a^T S (2 K V), S = e^w ⊙ S + b p + k v^T (K V + 2 K V + 2 K V) and o = S^T q (2 K V):
        9 K V. Times 3 for forward + backward, as the matmuls."""
        return 3 * 9 * self.num_heads * self.head_dim * self.head_dim


class RWKV7FeedForward(nn.Module):
    """RWKV7 channel mix: W_v relu(W_k (x + delta * mu_k))^2, width 4x by default."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.layer_id, self.num_layers = layer_id, args.num_layers
        self.backend = args.backend
        C = args.hidden_size
        width = args.ffn_hidden_size or 4 * C
        self.mu_k = vector_param(C)
        self.key = nn.Linear(C, width, bias=False)
        self.value = nn.Linear(width, C, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """RWKV-LM's RWKV_CMix_x070 and generate_init_weight (docs/initialization.md): mu_k =
        1 - (n/C)^{r1^4}; key orthogonal with gain 1 (whatever its shape), value 0."""
        _, r1 = init.layer_ratios(self.layer_id, self.num_layers)
        ddd = init.channel_ramps(self.mu_k.numel(), 1)["ddd"]
        init.assign_(self.mu_k, 1 - ddd ** (r1**4))
        init.orthogonal_(self.key.weight, 1.0)
        init.zeros_(self.value.weight)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None) -> torch.Tensor:
        previous = None if state is None else state.previous_token(x, "ffn_shift", cu_seqlens)
        (xk,) = ops.token_shift_mix(x, self.mu_k[None], cu_seqlens=cu_seqlens, previous=previous,
                                    backend=self.backend)
        return ops.squared_relu_mlp(xk, self.key.weight, self.value.weight, backend=self.backend)

    def decode_weights(self) -> dict[str, torch.Tensor]:
        return {"ffn_mu": self.mu_k.detach()[None]}

    def decode(self, x: torch.Tensor, norm: dict, state: LayerState, weights: dict) -> None:
        """One token: x [B, C] += the channel mix of its norm, in place. Two launches: the norm,
        lerp, key projection and squared ReLU; the value projection with the residual add and the
        token-shift write."""
        h = torch.empty_like(x)
        k = decode_matmul(x, self.key.weight, (Segment(self.key.out_features, 0, "sqrelu"),), **norm,
                          previous=state.ffn_shift, mu=weights["ffn_mu"], h_out=h, backend=self.backend)
        decode_matmul(k[None], self.value.weight, residual=x, commit=(h, state.ffn_shift), backend=self.backend)


class RWKV7Block(RWKVBlock):
    def __init__(self, args, layer_id: int):
        super().__init__(args, layer_id, RWKV7Attention(args, layer_id), RWKV7FeedForward(args, layer_id))

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None):
        if self.is_first:
            x = self.pre_norm(x)
        x, h = self.attn_norm(x, stream=True)
        attn_out, v_first = self.attn(h, v_first, cu_seqlens, state)
        x, h = self.ffn_norm(x, residual=attn_out)
        return x + self.ffn(h, cu_seqlens, state), v_first


class RWKV7ForCausalLM(RWKVCausalLM):
    def _build_layers(self, args) -> list[nn.Module]:
        return [RWKV7Block(args, i) for i in range(args.num_layers)]

    def _run_layers(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        v_first = None
        for layer in self.layers:
            x, v_first = layer(x, v_first, cu_seqlens=cu_seqlens)
        return x

    def _run_layers_with_state(self, x: torch.Tensor, states: list[LayerState],
                               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        v_first = None
        for layer, state in zip(self.layers, states):
            x, v_first = layer(x, v_first, cu_seqlens=cu_seqlens, state=state)
        return x

    def _decode_layers(self, x: torch.Tensor, state: list[LayerState], weights: list[dict]) -> torch.Tensor:
        v_first = torch.empty_like(x)
        for layer, layer_state, layer_weights in zip(self.layers, state, weights):
            x, v_first = layer.decode(x, layer_state, layer_weights, v_first)
        return x
