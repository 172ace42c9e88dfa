"""RWKV7 PyTorch backends (chunk_torch, fused_recurrent torch) against the fp64 naive recurrence,
and the naive recurrence itself against two closed forms (kernels.md 7.13)."""

import pytest
import torch

from flame.ops import chunk_rwkv7, fused_recurrent_rwkv7, naive_rwkv7
from flame.ops.rwkv7.chunk_torch import chunk_rwkv7_torch
from tests.ops.assertions import assert_close, assert_finite
from tests.ops.inputs import (RWKV7_LOG_DECAY_BOUND, assert_results_close, forward_backward, make_cu_seqlens,
                              make_rwkv7_inputs, split_sequences, to_reference, varlen_state)

F64 = torch.float64


@pytest.mark.parametrize("B,T,H,K,V,chunk_size", [
    (2, 37, 2, 16, 24, 16),     # T not a multiple of the chunk, K != V
    (1, 70, 3, 24, 8, 32),      # K > V, partial last chunk
    (2, 64, 1, 8, 8, 64),       # exactly one chunk
    (1, 1, 2, 8, 12, 32),       # a single token
])
def test_chunk_matches_naive_fp64(B, T, H, K, V, chunk_size):
    inputs = make_rwkv7_inputs(B, T, H, K, V, dtype=F64, requires_grad=True, seed=T)
    ref = forward_backward(naive_rwkv7, inputs, scale=0.7)
    out = forward_backward(chunk_rwkv7_torch, inputs, scale=0.7, chunk_size=chunk_size)
    assert_results_close(ref, out, ratio=1e-9)


def test_chunk_without_dht_and_without_initial_state():
    inputs = make_rwkv7_inputs(2, 40, 2, 8, 16, dtype=F64, requires_grad=True, initial_state=False)
    ref = forward_backward(naive_rwkv7, inputs, with_dht=False)
    out = forward_backward(chunk_rwkv7, inputs, with_dht=False, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)


def test_zero_initial_state_still_gets_a_gradient():
    inputs = make_rwkv7_inputs(1, 20, 2, 8, 8, dtype=F64, requires_grad=True)
    inputs["initial_state"] = torch.zeros_like(inputs["initial_state"]).requires_grad_(True)
    ref = forward_backward(naive_rwkv7, inputs)
    out = forward_backward(chunk_rwkv7, inputs, backend="torch")
    assert_results_close(ref, out, ratio=1e-9)
    assert out[2]["initial_state"].abs().sum() > 0


@pytest.mark.parametrize("op", [fused_recurrent_rwkv7, chunk_rwkv7])
def test_public_ops_fp32_match_fp64_naive(op):
    inputs = make_rwkv7_inputs(2, 45, 2, 16, 8, dtype=torch.float32, requires_grad=True)
    ref = forward_backward(naive_rwkv7, to_reference(inputs))
    out = forward_backward(op, inputs, backend="torch", gate_lower_bound=RWKV7_LOG_DECAY_BOUND)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    assert_results_close(ref, out, ratio=1e-5)


@pytest.mark.parametrize("op", [fused_recurrent_rwkv7, chunk_rwkv7])
def test_bf16_inputs_give_bf16_output_and_fp32_state(op):
    inputs = make_rwkv7_inputs(1, 40, 2, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    ref = forward_backward(naive_rwkv7, to_reference(inputs))
    out = forward_backward(op, inputs, backend="torch")
    assert out[0].dtype == torch.bfloat16
    assert out[1].dtype == torch.float32
    assert_results_close(ref, out, ratio=2e-2)


@pytest.mark.parametrize("op", [fused_recurrent_rwkv7, chunk_rwkv7])
def test_varlen_matches_per_sequence_runs(op):
    lengths = [1, 15, 33, 0, 20]
    cu = make_cu_seqlens(lengths)
    inputs = to_reference(varlen_state(make_rwkv7_inputs(1, sum(lengths), 2, 8, 12, dtype=F64), len(lengths)))
    out = forward_backward(op, inputs, cu_seqlens=cu, backend="torch")

    o_parts, h_parts = [], []
    for n, part in enumerate(zip(*(split_sequences(inputs[x], cu) for x in ("r", "w", "k", "v", "a", "b")))):
        o_n, h_n = naive_rwkv7(*part, initial_state=inputs["initial_state"][n:n + 1], output_final_state=True)
        o_parts.append(o_n)
        h_parts.append(h_n)
    assert_close("o", torch.cat(o_parts, 1), out[0], 1e-9)
    assert_close("final_state", torch.cat(h_parts, 0), out[1], 1e-9)
    ref = forward_backward(naive_rwkv7, inputs, cu_seqlens=cu)
    assert_results_close(ref, out, ratio=1e-9)


@pytest.mark.parametrize("decay", ["extreme", "wide", -1e3, "zero", "half_zero"])
def test_extreme_decays_fp32_finite_and_match(decay):
    inputs = make_rwkv7_inputs(1, 70, 2, 16, 16, dtype=torch.float32, decay=decay, requires_grad=True)
    ref = forward_backward(naive_rwkv7, to_reference(inputs))
    for op in (chunk_rwkv7, fused_recurrent_rwkv7):
        out = forward_backward(op, inputs, backend="torch")
        assert_finite("o", out[0])
        for name, g in out[2].items():
            assert_finite(f"d{name}", g)
        assert_results_close(ref, out, ratio=1e-4, label=f"{op.__name__} ", atol=1e-5)


def test_layer_bound_decay_bf16_long_chunked():
    """w at the layer's bound over many chunks, bf16 inputs: fp32 internals keep the error small."""
    inputs = make_rwkv7_inputs(1, 160, 2, 16, 16, dtype=torch.bfloat16, decay=RWKV7_LOG_DECAY_BOUND,
                               requires_grad=True)
    ref = forward_backward(naive_rwkv7, to_reference(inputs))
    out = forward_backward(chunk_rwkv7, inputs, backend="torch", gate_lower_bound=RWKV7_LOG_DECAY_BOUND)
    assert_results_close(ref, out, ratio=2e-2)


@pytest.mark.parametrize("chunk_size,sub_chunk", [(16, 4), (32, 8), (64, 16), (8, 8)])
def test_chunk_size_invariance(chunk_size, sub_chunk):
    inputs = make_rwkv7_inputs(1, 50, 2, 8, 8, dtype=F64, decay="extreme", requires_grad=True)
    ref = forward_backward(naive_rwkv7, inputs)
    out = forward_backward(chunk_rwkv7_torch, inputs, chunk_size=chunk_size, sub_chunk=sub_chunk)
    assert_results_close(ref, out, ratio=1e-9)


# ---------------------------------------------------------------------------------------------
# closed forms

def _inclusive_gla(r, w, k, v, scale, h0):
    """o_t = sc sum_{j<=t} sum_i r_ti k_ji exp(G_ti - G_ji) v_j + sc (r_t * exp(G_t))^T h0, G = cumsum(w)."""
    G = w.cumsum(1)                                                            # [B,T,H,K]
    T = r.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()                        # [t, j]
    decay = torch.exp(G[:, :, None] - G[:, None, :])                           # [B,t,j,H,K]
    decay = torch.where(causal[None, :, :, None, None], decay, 0.0)
    A = scale * torch.einsum("bthi,bjhi,btjhi->bhtj", r, k, decay)
    return torch.einsum("bhtj,bjhv->bthv", A, v) + scale * torch.einsum("bthi,bhiv->bthv", r * torch.exp(G), h0)


@pytest.mark.parametrize("op", [naive_rwkv7, chunk_rwkv7_torch, fused_recurrent_rwkv7])
def test_b_zero_is_inclusive_gated_linear_attention(op):
    x = make_rwkv7_inputs(2, 30, 2, 8, 6, dtype=F64, ab="zero_b", seed=3)
    o, _ = op(**x, scale=0.5)
    expected = _inclusive_gla(x["r"], x["w"], x["k"], x["v"], 0.5, x["initial_state"])
    assert_close("o", expected, o, 1e-10)


@pytest.mark.parametrize("op", [naive_rwkv7, chunk_rwkv7_torch, fused_recurrent_rwkv7])
def test_zero_decay_unit_kappa_is_the_delta_rule(op):
    """w = 0, a = -kappa_hat, b = kappa_hat: S_t = (I - kappa_hat kappa_hat^T) S_{t-1} + k_t v_t^T."""
    x = make_rwkv7_inputs(2, 30, 2, 8, 6, dtype=F64, ab="delta", decay="zero", seed=4)
    o, final = op(**x, scale=0.5, output_final_state=True)
    kappa = x["b"]
    B, T, H, K = kappa.shape
    eye = torch.eye(K, dtype=F64)
    for bi in range(B):
        for h in range(H):
            S = x["initial_state"][bi, h].clone()
            for t in range(T):
                kh = kappa[bi, t, h]
                S = (eye - torch.outer(kh, kh)) @ S + torch.outer(x["k"][bi, t, h], x["v"][bi, t, h])
                assert_close(f"o[{bi},{t},{h}]", S.T @ (0.5 * x["r"][bi, t, h]), o[bi, t, h], 1e-10)
            assert_close(f"final_state[{bi},{h}]", S, final[bi, h], 1e-10)
