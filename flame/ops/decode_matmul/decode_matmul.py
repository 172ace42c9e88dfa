"""decode_matmul: the projections of one decoding token, several of them in one launch.

A decoding step multiplies a few rows (one token per sequence, B of them) by many small weight
matrices; each product alone is a launch that reads a few MB and waits on its latency. Here the
weights of the projections that read the same token are concatenated along their outputs
(`weight` [rows, K], nn.Linear's layout) and described by `segments`, and one launch computes

    out[:, segment] = act(input[source] @ W[segment]^T)

for every segment, accumulating in fp32, with what sits around the products fused in:

- prologue, the input's norm and token-shift lerps (`norm`): the row x [B, K] is normalised
  (LayerNorm or RMSNorm, of silu(x) with `silu`), h is rounded to x's dtype, and with `previous`
  and `mu` the inputs are the lerps input[p] = h + (previous - h) * (mu[p] + mix[p]) (`mix` is
  optional), rounded once; h is written to `h_out` when given. `previous` is only read: every
  program of the launch reads it whole, so this token's h (the next token's `previous`) is
  committed by a later launch (`commit`). Without `norm`, x is the stack of inputs [P, B, K].
- epilogue, per segment, an activation: "tanh", "sigmoid", "sqrelu" (relu(z)^2), or "swiglu"
  (the segment's weight holds 2 x width rows, gate then up: silu(z_gate) * z_up); and for the
  whole launch, a residual add: residual += out (times sigmoid(residual_gate)), in place.
- `commit` (src, dst) [B, N]: dst <- src, written column by column by the programs that own the
  columns of the output, which read neither.

Rounding: h is computed in fp32 and rounded to x's dtype (a norm layer's output), the lerps are
computed in fp32 from that rounded h and rounded once; the products are fp32 sums of the rounded
inputs times the weights; the activation is applied in fp32 and rounded once (with a
residual, residual + activation is rounded once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.backend import resolve_backend
from ..utils.decode_checks import check_rows
from ..utils.dtypes import accumulation_dtype
from .segments import ACTIVATIONS, Segment

NORM_KINDS = ("layer", "rms")


def _norm_rounded(x, weight, bias, eps, norm, silu):
    """The prologue's h: LayerNorm or RMSNorm (`norm`) of x, or of silu(x) with `silu`, computed in
    fp32 (x's dtype when wider) and rounded to x's dtype."""
    acc = accumulation_dtype(x.dtype)
    z = x.to(acc)
    if silu:
        z = F.silu(z)
    w = None if weight is None else weight.to(acc)
    if norm == "rms":
        h = F.rms_norm(z, (z.shape[-1],), w, eps)
    else:
        h = F.layer_norm(z, (z.shape[-1],), w, None if bias is None else bias.to(acc), eps)
    return h.to(x.dtype)


def _activation(z: torch.Tensor, act: str | None, up: torch.Tensor | None = None) -> torch.Tensor:
    if act == "tanh":
        return torch.tanh(z)
    if act == "sigmoid":
        return torch.sigmoid(z)
    if act == "sqrelu":
        return torch.relu(z).square()
    if act == "swiglu":
        return F.silu(z) * up
    return z


def decode_matmul_torch(x, weight, segments, norm=None, norm_weight=None, norm_bias=None, eps=1e-5, silu=False,
                        previous=None, mu=None, mix=None, h_out=None, residual=None, residual_gate=None,
                        commit=None):
    """decode_matmul in PyTorch; the same contract as `decode_matmul` (arguments checked)."""
    dtype = x.dtype
    acc = accumulation_dtype(dtype)
    if norm is not None:
        h = _norm_rounded(x, norm_weight, norm_bias, eps, norm, silu)
        if h_out is not None:
            h_out.copy_(h)
        if mu is None:
            inputs = h[None]
        else:
            hf = h.to(acc)
            coef = mu.to(acc)[:, None] + (0 if mix is None else mix.to(acc))
            inputs = (hf + (previous.to(acc) - hf) * coef).to(dtype)
    else:
        inputs = x
    w = weight.to(acc)
    outs, row = [], 0
    for seg in segments:
        a = inputs[seg.source].to(acc)
        z = a @ w[row:row + seg.width].T
        up = a @ w[row + seg.width:row + 2 * seg.width].T if seg.act == "swiglu" else None
        outs.append(_activation(z, seg.act, up))
        row += seg.weight_rows
    y = torch.cat(outs, dim=1)
    if residual is not None:
        if residual_gate is not None:
            y = torch.sigmoid(residual_gate.to(acc)) * y
        residual.copy_((residual.to(acc) + y).to(dtype))
        y = residual
    else:
        y = y.to(dtype)
    if commit is not None:
        commit[1].copy_(commit[0])
    return y


def _check(x, weight, segments, norm, norm_weight, norm_bias, previous, mu, mix, h_out, residual, residual_gate,
           commit) -> tuple[int, int, int]:
    op = "decode_matmul"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != (2 if norm else 3):
        want = "[B, K] (the row the norm reads)" if norm else "[P, B, K] (the stacked inputs)"
        raise ValueError(f"{op}: x must be a floating {want} tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{op}: x must have unit channel stride, got strides {x.stride()}")
    B, K = x.shape[-2:]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != K \
            or not weight.is_contiguous() or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"{op}: weight must be a contiguous [rows, K = {K}] tensor of x's dtype {x.dtype} on "
                         f"{x.device}, got {tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight}")
    if not segments:
        raise ValueError(f"{op}: segments must list at least one Segment")
    sources = mu.shape[0] if (norm and mu is not None) else 1 if norm else x.shape[0]
    for seg in segments:
        if not isinstance(seg, Segment) or seg.width < 1 or seg.act not in ACTIVATIONS \
                or not 0 <= seg.source < sources:
            raise ValueError(f"{op}: each segment must be a Segment with width >= 1, an activation of {ACTIVATIONS} "
                             f"and a source in [0, {sources}), got {seg!r}")
    if any(seg.act == "swiglu" for seg in segments) and any(seg.act != "swiglu" for seg in segments):
        raise ValueError(f"{op}: 'swiglu' segments cannot share a launch with other activations")
    rows = sum(seg.weight_rows for seg in segments)
    if rows != weight.shape[0]:
        raise ValueError(f"{op}: the segments cover {rows} weight rows, weight has {weight.shape[0]}")
    N = sum(seg.width for seg in segments)
    if norm is not None:
        if norm not in NORM_KINDS:
            raise ValueError(f"{op}: norm must be one of {NORM_KINDS} or None, got {norm!r}")
        for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
            if t is not None and (tuple(t.shape) != (K,) or t.device != x.device):
                raise ValueError(f"{op}: {name} must be [K] = [{K}] on {x.device}, got {tuple(t.shape)}")
        if (mu is None) != (previous is None):
            raise ValueError(f"{op}: the token-shift lerps need both previous [B, K] and mu [P, K]")
        if mu is not None:
            if mu.dim() != 2 or mu.shape[1] != K or mu.device != x.device:
                raise ValueError(f"{op}: mu must be [P, K] with K = {K} on {x.device}, got {tuple(mu.shape)}")
            check_rows(op, (B, K), x=x, previous=previous)
            if not previous.is_contiguous():
                raise ValueError(f"{op}: previous must be contiguous")
            if mix is not None and (tuple(mix.shape) != (mu.shape[0], B, K) or mix.stride(-1) != 1
                                    or mix.device != x.device):
                raise ValueError(f"{op}: mix must be [P, B, K] = {[mu.shape[0], B, K]} with unit channel stride, "
                                 f"got {tuple(mix.shape)}")
        elif mix is not None:
            raise ValueError(f"{op}: mix adds to the lerp coefficients; it needs previous and mu")
        if h_out is not None:
            check_rows(op, (B, K), x=x, h_out=h_out)
            if not h_out.is_contiguous() or h_out.dtype != x.dtype:
                raise ValueError(f"{op}: h_out must be contiguous and of x's dtype {x.dtype}")
    elif any(t is not None for t in (norm_weight, norm_bias, previous, mu, mix, h_out)):
        raise ValueError(f"{op}: norm_weight, norm_bias, previous, mu, mix and h_out belong to the norm prologue; "
                         "pass norm='layer' or 'rms'")
    for name, t in (("residual", residual), *(zip(("commit source", "commit target"), commit or ()))):
        if t is not None and (tuple(t.shape) != (B, N) or not t.is_contiguous() or t.dtype != x.dtype
                              or t.device != x.device):
            raise ValueError(f"{op}: {name} must be a contiguous [B, N] = {[B, N]} tensor of x's dtype on "
                             f"{x.device}, got {tuple(t.shape)} {t.dtype}")
    if residual_gate is not None:
        if residual is None:
            raise ValueError(f"{op}: residual_gate scales the residual add; it needs residual")
        check_rows(op, (B, N), residual_gate=residual_gate)
    if commit is not None and len(commit) != 2:
        raise ValueError(f"{op}: commit must be a (source, target) pair")
    return B, K, N


def decode_matmul(x: torch.Tensor, weight: torch.Tensor, segments: tuple[Segment, ...] | None = None, *,
                  norm: str | None = None, norm_weight: torch.Tensor | None = None,
                  norm_bias: torch.Tensor | None = None, eps: float | None = None, silu: bool = False,
                  previous: torch.Tensor | None = None, mu: torch.Tensor | None = None,
                  mix: torch.Tensor | None = None, h_out: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, residual_gate: torch.Tensor | None = None,
                  commit: tuple[torch.Tensor, torch.Tensor] | None = None, backend: str = "auto") -> torch.Tensor:
    """Stacked projections of one decoding token with their prologue and epilogue (module docstring).

    Args:
        x: with `norm`, the row [B, K] that is normalised (unit channel stride); without, the
            inputs [P, B, K] (unit channel stride, any other strides: views of an earlier output).
        weight: [rows, K] contiguous, x's dtype: the segments' weights, concatenated in order.
        segments: the output segments (default: one plain segment over all rows).
        norm, norm_weight, norm_bias, eps, silu: "layer" or "rms", its [K] affine parameters and
            epsilon (None: the dtype's), applied to silu(x) with `silu`.
        previous: [B, K] the previous token's h; mu: [P, K] the lerp coefficients; mix: [P, B, K]
            added to mu (RWKV6's data-dependent lerps).
        h_out: [B, K] contiguous: receives this token's h.
        residual: [B, N] contiguous: residual += out (times sigmoid(residual_gate), [B, N] with
            unit channel stride), in place; it is then the return value.
        commit: (source, target) [B, N] contiguous: target <- source.
        backend: "auto" (Triton for CUDA tensors), "triton" or "torch".

    Returns out [B, N] in x's dtype (N = the segments' widths), or `residual`. No host sync: a CUDA
    graph can capture it (the Triton path builds each tile table on first use, so a captured step
    runs once eagerly first).
    """
    segments = (Segment(weight.shape[0]),) if segments is None else tuple(segments)
    _check(x, weight, segments, norm, norm_weight, norm_bias, previous, mu, mix, h_out, residual, residual_gate,
           commit)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if resolve_backend(backend, x.device, "decode_matmul") == "triton":
        from .decode_matmul_triton import decode_matmul_triton
        return decode_matmul_triton(x, weight, segments, norm, norm_weight, norm_bias, float(eps), silu, previous,
                                    mu, mix, h_out, residual, residual_gate, commit)
    return decode_matmul_torch(x, weight, segments, norm, norm_weight, norm_bias, eps, silu, previous, mu, mix,
                               h_out, residual, residual_gate, commit)
