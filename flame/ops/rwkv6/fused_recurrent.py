"""fused_recurrent_rwkv6: the public step-by-step RWKV6 op; its PyTorch backend is the recurrence in fp32."""

from __future__ import annotations

from ..utils.backend import resolve_backend, run_eager
from ..utils.dtypes import accumulation_dtype, autocast_off, to_compute_dtype
from ..utils.checks import check_rwkv6_inputs
from .naive import naive_rwkv6


def fused_recurrent_rwkv6_torch(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False,
                                cu_seqlens=None):
    """The naive recurrence run on fp32 copies of the inputs (fp64 stays fp64); o back in r's dtype."""
    dt = accumulation_dtype(r.dtype)
    o, final = naive_rwkv6(r.to(dt), k.to(dt), v.to(dt), w.to(dt), u.to(dt), scale,
                           None if initial_state is None else initial_state.to(dt), output_final_state, cu_seqlens)
    return o.to(r.dtype), final


def fused_recurrent_rwkv6(r, k, v, w, u, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                          backend="auto"):
    """RWKV6 attention computed token by token; same arguments and results as `chunk_rwkv6`."""
    r, k, v, w, u = to_compute_dtype(r, k, v, w, u)
    check_rwkv6_inputs("fused_recurrent_rwkv6", r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
    with autocast_off(r.device):
        if resolve_backend(backend, r.device, "fused_recurrent_rwkv6") == "triton":
            from .fused_recurrent_triton import fused_recurrent_rwkv6_triton
            return run_eager(fused_recurrent_rwkv6_triton, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
        return fused_recurrent_rwkv6_torch(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
