"""squared_relu_mlp: relu(x W_k^T)^2 W_v^T, the RWKV channel mixes' key product, squared ReLU and value
product as one op.

Composed of autograd's pieces, the key product writes its pre-activation [tokens, F], the activation
reads it and writes y, and the backward writes dy = dout W_v for the activation's gradient to read.
The Triton backend computes the activation in the epilogues of the two products that touch the wide
[tokens, F] tensors (flame/ops/squared_relu/squared_relu_mlp_triton.py): the forward writes only y,
which the backward keeps (for W_v's gradient and for relu(k) = sqrt(y)), and the backward's product
with W_v writes the pre-activation's gradient directly. The other three products of the backward
(dx, the two weight gradients) run on cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.backend import resolve_backend, triton_interpreter_enabled
from ..utils.dtypes import autocast_off, to_compute_dtype

_DESCRIPTOR_ALIGNMENT = 8  # tensor-memory-access descriptors need rows of a multiple of 16 bytes


def squared_relu_mlp(x: torch.Tensor, w_key: torch.Tensor, w_value: torch.Tensor, *,
                     backend: str = "auto") -> torch.Tensor:
    """relu(x @ w_key^T)^2 @ w_value^T for x [..., C], w_key [F, C] and w_value [C_out, F] (nn.Linear
    weights), in the compute dtype of the inputs (flame.ops.utils.dtypes). The Triton backend takes
    16-bit inputs (and fp32 under the interpreter) with C, F and C_out multiples of 8; other inputs
    run the PyTorch composition."""
    tensors = {"x": x, "w_key": w_key, "w_value": w_value}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"squared_relu_mlp: {name} must be a floating-point torch.Tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if w_key.dim() != 2 or w_value.dim() != 2 or x.dim() < 1:
        raise ValueError(f"squared_relu_mlp: expected x [..., C], w_key [F, C], w_value [C_out, F], got "
                         f"{tuple(x.shape)}, {tuple(w_key.shape)}, {tuple(w_value.shape)}")
    if x.shape[-1] != w_key.shape[1] or w_value.shape[1] != w_key.shape[0]:
        raise ValueError(f"squared_relu_mlp: x [..., {x.shape[-1]}] needs w_key [F, {x.shape[-1]}] and "
                         f"w_value [C_out, F]; got w_key {tuple(w_key.shape)}, w_value {tuple(w_value.shape)}")
    if len({t.device for t in tensors.values()}) > 1:
        raise ValueError(f"squared_relu_mlp: x, w_key and w_value must be on one device, got "
                         f"{', '.join(str(t.device) for t in tensors.values())}")
    x, w_key, w_value = to_compute_dtype(x, w_key, w_value)
    with autocast_off(x.device):
        if resolve_backend(backend, x.device, "squared_relu_mlp") == "triton" and _triton_takes(x, w_key, w_value):
            from .squared_relu_mlp_triton import squared_relu_mlp_triton

            out = squared_relu_mlp_triton(x.reshape(-1, x.shape[-1]).contiguous(), w_key.contiguous(),
                                          w_value.contiguous())
            return out.view(*x.shape[:-1], w_value.shape[0])
        return F.linear(torch.relu(F.linear(x, w_key)).square(), w_value)


def _triton_takes(x: torch.Tensor, w_key: torch.Tensor, w_value: torch.Tensor) -> bool:
    """Whether the Triton kernels take these inputs (see squared_relu_mlp)."""
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if triton_interpreter_enabled() else ())
    widths = (w_key.shape[1], w_key.shape[0], w_value.shape[0])
    return x.dtype in dtypes and all(w % _DESCRIPTOR_ALIGNMENT == 0 for w in widths)
