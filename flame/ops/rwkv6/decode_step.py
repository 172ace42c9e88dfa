"""rwkv6_decode_step: the RWKV6 time mix of one token between its projections and its output
projection, for B sequences, with the state updated in place.

From the projections r, k, v, the gate's projection and the decay LoRA's output, per head:

    w = -exp(time_decay + w_lora)                  log-decay
    o = S^T r + (sum(r * u * k)) v                 (the state before this token, plus the bonus u)
    S <- e^w * S + k v^T
    y = GroupNorm_head(o) * silu(gate)

which is RWKV6Attention's forward for T = 1 (flame.models.rwkv6) with the recurrence of
fused_recurrent_rwkv6 (scale 1). Everything runs in fp32; S is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.backend import resolve_backend
from ..utils.decode_checks import check_head_state, check_rows
from ..utils.dtypes import accumulation_dtype


def rwkv6_decode_step_torch(r, k, v, gate, w_lora, time_decay, u, ln_weight, ln_bias, ln_eps, state):
    """rwkv6_decode_step in PyTorch; the same contract as `rwkv6_decode_step`."""
    B, C = r.shape
    H, N = u.shape
    dtype = r.dtype
    acc = accumulation_dtype(dtype)
    rh, kh, vh = (t.to(acc).view(B, H, N) for t in (r, k, v))
    w = -torch.exp(time_decay.to(acc) + w_lora.to(acc)).view(B, H, N)
    S = state.to(acc)
    o = torch.einsum("bhk,bhkv->bhv", rh, S) + (rh * u.to(acc) * kh).sum(-1, keepdim=True) * vh
    state.copy_(torch.exp(w)[..., None] * S + kh[..., None] * vh[..., None, :])
    o = F.group_norm(o.reshape(B, C), H, ln_weight.to(acc), ln_bias.to(acc), ln_eps)
    return (o * F.silu(gate.to(acc))).to(dtype)


def rwkv6_decode_step(r, k, v, gate, w_lora, *, time_decay, u, ln_weight, ln_bias, ln_eps: float,
                      state: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The RWKV6 time mix of one token (module docstring) -> y [B, C] in r's dtype, the input of the
    output projection.

    Args:
        r, k, v, gate, w_lora: [B, C] with unit channel stride (any row stride).
        time_decay, ln_weight, ln_bias: [C]; u (the bonus): [H, N].
        state: [B, H, N, N] fp32 (fp64 for fp64 inputs), contiguous, updated in place.

    No host sync and no allocation beyond the output: a CUDA graph can capture it.
    """
    B, C, H, N = check_head_state("rwkv6_decode_step", r, u, "u", state)
    check_rows("rwkv6_decode_step", (B, C), r=r, k=k, v=v, gate=gate, w_lora=w_lora)
    if resolve_backend(backend, r.device, "rwkv6_decode_step") == "triton":
        from .decode_step_triton import rwkv6_decode_step_triton
        return rwkv6_decode_step_triton(r, k, v, gate, w_lora, time_decay, u, ln_weight, ln_bias, float(ln_eps),
                                        state)
    return rwkv6_decode_step_torch(r, k, v, gate, w_lora, time_decay, u, ln_weight, ln_bias, ln_eps, state)
