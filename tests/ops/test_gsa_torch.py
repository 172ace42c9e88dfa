"""GSA PyTorch backend cases of its own; the cases every family shares are in test_torch_backends.py."""

import torch

from flame.ops import chunk_gsa, naive_gsa
from tests.ops.inputs import assert_results_close, forward_backward, make_gsa_inputs, to_reference


def test_softmax_with_large_score_spread():
    """|q|, |k| up to ~10 with scale 1: the slot softmax must stay max-stable (docs/kernels.md#gsa-softmax)."""
    inputs = make_gsa_inputs(1, 40, 2, 16, 8, 8, dtype=torch.float32, requires_grad=True)
    inputs = {n: x for n, x in inputs.items()}
    inputs["q"] = (inputs["q"].detach() * 10).requires_grad_(True)
    inputs["k"] = (inputs["k"].detach() * 10).requires_grad_(True)
    ref = forward_backward(naive_gsa, to_reference(inputs))
    out = forward_backward(chunk_gsa, inputs, backend="torch")
    assert_results_close(ref, out, ratio=1e-4, atol=1e-5)
