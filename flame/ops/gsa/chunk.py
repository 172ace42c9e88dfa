"""chunk_gsa: the public chunked GSA op (validation, backend choice, dispatch)."""

from __future__ import annotations

from ..utils.backend import resolve_backend
from ..utils.dtypes import autocast_off, to_compute_dtype
from ..utils.checks import check_gsa_inputs
from .chunk_torch import chunk_gsa_torch


def chunk_gsa(q, k, v, s, g, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
              backend="auto"):
    """Gated slot attention (docs/kernels.md#gsa-recurrence) in chunked form.

    Args:
        q: [B, T, HQ, K] token-major, HQ = G * H (query head j reads key/value head j // G).
        k: [B, T, H, K]; v: [B, T, H, V]; s, g: [B, T, H, M] slot write weights and slot log-forget
            (g <= 0; the layer uses g = logsigmoid(f) / 8 and s = 1 - exp(g)). g=None (gates derived
            from s) is not defined and is rejected. Mixed floating dtypes are cast to one compute dtype (flame.ops.utils.dtypes).
        scale: multiplies q (the GSA layer uses 1.0).
        initial_state: (hk [N, H, K, M], hv [N, H, M, V]) or None; N = B, or len(cu_seqlens) - 1.
        output_final_state: return the final state pair.
        cu_seqlens: 1-D int offsets [0, ..., T] of sequences packed into B == 1, or None.
        backend: "auto" (Triton for CUDA tensors, PyTorch for CPU), "triton" or "torch".

    Returns:
        (o [B, T, HQ, V] in the input dtype, (hk, hv) fp32 (fp64 for fp64 inputs) or None).

    Raises ValueError / TypeError naming the argument for inconsistent shapes (including a
    head-first tensor whose head count disagrees with the other inputs or the states), dtypes,
    devices, bad cu_seqlens, g=None, or a positive log-forget (a value check, see flame.ops.utils.checks).
    """
    q, k, v, s, g = to_compute_dtype(q, k, v, s, g)
    check_gsa_inputs("chunk_gsa", q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
    with autocast_off(q.device):
        if resolve_backend(backend, q.device, "chunk_gsa") == "triton":
            from .chunk_triton import chunk_gsa_triton
            return chunk_gsa_triton(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
        return chunk_gsa_torch(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
