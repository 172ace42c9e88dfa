"""Every public op with the Triton backend inside torch.compile: the trainer compiles each block.

The ops run eagerly there (`flame.ops.backend.run_eager`, a graph break): without it Dynamo traced
into the Triton kernels, and Inductor recompiled them with fp64 float arguments, which failed on
the H100 ("Both operands must be same dtype. Got fp64 and fp32") and, under the interpreter, in
fake-tensor tracing. Results must equal the eager call bitwise.
"""

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
