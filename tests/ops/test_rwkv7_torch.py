"""RWKV7 PyTorch backend cases of its own (the cases every family shares are in
test_torch_backends.py), and the naive recurrence itself against two closed forms
(docs/kernels.md#rwkv7-closed-forms)."""

import pytest
import torch

from flame.ops import chunk_rwkv7, fused_recurrent_rwkv7, naive_rwkv7
from flame.ops.rwkv7.chunk_torch import chunk_rwkv7_torch
from tests.ops.assertions import assert_close
from tests.ops.inputs import (RWKV7_LOG_DECAY_BOUND, assert_results_close, forward_backward, make_rwkv7_inputs,
                              to_reference)

F64 = torch.float64


def test_layer_bound_decay_bf16_long_chunked():
    """w at the layer's bound over many chunks, bf16 inputs: fp32 internals keep the error small."""
    inputs = make_rwkv7_inputs(1, 160, 2, 16, 16, dtype=torch.bfloat16, decay=RWKV7_LOG_DECAY_BOUND,
                               requires_grad=True)
    ref = forward_backward(naive_rwkv7, to_reference(inputs))
    out = forward_backward(chunk_rwkv7, inputs, backend="torch", gate_lower_bound=RWKV7_LOG_DECAY_BOUND)
    assert_results_close(ref, out, ratio=2e-2)


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
