"""gsa_decode_step: the GSA attention of one token from its raw projections, for B sequences, with
the two slot states updated in place.

From the projections q [B, HQ*K], k, v [B, H*K] and the forget logits f [B, H*M], per key/value
head (its G = HQ / H query heads read the same states):

    q, k, v = silu(q), silu(k), silu(v);  g = logsigmoid(f) / normalizer;  s = 1 - e^g
    Hk <- Hk diag(e^g) + k s^T;   p = softmax(Hk^T q)
    Hv <- diag(e^g) Hv + s v^T;   o = Hv^T p

which is GSAAttention's forward for T = 1 (flame.models.gsa) up to its output norm, with the
recurrence of fused_recurrent_gsa (scale 1). Everything runs in fp32; the states are fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.backend import resolve_backend
from ..utils.decode_checks import check_rows, check_state
from ..utils.dtypes import accumulation_dtype


def gsa_decode_step_torch(q, k, v, f, normalizer, state_k, state_v):
    """gsa_decode_step in PyTorch; the same contract as `gsa_decode_step`."""
    B, H, K, M = state_k.shape
    HQ = q.shape[1] // K
    G = HQ // H
    dtype = q.dtype
    acc = accumulation_dtype(dtype)
    q = F.silu(q.to(acc)).view(B, H, G, K)
    k = F.silu(k.to(acc)).view(B, H, K)
    v = F.silu(v.to(acc)).view(B, H, -1)
    g = (F.logsigmoid(f.to(acc)) / normalizer).view(B, H, M)
    s = -torch.expm1(g)
    alpha = torch.exp(g)
    hk = state_k.to(acc) * alpha[:, :, None, :] + k[..., None] * s[:, :, None, :]
    hv = alpha[..., None] * state_v.to(acc) + s[..., None] * v[:, :, None, :]
    state_k.copy_(hk)
    state_v.copy_(hv)
    p = torch.softmax(torch.einsum("bhgk,bhkm->bhgm", q, hk), dim=-1)
    return torch.einsum("bhgm,bhmv->bhgv", p, hv).reshape(B, -1).to(dtype).contiguous()


def gsa_decode_step(q, k, v, f, *, normalizer: float, state_k: torch.Tensor, state_v: torch.Tensor,
                    backend: str = "auto") -> torch.Tensor:
    """GSA attention of one token (module docstring) -> o [B, HQ*V] in q's dtype (before the
    layer's silu and output norm).

    Args:
        q: [B, HQ*K]; k: [B, H*K]; v: [B, H*V]; f: [B, H*M] (the forget gate's logits), each with
            unit channel stride (any row stride: views of one fused projection).
        normalizer: the layer's gate_logit_normalizer.
        state_k: [B, H, K, M] and state_v: [B, H, M, V], fp32 (fp64 for fp64 inputs), contiguous,
            updated in place.

    No host sync and no allocation beyond the output: a CUDA graph can capture it.
    """
    B = q.shape[0]
    if state_k.dim() != 4 or state_v.dim() != 4 or state_k.shape[0] != B:
        raise ValueError(f"gsa_decode_step: state_k [B, H, K, M] and state_v [B, H, M, V] with B = {B}, got "
                         f"{tuple(state_k.shape)} and {tuple(state_v.shape)}")
    _, H, K, M = state_k.shape
    V = state_v.shape[-1]
    ok = (q.shape[1] % (H * K) == 0 and tuple(k.shape) == (B, H * K) and tuple(v.shape) == (B, H * V)
          and tuple(f.shape) == (B, H * M))
    if not ok:
        raise ValueError(f"gsa_decode_step: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, f {tuple(f.shape)}, state_k {tuple(state_k.shape)}, state_v "
                         f"{tuple(state_v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("f", f)):
        check_rows("gsa_decode_step", (B, t.shape[1]), **{name: t})
    check_state("gsa_decode_step", "state_k", state_k, (B, H, K, M), q.dtype)
    check_state("gsa_decode_step", "state_v", state_v, (B, H, M, V), q.dtype)
    if resolve_backend(backend, q.device, "gsa_decode_step") == "triton":
        from .decode_step_triton import gsa_decode_step_triton
        return gsa_decode_step_triton(q, k, v, f, float(normalizer), state_k, state_v)
    return gsa_decode_step_torch(q, k, v, f, normalizer, state_k, state_v)
