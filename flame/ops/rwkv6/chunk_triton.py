"""Triton chunked RWKV6 (kernels.md 1.2-1.4) on the shared gated-linear-attention core.

RWKV6 is GLA with the gate on the key side, an exclusive query decay and the bonus u on the
diagonal: exactly the `exclusive=True, u=u` configuration of flame.ops.common. Chunk size 64,
sub-chunks of 16. Saved between forward and backward: the inputs and the fp32 intra-chunk matrix A
[B, T, H, 64] (as fla does); the cumsum and the per-chunk states are recomputed in the backward.

Forward: cumsum; A and the chunks' local state terms (one kernel); the state scan; the output.
Backward: cumsum; the local terms of the states and of the state gradients (one kernel); the two
scans; dv with dA; dq, dk, dw, du.
"""

from __future__ import annotations

import torch

from ..common import (block_sizes, chunk_dqkg_from_dA, chunk_dv_dA_bwd, chunk_intra_fwd, chunk_layout,
                      chunk_local_cumsum, chunk_local_states, chunk_output, chunk_scan_states, dot_dtype)

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
        A, h = chunk_intra_fwd(r, k, gc, u, layout, scale, True, DT, BK, v=v, block_v=BV)
        h, ht = chunk_scan_states(h, gc, layout, h0, output_final_state, reverse=False)
        o = chunk_output(r, v, gc, h, A, layout, scale, True, DT, BK, BV)
        ctx.save_for_backward(r, k, v, w, u, h0, A)
        ctx.layout, ctx.scale = layout, scale
        ctx.h0_dtype = initial_state.dtype if initial_state is not None else None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, k, v, w, u, h0, A = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        K, V = r.shape[-1], v.shape[-1]
        DT = dot_dtype(v.dtype, K)
        BK, BV = block_sizes(K, V)
        do = do.contiguous()
        dht = dht.float().contiguous() if dht is not None else None
        gc = chunk_local_cumsum(w, layout)
        h, dh = chunk_local_states(r, k, v, do, gc, layout, scale, True, DT, fwd=True, bwd=True)
        h, _ = chunk_scan_states(h, gc, layout, h0, False, reverse=False)
        dh, dh0 = chunk_scan_states(dh, gc, layout, dht, h0 is not None, reverse=True)
        dv, dA, dAd = chunk_dv_dA_bwd(k, v, gc, A, do, dh, layout, scale, True, True, DT, BK, BV)
        dr, dk, dw, du = chunk_dqkg_from_dA(r, k, v, w, gc, u, h, do, dh, dA, dAd, layout, scale, True,
                                            DT, BK, BV)
        dh0 = dh0.to(ctx.h0_dtype) if dh0 is not None else None
        return dr, dk, dv, dw, du.to(u.dtype), None, dh0, None, None, None


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
