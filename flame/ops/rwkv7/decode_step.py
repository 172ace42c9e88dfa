"""rwkv7_decode_step: the whole RWKV7 time mix of one token between its projections and its output
projection, for B sequences, with the state updated in place.

From the projections r, k, v [B, C], the LoRA outputs (before their biases) and the gate g, per
head:

    w = -bound * sigmoid(w0 + w_lora)               log-decay
    a = sigmoid(a0 + a_lora)
    v <- v + (v_first - v) sigmoid(v0 + v_lora)     layer 0 instead stores v as v_first
    kappa = L2normalize(k * k_k);  k <- k * (1 + (a - 1) * k_a)
    p = -kappa^T S;  S <- e^w * S + (kappa * a) p^T + k v^T;  o = S^T r
    y = (GroupNorm_head(o) + sum(r * k * r_k) v) * g

which is RWKV7Attention's forward for T = 1 (flame.models.rwkv7) with the recurrence of
fused_recurrent_rwkv7 (a = -kappa, b = kappa * a, scale 1). Everything runs in fp32; S is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.backend import resolve_backend
from ..utils.decode_checks import check_head_state, check_rows
from ..utils.dtypes import accumulation_dtype


def rwkv7_decode_step_torch(r, k, v, w_lora, a_lora, v_lora, g, v_first, w0, a0, v0, k_k, k_a, r_k, ln_weight,
                            ln_bias, ln_eps, state, decay_bound, is_first):
    """rwkv7_decode_step in PyTorch; the same contract as `rwkv7_decode_step`."""
    B, C = r.shape
    H, N = r_k.shape
    dtype = r.dtype
    acc = accumulation_dtype(dtype)
    f = lambda t: t.to(acc)  # noqa: E731
    r, k, v, g = f(r), f(k), f(v), f(g)
    w = -decay_bound * torch.sigmoid(f(w0) + f(w_lora))
    a = torch.sigmoid(f(a0) + f(a_lora))
    if is_first:
        v_first.copy_(v)
    else:
        v = v + (f(v_first) - v) * torch.sigmoid(f(v0) + f(v_lora))
    kappa = F.normalize((k * f(k_k)).view(B, H, N), p=2.0, dim=-1)
    k = k * (1 + (a - 1) * f(k_a))
    rh, wh, kh, vh, ah = (t.view(B, H, N) for t in (r, w, k, v, a))
    S = state.to(acc)
    p = torch.einsum("bhk,bhkv->bhv", -kappa, S)
    S = torch.exp(wh)[..., None] * S + (kappa * ah)[..., None] * p[..., None, :] + kh[..., None] * vh[..., None, :]
    state.copy_(S)
    o = torch.einsum("bhk,bhkv->bhv", rh, S)
    o = F.group_norm(o.reshape(B, C), H, f(ln_weight), f(ln_bias), ln_eps).view(B, H, N)
    o = o + (rh * kh * f(r_k)).sum(-1, keepdim=True) * vh
    return (o.reshape(B, C) * g).to(dtype)


def rwkv7_decode_step(r, k, v, w_lora, a_lora, v_lora, g, v_first, *, w0, a0, v0, k_k, k_a, r_k, ln_weight,
                      ln_bias, ln_eps: float, state: torch.Tensor, decay_bound: float, is_first: bool,
                      backend: str = "auto") -> torch.Tensor:
    """The RWKV7 time mix of one token (module docstring) -> y [B, C] in r's dtype, the input of the
    output projection.

    Args:
        r, k, v, w_lora, a_lora, v_lora, g: [B, C] with unit channel stride (any row stride; views
            of stacked matmul outputs). v_lora is unused (may be None) in layer 0.
        v_first: [B, C] contiguous: written (this token's v) when is_first, read otherwise.
        w0, a0, v0, k_k, k_a, ln_weight, ln_bias: [C] parameters; r_k [H, N].
        state: [B, H, N, N] fp32 (fp64 for fp64 inputs), contiguous, updated in place.
        decay_bound: e^{-1/2} in RWKV7 (the log-decay lies in [-decay_bound, 0]).

    No host sync and no allocation beyond the output: a CUDA graph can capture it.
    """
    B, C, H, N = check_head_state("rwkv7_decode_step", r, r_k, "r_k", state)
    check_rows("rwkv7_decode_step", (B, C), r=r, k=k, v=v, w_lora=w_lora, a_lora=a_lora, g=g,
               **({} if is_first else {"v_lora": v_lora}))
    if tuple(v_first.shape) != (B, C) or not v_first.is_contiguous():
        raise ValueError(f"rwkv7_decode_step: v_first must be a contiguous [B, C] = {(B, C)} tensor")
    if resolve_backend(backend, r.device, "rwkv7_decode_step") == "triton":
        from .decode_step_triton import rwkv7_decode_step_triton
        return rwkv7_decode_step_triton(r, k, v, w_lora, a_lora, v_lora, g, v_first, w0, a0, v0, k_k, k_a, r_k,
                                        ln_weight, ln_bias, float(ln_eps), state, float(decay_bound), is_first)
    return rwkv7_decode_step_torch(r, k, v, w_lora, a_lora, v_lora, g, v_first, w0, a0, v0, k_k, k_a, r_k,
                                   ln_weight, ln_bias, ln_eps, state, decay_bound, is_first)
