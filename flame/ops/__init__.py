"""flame.ops: the linear-attention ops of RWKV6, RWKV7 and GSA, the RWKV token-shift lerps and channel
mix, the norms, and the fused LM-head loss (see docs/architecture.md)."""

from .utils.checks import set_value_checks
from .gsa import chunk_gsa, fused_recurrent_gsa, naive_gsa
from .linear_cross_entropy import linear_cross_entropy
from .norm import layer_norm, rms_norm
from .rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6, naive_rwkv6
from .rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7, naive_rwkv7
from .squared_relu import squared_relu_mlp
from .token_shift import token_shift, token_shift_mix

__all__ = [
    "chunk_gsa", "chunk_rwkv6", "chunk_rwkv7",
    "fused_recurrent_gsa", "fused_recurrent_rwkv6", "fused_recurrent_rwkv7",
    "layer_norm", "linear_cross_entropy",
    "naive_gsa", "naive_rwkv6", "naive_rwkv7",
    "rms_norm", "set_value_checks", "squared_relu_mlp", "token_shift", "token_shift_mix",
]
