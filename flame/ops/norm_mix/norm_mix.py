"""norm_mix: what a block does to one decoding token between two matmuls, in one pass over a row.

A decoding step carries each block's residual stream x [B, C] (one token per sequence). Before
a sub-layer's projections it adds the previous sub-layer's output (`add`, RWKV6's channel mix
gated by sigmoid(`gate`)), normalises (LayerNorm, or RMSNorm), and, for the RWKV families, mixes
the normed token h with the stored previous token's (`previous`, the token shift of a decoding
step): out_i = h + (previous - h) * mu_i. `previous` then takes h, ready for the next token.

    norm_mix(x, weight, bias, eps, add=..., gate=..., previous=..., mu=...)

Rounding follows the model's layers: x + add is rounded to x's dtype and stored back into x (the
residual stream), h is rounded to x's dtype (a norm's output), the lerps are computed in fp32
from those rounded values and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import resolve_backend
from ..decode_checks import check_rows

NORMS = ("layer", "rms")


def norm_mix_torch(x, weight, bias, eps, norm="layer", add=None, gate=None, previous=None, mu=None, silu=False):
    """norm_mix in PyTorch; the same contract as `norm_mix`."""
    dtype = x.dtype
    acc = torch.promote_types(dtype, torch.float32)
    if add is not None:
        y = add.to(acc)
        if gate is not None:
            y = torch.sigmoid(gate.to(acc)) * y
        x.copy_((x.to(acc) + y).to(dtype))
    z = x.to(acc)
    if silu:
        z = F.silu(z)
    w = None if weight is None else weight.to(acc)
    if norm == "rms":
        h = F.rms_norm(z, (z.shape[-1],), w, eps)
    else:
        h = F.layer_norm(z, (z.shape[-1],), w, None if bias is None else bias.to(acc), eps)
    h = h.to(dtype)
    if mu is None:
        return h
    hf = h.to(acc)
    delta = previous.to(acc) - hf
    outs = [torch.addcmul(hf, delta, mu[i].to(acc)).to(dtype) for i in range(mu.shape[0])]
    previous.copy_(h)
    return torch.stack(outs)


def _check(x, weight, bias, norm, add, gate, previous, mu) -> None:
    op = "norm_mix"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{op}: x must be a floating [B, C] tensor (one token per sequence), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, C = x.shape
    if not x.is_contiguous():
        raise ValueError(f"{op}: x must be contiguous (it is written in place)")
    if norm not in NORMS:
        raise ValueError(f"{op}: norm must be one of {NORMS}, got {norm!r}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (C,):
            raise ValueError(f"{op}: {name} must be [C] = [{C}], got {tuple(t.shape)}")
    check_rows(op, (B, C), x=x, **{name: t for name, t in (("add", add), ("gate", gate), ("previous", previous))
                                  if t is not None})
    if gate is not None and add is None:
        raise ValueError(f"{op}: gate scales add; it needs add")
    if (mu is None) != (previous is None):
        raise ValueError(f"{op}: the token-shift lerps need both previous [B, C] and mu [N, C]")
    if mu is not None:
        if mu.dim() != 2 or mu.shape[1] != C or mu.shape[0] < 1:
            raise ValueError(f"{op}: mu must be [N, C] with N >= 1 and C = {C}, got {tuple(mu.shape)}")
        if not previous.is_contiguous() or previous.dtype != x.dtype:
            raise ValueError(f"{op}: previous must be contiguous and of x's dtype {x.dtype} (it is written in place)")
    for name, t in (("weight", weight), ("bias", bias), ("add", add), ("gate", gate), ("previous", previous),
                    ("mu", mu)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")


def norm_mix(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
             norm: str = "layer", add: torch.Tensor | None = None, gate: torch.Tensor | None = None,
             previous: torch.Tensor | None = None, mu: torch.Tensor | None = None, silu: bool = False,
             backend: str = "auto") -> torch.Tensor:
    """One decoding token's norm (and token-shift lerps), after the residual add.

    Args:
        x: [B, C] the residual stream (contiguous). With `add`, x += add (times sigmoid(gate)) is
            written back into x.
        weight, bias: the norm's [C] affine parameters (None: none).
        eps: the norm's epsilon.
        norm: "layer" (LayerNorm) or "rms" (RMSNorm, bias unused).
        add, gate: [B, C] (unit channel stride, any row stride): the sub-layer output to add first.
        silu: normalise silu(x) instead of x (GSA's output norm); x is not written.
        previous: [B, C] the previous token's normed input (contiguous, x's dtype): the lerps read
            it and it takes this token's h.
        mu: [N, C] the lerp coefficients.
        backend: "auto" (Triton for CUDA tensors), "triton" or "torch".

    Returns h [B, C] without `mu`, else the lerps [N, B, C], in x's dtype. Neither path syncs with
    the host: a CUDA graph can capture it.
    """
    _check(x, weight, bias, norm, add, gate, previous, mu)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if resolve_backend(backend, x.device, "norm_mix") == "triton":
        from .norm_mix_triton import norm_mix_triton
        return norm_mix_triton(x, weight, bias, float(eps), norm, add, gate, previous, mu, silu)
    return norm_mix_torch(x, weight, bias, eps, norm, add, gate, previous, mu, silu)

