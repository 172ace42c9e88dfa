"""squared_relu (flame.ops.squared_relu) against relu(x)^2 in fp64 with autograd; the Triton backward
takes its gradient from the output, 2 sqrt(y) dy. CPU runs use the Triton interpreter."""

import pytest
import torch

from flame.ops import squared_relu
from flame.ops.squared_relu.squared_relu_triton import BLOCK
from tests.ops.assertions import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _check(x, dy, ratio):
    ref_x = x.detach().double().requires_grad_()
    ref = torch.relu(ref_x).square()
    (ref_dx,) = torch.autograd.grad((ref * dy.double()).sum(), [ref_x])
    y = squared_relu(x, backend="triton")
    (dx,) = torch.autograd.grad((y.double() * dy.double()).sum(), [x])
    assert y.dtype == dx.dtype == x.dtype
    assert_close("y", ref, y, ratio)
    assert_close("dx", ref_dx, dx, ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64(dtype):
    gen = torch.Generator().manual_seed(0)
    n = 2 * BLOCK + 77  # a partial last block
    x = torch.randn(3, n, generator=gen).to(DEVICE, dtype)
    x[0, :10] = 0.0  # relu's kink: the gradient there is 0, as autograd's
    _check(x.requires_grad_(), torch.randn(3, n, generator=gen).to(DEVICE, dtype), RATIO[dtype])


def test_gradient_is_zero_where_x_is_not_positive():
    x = torch.tensor([-2.0, -0.0, 0.0, 1e-30, 3.0], device=DEVICE, requires_grad=True)
    (dx,) = torch.autograd.grad(squared_relu(x, backend="triton").sum(), [x])
    assert dx.tolist()[:3] == [0.0, 0.0, 0.0]
    assert dx[4].item() == pytest.approx(6.0)


def test_autocast_computes_in_the_autocast_dtype():
    x = torch.randn(4, 64, device=DEVICE)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        y = squared_relu(x, backend="triton")
    assert y.dtype == torch.bfloat16
    assert_close("y", torch.relu(x.bfloat16().double()).square(), y, RATIO[torch.bfloat16])


def test_torch_backend_is_autograds():
    x = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    y = squared_relu(x, backend="torch")
    (dx,) = torch.autograd.grad(y.sum(), [x])
    torch.testing.assert_close(dx, 2 * torch.relu(x.detach()))


def test_inside_torch_compile_equals_eager():
    torch._dynamo.reset()
    x = torch.randn(4, 100, device=DEVICE, requires_grad=True)

    def run(x):
        return squared_relu(x * 1.0, backend="triton") * 2

    eager = run(x)
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    grads = [torch.autograd.grad(out.sum(), [x])[0] for out in (eager, compiled)]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="squared_relu: x must be a floating-point"):
        squared_relu(torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
def test_gpu_bf16_channel_mix_size():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16384, 4096, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    _check(x, torch.randn(16384, 4096, generator=gen).to(DEVICE, torch.bfloat16), RATIO[torch.bfloat16])
