"""The PyTorch backends of every family (chunk_torch, fused_recurrent torch) against the family's
fp64 naive recurrence. Cases that belong to one family (RWKV7's closed forms and layer-bound
decays, GSA's softmax spread, RWKV6's bf16 wide decays) live in test_<family>_torch.py."""

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from flame.ops import (chunk_gsa, chunk_rwkv6, chunk_rwkv7, fused_recurrent_gsa, fused_recurrent_rwkv6,
                       fused_recurrent_rwkv7, naive_gsa, naive_rwkv6, naive_rwkv7)
from flame.ops.gsa.chunk_torch import chunk_gsa_torch
from flame.ops.rwkv6.chunk_torch import chunk_rwkv6_torch
from flame.ops.rwkv7.chunk_torch import chunk_rwkv7_torch
from tests.ops.assertions import assert_close, assert_finite
from tests.ops.inputs import (RWKV7_LOG_DECAY_BOUND, assert_results_close, forward_backward, make_cu_seqlens,
                              make_inputs, split_sequences, to_reference, varlen_state)

F64 = torch.float64


@dataclass(frozen=True)
class Family:
    chunk: Callable          # the public chunk_<family>
    recurrent: Callable      # the public fused_recurrent_<family>
    naive: Callable          # the fp64 oracle
    chunk_torch: Callable    # the PyTorch chunked backend, with chunk_size and sub_chunk


FAMILIES = {
    "rwkv6": Family(chunk_rwkv6, fused_recurrent_rwkv6, naive_rwkv6, chunk_rwkv6_torch),
    "rwkv7": Family(chunk_rwkv7, fused_recurrent_rwkv7, naive_rwkv7, chunk_rwkv7_torch),
    "gsa": Family(chunk_gsa, fused_recurrent_gsa, naive_gsa, chunk_gsa_torch),
}
PUBLIC_OPS = [(family, kind) for family in FAMILIES for kind in ("chunk", "recurrent")]


def _public_op(family: str, kind: str) -> Callable:
    return getattr(FAMILIES[family], kind)


def _states(h) -> tuple:
    """The final state as a tuple: (S,) for RWKV, (hk, hv) for GSA."""
    return h if isinstance(h, tuple) else (h,)


RWKV_CHUNK_CASES = [  # (B, T, H, K, V), chunk_size
    ((2, 37, 2, 16, 24), 16),     # T not a multiple of the chunk, K != V
    ((1, 70, 3, 24, 8), 32),      # K > V, partial last chunk
    ((2, 64, 1, 8, 8), 64),       # exactly one chunk
    ((1, 1, 2, 8, 12), 32),       # a single token
]
GSA_CHUNK_CASES = [  # (B, T, H, K, V), chunk_size, slots M and query heads HQ
    ((2, 37, 2, 16, 24), 16, dict(M=8, HQ=2)),     # T not a multiple of the chunk, K != V != M
    ((1, 70, 2, 12, 8), 32, dict(M=16, HQ=4)),     # grouped queries (G = 2), partial last chunk
    ((2, 64, 1, 8, 8), 64, dict(M=8, HQ=1)),       # exactly one chunk
    ((1, 1, 2, 8, 12), 32, dict(M=4, HQ=6)),       # a single token, G = 3
]
CHUNK_CASES = ([(family, shape, chunk, {}) for family in ("rwkv6", "rwkv7") for shape, chunk in RWKV_CHUNK_CASES]
               + [("gsa", *case) for case in GSA_CHUNK_CASES])


@pytest.mark.parametrize("family,shape,chunk_size,gsa_shape", CHUNK_CASES)
def test_chunk_matches_naive_fp64(family, shape, chunk_size, gsa_shape):
    f = FAMILIES[family]
    inputs = make_inputs(family, *shape, **gsa_shape, dtype=F64, requires_grad=True, seed=shape[1])
    ref = forward_backward(f.naive, inputs, scale=0.7)
    out = forward_backward(f.chunk_torch, inputs, scale=0.7, chunk_size=chunk_size)
    assert_results_close(ref, out, ratio=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_without_dht_and_without_initial_state(family):
    f = FAMILIES[family]
    inputs = make_inputs(family, 2, 40, 2, 8, 16, M=8, dtype=F64, requires_grad=True, initial_state=False)
    ref = forward_backward(f.naive, inputs, with_dht=False)
    out = forward_backward(f.chunk, inputs, with_dht=False, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_initial_state_still_gets_a_gradient(family):
    f = FAMILIES[family]
    inputs = make_inputs(family, 1, 20, 2, 8, 8, M=4, dtype=F64, requires_grad=True)
    h0 = inputs["initial_state"]
    zeros = tuple(torch.zeros_like(h).requires_grad_(True) for h in _states(h0))
    inputs["initial_state"] = zeros if isinstance(h0, tuple) else zeros[0]
    ref = forward_backward(f.naive, inputs)
    out = forward_backward(f.chunk, inputs, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)
    state_grads = {name: g for name, g in out[2].items() if name.startswith("initial_state")}
    assert len(state_grads) == len(zeros)
    for name, g in state_grads.items():
        assert g.abs().sum() > 0, f"d{name} is zero"


@pytest.mark.parametrize("family,kind", PUBLIC_OPS)
def test_public_ops_fp32_match_fp64_naive(family, kind):
    inputs = make_inputs(family, 2, 45, 2, 16, 8, M=8, HQ=4, dtype=torch.float32, requires_grad=True)
    ref = forward_backward(FAMILIES[family].naive, to_reference(inputs))
    # RWKV7 with the bound its layer promises (the "normal" decay lies inside it)
    bound = {"gate_lower_bound": RWKV7_LOG_DECAY_BOUND} if family == "rwkv7" else {}
    out = forward_backward(_public_op(family, kind), inputs, backend="torch", **bound)
    assert out[0].dtype == torch.float32 and all(h.dtype == torch.float32 for h in _states(out[1]))
    assert_results_close(ref, out, ratio=1e-5)


@pytest.mark.parametrize("family,kind", PUBLIC_OPS)
def test_bf16_inputs_give_bf16_output_and_fp32_state(family, kind):
    inputs = make_inputs(family, 1, 40, 2, 16, 16, M=8, dtype=torch.bfloat16, requires_grad=True)
    ref = forward_backward(FAMILIES[family].naive, to_reference(inputs))
    out = forward_backward(_public_op(family, kind), inputs, backend="torch")
    assert out[0].dtype == torch.bfloat16
    assert all(h.dtype == torch.float32 for h in _states(out[1]))
    assert_results_close(ref, out, ratio=2e-2)


def _naive_per_sequence(naive, inputs: dict, cu_seqlens: torch.Tensor):
    """The naive recurrence on each packed sequence on its own (no cu_seqlens): (o, final states),
    concatenated along T and N. Every [B, T, H, D] input is cut; u stays whole."""
    per_token = {name: split_sequences(x, cu_seqlens) for name, x in inputs.items()
                 if name != "initial_state" and x.dim() == 4}
    whole = {name: x for name, x in inputs.items() if name != "initial_state" and name not in per_token}
    h0 = inputs["initial_state"]
    o_parts, h_parts = [], []
    for n in range(cu_seqlens.numel() - 1):
        state_n = tuple(h[n:n + 1] for h in h0) if isinstance(h0, tuple) else h0[n:n + 1]
        o_n, h_n = naive(**{name: parts[n] for name, parts in per_token.items()}, **whole, initial_state=state_n,
                         output_final_state=True)
        o_parts.append(o_n)
        h_parts.append(_states(h_n))
    return torch.cat(o_parts, 1), [torch.cat(parts, 0) for parts in zip(*h_parts)]


@pytest.mark.parametrize("family,kind", PUBLIC_OPS)
def test_varlen_matches_per_sequence_runs(family, kind):
    f = FAMILIES[family]
    lengths = [1, 15, 33, 0, 20]
    cu = make_cu_seqlens(lengths)
    inputs = to_reference(varlen_state(make_inputs(family, 1, sum(lengths), 2, 8, 12, M=4, HQ=4, dtype=F64),
                                       len(lengths)))
    out = forward_backward(_public_op(family, kind), inputs, cu_seqlens=cu, backend="torch")

    ref_o, ref_h = _naive_per_sequence(f.naive, inputs, cu)
    assert_close("o", ref_o, out[0], 1e-9)
    for i, (expected, actual) in enumerate(zip(ref_h, _states(out[1]), strict=True)):
        assert_close(f"final_state[{i}]", expected, actual, 1e-9)
    # gradients: the naive varlen path is the per-sequence loop, checked above for the forward
    ref = forward_backward(f.naive, inputs, cu_seqlens=cu)
    assert_close("o (naive varlen)", ref_o, ref[0], 1e-12)
    assert_results_close(ref, out, ratio=1e-9)


DECAYS = ["extreme", "wide", -1e3, "zero", "half_zero"]
EXTREME_DECAY_CASES = ([("rwkv6", 70, decay) for decay in DECAYS + [-1e4]]
                       + [("rwkv7", 70, decay) for decay in DECAYS]
                       + [("gsa", 50, decay) for decay in DECAYS])


@pytest.mark.parametrize("family,T,decay", EXTREME_DECAY_CASES)
def test_extreme_decays_fp32_finite_and_match(family, T, decay):
    f = FAMILIES[family]
    inputs = make_inputs(family, 1, T, 2, 16, 16, M=8, dtype=torch.float32, decay=decay, requires_grad=True)
    ref = forward_backward(f.naive, to_reference(inputs))
    for op in (f.chunk, f.recurrent):
        out = forward_backward(op, inputs, backend="torch")
        assert_finite("o", out[0])
        for name, g in out[2].items():
            assert_finite(f"d{name}", g)
        assert_results_close(ref, out, ratio=1e-4, label=f"{op.__name__} ", atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk_size,sub_chunk", [(16, 4), (32, 8), (64, 16), (8, 8)])
def test_chunk_size_invariance(family, chunk_size, sub_chunk):
    f = FAMILIES[family]
    inputs = make_inputs(family, 1, 50, 2, 8, 8, M=8, dtype=F64, decay="extreme", requires_grad=True)
    ref = forward_backward(f.naive, inputs)
    out = forward_backward(f.chunk_torch, inputs, chunk_size=chunk_size, sub_chunk=sub_chunk)
    assert_results_close(ref, out, ratio=1e-9)
