"""norm_mix: one decoding token's residual add, norm and token-shift lerps in one pass; shift_lerp:
RWKV6's data-dependent lerps of the same token."""

from .norm_mix import norm_mix, shift_lerp

__all__ = ["norm_mix", "shift_lerp"]
