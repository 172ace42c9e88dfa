"""The host's choices for one call of the chunk kernels: the tl.dot operand dtype and the K/V block widths."""

import torch
import triton
import triton.language as tl

from ...utils.backend import triton_interpreter_enabled

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def three_programs_register_cap(head_dim: int) -> int | None:
    """A per-thread register cap (launch keyword maxnreg) that fits three programs of 4 warps on an
    SM instead of two: 168 at head dims <= 64, where the kernels that take it (RWKV7's `prepare` and
    `_bwd_intra`, RWKV6's dv) run faster despite a few spills; None (Triton's choice) at wider heads,
    whose tiles would spill far more (bench/RESULTS.md, "Chunk kernels' launch settings")."""
    return 168 if head_dim <= 64 else None


def dot_dtype(dtype: torch.dtype, K: int | None = None):
    """The operand dtype of tl.dot (see `intra.mm`) for inputs of `dtype`: the input dtype, except
    fp32 products (no TF32) when the key width K < 32 (cheap products; 16-wide tensor-core tiles
    gain nothing), and for float64 under the interpreter (float64 is refused on the GPU). Under
    the interpreter 16-bit products are emulated exactly (operands rounded, fp32 multiply)."""
    if (K is not None and K < 32) or (dtype == torch.float64 and triton_interpreter_enabled()):
        return tl.float32
    if dtype not in _TL_DTYPES:
        raise TypeError(f"the Triton GLA kernels take float32, float16 or bfloat16 inputs, got {dtype} "
                        "(use backend='torch' for float64)")
    return _TL_DTYPES[dtype]


def block_sizes(K: int, V: int) -> tuple[int, int]:
    """K- and V-block widths of the chunk kernels: powers of two, >= 16 (tl.dot), <= 64."""
    return min(64, max(16, triton.next_power_of_2(K))), min(64, max(16, triton.next_power_of_2(V)))
