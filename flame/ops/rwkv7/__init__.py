"""RWKV7 ops: public chunk_rwkv7 / fused_recurrent_rwkv7 and the naive_rwkv7 oracle."""

from .chunk import chunk_rwkv7
from .fused_recurrent import fused_recurrent_rwkv7
from .naive import naive_rwkv7

__all__ = ["chunk_rwkv7", "fused_recurrent_rwkv7", "naive_rwkv7"]
