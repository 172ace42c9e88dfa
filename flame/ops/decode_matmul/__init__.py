"""decode_matmul: several projections of one decoding token in one launch, with the norm and
token-shift lerps before them and the activation, residual add and token-shift commit after."""

from .decode_matmul import ACTIVATIONS, Segment, decode_matmul, decode_matmul_torch

__all__ = ["ACTIVATIONS", "Segment", "decode_matmul", "decode_matmul_torch"]
