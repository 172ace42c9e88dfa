"""Token shift and the lerps that mix each token with its predecessor (RWKV6 and RWKV7)."""

from .mix import norm_token_shift_mix, norm_token_shift_mix_torch, token_shift_mix, token_shift_mix_torch
from .shift import token_shift

__all__ = ["norm_token_shift_mix", "norm_token_shift_mix_torch", "token_shift", "token_shift_mix",
           "token_shift_mix_torch"]
