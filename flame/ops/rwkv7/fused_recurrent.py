"""fused_recurrent_rwkv7: the public step-by-step RWKV7 op; its PyTorch backend is the recurrence in fp32."""

from __future__ import annotations

from ..utils.backend import resolve_backend, run_eager
from ..utils.dtypes import accumulation_dtype, autocast_off, to_compute_dtype
from ..utils.checks import check_rwkv7_inputs
from .naive import naive_rwkv7


def fused_recurrent_rwkv7_torch(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                                cu_seqlens=None, gate_lower_bound=None):
    """The naive recurrence run on fp32 copies of the inputs (fp64 stays fp64); o back in r's dtype."""
    dt = accumulation_dtype(r.dtype)
    o, final = naive_rwkv7(*(x.to(dt) for x in (r, w, k, v, a, b)), scale,
                           None if initial_state is None else initial_state.to(dt), output_final_state, cu_seqlens)
    return o.to(r.dtype), final


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                          cu_seqlens=None, backend="auto", gate_lower_bound=None):
    """RWKV7 attention computed token by token; same arguments and results as `chunk_rwkv7`."""
    r, w, k, v, a, b = to_compute_dtype(r, w, k, v, a, b)
    check_rwkv7_inputs("fused_recurrent_rwkv7", r, w, k, v, a, b, scale, initial_state, output_final_state,
                       cu_seqlens, gate_lower_bound)
    with autocast_off(r.device):
        if resolve_backend(backend, r.device, "fused_recurrent_rwkv7") == "triton":
            from .fused_recurrent_triton import fused_recurrent_rwkv7_triton
            return run_eager(fused_recurrent_rwkv7_triton, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
        return fused_recurrent_rwkv7_torch(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
