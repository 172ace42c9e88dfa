"""Triton chunked RWKV6 on the shared gated-linear-attention core
(docs/kernels.md#rwkv6-chunked-forward to #rwkv6-chunked-backward).

RWKV6 is GLA with the gate on the key side, an exclusive query decay and the bonus u on the
diagonal: exactly the `exclusive=True, u=u` configuration of flame.ops.common.chunk_triton. Chunk size 64,
sub-chunks of 16. Saved between forward and backward: the inputs and the fp32 intra-chunk matrix A
[B, T, H, 64] (as fla does); the cumsum and the per-chunk states are recomputed in the backward.

Forward: cumsum; A; the per-chunk states; the output. Backward: cumsum; the states and the state
gradients; dv with dA; dq, dk, dw, du. The state passes walk the chunks with the state in registers
where N x H x tiles fills the GPU (flame.ops.common.chunk_triton.state.walks); elsewhere the intra kernel forms
the chunks' local state terms alongside A and an elementwise scan carries them.
"""

from __future__ import annotations

import torch

from ..utils.backend import run_eager
from ..common.chunk_triton import (block_sizes, chunk_dqkg_from_dA, chunk_dv_dA_bwd, chunk_intra_fwd, chunk_layout,
                      chunk_local_cumsum, chunk_output, chunk_scan_states, chunk_state_fwd, chunk_states_fwd_bwd,
                      dot_dtype, three_programs_register_cap, walks)

CHUNK_SIZE = 64
# sub-chunk of the forward intra kernel's exact diagonal blocks: 8 the fastest of 8, 16 and 32 at the
# 340M layer shape on an H100 (bench/RESULTS.md, kernels: "Chunk kernels' launch settings")
INTRA_SUB_CHUNK = 8


def _forward(r, k, v, w, u, scale, h0, output_final_state, cu_seqlens, chunk_size):
    """(o, final state or None, A: the intra-chunk matrix the backward reads)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    layout = chunk_layout(B, T, cu_seqlens, chunk_size, r.device)
    DT = dot_dtype(v.dtype, K)
    BK, BV = block_sizes(K, V)
    gc = chunk_local_cumsum(w, layout)
    if walks(layout, H, K, V):
        A, _ = chunk_intra_fwd(r, k, gc, u, layout, scale, True, DT, BK, sub_chunk=INTRA_SUB_CHUNK)
        h, ht = chunk_state_fwd(k, v, gc, layout, h0, output_final_state, DT)
    else:  # the intra kernel forms the local state terms too, for the split pass's scan
        A, h = chunk_intra_fwd(r, k, gc, u, layout, scale, True, DT, BK, v=v, block_v=BV,
                                   sub_chunk=INTRA_SUB_CHUNK)
        h, ht = chunk_scan_states(h, gc, layout, h0, output_final_state, reverse=False)
    o = chunk_output(r, v, gc, h, A, layout, scale, True, DT, BK, BV)
    return o, ht, A


def _backward(r, k, v, w, u, h0, A, scale, cu_seqlens, chunk_size, do, dht):
    """dr, dk, dv, dw, du (fp32) and dh0 (fp32, or None without an initial state)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    layout = chunk_layout(B, T, cu_seqlens, chunk_size, r.device)
    DT = dot_dtype(v.dtype, K)
    BK, BV = block_sizes(K, V)
    do = do.contiguous()
    dht = dht.float().contiguous() if dht is not None else None
    gc = chunk_local_cumsum(w, layout)
    h, dh, dh0 = chunk_states_fwd_bwd(r, k, v, do, gc, layout, h0, dht, scale, True, h0 is not None, DT)
    # the dv kernel under the three-programs register cap (faster for RWKV6; GSA's wider value blocks
    # are slower under it)
    dv, dA, dAd = chunk_dv_dA_bwd(k, v, gc, A, do, dh, layout, scale, True, True, DT, BK, BV,
                                  maxnreg=three_programs_register_cap(K))
    dr, dk, dw, du = chunk_dqkg_from_dA(r, k, v, w, gc, u, h, do, dh, dA, dAd, layout, scale, True,
                                        DT, BK, BV)
    return dr, dk, dv, dw, du, dh0


class ChunkRWKV6Function(torch.autograd.Function):
    """The autograd path of varlen calls, which the custom ops below do not take."""

    @staticmethod
    def forward(ctx, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        o, ht, A = _forward(r, k, v, w, u, scale, h0, output_final_state, cu_seqlens, chunk_size)
        ctx.save_for_backward(r, k, v, w, u, h0, A)
        ctx.meta = (scale, cu_seqlens, chunk_size)
        ctx.h0_dtype = initial_state.dtype if initial_state is not None else None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, k, v, w, u, h0, A = ctx.saved_tensors
        scale, cu_seqlens, chunk_size = ctx.meta
        dr, dk, dv, dw, du, dh0 = _backward(r, k, v, w, u, h0, A, scale, cu_seqlens, chunk_size, do, dht)
        dh0 = dh0.to(ctx.h0_dtype) if dh0 is not None else None
        return dr, dk, dv, dw, du.to(u.dtype), None, dh0, None, None, None


# custom ops: what torch.compile sees for fixed-length calls (one opaque node each way, so Inductor
# fuses the glue on both sides and the block stays one graph); A's shape follows from the inputs'.

_EMPTY = (0,)


@torch.library.custom_op("flame::chunk_rwkv6_fwd", mutates_args=())
def _chunk_rwkv6_fwd_op(r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                        h0: torch.Tensor | None, scale: float, output_final_state: bool, chunk_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o, ht, A = _forward(r, k, v, w, u, scale, h0, output_final_state, None, chunk_size)
    return o, ht if ht is not None else r.new_empty(_EMPTY, dtype=torch.float32), A


@_chunk_rwkv6_fwd_op.register_fake
def _(r, k, v, w, u, h0, scale, output_final_state, chunk_size):
    B, T, H, K = r.shape
    V = v.shape[-1]
    return (torch.empty_like(v, memory_format=torch.contiguous_format),
            r.new_empty((B, H, K, V) if output_final_state else _EMPTY, dtype=torch.float32),
            r.new_empty((B, T, H, chunk_size), dtype=torch.float32))


@torch.library.custom_op("flame::chunk_rwkv6_bwd", mutates_args=())
def _chunk_rwkv6_bwd_op(r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                        h0: torch.Tensor | None, A: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None,
                        scale: float, chunk_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor]:
    dr, dk, dv, dw, du, dh0 = _backward(r, k, v, w, u, h0, A, scale, None, chunk_size, do, dht)
    return dr, dk, dv, dw, du.to(u.dtype), dh0 if dh0 is not None else r.new_empty(_EMPTY, dtype=torch.float32)


@_chunk_rwkv6_bwd_op.register_fake
def _(r, k, v, w, u, h0, A, do, dht, scale, chunk_size):
    grads = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (r, k, v, w, u))
    return (*grads, torch.empty_like(h0, dtype=torch.float32) if h0 is not None
            else r.new_empty(_EMPTY, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    r, k, v, w, u, h0, scale, output_final_state, chunk_size = inputs
    ctx.save_for_backward(r, k, v, w, u, h0, output[2])
    ctx.scale, ctx.chunk_size, ctx.output_final_state = scale, chunk_size, output_final_state


def _backward_op(ctx, do, dht, dA):
    r, k, v, w, u, h0, A = ctx.saved_tensors
    dr, dk, dv, dw, du, dh0 = torch.ops.flame.chunk_rwkv6_bwd(
        r, k, v, w, u, h0, A, do, dht if ctx.output_final_state else None, ctx.scale, ctx.chunk_size)
    return dr, dk, dv, dw, du, (dh0 if h0 is not None else None), None, None, None


_chunk_rwkv6_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


def chunk_rwkv6_triton(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False,
                       cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """Chunked RWKV6 in Triton: (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None).

    Inputs are validated by flame.ops.rwkv6.chunk_rwkv6; chunk_size is a power of two >= 16.
    """
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_rwkv6_triton: chunk_size must be a power of two >= 16, got {chunk_size}")
    r, k, v, w, u = (x.contiguous() for x in (r, k, v, w, u))
    if cu_seqlens is None:
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        o, ht, _ = torch.ops.flame.chunk_rwkv6_fwd(r, k, v, w, u, h0, float(scale), bool(output_final_state),
                                                   chunk_size)
        return o, (ht if output_final_state else None)
    return run_eager(ChunkRWKV6Function.apply, r, k, v, w, u, float(scale), initial_state,
                     bool(output_final_state), cu_seqlens, chunk_size)
