"""norm_mix: one decoding token's residual add, norm and token-shift lerps in one pass."""

from .norm_mix import norm_mix

__all__ = ["norm_mix"]
