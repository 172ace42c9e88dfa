"""layer_norm and rms_norm (flame.ops.norm) against an fp64 row-by-row oracle with autograd.

CPU runs use the Triton interpreter (set by conftest) at small shapes: 140 rows span several
backward programs and a partial last one (and a partial last forward tile); C = 100 is not a power
of two, so every tile masks channels. GPU tests (`-m gpu`) run bf16 at the 340M, 1B and 2.9B
hidden sizes.
"""

import pytest
import torch

from flame import ops
from flame.ops.norm.norm_triton import program_rows, tile_rows
from tests.ops.assertions import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-5


def oracle(x, weight, bias, eps, rms):
    """The norm in fp64, one row at a time (the parameters cast once: their gradients sum in fp64)."""
    weight = weight.double() if weight is not None else None
    bias = bias.double() if bias is not None else None
    rows = []
    for row in x.double().reshape(-1, x.shape[-1]).unbind(0):
        centred = row if rms else row - row.mean()
        out = centred / torch.sqrt((centred * centred).mean() + eps)
        if weight is not None:
            out = out * weight
        if bias is not None:
            out = out + bias
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


def _inputs(shape, dtype, param_dtype, affine, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = (3 * torch.randn(*shape, generator=gen) + 1.5).to(DEVICE, dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(C, generator=gen)).to(DEVICE, param_dtype).requires_grad_() if affine else None
    b = (0.2 * torch.randn(C, generator=gen)).to(DEVICE, param_dtype).requires_grad_() if bias else None
    dy = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    return x, w, b, dy


def _run(fn, x, w, b, dy):
    y = fn(x, w, b)
    leaves = [t for t in (x, w, b) if t is not None]
    return y, torch.autograd.grad((y.double() * dy.double()).sum(), leaves)


def _call(rms, backend):
    if rms:
        return lambda x, w, b: ops.rms_norm(x, w, EPS, backend=backend)
    return lambda x, w, b: ops.layer_norm(x, w, b, EPS, backend=backend)


def _assert_matches_oracle(rms, x, w, b, dy, ratio, backend="triton"):
    ref_y, ref_grads = _run(lambda *a: oracle(*a, EPS, rms), x, w, b, dy)
    y, grads = _run(_call(rms, backend), x, w, b, dy)
    assert y.dtype == x.dtype
    assert_close("y", ref_y, y, ratio)
    names = [n for n, t in (("dx", x), ("dw", w), ("db", b)) if t is not None]
    for name, leaf, r, g in zip(names, [t for t in (x, w, b) if t is not None], ref_grads, grads):
        assert g.dtype == leaf.dtype, name
        assert_close(name, r, g, ratio)


NORMS = [(False, True, True), (False, False, False), (True, True, False), (True, False, False)]
NORM_IDS = ["layer_norm", "layer_norm_plain", "rms_norm", "rms_norm_plain"]


@pytest.mark.parametrize("rms, affine, bias", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_oracle(rms, affine, bias, dtype):
    # 2 x 70 rows: three backward programs, the last partial, and a partial last forward tile
    assert 140 % program_rows(100) and 140 > 2 * program_rows(100) and 140 % tile_rows(100)
    _assert_matches_oracle(rms, *_inputs((2, 70, 100), dtype, dtype, affine, bias), RATIO[dtype])


@pytest.mark.parametrize("rms, affine, bias", [NORMS[0], NORMS[2]], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_matches_fp64_oracle(rms, affine, bias, dtype):
    """With `residual`: (s, norm(s)), s = x + residual rounded to x's dtype; x and residual both
    take s's gradient, from s's own use (the residual stream) and through the norm."""
    x, w, b, dy = _inputs((2, 70, 100), dtype, dtype, affine, bias, seed=8)
    res, _, _, ds = _inputs((2, 70, 100), dtype, dtype, False, False, seed=9)

    def loss(s, y):
        return (s.double() * ds.double()).sum() + (y.double() * dy.double()).sum()

    leaves = [t for t in (x, res, w, b) if t is not None]
    s_ref = (x.double() + res.double()).to(dtype).double()  # the oracle's sum rounds as the op's does
    y_ref = oracle(s_ref, w, b, EPS, rms)
    ref_grads = torch.autograd.grad(loss(s_ref, y_ref), leaves)
    call = (lambda: ops.rms_norm(x, w, EPS, residual=res, backend="triton")) if rms else \
        (lambda: ops.layer_norm(x, w, b, EPS, residual=res, backend="triton"))
    s, y = call()
    grads = torch.autograd.grad(loss(s, y), leaves)
    assert s.dtype == y.dtype == dtype
    assert_close("s", s_ref, s, RATIO[dtype])
    assert_close("y", y_ref, y, RATIO[dtype])
    for name, r, g in zip(["dx", "dresidual", "dw", "db"], ref_grads, grads):
        assert_close(name, r, g, RATIO[dtype])


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_stream_form_sums_both_gradients_of_x(rms):
    """`stream=True`: (x, norm(x)); x's gradient is that of its use as the stream plus that through
    the norm, summed in the norm's backward pass."""
    x, w, b, dy = _inputs((2, 70, 100), torch.float32, torch.float32, True, not rms, seed=14)
    ds = _inputs((2, 70, 100), torch.float32, torch.float32, False, False, seed=15)[3]
    leaves = [t for t in (x, w, b) if t is not None]

    def loss(s, y):
        return (s.double() * ds.double()).sum() + (y.double() * dy.double()).sum()

    ref = torch.autograd.grad(loss(x, oracle(x, w, b, EPS, rms)), leaves)
    s, y = (ops.rms_norm(x, w, EPS, stream=True, backend="triton") if rms
            else ops.layer_norm(x, w, b, EPS, stream=True, backend="triton"))
    assert torch.equal(s, x)
    for name, r, g in zip(["dx", "dw", "db"], ref, torch.autograd.grad(loss(s, y), leaves)):
        assert_close(name, r, g, RATIO[torch.float32])


def test_residual_add_torch_backend_matches_triton():
    x, w, b, dy = _inputs((2, 9, 24), torch.float32, torch.float32, True, True, seed=10)
    res, _, _, ds = _inputs((2, 9, 24), torch.float32, torch.float32, False, False, seed=11)
    outs = []
    for backend in ("torch", "triton"):
        s, y = ops.layer_norm(x, w, b, EPS, residual=res, backend=backend)
        grads = torch.autograd.grad((s * ds).sum() + (y * dy).sum(), [x, res, w, b])
        outs.append([s, y, *grads])
    for r, o in zip(*outs):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_residual_of_another_dtype_promotes_as_the_add():
    """x + residual in mixed dtypes promotes (an fp32 residual stream meeting a bf16 branch under
    autocast); the fused op does the same."""
    x, w, b, _ = _inputs((2, 9, 24), torch.float32, torch.float32, True, True, seed=12)
    res = _inputs((2, 9, 24), torch.bfloat16, torch.bfloat16, False, False, seed=13)[0]
    s, y = ops.layer_norm(x, w, b, EPS, residual=res, backend="triton")
    assert s.dtype == y.dtype == torch.float32
    torch.testing.assert_close(s, x + res, rtol=0, atol=0)
    dx, dres = torch.autograd.grad(y.sum() + s.sum(), [x, res])
    assert dx.dtype == torch.float32 and dres.dtype == torch.bfloat16


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_bf16_activations_with_fp32_parameters(rms):
    """Under autocast on one GPU the parameters stay fp32 and the activations are bf16: the output
    and dx are bf16, the parameter gradients fp32."""
    _assert_matches_oracle(rms, *_inputs((3, 17, 48), torch.bfloat16, torch.float32, True, not rms, seed=1),
                           RATIO[torch.bfloat16])


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_rows_wider_than_a_tile(rms):
    """C past TILE_ELEMENTS: one row per tile."""
    C = 5000
    assert tile_rows(C) == 1
    _assert_matches_oracle(rms, *_inputs((3, C), torch.float32, torch.float32, True, not rms, seed=2),
                           RATIO[torch.float32])


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_torch_backend_matches_oracle(rms):
    _assert_matches_oracle(rms, *_inputs((2, 9, 24), torch.bfloat16, torch.float32, True, not rms, seed=3),
                           RATIO[torch.bfloat16], backend="torch")


def test_constant_rows_stay_finite():
    """A row of one value has zero variance: the output is the bias, and every gradient is finite
    (eps keeps rstd finite; masked channels never enter the statistics)."""
    x, w, b, dy = _inputs((4, 100), torch.float32, torch.float32, True, True, seed=4)
    with torch.no_grad():
        x[1] = 7.0
    y, grads = _run(_call(False, "triton"), x, w, b, dy)
    torch.testing.assert_close(y[1], b.detach(), rtol=0, atol=1e-6)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("bad, message", [
    (dict(weight=torch.ones(9)), "weight must be"),
    (dict(bias=torch.ones(4, 8)), "bias must be"),
    (dict(x=torch.zeros(3, 8, dtype=torch.int64)), "x must be floating"),
    (dict(x=torch.zeros(3, 0)), "x must be"),
    (dict(eps=0.0), "eps must be"),
    (dict(weight=[1.0] * 8), "weight must be a torch.Tensor"),
    (dict(residual=torch.zeros(3, 7)), "residual must match x"),
])
def test_bad_inputs_are_named(bad, message):
    args = dict(x=torch.zeros(3, 8), weight=torch.ones(8), bias=torch.zeros(8), eps=EPS, residual=None) | bad
    with pytest.raises((ValueError, TypeError), match=message):
        ops.layer_norm(args["x"], args["weight"], args["bias"], args["eps"], residual=args["residual"])


def test_inside_torch_compile_equals_eager():
    """The trainer compiles each block: the norm is a custom op pair that the compiled graph calls."""
    torch._dynamo.reset()
    x, w, b, dy = _inputs((2, 24, 40), torch.float32, torch.float32, True, True, seed=5)

    def run(x, w, b):  # a pre-norm block's shape: both stream forms and a plain norm
        s, h = ops.layer_norm(x * 1.0, w, b, EPS, stream=True, backend="triton")
        s, h = ops.layer_norm(s, w, b, EPS, residual=torch.tanh(h), backend="triton")
        return ops.layer_norm(s + h * 2, w, b, EPS, backend="triton")

    eager = _run(run, x, w, b, dy)
    compiled = _run(torch.compile(run, backend="aot_eager", fullgraph=True), x, w, b, dy)
    for r, o in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]]):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_custom_ops_pass_opcheck():
    """The kernels' custom ops: schemas and fake (meta) implementations (the autograd Function
    around them is traced by Dynamo, see test_inside_torch_compile_equals_eager)."""
    x, w, b, dy = (t.detach() for t in _inputs((2, 5, 40), torch.float32, torch.float32, True, True, seed=6))
    res = _inputs((2, 5, 40), torch.float32, torch.float32, False, False, seed=7)[0].detach()
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.flame.norm_fwd.default, (x, w, b, EPS, False), test_utils=utils)
    torch.library.opcheck(torch.ops.flame.add_norm_fwd.default, (x, res, w, None, EPS, True), test_utils=utils)
    torch.library.opcheck(torch.ops.flame.norm_bwd.default, (x, w, dy, res, EPS, False, True), test_utils=utils)


def _assert_form_matches_fp64_torch(shape, rms, form, seed):
    """The Triton form in bf16 against PyTorch's form in fp64 (checked against the row-by-row oracle
    above), in one of the three forms the models call: `plain` y, `stream` (x, y), `residual`
    (x + residual, y); the loss takes s's gradient from the stream too."""
    x, w, b, dy = _inputs(shape, torch.bfloat16, torch.bfloat16, True, not rms, seed=seed)
    res, _, _, ds = _inputs(shape, torch.bfloat16, torch.bfloat16, False, False, seed=seed + 1)
    if form != "residual":
        res = None

    def forward_backward(backend, x, res, w, b):
        kw = dict(residual=res) if form == "residual" else dict(stream=form == "stream")
        out = (ops.rms_norm(x, w, EPS, backend=backend, **kw) if rms
               else ops.layer_norm(x, w, b, EPS, backend=backend, **kw))
        s, y = (None, out) if form == "plain" else out
        loss = (y.double() * dy.double()).sum()
        if s is not None:
            loss = loss + (s.double() * ds.double()).sum()
        leaves = [t for t in (x, res, w, b) if t is not None]
        return [y, *torch.autograd.grad(loss, leaves)]

    ref = forward_backward("torch", *[t.detach().double().requires_grad_() if t is not None else None
                                      for t in (x, res, w, b)])
    got = forward_backward("triton", x, res, w, b)
    for i, (r, o) in enumerate(zip(ref, got)):
        assert_close("y" if i == 0 else f"gradient {i}", r, o, RATIO[torch.bfloat16])


@pytest.mark.parametrize("form", ["plain", "stream", "residual"])
def test_bf16_forms_match_fp64_torch(form):
    _assert_form_matches_fp64_torch((2, 70, 100), False, form, seed=16)


@pytest.mark.gpu
@pytest.mark.parametrize("C", [1024, 2048, 2560])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("form", ["plain", "stream", "residual"])
def test_gpu_bf16_model_sizes(C, rms, form):
    """32768 tokens at the hidden sizes of the shipped configs."""
    _assert_form_matches_fp64_torch((8, 4096, C), rms, form, seed=7)
