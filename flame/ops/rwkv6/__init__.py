"""RWKV6 ops: public chunk_rwkv6 / fused_recurrent_rwkv6 and the naive_rwkv6 oracle."""

from .chunk import chunk_rwkv6
from .fused_recurrent import fused_recurrent_rwkv6
from .naive import naive_rwkv6

__all__ = ["chunk_rwkv6", "fused_recurrent_rwkv6", "naive_rwkv6"]
