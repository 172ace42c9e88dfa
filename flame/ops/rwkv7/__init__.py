"""RWKV7 ops."""

from .naive import naive_rwkv7

__all__ = ["naive_rwkv7"]
