"""Regression: a trained RWKV7 head whose chunked bf16 forward overflowed to inf on the H100.

`data/rwkv7_340M_layer1_head3_bf16.pt` holds the real inputs (r, w, k, v, a, b; bf16,
[1, 2048, 1, 64]) of layer 1, head 3 of configs/rwkv7_340M.toml after 19 steps on the embedded
corpus (batch 8 x GA 2, lr warm-up 6): slow decays (w up to -2e-4), |k| up to 8, an output range of
1.3e4. With plain-TF32 products (nilpotent-product inverse and state scan) the chunk kernel
returned inf from chunk 29 on and the run's loss turned NaN at step 20 (1 GPU and FSDP over 2
GPUs alike); the fp64 recurrence stays finite. The interpreter computes these products in fp32,
so only a GPU reproduces the failure: the test is GPU-only.
"""

from pathlib import Path

import pytest
import torch

from flame.ops import chunk_rwkv7, fused_recurrent_rwkv7, naive_rwkv7
from tests.ops.assertions import assert_close, assert_finite
from tests.ops.inputs import forward_backward

DATA = Path(__file__).parent / "data" / "rwkv7_340M_layer1_head3_bf16.pt"
BOUND = -0.6065306597126334  # the RWKV7 layer's gate_lower_bound (centred regime)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["chunk_centred", "chunk_exact", "fused_recurrent"])
def test_trained_head_bf16_stays_finite_and_matches_fp64(op):
    data = torch.load(DATA, map_location="cuda")
    inputs = {name: data[name].requires_grad_() for name in "rwkvab"}
    reference = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    # the same seeded output gradient for both (forward_backward draws it in fp64, then casts)
    o_ref, _, g_ref = forward_backward(naive_rwkv7, reference, with_dht=False, scale=1.0)
    fn, kw = {
        "chunk_centred": (chunk_rwkv7, {"gate_lower_bound": BOUND, "backend": "triton"}),
        "chunk_exact": (chunk_rwkv7, {"backend": "triton"}),
        "fused_recurrent": (fused_recurrent_rwkv7, {"backend": "triton"}),
    }[op]
    o, _, grads = forward_backward(fn, inputs, with_dht=False, scale=1.0, **kw)
    assert_finite("o", o)
    assert_close("o", o_ref, o, 1e-2)
    for name in "rwkvab":
        assert_finite(f"d{name}", grads[name])
        assert_close(f"d{name}", g_ref[name], grads[name], 2e-2)
