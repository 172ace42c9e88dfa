"""tests/triton_interpreter.py: under it a kernel built from helpers computes what the interpreter
computes, walks triton.language as often as a kernel without helpers does (once per launch, not once
per helper call and program), and leaves the language as it found it."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from flame.ops.utils.backend import triton_interpreter_enabled

pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")]


@triton.jit
def _step(x, c):
    return x * c + 1.0


@triton.jit
def _with_helpers_kernel(x, y, N: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    acc = tl.load(x + offs)
    for _ in range(STEPS):
        acc = _step(acc, 0.5)
    tl.store(y + offs, acc)


@triton.jit
def _inline_kernel(x, y, N: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    acc = tl.load(x + offs)
    for _ in range(STEPS):
        acc = acc * 0.5 + 1.0
    tl.store(y + offs, acc)


def test_helper_calls_do_not_walk_the_language_again(monkeypatch):
    if not hasattr(interpreter, "_patch_builtin"):
        pytest.skip("this Triton's interpreter has another shape; tests/triton_interpreter.py leaves it alone")
    walks = []
    walk = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: (walks.append(args[0]), walk(*args))[1])
    x = torch.arange(32, dtype=torch.float32)
    expected = x.clone()
    for _ in range(5):
        expected = expected * 0.5 + 1.0
    counts = []
    for kernel in (_inline_kernel, _with_helpers_kernel):
        walks.clear()
        y = torch.empty_like(x)
        kernel[(4,)](x, y, N=8, STEPS=5)  # 4 programs x 5 helper calls
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        counts.append(len(walks))
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.tensor.__mul__), "the language stays swapped"
    assert counts[0] > 0 and counts[1] == counts[0], counts
