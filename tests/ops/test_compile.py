"""Every public op with the Triton backend inside torch.compile: the trainer compiles each block.

Fixed-length chunk ops are custom op pairs (torch.ops.flame.chunk_<family>_fwd / _bwd), opaque to the
compiler; the other calls (fused recurrent, varlen) run eagerly behind a graph break
(`flame.ops.utils.backend.run_eager`), since Dynamo tracing into the Triton kernels lets Inductor recompile
them with fp64 float arguments ("Both operands must be same dtype. Got fp64 and fp32" on an H100).
Results must equal the eager call bitwise.
"""

import importlib

import pytest
import torch

from flame import ops
from tests.ops.inputs import forward_backward, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [
    ("rwkv6", ops.chunk_rwkv6), ("rwkv6", ops.fused_recurrent_rwkv6),
    ("rwkv7", ops.chunk_rwkv7), ("rwkv7", ops.fused_recurrent_rwkv7),
    ("gsa", ops.chunk_gsa), ("gsa", ops.fused_recurrent_gsa),
]


@pytest.mark.parametrize("family, op", CASES, ids=[op.__name__ for _, op in CASES])
def test_triton_op_inside_torch_compile_equals_eager(family, op):
    torch._dynamo.reset()
    inputs = make_inputs(family, B=1, T=40, H=2, K=16, V=16, M=8, dtype=torch.float32, device=DEVICE,
                         requires_grad=True, seed=3)

    def run(**kw):  # elementwise work around the op, so that the compiled graph is not empty
        first = next(iter(kw))
        kw[first] = kw[first] * 1.0
        o, state = op(**kw, backend="triton")
        return o * 2, state

    eager = forward_backward(run, inputs)
    compiled = forward_backward(torch.compile(run, backend="aot_eager"), inputs)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    assert eager[2].keys() == compiled[2].keys()
    for name in eager[2]:
        a, b = eager[2][name], compiled[2][name]
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"d{name}: {m}")


FULLGRAPH_CASES = [("rwkv7", ops.chunk_rwkv7, dict(gate_lower_bound=-0.6065306597126334)),
                   ("rwkv6", ops.chunk_rwkv6, {}), ("gsa", ops.chunk_gsa, {})]


@pytest.mark.parametrize("family, op, extra", FULLGRAPH_CASES, ids=[c[0] for c in FULLGRAPH_CASES])
def test_fixed_length_chunk_op_traces_into_one_graph(family, op, extra):
    """Fixed-length chunk_rwkv7 / chunk_rwkv6 are custom op pairs (torch.ops.flame.chunk_*_fwd / _bwd):
    a compiled function around one has no graph break (fullgraph=True) and equals the eager call
    bitwise. Value checks are off, as in training (they read values on the host)."""
    torch._dynamo.reset()
    previous = ops.utils.checks.value_checks_enabled()
    ops.set_value_checks(False)
    try:
        inputs = make_inputs(family, B=1, T=40, H=2, K=16, V=16, M=8, dtype=torch.float32, device=DEVICE,
                             requires_grad=True, seed=5)

        def run(**kw):
            first = next(iter(kw))
            kw[first] = kw[first] * 1.0
            o, state = op(**kw, backend="triton", **extra)
            return o * 2, state

        eager = forward_backward(run, inputs)
        compiled = forward_backward(torch.compile(run, backend="aot_eager", fullgraph=True), inputs)
    finally:
        ops.set_value_checks(previous)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for name, grad in eager[2].items():
        if grad is not None:
            torch.testing.assert_close(compiled[2][name], grad, rtol=0, atol=0, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("family", ["rwkv7", "rwkv7_cached", "rwkv7_cached_centred", "rwkv7_recompute_states",
                                    "rwkv6", "gsa"])
def test_chunk_custom_ops_pass_opcheck(family):
    """The forward ops' schemas, fake (meta) implementations and compiled autograd; RWKV7 with and
    without cached intermediates, in the centred regime (a per-chunk regime record), and with the
    states recomputed from an initial state in the backward."""
    variant = family
    family = family.split("_")[0]
    importlib.import_module(f"flame.ops.{family}.chunk_triton")  # registers the ops
    inputs = make_inputs(family, B=1, T=20, H=1, K=16, V=16, M=8, dtype=torch.float32, device=DEVICE,
                         requires_grad=True, seed=6)
    if family == "rwkv7":
        op = torch.ops.flame.chunk_rwkv7_fwd.default
        bound = -0.5 if variant.endswith("centred") else None
        recompute = variant.endswith("recompute_states")
        h0 = inputs["initial_state"] if recompute else None
        args = tuple(inputs[n] for n in ("r", "w", "k", "v", "a", "b")) + (h0, 1.0, bound, True, True,
                                                                           "cached" in variant, recompute)
    elif family == "rwkv6":
        op = torch.ops.flame.chunk_rwkv6_fwd.default
        args = tuple(inputs[n] for n in ("r", "k", "v", "w", "u")) + (None, 1.0, True, 64)
    else:  # with initial states and two query heads per key head: every gradient path of the pair
        inputs = make_inputs(family, B=1, T=20, H=1, HQ=2, K=16, V=16, M=8, dtype=torch.float32, device=DEVICE,
                             requires_grad=True, seed=6)
        op = torch.ops.flame.chunk_gsa_fwd.default
        args = tuple(inputs[n] for n in ("q", "k", "v", "s", "g")) + (*inputs["initial_state"], 1.0, True, 16)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("family", ["rwkv7", "rwkv6"])
@pytest.mark.parametrize("output_final_state", [False, True])
@torch.no_grad()
def test_chunk_custom_ops_run_without_autograd(family, output_final_state):
    """Inference (validation, evaluation, a prompt's prefill): no saved tensors, so the custom op
    returns several empty placeholders, which must be distinct tensors (a custom op's outputs may
    not alias each other)."""
    inputs = make_inputs(family, B=2, T=20, H=1, K=16, V=16, dtype=torch.float32, device=DEVICE,
                         requires_grad=False, seed=7)
    names = ("r", "w", "k", "v", "a", "b") if family == "rwkv7" else ("r", "k", "v", "w", "u")
    op = ops.chunk_rwkv7 if family == "rwkv7" else ops.chunk_rwkv6
    args = tuple(inputs[n] for n in names)
    o, ht = op(*args, output_final_state=output_final_state, backend="triton")
    ref_o, ref_ht = op(*args, output_final_state=output_final_state, backend="torch")
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-4)
    assert (ht is None) == (ref_ht is None) == (not output_final_state)
