"""fused_recurrent_gsa: the public step-by-step GSA op; its PyTorch backend is the recurrence in fp32."""

from __future__ import annotations

from ..utils.backend import resolve_backend, run_eager
from ..utils.dtypes import accumulation_dtype, autocast_off, to_compute_dtype
from ..utils.checks import check_gsa_inputs
from .naive import naive_gsa


def fused_recurrent_gsa_torch(q, k, v, s, g, scale=1.0, initial_state=None, output_final_state=False,
                              cu_seqlens=None):
    """The naive recurrence run on fp32 copies of the inputs (fp64 stays fp64); o back in q's dtype."""
    dt = accumulation_dtype(q.dtype)
    state = None if initial_state is None else tuple(h.to(dt) for h in initial_state)
    o, final = naive_gsa(*(x.to(dt) for x in (q, k, v, s, g)), scale, state, output_final_state, cu_seqlens)
    return o.to(q.dtype), final


def fused_recurrent_gsa(q, k, v, s, g, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                        backend="auto"):
    """Gated slot attention computed token by token; same arguments and results as `chunk_gsa`."""
    q, k, v, s, g = to_compute_dtype(q, k, v, s, g)
    check_gsa_inputs("fused_recurrent_gsa", q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
    with autocast_off(q.device):
        if resolve_backend(backend, q.device, "fused_recurrent_gsa") == "triton":
            from .fused_recurrent_triton import fused_recurrent_gsa_triton
            return run_eager(fused_recurrent_gsa_triton, q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
        return fused_recurrent_gsa_torch(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
