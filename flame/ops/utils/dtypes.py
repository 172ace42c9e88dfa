"""The two dtypes of an op call: the compute dtype its floating inputs are cast to before the checks,
and the accumulation dtype its states, sums and reductions run in.

Under `torch.autocast` a model with fp32 parameters produces a mix of dtypes (bf16 matmul outputs,
fp32 elementwise results); the ops then compute in the autocast dtype, as autocast's own matmuls do.
Outside autocast, mixed inputs are promoted (`torch.promote_types`), so nothing loses precision that
the caller did not give up. States (initial_state) keep their own dtype: they are fp32 by contract.
The accumulation dtype is fp32, or fp64 for fp64 inputs, whatever the compute dtype.
"""

from __future__ import annotations

import torch


def compute_dtype(tensors) -> torch.dtype:
    """The dtype the floating tensors of one op call compute in (see the module docstring)."""
    floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise TypeError("expected at least one floating-point tensor")
    device_type = floats[0].device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    dtype = floats[0].dtype
    for t in floats[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that states, cumulative sums and reductions over inputs of `dtype` run in: fp32, or
    fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_compute_dtype(*tensors):
    """The tensors cast to their common compute dtype; non-floating tensors and None pass through
    unchanged (the op's checks then name them)."""
    floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return tensors
    dtype = compute_dtype(floats)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
                 else t for t in tensors)


def autocast_off(device: torch.device):
    """Autocast switched off for the op's own computation: once the inputs share the compute dtype, the
    op's internal precision (fp32 cumulative sums and states, its own matmul dtypes) is its choice,
    not autocast's."""
    return torch.autocast(device.type, enabled=False)
