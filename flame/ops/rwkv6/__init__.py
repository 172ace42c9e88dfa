"""RWKV6 (Finch) ops."""

from .naive import naive_rwkv6

__all__ = ["naive_rwkv6"]
