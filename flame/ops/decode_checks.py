"""Input checks shared by the one-token decoding ops (flame.ops.norm_mix and the families'
decode_step): shape, layout and device only, nothing that syncs with the host, so a CUDA graph can
capture the ops with their checks."""

from __future__ import annotations

import torch


def check_rows(op: str, shape: tuple[int, int], **tensors: torch.Tensor) -> None:
    """Each tensor is a floating [rows, cols] = `shape` tensor with unit channel stride (any row
    stride: a view of a stacked or fused matmul output) on the device of the first."""
    device = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be a floating-point torch.Tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != tuple(shape) or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{op}: {name} must be [B, C] = {list(shape)} with unit channel stride, got shape "
                             f"{tuple(t.shape)} and strides {t.stride()}")
        device = t.device if device is None else device
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, the other inputs on {device}")
