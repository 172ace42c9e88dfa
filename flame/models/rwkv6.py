"""RWKV6 ("Finch"): data-dependent token shift, LoRA decay, bonus, receptance-gated channel mix
(docs/kernels.md#rwkv6-layer, official x060).

Layer equations (x: the normed block input, delta = token_shift(x) - x):
    xi = tanh((x + delta * mu_x) @ mix_w1)             [5 * mix_rank]
    m_w, m_k, m_v, m_r, m_g = xi_b @ mix_w2[b]         five branches, [C] each
    x_* = x + delta * (mu_* + m_*)
    r = W_r x_r,  k = W_k x_k,  v = W_v x_v,  g = silu(W_g x_g)
    w = -exp(time_decay + tanh(x_w @ decay_w1) @ decay_w2)    log-decay < 0
    o = chunk_rwkv6(r, k, v, w, u=bonus, scale=1)
    out = W_o (GroupNorm_H(o) (eps group_norm_eps, officially 1e-5 * 8^2) * g)
Channel mix: out = sigmoid(W_r (x + delta mu_r)) * W_v relu(W_k (x + delta mu_k))^2, width 3.5 C
rounded down to a multiple of 32.
Block: pre-LN, x += attn(ln1 x); x += ffn(ln2 x); layer 0 first applies ln0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flame.models import init
from flame.models.rwkv_common import RWKVBlock, RWKVCausalLM, matrix_param, rwkv_heads, vector_param
from flame.models.precision import GroupNorm, like
from flame.models.state import LayerState
from flame import ops
from flame.ops.decode_matmul import Segment, decode_matmul
from flame.ops.rwkv6.decode_step import rwkv6_decode_step

DECAY_LOW_RANK_DIM = 64
"""The official RWKV6 decay-LoRA rank, used when decay_low_rank_dim is 0."""
MIX_BRANCHES = 5  # w, k, v, r, g


def rwkv6_ffn_width(hidden_size: int) -> int:
    """Official x060 channel-mix width: 3.5 C rounded down to a multiple of 32."""
    return int(hidden_size * 3.5) // 32 * 32


class RWKV6Attention(nn.Module):
    """RWKV6 time mix. `time_decay` is the decay bias (the trainer gives it
    `decay_lr_multiplier`); LoRA matrices are free parameters (never weight-decayed).

    Decoding one token (`decode`): the static lerp with mu_x feeds the mix LoRA, whose outputs
    make the five data-dependent lerps of one decode_matmul launch that computes k, v, r, the
    gate and the decay LoRA's first matrix."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.layer_id, self.num_layers = layer_id, args.num_layers
        self.num_heads, self.head_dim = rwkv_heads(args)
        self.backend = args.backend
        C = args.hidden_size
        if args.mix_low_rank_dim <= 0:
            raise ValueError(f"mix_low_rank_dim must be > 0 for rwkv6, got {args.mix_low_rank_dim}")
        self.mix_rank = args.mix_low_rank_dim
        decay_rank = args.decay_low_rank_dim or DECAY_LOW_RANK_DIM

        self.mu_x, self.mu_w, self.mu_k = vector_param(C), vector_param(C), vector_param(C)
        self.mu_v, self.mu_r, self.mu_g = vector_param(C), vector_param(C), vector_param(C)
        self.mix_w1 = matrix_param(C, MIX_BRANCHES * self.mix_rank)
        self.mix_w2 = nn.Parameter(torch.empty(MIX_BRANCHES, self.mix_rank, C))
        self.time_decay = vector_param(C)
        self.decay_w1, self.decay_w2 = matrix_param(C, decay_rank), matrix_param(decay_rank, C)
        self.bonus = nn.Parameter(torch.empty(self.num_heads, self.head_dim))
        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.gate = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.ln_x = GroupNorm(self.num_heads, C, eps=args.group_norm_eps)

    @torch.no_grad()
    def init_weights(self) -> None:
        """RWKV-LM's x060 init (docs/initialization.md): the formulas of RWKV_Tmix_x060, then
        generate_init_weight's projections (receptance and value orthogonal with gain 1, key and
        gate 0.1, output 0) and GroupNorm weight ((l+1)/L)^0.7."""
        C = self.time_decay.numel()
        r0, r1 = init.layer_ratios(self.layer_id, self.num_layers)
        ramp = init.channel_ramps(C, self.head_dim)
        ddd, n_ramp = ramp["ddd"], ramp["ramp"]
        init.assign_(self.mu_x, 1 - ddd**r1)
        init.assign_(self.mu_w, 1 - ddd**r1)
        init.assign_(self.mu_k, 1 - ddd**r1)
        init.assign_(self.mu_v, 1 - (ddd**r1 + 0.3 * r0))
        init.assign_(self.mu_r, 1 - ddd ** (0.5 * r1))
        init.assign_(self.mu_g, 1 - ddd ** (0.5 * r1))
        init.zeros_(self.mix_w1)
        init.uniform_(self.mix_w2, 0.01)
        init.assign_(self.time_decay, -6 + 5 * n_ramp ** (0.7 + 1.3 * r0))
        init.zeros_(self.decay_w1)
        init.uniform_(self.decay_w2, 0.01)
        n = torch.arange(C, dtype=torch.float32, device="cpu")
        bonus = r0 * (1 - n_ramp) + 0.1 * ((n + 1) % 3 - 1)
        init.assign_(self.bonus, bonus.view(self.num_heads, self.head_dim))
        init.orthogonal_(self.receptance.weight, 1.0)
        init.orthogonal_(self.key.weight, 0.1)
        init.orthogonal_(self.value.weight, 1.0)
        init.orthogonal_(self.gate.weight, 0.1)
        init.zeros_(self.output.weight)
        init.constant_(self.ln_x.weight, ((self.layer_id + 1) / self.num_layers) ** 0.7)
        init.zeros_(self.ln_x.bias)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None) -> torch.Tensor:
        B, T, C = x.shape
        H, N = self.num_heads, self.head_dim
        previous = None if state is None else state.previous_token(x, "attn_shift", cu_seqlens)
        (xx,) = ops.token_shift_mix(x, self.mu_x[None], cu_seqlens=cu_seqlens, previous=previous,
                                    backend=self.backend)
        xi = torch.tanh(xx @ self.mix_w1)
        xi = xi.view(B * T, MIX_BRANCHES, self.mix_rank).transpose(0, 1)
        m = torch.bmm(xi, self.mix_w2).view(MIX_BRANCHES, B, T, C)
        mu = torch.stack([self.mu_w, self.mu_k, self.mu_v, self.mu_r, self.mu_g])
        xw, xk, xv, xr, xg = ops.token_shift_mix(x, mu, m, cu_seqlens=cu_seqlens, previous=previous,
                                                 backend=self.backend)

        r = self.receptance(xr).view(B, T, H, N)
        k = self.key(xk).view(B, T, H, N)
        v = self.value(xv).view(B, T, H, N)
        g = F.silu(self.gate(xg))
        w = -torch.exp(like(self.time_decay, x) + torch.tanh(xw @ self.decay_w1) @ self.decay_w2).view(B, T, H, N)
        if state is None:
            o, _ = ops.chunk_rwkv6(r, k, v, w, self.bonus, scale=1.0, cu_seqlens=cu_seqlens, backend=self.backend)
        else:
            o = state.attend(ops.chunk_rwkv6, ops.fused_recurrent_rwkv6, r, k, v, w, self.bonus, scale=1.0,
                             backend=self.backend, cu_seqlens=cu_seqlens)
        o = self.ln_x(o.reshape(B * T, C)).view(B, T, C)
        return self.output(o * g)

    @torch.no_grad()
    def decode_weights(self) -> dict[str, torch.Tensor]:
        """`mix_in` [5 R, C] and `mix_out` [5 C, R]: the mix LoRA's matrices transposed (its second
        stacked by branch w, k, v, r, g); `attn_in` [4 C + R_decay, C]: the key, value, receptance
        and gate weights and the decay LoRA's first matrix, transposed; `decay_out` [C, R_decay];
        the lerp coefficients mu_x (`attn_mu`) and w, k, v, r, g (`mix_mu`)."""
        return {
            "attn_mu": self.mu_x[None].clone(),
            "mix_mu": torch.stack([self.mu_w, self.mu_k, self.mu_v, self.mu_r, self.mu_g]),
            "mix_in": self.mix_w1.T.contiguous(),
            "mix_out": self.mix_w2.transpose(1, 2).flatten(0, 1),
            "attn_in": torch.cat([self.key.weight, self.value.weight, self.receptance.weight, self.gate.weight,
                                  self.decay_w1.T]),
            "decay_out": self.decay_w2.T.contiguous(),
        }

    def decode(self, x: torch.Tensor, norm: dict, state: LayerState, weights: dict) -> tuple:
        """One token: x [B, C] the residual stream, to which the time mix's output is added in
        place; norm: the block norm's decode_matmul prologue arguments. Six launches: the norm, the
        mu_x lerp and the mix LoRA's first matrix with its tanh; its second matrices (five
        branches); the norm again, the data-dependent lerps and the k, v, r, gate and decay-LoRA
        projections; the decay LoRA's second matrix; the attention (rwkv6_decode_step); the output
        projection with the residual add and the token-shift write. Returns no carry, ()."""
        B, C = x.shape
        R, R_decay = self.mix_rank, weights["decay_out"].shape[1]
        h = torch.empty_like(x)
        xi = decode_matmul(x, weights["mix_in"], (Segment(MIX_BRANCHES * R, 0, "tanh"),), **norm,
                           previous=state.attn_shift, mu=weights["attn_mu"], h_out=h, backend=self.backend)
        m = decode_matmul(xi.unflatten(1, (MIX_BRANCHES, R)).transpose(0, 1), weights["mix_out"],
                          tuple(Segment(C, i) for i in range(MIX_BRANCHES)), backend=self.backend)
        segments = (*(Segment(C, i) for i in range(1, MIX_BRANCHES)), Segment(R_decay, 0, "tanh"))
        proj = decode_matmul(x, weights["attn_in"], segments, **norm, previous=state.attn_shift,
                             mu=weights["mix_mu"], mix=m.unflatten(1, (MIX_BRANCHES, C)).transpose(0, 1),
                             backend=self.backend)  # k, v, r, gate, tanh(decay LoRA hidden)
        w_lora = decode_matmul(proj[:, 4 * C:][None], weights["decay_out"], backend=self.backend)
        y = rwkv6_decode_step(proj[:, 2 * C:3 * C], proj[:, :C], proj[:, C:2 * C], proj[:, 3 * C:4 * C], w_lora,
                              time_decay=self.time_decay, u=self.bonus, ln_weight=self.ln_x.weight,
                              ln_bias=self.ln_x.bias, ln_eps=self.ln_x.eps, state=state.recurrent,
                              backend=self.backend)
        decode_matmul(y[None], self.output.weight, residual=x, commit=(h, state.attn_shift), backend=self.backend)
        return ()

    def state_flops_per_token(self) -> int:
        """FLOPs of the recurrence per token, forward + backward (docs/architecture.md, "FLOPs per
        token and MFU"). Per head (docs/kernels.md, "RWKV6 recurrence"), the forward reads
        o = S^T r (2 K V) and updates S = e^w ⊙ S + k v^T (K V + 2 K V): 5 K V; the bonus is
        O(K + V) and not counted. Times 3 for forward + backward, as the matmuls."""
        return 3 * 5 * self.num_heads * self.head_dim * self.head_dim


class RWKV6FeedForward(nn.Module):
    """RWKV6 channel mix: sigmoid(W_r x_r) * W_v relu(W_k x_k)^2."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.layer_id, self.num_layers = layer_id, args.num_layers
        self.backend = args.backend
        C = args.hidden_size
        width = args.ffn_hidden_size or rwkv6_ffn_width(C)
        self.mu_k, self.mu_r = vector_param(C), vector_param(C)
        self.key = nn.Linear(C, width, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(width, C, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """RWKV-LM's RWKV_CMix_x060 and generate_init_weight (docs/initialization.md): mu_k =
        mu_r = 1 - (n/C)^{r1^3}; key orthogonal with gain 1 (whatever its shape); receptance and
        value 0."""
        _, r1 = init.layer_ratios(self.layer_id, self.num_layers)
        ddd = init.channel_ramps(self.mu_k.numel(), 1)["ddd"]
        init.assign_(self.mu_k, 1 - ddd ** (r1**3))
        init.assign_(self.mu_r, 1 - ddd ** (r1**3))
        init.orthogonal_(self.key.weight, 1.0)
        init.zeros_(self.receptance.weight)
        init.zeros_(self.value.weight)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None) -> torch.Tensor:
        previous = None if state is None else state.previous_token(x, "ffn_shift", cu_seqlens)
        xk, xr = ops.token_shift_mix(x, torch.stack([self.mu_k, self.mu_r]), cu_seqlens=cu_seqlens,
                                     previous=previous, backend=self.backend)
        value = ops.squared_relu_mlp(xk, self.key.weight, self.value.weight, backend=self.backend)
        return torch.sigmoid(self.receptance(xr)) * value

    @torch.no_grad()
    def decode_weights(self) -> dict[str, torch.Tensor]:
        """`ffn_mu`: the lerp coefficients k, r; `ffn_in`: the key and receptance weights, one
        decode_matmul launch."""
        return {"ffn_mu": torch.stack([self.mu_k, self.mu_r]),
                "ffn_in": torch.cat([self.key.weight, self.receptance.weight])}

    def decode(self, x: torch.Tensor, norm: dict, state: LayerState, weights: dict) -> None:
        """One token: x [B, C] += the channel mix of its norm, in place. Two launches: the norm,
        lerps, key projection with its squared ReLU and receptance projection; the value projection
        gated by sigmoid(receptance) with the residual add and the token-shift write."""
        width = self.key.out_features
        h = torch.empty_like(x)
        kr = decode_matmul(x, weights["ffn_in"], (Segment(width, 0, "sqrelu"), Segment(x.shape[1], 1)), **norm,
                           previous=state.ffn_shift, mu=weights["ffn_mu"], h_out=h, backend=self.backend)
        decode_matmul(kr[:, :width][None], self.value.weight, residual=x, residual_gate=kr[:, width:],
                      commit=(h, state.ffn_shift), backend=self.backend)


class RWKV6Block(RWKVBlock):
    def __init__(self, args, layer_id: int):
        super().__init__(args, layer_id, RWKV6Attention(args, layer_id), RWKV6FeedForward(args, layer_id))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None) -> torch.Tensor:
        if self.is_first:
            x = self.pre_norm(x)
        x, h = self.attn_norm(x, stream=True)
        x, h = self.ffn_norm(x, residual=self.attn(h, cu_seqlens, state))
        return x + self.ffn(h, cu_seqlens, state)


class RWKV6ForCausalLM(RWKVCausalLM):
    def _build_layers(self, args) -> list[nn.Module]:
        return [RWKV6Block(args, i) for i in range(args.num_layers)]
