"""Op-side regression tests for two known failures (docs/known-failures.md):
#all-nan-rwkv7-outputs and #chunked-and-recurrent-kernels-disagree.

All-NaN RWKV7 outputs (#all-nan-rwkv7-outputs): on the op side, a positive "log-decay" (log of a w
that can be negative, or the decay itself) and a head-first [B, H, T, K] layout must be rejected
with a clear error.
Chunked and recurrent kernels disagreeing (#chunked-and-recurrent-kernels-disagree): an input
modified in place by one path made chunked and recurrent RWKV6 disagree; no op may modify its
inputs, and chunked and recurrent must agree with each other and with fp64.

The backend lists below are where the Triton backends plug in: add "triton" to BACKENDS to run the
same checks on the kernels (under TRITON_INTERPRET=1 on CPU).
"""

import pytest
import torch

from flame.ops import (chunk_gsa, chunk_rwkv6, chunk_rwkv7, fused_recurrent_gsa, fused_recurrent_rwkv6,
                       fused_recurrent_rwkv7, naive_gsa, naive_rwkv6, naive_rwkv7)
from tests.ops.inputs import (assert_inputs_unchanged, assert_results_close, forward_backward, make_gsa_inputs,
                              make_rwkv6_inputs, make_rwkv7_inputs, to_reference)

BACKENDS = ["torch"]

FAMILIES = {
    "rwkv6": (chunk_rwkv6, fused_recurrent_rwkv6, naive_rwkv6, lambda **kw: make_rwkv6_inputs(2, 40, 2, 8, 12, **kw)),
    "rwkv7": (chunk_rwkv7, fused_recurrent_rwkv7, naive_rwkv7, lambda **kw: make_rwkv7_inputs(2, 40, 2, 8, 12, **kw)),
    "gsa": (chunk_gsa, fused_recurrent_gsa, naive_gsa, lambda **kw: make_gsa_inputs(2, 40, 2, 8, 12, 6, HQ=4, **kw)),
}
DECAY_NAME = {"rwkv6": "w", "rwkv7": "w", "gsa": "g"}
OPS = [(family, kind) for family in FAMILIES for kind in ("chunk", "fused_recurrent")]


def _op(family, kind):
    chunk, recurrent, _, _ = FAMILIES[family]
    return chunk if kind == "chunk" else recurrent


# ---------------------------------------------------------------------------------------------
# all-NaN RWKV7 outputs: inputs that lead there are refused

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family,kind", OPS)
def test_positive_log_decay_rejected(family, kind, backend):
    op = _op(family, kind)
    inputs = FAMILIES[family][3]()
    name = DECAY_NAME[family]
    decay = torch.exp(inputs[name])              # the decay itself, in (0, 1], instead of its log
    with pytest.raises(ValueError, match=f"{name} must be a log-decay"):
        op(**{**inputs, name: decay}, backend=backend)
    # log of a "decay" that can be negative: NaN where it is negative
    log_of_signed = torch.log(torch.randn_like(decay))
    with pytest.raises(ValueError, match=f"{name} must be a log-decay .* NaN"):
        op(**{**inputs, name: log_of_signed}, backend=backend)


def _head_first(x):
    return x.transpose(1, 2).contiguous() if isinstance(x, torch.Tensor) and x.dim() == 4 else x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["chunk", "fused_recurrent"])
def test_head_first_layout_rejected_rwkv6(kind, backend):
    """All of r, k, v, w head-first: u [H, K] and the state expose the wrong head count."""
    op = _op("rwkv6", kind)
    inputs = FAMILIES["rwkv6"][3]()
    tensors = {n: _head_first(x) for n, x in inputs.items() if n in "rkvw"}
    with pytest.raises(ValueError, match=r"u must have shape \[H, K\] = \(40, 8\).*head-first"):
        op(**{**inputs, **tensors}, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["chunk", "fused_recurrent"])
def test_head_first_layout_rejected_rwkv7(kind, backend):
    op = _op("rwkv7", kind)
    inputs = FAMILIES["rwkv7"][3]()
    # one tensor head-first among token-major ones
    with pytest.raises(ValueError, match="head-first"):
        op(**{**inputs, "k": _head_first(inputs["k"])}, backend=backend)
    # every tensor head-first: the [N, H, K, V] state exposes it
    all_head_first = {n: _head_first(x) for n, x in inputs.items() if n != "initial_state"}
    with pytest.raises(ValueError, match=r"initial_state must have shape .* \(2, 40, 8, 12\).*head-first"):
        op(**{**inputs, **all_head_first}, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["chunk", "fused_recurrent"])
def test_head_first_layout_rejected_gsa(kind, backend):
    op = _op("gsa", kind)
    inputs = FAMILIES["gsa"][3]()
    # q head-first: its "head" dim is T = 40, and B/T no longer match k
    with pytest.raises(ValueError, match="head-first"):
        op(**{**inputs, "q": _head_first(inputs["q"])}, backend=backend)
    # every tensor head-first: with grouped queries q and k disagree; without, the state exposes it
    all_head_first = {n: _head_first(x) for n, x in inputs.items() if n != "initial_state"}
    with pytest.raises(ValueError, match="head-first"):
        op(**{**inputs, **all_head_first}, backend=backend)
    inputs = make_gsa_inputs(2, 40, 2, 8, 12, 6)
    all_head_first = {n: _head_first(x) for n, x in inputs.items() if n != "initial_state"}
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(hk\) must have shape .*head-first"):
        op(**{**inputs, **all_head_first}, backend=backend)


# ---------------------------------------------------------------------------------------------
# chunked and recurrent kernels disagree: inputs untouched, paths agree

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family,kind", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_do_not_modify_inputs(family, kind, dtype, backend):
    inputs = FAMILIES[family][3](dtype=dtype, requires_grad=True, decay="half_zero")
    assert_inputs_unchanged(_op(family, kind), inputs, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunk_and_recurrent_agree_with_each_other_and_fp64(family, backend):
    chunk, recurrent, naive, make = FAMILIES[family]
    inputs = make(dtype=torch.float32, requires_grad=True, decay="strong")
    ref = forward_backward(naive, to_reference(inputs))
    out_chunk = forward_backward(chunk, inputs, backend=backend)
    out_recurrent = forward_backward(recurrent, inputs, backend=backend)
    assert_results_close(ref, out_chunk, ratio=1e-5, label="chunk vs fp64: ")
    assert_results_close(ref, out_recurrent, ratio=1e-5, label="recurrent vs fp64: ")
    assert_results_close(out_recurrent, out_chunk, ratio=1e-5, label="chunk vs recurrent: ")
