"""The fused LM-head cross-entropy: linear_cross_entropy(hidden, weight, labels) in chunks of rows."""

from .linear_cross_entropy import linear_cross_entropy
from .rows_torch import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "linear_cross_entropy"]
