"""RWKV6 PyTorch backends (chunk_torch, fused_recurrent torch) against the fp64 naive recurrence."""

import pytest
import torch

from flame.ops import chunk_rwkv6, fused_recurrent_rwkv6, naive_rwkv6
from flame.ops.rwkv6.chunk_torch import chunk_rwkv6_torch
from tests.ops.assertions import assert_close, assert_finite
from tests.ops.inputs import (assert_results_close, forward_backward, make_cu_seqlens, make_rwkv6_inputs,
                              split_sequences, to_reference, varlen_state)

F64 = torch.float64


@pytest.mark.parametrize("B,T,H,K,V,chunk_size", [
    (2, 37, 2, 16, 24, 16),     # T not a multiple of the chunk, K != V
    (1, 70, 3, 24, 8, 32),      # K > V, partial last chunk
    (2, 64, 1, 8, 8, 64),       # exactly one chunk
    (1, 1, 2, 8, 12, 32),       # a single token
])
def test_chunk_matches_naive_fp64(B, T, H, K, V, chunk_size):
    inputs = make_rwkv6_inputs(B, T, H, K, V, dtype=F64, requires_grad=True, seed=T)
    ref = forward_backward(naive_rwkv6, inputs, scale=0.7)
    out = forward_backward(chunk_rwkv6_torch, inputs, scale=0.7, chunk_size=chunk_size)
    assert_results_close(ref, out, ratio=1e-9)


def test_chunk_without_dht_and_without_initial_state():
    inputs = make_rwkv6_inputs(2, 40, 2, 8, 16, dtype=F64, requires_grad=True, initial_state=False)
    ref = forward_backward(naive_rwkv6, inputs, with_dht=False)
    out = forward_backward(chunk_rwkv6, inputs, with_dht=False, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)


def test_zero_initial_state_still_gets_a_gradient():
    inputs = make_rwkv6_inputs(1, 20, 2, 8, 8, dtype=F64, requires_grad=True)
    inputs["initial_state"] = torch.zeros_like(inputs["initial_state"]).requires_grad_(True)
    ref = forward_backward(naive_rwkv6, inputs)
    out = forward_backward(chunk_rwkv6, inputs, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)
    assert out[2]["initial_state"].abs().sum() > 0


@pytest.mark.parametrize("op", [fused_recurrent_rwkv6, chunk_rwkv6])
def test_public_ops_fp32_match_fp64_naive(op):
    inputs = make_rwkv6_inputs(2, 45, 2, 16, 8, dtype=torch.float32, requires_grad=True)
    ref = forward_backward(naive_rwkv6, to_reference(inputs))
    out = forward_backward(op, inputs, backend="torch")
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    assert_results_close(ref, out, ratio=1e-5)


@pytest.mark.parametrize("op", [fused_recurrent_rwkv6, chunk_rwkv6])
def test_bf16_inputs_give_bf16_output_and_fp32_state(op):
    inputs = make_rwkv6_inputs(1, 40, 2, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    ref = forward_backward(naive_rwkv6, to_reference(inputs))
    out = forward_backward(op, inputs, backend="torch")
    assert out[0].dtype == torch.bfloat16
    assert out[1].dtype == torch.float32
    assert_results_close(ref, out, ratio=2e-2)


@pytest.mark.parametrize("op", [fused_recurrent_rwkv6, chunk_rwkv6])
def test_varlen_matches_per_sequence_runs(op):
    lengths = [1, 15, 33, 0, 20]
    cu = make_cu_seqlens(lengths)
    inputs = varlen_state(make_rwkv6_inputs(1, sum(lengths), 2, 8, 12, dtype=F64), len(lengths))
    inputs = to_reference(inputs)
    out = forward_backward(op, inputs, cu_seqlens=cu, backend="torch")

    # reference: each sequence on its own through the naive recurrence
    o_parts, h_parts = [], []
    for n, part in enumerate(zip(*(split_sequences(inputs[x], cu) for x in "rkvw"))):
        o_n, h_n = naive_rwkv6(*part, inputs["u"], initial_state=inputs["initial_state"][n:n + 1],
                               output_final_state=True)
        o_parts.append(o_n)
        h_parts.append(h_n)
    ref_o, ref_h = torch.cat(o_parts, 1), torch.cat(h_parts, 0)
    assert_close("o", ref_o, out[0], 1e-9)
    assert_close("final_state", ref_h, out[1], 1e-9)
    # gradients: the naive varlen path is the per-sequence loop, checked above for the forward
    ref = forward_backward(naive_rwkv6, inputs, cu_seqlens=cu)
    assert_close("o (naive varlen)", ref_o, ref[0], 1e-12)
    assert_results_close(ref, out, ratio=1e-9)


@pytest.mark.parametrize("decay", ["extreme", "wide", -1e3, -1e4, "zero", "half_zero"])
def test_extreme_decays_fp32_finite_and_match(decay):
    inputs = make_rwkv6_inputs(1, 70, 2, 16, 16, dtype=torch.float32, decay=decay, requires_grad=True)
    ref = forward_backward(naive_rwkv6, to_reference(inputs))
    for op in (chunk_rwkv6, fused_recurrent_rwkv6):
        out = forward_backward(op, inputs, backend="torch")
        assert_finite("o", out[0])
        for name, g in out[2].items():
            assert_finite(f"d{name}", g)
        assert_results_close(ref, out, ratio=1e-4, label=f"{op.__name__} ", atol=1e-5)


def test_extreme_decays_bf16_finite():
    inputs = make_rwkv6_inputs(1, 70, 2, 16, 16, dtype=torch.bfloat16, decay="wide", requires_grad=True)
    ref = forward_backward(naive_rwkv6, to_reference(inputs))
    out = forward_backward(chunk_rwkv6, inputs, backend="torch")
    assert_results_close(ref, out, ratio=2e-2)


@pytest.mark.parametrize("chunk_size,sub_chunk", [(16, 4), (32, 8), (64, 16), (8, 8)])
def test_chunk_size_invariance(chunk_size, sub_chunk):
    inputs = make_rwkv6_inputs(1, 50, 2, 8, 8, dtype=F64, decay="extreme", requires_grad=True)
    ref = forward_backward(naive_rwkv6, inputs)
    out = forward_backward(chunk_rwkv6_torch, inputs, chunk_size=chunk_size, sub_chunk=sub_chunk)
    assert_results_close(ref, out, ratio=1e-9)
