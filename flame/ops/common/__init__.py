"""The gated-linear-attention (GLA) chunk core shared by RWKV6 and GSA: Triton kernels + launchers.

The recurrence, per (sequence, head), with a log-gate g_t <= 0 on the key side (the K rows of S):

    S_t = exp(g_t)[:, None] * S_{t-1} + k_t v_t^T                       S in R^{K x V}, fp32
    o_t = S_t^T (scale q_t)                                              (inclusive: GLA, GSA pass 2)
    o_t = S_{t-1}^T (scale q_t) + scale (q_t . (u * k_t)) v_t            (exclusive + bonus u: RWKV6)

`exclusive` (does the query read the state before the current token?) and the bonus `u`
([H, K] or None) are arguments, compiled as constexpr flags of one set of kernels.

Using the core (all tensors token-major and contiguous: q, k, g [B, T, H, K], v [B, T, H, V]):

    layout = chunk_layout(B, T, cu_seqlens, chunk_size=64, device=q.device)  # varlen: B == 1
    DT     = dot_dtype(v.dtype, K)                # tensor-core operand dtype
    BK, BV = block_sizes(K, V)
    # forward
    gc       = chunk_local_cumsum(g, layout)                                  # fp32, * log2(e)
    A, _     = chunk_intra_fwd(q, k, gc, u, layout, scale, exclusive, DT, BK)
    h, ht    = chunk_state_fwd(k, v, gc, layout, h0, output_final_state, DT)
    o        = chunk_output(q, v, gc, h, A, layout, scale, exclusive, DT, BK, BV)
    # backward (recompute gc; A saved from the forward; dht may be None; h=<the forward's h> if it kept them)
    h, dh, dh0 = chunk_states_fwd_bwd(q, k, v, do, gc, layout, h0, dht, scale, exclusive, need_dh0, DT)
    dv, dA, dAd    = chunk_dv_dA_bwd(k, v, gc, A, do, dh, layout, scale, exclusive, u is not None, DT, BK, BV)
    dq, dk, dg, du = chunk_dqkg_from_dA(q, k, v, g, gc, u, h, do, dh, dA, dAd, layout, scale, exclusive, DT, BK, BV)

A is the intra-chunk matrix, fp32 [B, T, H, BT] (scale and the bonus included, zero above the
diagonal); dA its gradient in the same layout (scaled, masked), dAd the bonus diagonal [B, T, H].
The state passes pick the walk or the split pass (`walks`, state.py); where `walks` is false, the intra
kernel can form the split pass's local terms alongside A (`chunk_intra_fwd(..., v=v)`, then
`chunk_scan_states` in place, as RWKV6 does). A family that does not keep A recomputes it with
`chunk_intra_fwd` in the backward; `chunk_dv_dA_bwd(..., with_dv=False)` / `(..., with_dA=False)` form dA
and dv alone, where they need different V-blocks (GSA).

h0/ht/dh0/dht are [N, H, K, V] fp32 (N = B, or the number of packed sequences); h/dh are the
per-chunk states [num_chunks, H, K, V] fp32. dg is the gradient of the raw log-gate g (natural
units), by the reverse-cumsum identity. du is [H, K] fp32. o, dq, dk, dv, dg have the dtypes of v,
q, k, v, g.

Stability (docs/kernels.md#stable-decay-placement): the cumsums are chunk-local fp32; every exponent is <= 0, with
the intra-chunk matrix factored around a reference row that lies between the query and key rows
(the row before the query sub-chunk; for the exclusive query this is the cumsum one position before
the block); rows beyond a sequence end are selected out of every exponent (exp2(-inf) = 0). No
atomics: partial sums are written and reduced in PyTorch, so gradients are bitwise reproducible.

Building blocks for other kernels (flame.ops.common.intra, Triton device functions): `mm` (tl.dot
with the operand-dtype rule, exact 16-bit emulation under the interpreter), `load_rows`, `load_row`,
`load_query_gate` (and their [NB, BC, D] sub-chunk views `load_rows3`, `load_query_gate3`) and
`intra_chunk_matrix`. The state passes work for any gated side by transposition: a gate on the
columns of S is a gate on the rows of S^T (pass the roles swapped).

Not covered here: the intra-chunk read of a gate on the value side (A = q k^T followed by a
per-column decayed A v, GSA pass 1); flame.ops.gsa.chunk_triton builds it from these blocks.

Structure, for speed: the state passes walk the chunks with the state in registers where the batch
gives enough (sequence, head, tile) chains to fill the GPU, and are split into a parallel per-chunk
local term and an elementwise scan over chunks where it does not (state.py), so a long sequence with
few heads does not run a few programs through a chain of tensor-core steps; A is computed once in the forward and
saved (output.py); dv writes dA, which the dq/dk/dg kernel reads whole for the off-diagonal
sub-block products and gathers entry by entry for the exact diagonal sub-blocks, computed in an
[NB, BC, BK] view (a 16-row sub-chunk per leading index) instead of [64, 64] select-reductions.
Launch widths: module constants (INTRA_WARPS, DQKG_WARPS, ...; 4 warps each, the fastest for
RWKV6's K = V = 64 on the H100), and a family with wider tiles passes its own to the
intra and dq/dk/dg kernels (GSA: 8). bench/ops.py --profile gives the per-kernel split. (16 and 8
warps are slower for RWKV6 on the H100 with triton 3.6.)
"""

import os

import torch
import triton
import triton.language as tl

from .cumsum import chunk_local_cumsum
from .grads import chunk_dqkg_from_dA, chunk_dv_dA_bwd
from .layout import ChunkLayout, chunk_layout
from .output import chunk_intra_fwd, chunk_output
from .state import (chunk_local_states, chunk_scan_states, chunk_state_fwd, chunk_states_fwd_bwd, chunk_states_walk,
                    walks)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype, K: int | None = None):
    """The operand dtype of tl.dot (see `intra.mm`) for inputs of `dtype`: the input dtype, except
    fp32 products (no TF32) when the key width K < 32 (cheap products; 16-wide tensor-core tiles
    gain nothing), and for float64 under the interpreter (float64 is refused on the GPU). Under
    the interpreter 16-bit products are emulated exactly (operands rounded, fp32 multiply)."""
    if (K is not None and K < 32) or (dtype == torch.float64 and os.environ.get("TRITON_INTERPRET") == "1"):
        return tl.float32
    if dtype not in _TL_DTYPES:
        raise TypeError(f"the Triton GLA kernels take float32, float16 or bfloat16 inputs, got {dtype} "
                        "(use backend='torch' for float64)")
    return _TL_DTYPES[dtype]


def block_sizes(K: int, V: int) -> tuple[int, int]:
    """K- and V-block widths of the chunk kernels: powers of two, >= 16 (tl.dot), <= 64."""
    return min(64, max(16, triton.next_power_of_2(K))), min(64, max(16, triton.next_power_of_2(V)))


__all__ = [
    "ChunkLayout", "block_sizes", "chunk_dqkg_from_dA", "chunk_dv_dA_bwd", "chunk_intra_fwd", "chunk_layout",
    "chunk_local_cumsum", "chunk_local_states", "chunk_output", "chunk_scan_states", "chunk_state_fwd",
    "chunk_states_fwd_bwd", "chunk_states_walk", "dot_dtype", "walks",
]
