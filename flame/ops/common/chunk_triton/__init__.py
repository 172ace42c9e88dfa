"""The gated-linear-attention chunk core in Triton, shared by RWKV6 and GSA (docs/kernels.md#triton-chunk-core)."""

from .cumsum import chunk_local_cumsum
from .grads import chunk_dqkg_from_dA, chunk_dv_dA_bwd, fuses_softmax_bwd
from .layout import ChunkLayout, chunk_layout
from .output import chunk_intra_fwd, chunk_output
from .plan import block_sizes, dot_dtype, three_programs_register_cap
from .state import (chunk_local_states, chunk_scan_states, chunk_state_fwd, chunk_states_fwd_bwd, chunk_states_walk,
                    walks)

__all__ = [
    "ChunkLayout", "block_sizes", "chunk_dqkg_from_dA", "chunk_dv_dA_bwd", "chunk_intra_fwd", "chunk_layout",
    "chunk_local_cumsum", "chunk_local_states", "chunk_output", "chunk_scan_states", "chunk_state_fwd",
    "chunk_states_fwd_bwd", "chunk_states_walk", "dot_dtype", "fuses_softmax_bwd", "three_programs_register_cap",
    "walks",
]
