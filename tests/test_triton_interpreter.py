"""tests/triton_interpreter.py: under it a kernel built from helpers computes what the interpreter
computes, walks triton.language as often as a kernel without helpers does (once per launch, not once
per helper call and program), and leaves the language as it found it; the overflow check it skips
is one whose verdict the interpreter discards; its memoized type conversions, shared tensor shapes and
shortcut broadcasts give what Triton's own give, and kernels compute bitwise the same with them."""

import dataclasses

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


@triton.jit
def _mixed_kernel(x16, x32, idx, out, out_i, M: tl.constexpr, N: tl.constexpr):
    """bf16 and fp32 tiles of two shapes, broadcasting, a product, a reduction, and int32 arithmetic
    that overflows."""
    pid = tl.program_id(0)
    rows = tl.arange(0, M)
    cols = tl.arange(0, N)
    offs = pid * M * N + rows[:, None] * N + cols[None, :]
    a = tl.load(x16 + offs).to(tl.float32)
    b = tl.load(x32 + offs)
    c = tl.dot(a, tl.trans(b), input_precision="ieee")  # [M, M]
    s = tl.sum(c, axis=1)[:, None] * tl.exp(b - tl.max(b, axis=1)[:, None])
    tl.store(out + offs, (s + a).to(out.dtype.element_ty))
    i = tl.load(idx + pid * M + rows)
    tl.store(out_i + pid * M + rows, i * 1_000_003 + 2_000_000_000)  # wraps in int32


def _mixed_run():
    g = torch.Generator().manual_seed(0)
    M, N, P = 16, 32, 3
    x16 = torch.randn(P * M * N, generator=g).to(torch.bfloat16)
    x32 = torch.randn(P * M * N, generator=g)
    idx = torch.randint(0, 2**20, (P * M,), generator=g, dtype=torch.int32)
    out, out_i = torch.empty(P * M * N, dtype=torch.bfloat16), torch.empty_like(idx)
    _mixed_kernel[(P,)](x16, x32, idx, out, out_i, M=M, N=N)
    return out, out_i


def test_the_skipped_overflow_check_is_one_the_interpreter_discards(monkeypatch):
    options = interpreter.interpreter_builder.options
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):
        pytest.skip("this Triton's interpreter has another shape; tests/triton_interpreter.py leaves it alone")
    assert not options.sanitize_overflow and not options.debug
    skipped = _mixed_run()
    monkeypatch.setattr(interpreter.interpreter_builder, "options",
                        dataclasses.replace(options, sanitize_overflow=True))
    checked = _mixed_run()  # int32 overflows, and the check lets it pass: its verdict goes nowhere
    for a, b in zip(skipped, checked):
        assert torch.equal(a, b)
    assert (checked[1] < 0).any(), "the kernel's int32 arithmetic overflows"


def test_memoized_type_conversions_give_what_tritons_own_give(monkeypatch):
    get_np_dtype, init = interpreter._get_np_dtype, tl.core.block_type.__init__
    if not (hasattr(get_np_dtype, "__wrapped__") and hasattr(init, "__wrapped__")):
        pytest.skip("this Triton's interpreter has another shape; tests/triton_interpreter.py leaves it alone")
    scalars = [tl.int1, tl.int8, tl.int32, tl.int64, tl.uint32, tl.float16, tl.bfloat16, tl.float32, tl.float64]
    for t in scalars + [tl.pointer_type(tl.float32), tl.pointer_type(tl.bfloat16, const=True)]:
        for ty in (t, tl.block_type(t, [4, 8]), tl.block_type(t, [tl.constexpr(2)])):
            assert get_np_dtype(ty) == get_np_dtype.__wrapped__(ty), ty
    for element_ty, shape in ((tl.float32, [16, 32]), (tl.pointer_type(tl.bfloat16), [tl.constexpr(8), 4]),
                              (tl.int32, [1])):
        memo, own = object.__new__(tl.block_type), object.__new__(tl.block_type)
        for _ in range(2):  # computed, then reused
            tl.block_type(element_ty, shape)
            init(memo, element_ty, shape)
            init.__wrapped__(own, element_ty, shape)
            assert vars(memo) == vars(own), (vars(memo), vars(own))
    with pytest.raises(ValueError):
        tl.block_type(tl.float32, [3])  # Triton's own validation still runs on a new shape
    memoized = _mixed_run()
    monkeypatch.setattr(interpreter, "_get_np_dtype", get_np_dtype.__wrapped__)
    monkeypatch.setattr(tl.core.block_type, "__init__", init.__wrapped__)
    for a, b in zip(memoized, _mixed_run()):
        assert torch.equal(a, b)


def _shape_and_numel(t):
    return [tl.core._unwrap_if_constexpr(s) for s in t.shape], tl.core._unwrap_if_constexpr(t.numel)


def test_shared_tensor_shapes_are_tritons_own(monkeypatch):
    init = tl.core.tensor.__init__
    if not hasattr(init, "__wrapped__"):
        pytest.skip("this Triton's interpreter has another shape; tests/triton_interpreter.py leaves it alone")
    types = [tl.float32, tl.int1, tl.block_type(tl.float32, [16, 32]), tl.block_type(tl.bfloat16, [16, 32]),
             tl.block_type(tl.pointer_type(tl.float32), [8]), tl.block_type(tl.int32, [2, 4, 8])]
    for ty in types:
        for _ in range(2):  # built, then shared
            shared, own = object.__new__(tl.core.tensor), object.__new__(tl.core.tensor)
            init(shared, None, ty)
            init.__wrapped__(own, None, ty)
            assert shared.type is own.type is ty and shared.dtype == own.dtype and shared.handle is None
            assert _shape_and_numel(shared) == _shape_and_numel(own), ty
    a, b = object.__new__(tl.core.tensor), object.__new__(tl.core.tensor)
    init(a, None, tl.block_type(tl.float32, [4, 8]))
    init(b, None, tl.block_type(tl.float32, [4, 8]))
    assert a.shape is b.shape, "tensors of one type share their shape"
    shared_run = _mixed_run()
    monkeypatch.setattr(tl.core.tensor, "__init__", init.__wrapped__)
    for x, y in zip(shared_run, _mixed_run()):
        assert torch.equal(x, y)


def test_equal_shape_broadcasts_return_what_tritons_own_returns(monkeypatch):
    semantic = interpreter.interpreter_semantic
    broadcast = semantic.broadcast_impl_value
    if not hasattr(broadcast, "__wrapped__"):
        pytest.skip("this Triton's interpreter has another shape; tests/triton_interpreter.py leaves it alone")
    f32, bf16 = tl.float32, tl.bfloat16

    def block(dtype, shape):
        return semantic.cast(semantic.splat(semantic.to_tensor(1.0), shape), dtype)

    pairs = [(block(f32, [4, 8]), block(bf16, [4, 8])), (block(f32, [4, 8]), block(f32, [1, 8])),
             (block(f32, [8]), block(f32, [4, 8])), (block(f32, [4, 1]), block(f32, [1, 8])),
             (block(f32, [4, 8]), semantic.to_tensor(2.0))]
    for lhs, rhs in pairs:
        fast, own = broadcast(lhs, rhs), broadcast.__wrapped__(lhs, rhs)
        for a, b in zip(fast, own):
            assert list(a.type.shape) == list(b.type.shape) and a.dtype == b.dtype
        if rhs.type.is_block() and list(lhs.type.shape) == list(rhs.type.shape):
            assert fast[0] is lhs and fast[1] is rhs and own[0] is lhs and own[1] is rhs
    with pytest.raises(ValueError):
        broadcast(block(f32, [4, 8]), block(f32, [8, 4]))  # Triton's own check still runs on other shapes
    shortcut = _mixed_run()
    monkeypatch.setattr(semantic, "broadcast_impl_value", broadcast.__wrapped__)
    for x, y in zip(shortcut, _mixed_run()):
        assert torch.equal(x, y)
