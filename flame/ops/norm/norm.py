"""layer_norm and rms_norm over the last dimension, in the input's dtype with fp32 statistics.

The models' norms (flame.models.precision) run through these: x in the compute dtype (bf16), the
weight and bias in theirs (fp32 parameters under autocast, bf16 copies under FSDP's mixed
precision), the mean, variance and normalisation in fp32 (fp64 for fp64 x), the output in x's
dtype. The Triton form reads x once forward and x and dy once backward, weight and bias gradients
included (flame.ops.norm.norm_triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.backend import resolve_backend
from ..utils.checks import FLOAT_DTYPES
from ..utils.dtypes import accumulation_dtype, autocast_off


def norm_torch(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               rms: bool) -> torch.Tensor:
    """The norm in PyTorch (autograd through F.layer_norm / F.rms_norm on fp32 copies)."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    wf = weight.to(acc) if weight is not None else None
    if rms:
        y = F.rms_norm(xf, x.shape[-1:], wf, eps)
    else:
        y = F.layer_norm(xf, x.shape[-1:], wf, bias.to(acc) if bias is not None else None, eps)
    return y.to(x.dtype)


def _check_inputs(op: str, x, residual, weight, bias, eps) -> None:
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must be [..., C] with C > 0, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        raise ValueError(f"{op}: residual must match x's shape {tuple(x.shape)} and device {x.device}, got shape "
                         f"{tuple(residual.shape)} on {residual.device}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (C,):
            raise ValueError(f"{op}: {name} must be [C] = [{C}] (x's last dimension), got shape {tuple(t.shape)}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} must be on x's device {x.device}, got {t.device}")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{op}: eps must be a positive number, got {eps!r}")


def _norm(op: str, x, residual, weight, bias, eps, rms: bool, stream: bool, backend: str):
    _check_inputs(op, x, residual, weight, bias, eps)
    if residual is not None and residual.dtype != x.dtype:  # as x + residual would: the promoted dtype
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    with autocast_off(x.device):
        if resolve_backend(backend, x.device, op) == "triton":
            from .norm_triton import norm_triton
            s, y = norm_triton(x, residual, weight, bias, eps, rms)
        else:
            s = x + residual if residual is not None else x
            y = norm_torch(s, weight, bias, eps, rms)
    return (s, y) if stream or residual is not None else y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
               residual: torch.Tensor | None = None, stream: bool = False, backend: str = "auto"):
    """LayerNorm of x [..., C] over C: (x - mean) / sqrt(var + eps) * weight + bias, with the
    biased variance; weight and bias [C] or None. Returns x's shape and dtype.

    The pre-norm block's form, `stream=True` or a `residual` (x's shape): returns (s, layer_norm(s))
    with s = x + residual (in the promoted dtype of the two, as the add's) or s = x. The block
    carries s on as its residual stream; the Triton form adds in the norm's pass forward, and
    backward adds s's gradient from the stream into the norm's dx in the norm's pass.
    backend: "auto" (Triton for CUDA tensors, PyTorch for CPU), "triton" or "torch"."""
    return _norm("layer_norm", x, residual, weight, bias, eps, False, stream, backend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, residual: torch.Tensor | None = None,
             stream: bool = False, backend: str = "auto"):
    """RMSNorm of x [..., C] over C: x / sqrt(mean(x^2) + eps) * weight; weight [C] or None.
    Returns x's shape and dtype; `residual`, `stream` and `backend` as layer_norm's."""
    return _norm("rms_norm", x, residual, weight, None, eps, True, stream, backend)
