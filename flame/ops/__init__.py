"""flame.ops: the linear-attention ops of RWKV6, RWKV7 and GSA (see docs/architecture.md)."""

from .gsa import naive_gsa
from .rwkv6 import naive_rwkv6
from .rwkv7 import naive_rwkv7

__all__ = ["naive_gsa", "naive_rwkv6", "naive_rwkv7"]
