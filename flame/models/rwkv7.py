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
from flame.ops.rwkv7.decode_step import rwkv7_decode_step

DECAY_BOUND = math.exp(-0.5)
"""|log-decay| <= e^{-1/2} = 0.6065306597126334: the official clamp of RWKV7's decay."""


class RWKV7Attention(nn.Module):
    """RWKV7 time mix. LoRA matrices are free parameters applied as x @ W (never weight-decayed);
    `w0` is the decay bias (the trainer gives it `decay_lr_multiplier`).

    Decoding one token (`decode`): the six lerps come out of the block's norm_mix in the order
    r, k, v, a, w, g, so that r, k, v feed one batched matmul and v, a, w, g the LoRAs' first
    matrices, stacked, with one more batched matmul for their second matrices."""

    DECODE_KEEPS_DELTA = False

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
        """The LoRAs stacked in the branch order v, a, w, g, so that the two nonlinear branches
        share one tanh: sigmoid(z) = 1/2 + tanh(z/2) / 2, so the gate's LoRA runs as
        tanh(x (g1/2)) (g2/2) plus the bias colsum(g2)/2 (`gate_bias`)."""
        if self.defines_v_first:  # no value residual: a zero LoRA in the v slot
            v1, v2 = self.w1.new_zeros(self.w1.shape[0], 1), self.w2.new_zeros(1, self.w2.shape[1])
        else:
            v1, v2 = self.v1, self.v2
        return {
            "attn_mu": torch.stack([self.mu_r, self.mu_k, self.mu_v, self.mu_a, self.mu_w, self.mu_g]),
            "rkv": torch.stack([self.receptance.weight, self.key.weight, self.value.weight]),
            "lora_in": stack_padded([v1, self.a1, self.w1, self.g1 / 2]),   # [4, C, rank]
            "lora_out": stack_padded([v2, self.a2, self.w2, self.g2 / 2]),  # [4, rank, C]
            "gate_bias": self.g2.float().sum(0) / 2,
        }

    def decode(self, lerps: torch.Tensor, state: LayerState, weights: dict, v_first: torch.Tensor):
        """One token: lerps [6, B, C] (r, k, v, a, w, g) -> (the output projection's output [B, C],
        v_first). Layer 0 writes v_first [B, C]; the others read it. Three batched matmuls: r, k, v;
        the LoRAs' first matrices; their second matrices."""
        rkv = torch.bmm(lerps[0:3], weights["rkv"].transpose(1, 2))
        hidden = torch.bmm(lerps[2:6], weights["lora_in"])
        hidden[2:4].tanh_()
        lora = torch.bmm(hidden, weights["lora_out"])  # the v, a, w LoRA outputs and the gate without its bias
        y = rwkv7_decode_step(
            rkv[0], rkv[1], rkv[2], lora[2], lora[1], lora[0], lora[3], v_first,
            w0=self.w0, a0=self.a0, v0=None if self.defines_v_first else self.v0, k_k=self.k_k, k_a=self.k_a,
            r_k=self.r_k, ln_weight=self.ln_x.weight, ln_bias=self.ln_x.bias, ln_eps=self.ln_x.eps,
            state=state.recurrent, decay_bound=DECAY_BOUND, is_first=self.defines_v_first,
            gate_bias=weights["gate_bias"], backend=self.backend,
        )
        return self.output(y), v_first

    def state_flops_per_token(self) -> int:
        """Per head and token, forward: decay K*V, p = a^T S 2KV, b p^T 2KV, k v^T 2KV,
        readout S^T r 2KV = 9 K V; backward ~ 2x forward."""
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
        return self.value(ops.squared_relu(self.key(xk), backend=self.backend))

    def decode_weights(self) -> dict[str, torch.Tensor]:
        return {"ffn_mu": self.mu_k.detach()[None]}

    def decode(self, lerps: torch.Tensor, weights: dict) -> dict:
        """One token: lerps [1, B, C] -> the output, left for the next block's norm to add."""
        return {"add": self.value(ops.squared_relu(self.key(lerps[0]), backend=self.backend))}


class RWKV7Block(RWKVBlock):
    def __init__(self, args, layer_id: int):
        super().__init__(args, layer_id, RWKV7Attention(args, layer_id), RWKV7FeedForward(args, layer_id))

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None):
        if self.is_first:
            x = self.pre_norm(x)
        attn_out, v_first = self.attn(self.attn_norm(x), v_first, cu_seqlens, state)
        x = x + attn_out
        x = x + self.ffn(self.ffn_norm(x), cu_seqlens, state)
        return x, v_first


class RWKV7ForCausalLM(RWKVCausalLM):
    def __init__(self, args):
        super().__init__(args)
        self.l2wrap = bool(getattr(args, "l2wrap", False))

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

    def _decode_layers(self, x: torch.Tensor, state: list[LayerState], weights: list[dict]):
        pending, v_first = {}, torch.empty_like(x)
        for layer, layer_state, layer_weights in zip(self.layers, state, weights):
            x, pending, v_first = layer.decode(x, pending, layer_state, layer_weights, v_first)
        return x, pending
