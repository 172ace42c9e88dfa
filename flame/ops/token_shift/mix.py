"""token_shift_mix: the lerps between each token and its predecessor, x + (x_{t-1} - x) * c_i.

RWKV6 and RWKV7 feed every projection of a time mix or channel mix with its own lerp of the
normed input x and its token shift: x_i = x + delta * c_i with delta = token_shift(x) - x and a
per-channel coefficient c_i = mu_i (RWKV7; RWKV6's channel mix and its first, static lerp), or
mu_i + m_i with a data-dependent m_i from a LoRA (RWKV6's five time-mix branches).
"""

from __future__ import annotations

import torch

from ..utils.backend import resolve_backend
from ..utils.checks import FLOAT_DTYPES
from ..utils.dtypes import accumulation_dtype, autocast_off, to_compute_dtype
from .shift import sequence_starts, token_shift


def token_shift_mix_torch(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None = None,
                          cu_seqlens: torch.Tensor | None = None, previous: torch.Tensor | None = None
                          ) -> list[torch.Tensor]:
    """token_shift_mix in PyTorch (autograd through plain ops); the math in fp32 (fp64 for fp64 x)."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    delta = token_shift(xf, cu_seqlens, previous) - xf
    n_static = mu.shape[0] - (m.shape[0] if m is not None else 0)
    outs = []
    for i in range(mu.shape[0]):
        coef = mu[i].to(acc)
        if i >= n_static:
            coef = coef + m[i - n_static].to(acc)
        outs.append(torch.addcmul(xf, delta, coef).to(x.dtype))
    return outs


def _check_inputs(x, mu, m, cu_seqlens, previous) -> None:
    op = "token_shift_mix"
    for name, t in (("x", x), ("mu", mu), ("m", m), ("previous", previous)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if mu.dim() != 2 or mu.shape[1] != C or not 1 <= mu.shape[0] <= 6:
        raise ValueError(f"{op}: mu must be [N, C] = [N, {C}] with 1 <= N <= 6 branches, got shape {tuple(mu.shape)}")
    if m is not None and (m.dim() != 4 or tuple(m.shape[1:]) != (B, T, C) or m.shape[0] > mu.shape[0]):
        raise ValueError(f"{op}: m must be [N_M, B, T, C] = [N_M, {B}, {T}, {C}] with N_M <= N = {mu.shape[0]}, "
                         f"got shape {tuple(m.shape)}")
    if previous is not None and tuple(previous.shape) != (B, C):
        raise ValueError(f"{op}: previous must be [B, C] = [{B}, {C}], got shape {tuple(previous.shape)}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor of N+1 offsets, got shape "
                             f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"{op}: cu_seqlens needs the documents packed into batch size 1, got batch size {B}")
    for name, t in (("mu", mu), ("m", m), ("previous", previous), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} must be on x's device {x.device}, got {t.device}")


def token_shift_mix(x: torch.Tensor, mu: torch.Tensor, m: torch.Tensor | None = None, *,
                    cu_seqlens: torch.Tensor | None = None, previous: torch.Tensor | None = None,
                    backend: str = "auto") -> list[torch.Tensor]:
    """The N lerps x + (token_shift(x) - x) * c_i, i = 0 .. N-1, with c_i = mu_i for the first
    N - N_M branches and c_i = mu_i + m_{i - (N - N_M)} for the last N_M.

    Args:
        x: [B, T, C] floating; x and m compute in one dtype (the autocast dtype under autocast,
            see flame.ops.utils.dtypes), the lerps in fp32.
        mu: [N, C] per-channel coefficients, 1 <= N <= 6 (fp32 parameters stay fp32; the gradient
            has mu's dtype).
        m: [N_M, B, T, C] data-dependent offsets of the last N_M coefficients, or None.
        cu_seqlens: offsets of documents packed into B == 1: the token shift is zero at each start.
            The offsets are the caller's to validate (CausalLM checks them once per batch).
        previous: [B, C] the token before x's first (decoding), or None for zeros. Calls with it run
            the PyTorch form.
        backend: "auto" (Triton for CUDA tensors, PyTorch for CPU), "triton" or "torch".

    Returns a list of N tensors [B, T, C] in the compute dtype.
    """
    _check_inputs(x, mu, m, cu_seqlens, previous)
    x, m = to_compute_dtype(x, m)
    with autocast_off(x.device):
        if previous is None and resolve_backend(backend, x.device, "token_shift_mix") == "triton":
            from .mix_triton import token_shift_mix_triton
            starts = sequence_starts(cu_seqlens, x.shape[1]) if cu_seqlens is not None else None
            return token_shift_mix_triton(x, mu, m, starts)
        return token_shift_mix_torch(x, mu, m, cu_seqlens, previous)
