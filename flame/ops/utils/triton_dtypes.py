"""Triton's form of the accumulation dtype (flame.ops.utils.dtypes), for kernels' `ACC` argument."""

from __future__ import annotations

import torch
import triton.language as tl

from .dtypes import accumulation_dtype


def tl_accumulation_dtype(dtype: torch.dtype):
    """accumulation_dtype(dtype) as a Triton dtype: tl.float32, or tl.float64 for fp64."""
    return {torch.float32: tl.float32, torch.float64: tl.float64}[accumulation_dtype(dtype)]
