"""Triton chunked RWKV6 (kernels.md 1.2-1.4) on the shared gated-linear-attention core.

RWKV6 is GLA with the gate on the key side, an exclusive query decay and the bonus u on the
diagonal: exactly the `exclusive=True, u=u` configuration of flame.ops.common. Chunk size 64,
sub-chunks of 16. Nothing is saved between forward and backward but the inputs: the cumsum and
the per-chunk states are recomputed in the backward.
"""

from __future__ import annotations

import torch

from ..common import (block_sizes, chunk_dqkg_bwd, chunk_dv_bwd, chunk_layout, chunk_local_cumsum,
                      chunk_output_fwd, chunk_state_bwd, chunk_state_fwd, dot_dtype)

CHUNK_SIZE = 64


class ChunkRWKV6Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
        B, T, H, K = r.shape
        V = v.shape[-1]
        layout = chunk_layout(B, T, cu_seqlens, chunk_size, r.device)
        DT = dot_dtype(v.dtype, K)
        BK, BV = block_sizes(K, V)
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        gc = chunk_local_cumsum(w, layout)
        h, ht = chunk_state_fwd(k, v, gc, layout, h0, output_final_state, DT)
        o = chunk_output_fwd(r, k, v, gc, h, layout, scale, True, u, DT, BK, BV)
        ctx.save_for_backward(r, k, v, w, u, h0)
        ctx.layout, ctx.scale = layout, scale
        ctx.h0_dtype = initial_state.dtype if initial_state is not None else None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, k, v, w, u, h0 = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        K, V = r.shape[-1], v.shape[-1]
        DT = dot_dtype(v.dtype, K)
        BK, BV = block_sizes(K, V)
        do = do.contiguous()
        dht = dht.float().contiguous() if dht is not None else None
        gc = chunk_local_cumsum(w, layout)
        h, _ = chunk_state_fwd(k, v, gc, layout, h0, False, DT)
        dh, dh0 = chunk_state_bwd(r, do, gc, layout, dht, scale, True, h0 is not None, DT)
        dr, dk, dw, du = chunk_dqkg_bwd(r, k, v, w, gc, u, h, do, dh, layout, scale, True, DT, BK, BV)
        dv = chunk_dv_bwd(r, k, v, gc, u, do, dh, layout, scale, True, DT, BK, BV)
        dh0 = dh0.to(ctx.h0_dtype) if dh0 is not None else None
        return dr, dk, dv, dw, du.to(u.dtype), None, dh0, None, None, None


@torch.compiler.disable  # the Triton launches run eagerly inside compiled blocks (a graph break)
def chunk_rwkv6_triton(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False,
                       cu_seqlens=None, chunk_size: int = CHUNK_SIZE):
    """Chunked RWKV6 in Triton: (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None).

    Inputs are validated by flame.ops.rwkv6.chunk_rwkv6; chunk_size is a power of two >= 16.
    """
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_rwkv6_triton: chunk_size must be a power of two >= 16, got {chunk_size}")
    r, k, v, w, u = (x.contiguous() for x in (r, k, v, w, u))
    return ChunkRWKV6Function.apply(r, k, v, w, u, float(scale), initial_state, bool(output_final_state),
                                    cu_seqlens, chunk_size)
