"""squared_relu: y = relu(x)^2, the activation of the RWKV6 and RWKV7 channel mixes.

Autograd's form saves x (or relu(x)) for dx = 2 relu(x) dy, and the next projection saves y for
its weight gradient: two [tokens, 4C] tensors, or one and a recomputation. Here the gradient is
taken from the output, dx = 2 sqrt(y) dy (relu(x) = sqrt(y) for y >= 0), so only y is kept, and
the backward reads two tensors and writes one instead of reading two, recomputing y and writing
two.
"""

from __future__ import annotations

import torch

from ..utils.backend import resolve_backend
from ..utils.dtypes import autocast_off, to_compute_dtype


def squared_relu(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """relu(x)^2 in x's compute dtype (the autocast dtype under autocast; flame.ops.utils.dtypes), computed
    in fp32; its gradient is 2 sqrt(y) dy, from the output y (the Triton backend) or 2 relu(x) dy
    (the PyTorch backend: autograd's own)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"squared_relu: x must be a floating-point torch.Tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    (x,) = to_compute_dtype(x)
    with autocast_off(x.device):
        if resolve_backend(backend, x.device, "squared_relu") == "triton":
            from .squared_relu_triton import squared_relu_triton
            return squared_relu_triton(x)
        return torch.relu(x).square()
