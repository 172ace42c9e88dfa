"""GSA (Gated Slot Attention): two gated linear-attention passes around a softmax over M memory
slots, with RMSNorm pre-norm blocks and a SwiGLU MLP (docs/kernels.md#gsa-recurrence, #gsa-layer).

Layer equations (x: the normed block input; HQ query heads, H key/value heads, head dim d = C/HQ):
    q = swish(W_q x) [HQ, d],  k = swish(W_k x) [H, d],  v = silu(W_v x) [H, d]
    g = logsigmoid(W_f x) / gate_logit_normalizer [H, M],  s = 1 - exp(g)
    o = chunk_gsa(q, k, v, s, g, scale=1)
    out = W_o RMSNorm_{HQ d}(silu(o))      (the norm runs in fp32)
MLP: W_down (silu(W_gate x) * W_up x). Init: normal(0.02) everywhere, W_o and W_down rescaled by
1/sqrt(2 L) (the GPT-2 residual rule), norms 1: fla's init (docs/initialization.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flame.models import init
from flame.models.causal_lm import CausalLM, prologue_args
from flame.models.precision import RMSNorm
from flame.models.state import LayerState
from flame import ops
from flame.ops.gsa.decode_step import gsa_decode_step
from flame.ops.decode_matmul import Segment, decode_matmul

INIT_STD = 0.02


def swiglu_width(hidden_size: int) -> int:
    """SwiGLU width for a 4x MLP: 2/3 * 4 C rounded up to a multiple of 256."""
    width = int(hidden_size * 4 * 2 / 3)
    return 256 * math.ceil(width / 256)


class FP32RMSNorm(nn.RMSNorm):
    """RMSNorm computed in fp32 whatever the input dtype (avoids underflow of small outputs);
    returns the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps).to(x.dtype)


def gsa_heads(args) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim), checked."""
    heads = args.num_heads
    kv_heads = args.num_kv_heads or heads
    if heads <= 0 or args.hidden_size % heads:
        raise ValueError(f"hidden_size ({args.hidden_size}) must be a multiple of num_heads ({heads}) for gsa")
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"num_heads ({heads}) must be a multiple of num_kv_heads ({kv_heads}) for gsa")
    if args.num_slots <= 0:
        raise ValueError(f"num_slots must be > 0 for gsa, got {args.num_slots}")
    if args.gate_logit_normalizer <= 0:
        raise ValueError(f"gate_logit_normalizer must be > 0, got {args.gate_logit_normalizer}")
    return heads, kv_heads, args.hidden_size // heads


class GSAAttention(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        self.layer_id, self.num_layers = layer_id, args.num_layers
        self.num_heads, self.num_kv_heads, self.head_dim = gsa_heads(args)
        self.num_slots = args.num_slots
        self.gate_logit_normalizer = float(args.gate_logit_normalizer)
        self.backend = args.backend
        C, d = args.hidden_size, self.head_dim
        self.q_proj = nn.Linear(C, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(C, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(C, self.num_kv_heads * d, bias=False)
        self.f_proj = nn.Linear(C, self.num_kv_heads * self.num_slots, bias=False)
        self.g_norm = FP32RMSNorm(self.num_heads * d, eps=args.norm_eps)
        self.o_proj = nn.Linear(self.num_heads * d, C, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.f_proj):
            init.normal_(proj.weight, INIT_STD)
        init.normal_(self.o_proj.weight, INIT_STD / math.sqrt(2 * self.num_layers))
        self.g_norm.reset_parameters()

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, HQ, d, M = self.num_kv_heads, self.num_heads, self.head_dim, self.num_slots
        q = F.silu(self.q_proj(x)).view(B, T, HQ, d)
        k = F.silu(self.k_proj(x)).view(B, T, H, d)
        v = F.silu(self.v_proj(x)).view(B, T, H, d)
        g = F.logsigmoid(self.f_proj(x)).view(B, T, H, M) / self.gate_logit_normalizer
        s = -torch.expm1(g)  # 1 - exp(g), exact near g = 0
        if state is None:
            o, _ = ops.chunk_gsa(q, k, v, s, g, scale=1.0, cu_seqlens=cu_seqlens, backend=self.backend)
        else:
            o = state.attend(ops.chunk_gsa, ops.fused_recurrent_gsa, q, k, v, s, g, scale=1.0, backend=self.backend,
                             cu_seqlens=cu_seqlens)
        return self.o_proj(self.g_norm(F.silu(o.reshape(B, T, HQ * d))))

    def decode(self, x: torch.Tensor, norm: dict, state: LayerState, weights: dict) -> None:
        """One token: x [B, C] += the attention of its norm (`norm`: the block norm's decode_matmul
        prologue arguments), in place. Three launches: the norm and the q, k, v and forget-gate
        projections; the attention (gsa_decode_step); the output norm of silu(o) and the output
        projection with the residual add."""
        H, HQ, d, M = self.num_kv_heads, self.num_heads, self.head_dim, self.num_slots
        qkvf = decode_matmul(x, weights["qkvf"], **norm, backend=self.backend)
        q, k, v, f = qkvf.split([HQ * d, H * d, H * d, H * M], dim=1)
        hk, hv = state.recurrent
        o = gsa_decode_step(q, k, v, f, normalizer=self.gate_logit_normalizer, state_k=hk, state_v=hv,
                            backend=self.backend)
        decode_matmul(o, self.o_proj.weight, **prologue_args(self.g_norm), silu=True, residual=x, backend=self.backend)

    def state_flops_per_token(self) -> int:
        """FLOPs of the two recurrences per token, forward + backward (docs/architecture.md,
        "FLOPs per token and MFU"). Forward (docs/kernels.md, "GSA recurrence"): each of the H
        key/value heads updates Hk = Hk diag(e^g) + k s^T [d, M] and Hv = diag(e^g) Hv + s v^T
        [M, d] (3 d M each); each of the HQ query heads reads z = Hk^T q and o = Hv^T p (2 d M
        each); the softmax over M slots is O(M) and not counted. Times 3 for forward + backward,
        as the matmuls."""
        d, M = self.head_dim, self.num_slots
        forward = 2 * 3 * self.num_kv_heads * d * M + 2 * 2 * self.num_heads * d * M
        return 3 * forward


class GSAMLP(nn.Module):
    """SwiGLU: W_down (silu(W_gate x) * W_up x)."""

    def __init__(self, args, layer_id: int):
        super().__init__()
        self.num_layers = args.num_layers
        C = args.hidden_size
        width = args.ffn_hidden_size or swiglu_width(C)
        self.gate_proj = nn.Linear(C, width, bias=False)
        self.up_proj = nn.Linear(C, width, bias=False)
        self.down_proj = nn.Linear(width, C, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        init.normal_(self.gate_proj.weight, INIT_STD)
        init.normal_(self.up_proj.weight, INIT_STD)
        init.normal_(self.down_proj.weight, INIT_STD / math.sqrt(2 * self.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GSABlock(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        C, eps = args.hidden_size, args.norm_eps
        self.attn_norm = RMSNorm(C, eps=eps, backend=args.backend)
        self.attn = GSAAttention(args, layer_id)
        self.mlp_norm = RMSNorm(C, eps=eps, backend=args.backend)
        self.mlp = GSAMLP(args, layer_id)

    @torch.no_grad()
    def init_weights(self) -> None:
        self.attn_norm.reset_parameters()
        self.mlp_norm.reset_parameters()
        self.attn.init_weights()
        self.mlp.init_weights()

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: LayerState | None = None) -> torch.Tensor:
        x, h = self.attn_norm(x, stream=True)
        x, h = self.mlp_norm(x, residual=self.attn(h, cu_seqlens, state))
        return x + self.mlp(h)

    def state_flops_per_token(self) -> int:
        return self.attn.state_flops_per_token()

    def new_decode_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> LayerState:
        attn = self.attn
        H, d, M = attn.num_kv_heads, attn.head_dim, attn.num_slots
        acc = torch.promote_types(dtype, torch.float32)
        return LayerState(recurrent=(torch.zeros(batch_size, H, d, M, device=device, dtype=acc),
                                     torch.zeros(batch_size, H, M, d, device=device, dtype=acc)))

    @torch.no_grad()
    def decode_weights(self) -> dict[str, torch.Tensor]:
        """`qkvf`: the q, k, v and forget-gate weights; `gate_up`: the MLP's gate then up weights
        (one swiglu segment of decode_matmul)."""
        attn, mlp = self.attn, self.mlp
        return {"qkvf": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.f_proj.weight]),
                "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])}

    def decode(self, x: torch.Tensor, state: LayerState, weights: dict) -> torch.Tensor:
        """One token of the block over static buffers (CausalLM.decode_step): x [B, C], the
        residual stream, takes both sub-layers' outputs in place. Five launches: three for the
        attention (GSAAttention.decode), then the norm, gate and up projections with silu(gate) * up,
        and the down projection with the residual add."""
        backend = self.attn.backend
        self.attn.decode(x, prologue_args(self.attn_norm), state, weights)
        width = self.mlp.down_proj.in_features
        hidden = decode_matmul(x, weights["gate_up"], (Segment(width, 0, "swiglu"),), **prologue_args(self.mlp_norm),
                               backend=backend)
        decode_matmul(hidden[None], self.mlp.down_proj.weight, residual=x, backend=backend)
        return x


class GSAForCausalLM(CausalLM):
    def _build_layers(self, args) -> list[nn.Module]:
        return [GSABlock(args, i) for i in range(args.num_layers)]

    def _build_norm(self, args) -> nn.Module:
        return RMSNorm(args.hidden_size, eps=args.norm_eps, backend=args.backend)

    def _init_embeddings_and_head(self) -> None:
        init.normal_(self.embeddings.weight, INIT_STD)
        if not self.tie_word_embeddings:
            init.normal_(self.lm_head.weight, INIT_STD)
