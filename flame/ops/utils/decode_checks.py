"""Input checks shared by the one-token decoding ops (flame.ops.decode_matmul and the families'
decode_step): shape, layout and device only, nothing that syncs with the host, so a CUDA graph can
capture the ops with their checks."""

from __future__ import annotations

import torch

from .dtypes import accumulation_dtype


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


def check_state(op: str, name: str, state: torch.Tensor, shape: tuple[int, ...], inputs_dtype: torch.dtype) -> None:
    """A recurrent state updated in place: contiguous, of `shape`, fp32 (fp64 for fp64 inputs)."""
    dtype = accumulation_dtype(inputs_dtype)
    if not isinstance(state, torch.Tensor) or tuple(state.shape) != tuple(shape) or state.dtype != dtype \
            or not state.is_contiguous():
        got = f"{tuple(state.shape)} {state.dtype}" if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(f"{op}: {name} must be a contiguous {dtype} tensor of shape {tuple(shape)}, got {got}")


def check_head_state(op: str, r: torch.Tensor, per_head: torch.Tensor, per_head_name: str,
                     state: torch.Tensor) -> tuple[int, int, int, int]:
    """(B, C, H, N) of an RWKV decode step: r [B, C], a per-head parameter [H, N] with H * N = C,
    and the state [B, H, N, N] (check_state)."""
    B, C = r.shape
    H, N = per_head.shape
    if H * N != C:
        raise ValueError(f"{op}: C = {C} must be heads x head size = {H} x {N} ({per_head_name}'s shape)")
    check_state(op, "state", state, (B, H, N, N), r.dtype)
    return B, C, H, N
