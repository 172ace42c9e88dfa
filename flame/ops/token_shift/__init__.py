"""Token shift and the lerps that mix each token with its predecessor (RWKV6 and RWKV7)."""

from .mix import token_shift_mix, token_shift_mix_torch
from .shift import token_shift

__all__ = ["token_shift", "token_shift_mix", "token_shift_mix_torch"]
