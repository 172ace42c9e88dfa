"""GSA PyTorch backends (chunk_torch, fused_recurrent torch) against the fp64 naive recurrence."""

import pytest
import torch

from flame.ops import chunk_gsa, fused_recurrent_gsa, naive_gsa
from flame.ops.gsa.chunk_torch import chunk_gsa_torch
from tests.ops.assertions import assert_close, assert_finite
from tests.ops.inputs import (assert_results_close, forward_backward, make_cu_seqlens, make_gsa_inputs,
                              split_sequences, to_reference, varlen_state)

F64 = torch.float64


@pytest.mark.parametrize("B,T,H,HQ,K,V,M,chunk_size", [
    (2, 37, 2, 2, 16, 24, 8, 16),     # T not a multiple of the chunk, K != V != M
    (1, 70, 2, 4, 12, 8, 16, 32),     # grouped queries (G = 2), partial last chunk
    (2, 64, 1, 1, 8, 8, 8, 64),       # exactly one chunk
    (1, 1, 2, 6, 8, 12, 4, 32),       # a single token, G = 3
])
def test_chunk_matches_naive_fp64(B, T, H, HQ, K, V, M, chunk_size):
    inputs = make_gsa_inputs(B, T, H, K, V, M, HQ=HQ, dtype=F64, requires_grad=True, seed=T)
    ref = forward_backward(naive_gsa, inputs, scale=0.7)
    out = forward_backward(chunk_gsa_torch, inputs, scale=0.7, chunk_size=chunk_size)
    assert_results_close(ref, out, ratio=1e-9)


def test_chunk_without_dht_and_without_initial_state():
    inputs = make_gsa_inputs(2, 40, 2, 8, 16, 8, dtype=F64, requires_grad=True, initial_state=False)
    ref = forward_backward(naive_gsa, inputs, with_dht=False)
    out = forward_backward(chunk_gsa, inputs, with_dht=False, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)


def test_zero_initial_state_still_gets_a_gradient():
    inputs = make_gsa_inputs(1, 20, 2, 8, 8, 4, dtype=F64, requires_grad=True)
    inputs["initial_state"] = tuple(torch.zeros_like(h).requires_grad_(True) for h in inputs["initial_state"])
    ref = forward_backward(naive_gsa, inputs)
    out = forward_backward(chunk_gsa, inputs, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)
    assert out[2]["initial_state.0"].abs().sum() > 0 and out[2]["initial_state.1"].abs().sum() > 0


@pytest.mark.parametrize("op", [fused_recurrent_gsa, chunk_gsa])
def test_public_ops_fp32_match_fp64_naive(op):
    inputs = make_gsa_inputs(2, 45, 2, 16, 8, 8, HQ=4, dtype=torch.float32, requires_grad=True)
    ref = forward_backward(naive_gsa, to_reference(inputs))
    out = forward_backward(op, inputs, backend="torch")
    assert out[0].dtype == torch.float32 and all(h.dtype == torch.float32 for h in out[1])
    assert_results_close(ref, out, ratio=1e-5)


@pytest.mark.parametrize("op", [fused_recurrent_gsa, chunk_gsa])
def test_bf16_inputs_give_bf16_output_and_fp32_state(op):
    inputs = make_gsa_inputs(1, 40, 2, 16, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    ref = forward_backward(naive_gsa, to_reference(inputs))
    out = forward_backward(op, inputs, backend="torch")
    assert out[0].dtype == torch.bfloat16
    assert all(h.dtype == torch.float32 for h in out[1])
    assert_results_close(ref, out, ratio=2e-2)


@pytest.mark.parametrize("op", [fused_recurrent_gsa, chunk_gsa])
def test_varlen_matches_per_sequence_runs(op):
    lengths = [1, 15, 33, 0, 20]
    cu = make_cu_seqlens(lengths)
    inputs = to_reference(varlen_state(make_gsa_inputs(1, sum(lengths), 2, 8, 12, 4, HQ=4, dtype=F64),
                                       len(lengths)))
    out = forward_backward(op, inputs, cu_seqlens=cu, backend="torch")

    o_parts, hk_parts, hv_parts = [], [], []
    hk0, hv0 = inputs["initial_state"]
    for n, part in enumerate(zip(*(split_sequences(inputs[x], cu) for x in "qkvsg"))):
        o_n, (hk_n, hv_n) = naive_gsa(*part, initial_state=(hk0[n:n + 1], hv0[n:n + 1]), output_final_state=True)
        o_parts.append(o_n)
        hk_parts.append(hk_n)
        hv_parts.append(hv_n)
    assert_close("o", torch.cat(o_parts, 1), out[0], 1e-9)
    assert_close("hk", torch.cat(hk_parts, 0), out[1][0], 1e-9)
    assert_close("hv", torch.cat(hv_parts, 0), out[1][1], 1e-9)
    ref = forward_backward(naive_gsa, inputs, cu_seqlens=cu)
    assert_results_close(ref, out, ratio=1e-9)


@pytest.mark.parametrize("decay", ["extreme", "wide", -1e3, "zero", "half_zero"])
def test_extreme_decays_fp32_finite_and_match(decay):
    inputs = make_gsa_inputs(1, 50, 2, 16, 16, 8, dtype=torch.float32, decay=decay, requires_grad=True)
    ref = forward_backward(naive_gsa, to_reference(inputs))
    for op in (chunk_gsa, fused_recurrent_gsa):
        out = forward_backward(op, inputs, backend="torch")
        assert_finite("o", out[0])
        for name, g in out[2].items():
            assert_finite(f"d{name}", g)
        assert_results_close(ref, out, ratio=1e-4, label=f"{op.__name__} ", atol=1e-5)


def test_softmax_with_large_score_spread():
    """|q|, |k| up to ~10 with scale 1: the slot softmax must stay max-stable (kernels.md 7.14)."""
    inputs = make_gsa_inputs(1, 40, 2, 16, 8, 8, dtype=torch.float32, requires_grad=True)
    inputs = {n: x for n, x in inputs.items()}
    inputs["q"] = (inputs["q"].detach() * 10).requires_grad_(True)
    inputs["k"] = (inputs["k"].detach() * 10).requires_grad_(True)
    ref = forward_backward(naive_gsa, to_reference(inputs))
    out = forward_backward(chunk_gsa, inputs, backend="torch")
    assert_results_close(ref, out, ratio=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size,sub_chunk", [(16, 4), (32, 8), (64, 16), (8, 8)])
def test_chunk_size_invariance(chunk_size, sub_chunk):
    inputs = make_gsa_inputs(1, 50, 2, 8, 8, 8, dtype=F64, decay="extreme", requires_grad=True)
    ref = forward_backward(naive_gsa, inputs)
    out = forward_backward(chunk_gsa_torch, inputs, chunk_size=chunk_size, sub_chunk=sub_chunk)
    assert_results_close(ref, out, ratio=1e-9)
