"""LayerNorm and RMSNorm with fp32 statistics, in the input's dtype; the Triton form fuses the weight
and bias gradients into the backward's one pass."""

from .norm import layer_norm, norm_torch, rms_norm

__all__ = ["layer_norm", "norm_torch", "rms_norm"]
