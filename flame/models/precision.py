"""The dtype the models compute in, and norms that keep it.

Under FSDP mixed precision every parameter arrives in the compute dtype (bf16), and so does every
activation. Under `torch.autocast` with fp32 parameters (one GPU, or a user's own loop), autocast
runs the matmuls in bf16, but an elementwise op that meets an fp32 parameter promotes to fp32, and
norms return fp32: the residual stream and the glue between the matmuls would run in fp32, at twice
the memory traffic and activation memory. The models therefore keep activations in the compute
dtype: the embedding output is cast to it (`flame.ops.utils.dtypes.to_compute_dtype`), norms return
their input's dtype (`LayerNorm`, `GroupNorm`, `RMSNorm`), and a per-channel parameter is cast to
the activation's dtype where it meets an activation (`like`). Without autocast all three leave the
dtypes alone.
"""

from __future__ import annotations

import torch
from torch import nn

from flame import ops


def like(param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`param` in the dtype of the activation `x` it is combined with."""
    return param.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (its parameters, state-dict names and init) whose output has the input's dtype,
    computed by flame.ops.layer_norm: fp32 statistics; on CUDA one Triton pass each way, the weight
    and bias gradients in the backward's pass."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, backend: str = "auto"):
        super().__init__(normalized_shape, eps=eps)
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, stream: bool = False):
        """The norm of x; in a pre-norm block (`stream`, or a `residual` to add first), (s, norm(s))
        with s = x (+ residual) the residual stream: one pass each way for the add, the norm and,
        backward, the sum of s's two gradients (flame.ops.layer_norm)."""
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual=residual, stream=stream,
                              backend=self.backend)


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm whose output has the input's dtype (autocast computes it in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (its parameter, state-dict name and init) whose output has the input's dtype,
    computed by flame.ops.rms_norm as LayerNorm is by flame.ops.layer_norm."""

    def __init__(self, normalized_shape: int, eps: float = 1e-6, backend: str = "auto"):
        super().__init__(normalized_shape, eps=eps)
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, stream: bool = False):
        """The norm of x, or (s, norm(s)): as LayerNorm's."""
        return ops.rms_norm(x, self.weight, self.eps, residual=residual, stream=stream, backend=self.backend)
