"""decode_matmul: several projections of one decoding token in one launch, with the norm and
token-shift lerps before them and the activation, residual add and token-shift commit after."""

from .decode_matmul import decode_matmul, decode_matmul_torch
from .segments import ACTIVATIONS, Segment

__all__ = ["ACTIVATIONS", "Segment", "decode_matmul", "decode_matmul_torch"]
