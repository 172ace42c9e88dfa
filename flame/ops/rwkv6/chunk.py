"""chunk_rwkv6: the public chunked RWKV6 op (validation, backend choice, dispatch)."""

from __future__ import annotations

from ..utils.backend import resolve_backend
from ..utils.dtypes import autocast_off, to_compute_dtype
from ..utils.checks import check_rwkv6_inputs
from .chunk_torch import chunk_rwkv6_torch


def chunk_rwkv6(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                backend="auto"):
    """RWKV6 attention (docs/kernels.md#rwkv6-recurrence) in chunked form.

    Args:
        r, k, w: [B, T, H, K] token-major (not head-first [B, H, T, K]); w is the log-decay (<= 0:
            the per-step decay is exp(w)). v: [B, T, H, V] (K != V allowed). r, k, v, w share a
            floating dtype (fp32, fp16, bf16 or fp64).
        u: [H, K] bonus of the current token.
        scale: multiplies r (the RWKV6 layer uses 1.0).
        initial_state: [N, H, K, V] or None; N = B, or len(cu_seqlens) - 1 in varlen mode.
        output_final_state: return the final state.
        cu_seqlens: 1-D int offsets [0, ..., T] of sequences packed into B == 1, or None.
        backend: "auto" (Triton for CUDA tensors, PyTorch for CPU), "triton" or "torch".

    Returns:
        (o [B, T, H, V] in the input dtype, final state [N, H, K, V] fp32 (fp64 for fp64 inputs) or None).

    Raises ValueError / TypeError naming the argument for inconsistent shapes (including a
    head-first tensor whose head count disagrees with u, the state or the other inputs), dtypes,
    devices, bad cu_seqlens, or a positive log-decay (a value check, see flame.ops.utils.checks).
    """
    r, k, v, w, u = to_compute_dtype(r, k, v, w, u)
    check_rwkv6_inputs("chunk_rwkv6", r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
    with autocast_off(r.device):
        if resolve_backend(backend, r.device, "chunk_rwkv6") == "triton":
            from .chunk_triton import chunk_rwkv6_triton
            return chunk_rwkv6_triton(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
        return chunk_rwkv6_torch(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
