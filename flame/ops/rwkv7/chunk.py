"""chunk_rwkv7: the public chunked RWKV7 op (validation, backend choice, dispatch)."""

from __future__ import annotations

from ..utils.backend import resolve_backend
from ..utils.dtypes import autocast_off, to_compute_dtype
from ..utils.checks import check_rwkv7_inputs
from .chunk_torch import chunk_rwkv7_torch


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                backend="auto", gate_lower_bound=None, cache_intermediates=False, recompute_states=False):
    """RWKV7 attention (the DPLR delta rule, docs/kernels.md#rwkv7-recurrence) in chunked form.

    Args:
        r, w, k, a, b: [B, T, H, K] token-major (not head-first [B, H, T, K]); w is the log-decay
            (<= 0). In the RWKV7 layer a = -kappa_hat and b = kappa_hat * alpha.
        v: [B, T, H, V] (K != V allowed). Mixed floating dtypes are cast to one compute dtype (flame.ops.utils.dtypes: the autocast dtype under autocast, else the promoted one).
        scale: multiplies r (the RWKV7 layer uses 1.0).
        initial_state: [N, H, K, V] or None; N = B, or len(cu_seqlens) - 1 in varlen mode.
        output_final_state: return the final state.
        cu_seqlens: 1-D int offsets [0, ..., T] of sequences packed into B == 1, or None.
        backend: "auto" (Triton for CUDA tensors, PyTorch for CPU), "triton" or "torch".
        gate_lower_bound: None, or a promise that w >= this negative bound everywhere (checked when
            value checks are on); kernels may use it for faster stable paths.
        cache_intermediates: Triton backend only (the PyTorch one ignores it): keep the forward's
            per-chunk intermediates for the backward instead of recomputing them: (2 K + C) 16-bit and
            (K + 4 C) fp32 values per token and head, plus K * K fp32 per chunk and head (instead of
            the C fp32 values that the recomputation starts from), for a faster backward
            (bench/RESULTS.md, kernels: chunk_rwkv7_cached).
        recompute_states: Triton backend only (the PyTorch one ignores it): the forward does not keep
            the per-chunk states (K * V fp32 per chunk and head), and the backward runs the forward scan again for them, in the same launch as
            its own scan. Combines with cache_intermediates.

    Returns:
        (o [B, T, H, V] in the input dtype, final state [N, H, K, V] fp32 (fp64 for fp64 inputs) or None).

    Raises ValueError / TypeError naming the argument for inconsistent shapes (a head-first tensor
    is caught when its head count disagrees with the other inputs or the state; all-head-first
    inputs without a state cannot be detected), dtypes, devices, bad cu_seqlens, a positive
    log-decay or a violated gate_lower_bound (value checks, see flame.ops.utils.checks).
    """
    r, w, k, v, a, b = to_compute_dtype(r, w, k, v, a, b)
    check_rwkv7_inputs("chunk_rwkv7", r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                       gate_lower_bound)
    with autocast_off(r.device):
        if resolve_backend(backend, r.device, "chunk_rwkv7") == "triton":
            from .chunk_triton import chunk_rwkv7_triton
            return chunk_rwkv7_triton(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                                      gate_lower_bound, cache_intermediates, recompute_states)
        return chunk_rwkv7_torch(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
