"""squared_relu_mlp (flame.ops.squared_relu_mlp) against relu(x W_k^T)^2 W_v^T in fp64 with autograd:
the output and the gradients of x and both weights. The Triton backend puts the activation in the
epilogues of the key product (forward) and of dout W_v (backward). CPU runs use the Triton
interpreter, with small tiles so that every edge (rows, output columns and the reduction) is a
partial tile."""

import pytest
import torch

from flame.ops import squared_relu_mlp
from flame.ops.squared_relu import squared_relu_mlp_triton
from tests.ops.assertions import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 32 x 32 x 16 under the interpreter (fast, and the sizes below cut them)."""
    if DEVICE == "cpu":
        for name, value in (("BLOCK_M", 32), ("BLOCK_N", 32), ("BLOCK_K", 16)):
            monkeypatch.setattr(squared_relu_mlp_triton, name, value)


def _inputs(M, C, F, C_out, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=gen)
    w_key = torch.randn(F, C, generator=gen) / C**0.5
    w_value = torch.randn(C_out, F, generator=gen) / F**0.5
    dout = torch.randn(M, C_out, generator=gen)
    return [t.to(DEVICE, dtype) for t in (x, w_key, w_value, dout)]


def _reference(x, w_key, w_value, dout):
    """The output and the gradients of x, w_key, w_value in fp64 with autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w_key, w_value)]
    out = torch.relu(leaves[0] @ leaves[1].T).square() @ leaves[2].T
    return (out, *torch.autograd.grad(out, leaves, dout.double()))


def _check(x, w_key, w_value, dout, ratio, backend="triton"):
    ref = _reference(x, w_key, w_value, dout)
    leaves = [t.detach().requires_grad_() for t in (x, w_key, w_value)]
    out = squared_relu_mlp(*leaves, backend=backend)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    for name, want, have, leaf in zip(("out", "dx", "dw_key", "dw_value"), ref, got, (x, *leaves)):
        assert have.dtype == leaf.dtype, f"{name}: dtype {have.dtype}, expected {leaf.dtype}"
        assert want.abs().max() > 0, f"{name}: the reference is all zero, nothing compared"
        assert_close(name, want, have, ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64(dtype, small_tiles):
    # 70 rows, 40 = 2.5 reduction tiles, 56 = 1.75 output tiles, 24 outputs: every edge partial
    x, w_key, w_value, dout = _inputs(70, 40, 56, 24, dtype)
    x[:3] = 0.0  # pre-activations exactly 0: relu's kink, where the gradient is 0 as in autograd
    _check(x, w_key, w_value, dout, RATIO[dtype])


def test_leading_dimensions_are_kept(small_tiles):
    x, w_key, w_value, dout = _inputs(2 * 9, 16, 32, 16, torch.float32)
    out = squared_relu_mlp(x.view(2, 9, 16), w_key, w_value, backend="triton")
    assert out.shape == (2, 9, 16)
    assert_close("out", _reference(x, w_key, w_value, dout)[0].view(2, 9, 16), out, 1e-6)


def test_inputs_that_start_off_16_bytes_are_copied_for_the_descriptors(small_tiles):
    """x as a view one element into a buffer (its rows still 16-byte multiples): the descriptors need
    a 16-byte aligned start, so the op copies it rather than fail."""
    x, w_key, w_value, dout = _inputs(24, 16, 32, 16, torch.float32)
    buffer = torch.empty(x.numel() + 1, device=DEVICE, dtype=x.dtype)
    shifted = buffer[1:].view_as(x).copy_(x)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0
    _check(shifted, w_key, w_value, dout, RATIO[torch.float32])


def test_widths_the_descriptors_refuse_run_the_composition():
    """Row widths that are not multiples of 8 elements (16 bytes of bf16) go to the PyTorch
    composition, with the same results."""
    x, w_key, w_value, dout = _inputs(10, 12, 20, 12, torch.float32)
    _check(x, w_key, w_value, dout, RATIO[torch.float32])


def test_torch_backend_matches_fp64():
    x, w_key, w_value, dout = _inputs(33, 24, 40, 16, torch.float32)
    _check(x, w_key, w_value, dout, RATIO[torch.float32], backend="torch")


def test_autocast_computes_in_the_autocast_dtype(small_tiles):
    x, w_key, w_value, dout = _inputs(40, 32, 48, 32, torch.float32)
    w_key.requires_grad_()
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        out = squared_relu_mlp(x, w_key, w_value, backend="triton")
    assert out.dtype == torch.bfloat16
    (dw_key,) = torch.autograd.grad(out, [w_key], dout.bfloat16())
    assert dw_key.dtype == torch.float32
    ref = _reference(*(t.bfloat16() for t in (x, w_key, w_value, dout)))
    assert_close("out", ref[0], out, RATIO[torch.bfloat16])
    assert_close("dw_key", ref[2], dw_key, RATIO[torch.bfloat16])


def test_inside_torch_compile_equals_eager(small_tiles):
    torch._dynamo.reset()
    x, w_key, w_value, dout = _inputs(40, 32, 48, 16, torch.float32)
    leaves = [t.requires_grad_() for t in (x, w_key, w_value)]

    def run(x, w_key, w_value):
        return squared_relu_mlp(x * 1.0, w_key, w_value, backend="triton") * 2

    results = []
    for fn in (run, torch.compile(run, backend="aot_eager", fullgraph=True)):
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_bad_input_is_named():
    x, w_key, w_value, _ = _inputs(4, 16, 32, 16, torch.float32)
    with pytest.raises(TypeError, match="squared_relu_mlp: x must be a floating-point"):
        squared_relu_mlp(x.long(), w_key, w_value)
    with pytest.raises(ValueError, match=r"squared_relu_mlp: x \[..., 16\] needs w_key \[F, 16\]"):
        squared_relu_mlp(x, w_key[:, :8], w_value)
    with pytest.raises(ValueError, match="squared_relu_mlp: x \\[..., 16\\] needs"):
        squared_relu_mlp(x, w_key, w_value[:, :8])


@pytest.mark.gpu
@pytest.mark.parametrize("M, C, F", [(16384, 1024, 4096), (8192, 2048, 8192), (4096, 1024, 3584)])
def test_gpu_bf16_channel_mix_sizes(M, C, F):
    """The shipped channel mixes in bf16: RWKV7 340M (one micro-batch) and 1B, RWKV6 340M (3.5 C)."""
    x, w_key, w_value, dout = _inputs(M, C, F, C, torch.bfloat16, seed=1)
    _check(x, w_key, w_value, dout, RATIO[torch.bfloat16])
