"""The fused LM-head cross-entropy: linear_cross_entropy(hidden, weight, labels) in chunks of rows."""

from .linear_cross_entropy import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
