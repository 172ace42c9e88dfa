"""RWKV6 PyTorch backend cases of its own; the cases every family shares are in test_torch_backends.py."""

import torch

from flame.ops import chunk_rwkv6, naive_rwkv6
from tests.ops.inputs import assert_results_close, forward_backward, make_rwkv6_inputs, to_reference


def test_extreme_decays_bf16_finite():
    inputs = make_rwkv6_inputs(1, 70, 2, 16, 16, dtype=torch.bfloat16, decay="wide", requires_grad=True)
    ref = forward_backward(naive_rwkv6, to_reference(inputs))
    out = forward_backward(chunk_rwkv6, inputs, backend="torch")
    assert_results_close(ref, out, ratio=2e-2)
