"""norm_token_shift_mix (flame.ops.token_shift): the lerps of a LayerNorm's output, the pre-norm
block's residual stream passed through or summed, against the fp64 oracles of its two halves with
autograd (tests/ops/test_norm.py's row-by-row norm, tests/ops/test_token_shift_mix.py's
token-by-token lerps).

CPU runs use the Triton interpreter (set by conftest). C = 100 is not a power of two (every tile
masks channels); 2 x 70 rows span several forward tiles and backward programs, partial last ones,
and a batch boundary inside a program. GPU tests (`-m gpu`) run bf16 at the shipped RWKV configs'
hidden sizes.
"""

import pytest
import torch

from flame.ops.token_shift import norm_token_shift_mix
from flame.ops.token_shift import mix_triton
from tests.ops.assertions import assert_close
from tests.ops.inputs import make_cu_seqlens
from tests.ops.test_norm import oracle as norm_oracle
from tests.ops.test_token_shift_mix import oracle as lerp_oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-5


def oracle(x, mu, weight, bias, residual=None, starts=()):
    """(s, lerps) in fp64: s = x + residual rounded to x's dtype (as the op's add), or x."""
    s = (x.double() + residual.double()).to(x.dtype).double() if residual is not None else x.double()
    return s, lerp_oracle(norm_oracle(s, weight, bias, EPS, rms=False), mu, starts=starts)


def _inputs(B, T, C, N, dtype, param_dtype=None, residual=False, affine=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype

    def tensor(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=gen) + shift).to(DEVICE, dt).requires_grad_()

    return dict(
        x=tensor(B, T, C, scale=2.0, shift=0.5),
        residual=tensor(B, T, C) if residual else None,
        mu=torch.rand(N, C, generator=gen).to(DEVICE).requires_grad_(),  # fp32, as the layers' parameters
        weight=tensor(C, scale=0.2, shift=1.0, dt=param_dtype) if affine else None,
        bias=tensor(C, scale=0.2, dt=param_dtype) if affine else None,
        ds=torch.randn(B, T, C, generator=gen).to(DEVICE, dtype),
        grads=[torch.randn(B, T, C, generator=gen).to(DEVICE, dtype) for _ in range(N)],
    )


def _leaf_names(inp):
    return [k for k in ("x", "residual", "mu", "weight", "bias") if inp[k] is not None]


def _leaves(inp):
    return [inp[k] for k in _leaf_names(inp)]


def _run(fn, inp):
    """(s, lerps, gradients of the leaves) for the loss <s, ds> + sum_i <lerp_i, grads_i>."""
    s, lerps = fn(inp)
    loss = (s.double() * inp["ds"].double()).sum()
    loss = loss + sum((o.double() * g.double()).sum() for o, g in zip(lerps, inp["grads"]))
    return s, lerps, torch.autograd.grad(loss, _leaves(inp))


def _op(backend, cu_seqlens=None):
    return lambda inp: norm_token_shift_mix(inp["x"], inp["mu"], inp["weight"], inp["bias"], EPS,
                                            residual=inp["residual"], cu_seqlens=cu_seqlens, backend=backend)


def _assert_matches(ref, got, ratio, inp):
    (s_ref, lerps_ref, grads_ref), (s, lerps, grads) = ref, got
    assert s.dtype == inp["x"].dtype and all(o.dtype == inp["x"].dtype for o in lerps)
    assert_close("s", s_ref, s, ratio)
    assert len(lerps) == len(lerps_ref)
    for i, (r, o) in enumerate(zip(lerps_ref, lerps)):
        assert_close(f"lerp{i}", r, o, ratio)
    for name, r, g in zip(_leaf_names(inp), grads_ref, grads):
        assert g.dtype == inp[name].dtype, name
        assert_close("d" + name, r, g, ratio)


def _assert_matches_oracle(inp, ratio, starts=(), cu_seqlens=None, backend="triton"):
    ref = _run(lambda i: oracle(i["x"], i["mu"], i["weight"], i["bias"], i["residual"], starts), inp)
    _assert_matches(ref, _run(_op(backend, cu_seqlens), inp), ratio, inp)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 rows at C = 100 (128 channels a row), backward programs of 32 rows."""
    monkeypatch.setattr(mix_triton, "NORM_FWD_ELEMENTS", 8 * 128)
    monkeypatch.setattr(mix_triton, "NORM_BWD_TILE_ELEMENTS", 8 * 128)
    monkeypatch.setattr(mix_triton, "NORM_BWD_ELEMENTS", 32 * 128)
    assert mix_triton.norm_bwd_launch(100)[:2] == (8, 32)


@pytest.mark.parametrize("N", [6, 2, 1])
@pytest.mark.parametrize("residual", [False, True], ids=["stream", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_oracle(N, residual, dtype, small_tiles):
    # 140 rows: partial last tiles and program, a batch boundary inside a program (rows 64-95)
    _assert_matches_oracle(_inputs(2, 70, 100, N, dtype, residual=residual), RATIO[dtype])


def test_shipped_launch_settings_match_fp64_oracle():
    """The shipped tiles and programs: 1200 rows of C = 100 span several backward programs."""
    tile, program_rows, _ = mix_triton.norm_bwd_launch(100)
    assert 1200 > 2 * program_rows and 1200 % program_rows and 600 % tile
    assert 1200 % (mix_triton.NORM_FWD_ELEMENTS // 128)
    _assert_matches_oracle(_inputs(2, 600, 100, 6, torch.float32, residual=True, seed=11), RATIO[torch.float32])


def test_packed_documents_shift_zeros_at_every_start(small_tiles):
    lengths = [5, 1, 150, 10, 300 - 166]  # a one-token document; documents across tiles and programs
    cu = make_cu_seqlens(lengths, device=DEVICE)
    _assert_matches_oracle(_inputs(1, 300, 72, 6, torch.float32, residual=True, seed=1), RATIO[torch.float32],
                           starts=set(cu[:-1].tolist()), cu_seqlens=cu)


def test_bf16_activations_with_fp32_parameters():
    """Under autocast on one GPU the parameters stay fp32 and the activations are bf16: s, the lerps
    and dx are bf16, the parameter gradients fp32."""
    _assert_matches_oracle(_inputs(2, 70, 100, 6, torch.bfloat16, torch.float32, residual=True, seed=2),
                           RATIO[torch.bfloat16])


def test_norm_without_affine_parameters():
    _assert_matches_oracle(_inputs(2, 70, 100, 2, torch.float32, affine=False, seed=3), RATIO[torch.float32])


def test_stream_form_passes_x_through():
    inp = _inputs(2, 9, 24, 2, torch.float32, seed=4)
    s, _ = _op("triton")(inp)
    assert torch.equal(s, inp["x"])


def test_torch_backend_matches_oracle():
    _assert_matches_oracle(_inputs(2, 70, 100, 6, torch.bfloat16, torch.float32, residual=True, seed=5),
                           RATIO[torch.bfloat16], backend="torch")


def test_autocast_computes_in_the_autocast_dtype():
    inp = _inputs(1, 20, 32, 6, torch.float32, residual=True, seed=6)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        s, lerps = _op("triton")(inp)
    assert s.dtype == torch.bfloat16 and all(o.dtype == torch.bfloat16 for o in lerps)
    _, ref = oracle(inp["x"].detach().bfloat16(), inp["mu"].detach(), inp["weight"].detach(), inp["bias"].detach(),
                    inp["residual"].detach().bfloat16())
    assert_close("lerp3", ref[3], lerps[3], RATIO[torch.bfloat16])


@pytest.mark.parametrize("bad, message", [
    (dict(mu=torch.zeros(7, 8)), "mu must be"),
    (dict(weight=torch.ones(9)), "weight must be"),
    (dict(residual=torch.zeros(1, 4, 8)), "residual must match x"),
    (dict(x=torch.zeros(5, 8)), "x must be"),
    (dict(eps=0.0), "eps must be"),
])
def test_bad_inputs_are_named(bad, message):
    args = dict(x=torch.zeros(1, 5, 8), mu=torch.zeros(2, 8), weight=torch.ones(8), bias=None, eps=EPS,
                residual=None) | bad
    with pytest.raises((ValueError, TypeError), match=message):
        norm_token_shift_mix(args["x"], args["mu"], args["weight"], args["bias"], args["eps"],
                             residual=args["residual"])


def test_inside_torch_compile_equals_eager():
    """The trainer compiles each block: the op is a custom op pair inside an autograd Function that
    Dynamo traces."""
    torch._dynamo.reset()
    inp = _inputs(2, 24, 40, 6, torch.float32, residual=True, seed=7)

    def run(inp):  # a block's shape: the stream form, then the residual form on its stream
        s, lerps = norm_token_shift_mix(inp["x"] * 1.0, inp["mu"], inp["weight"], inp["bias"], EPS, backend="triton")
        s, more = norm_token_shift_mix(s, inp["mu"], inp["weight"], inp["bias"], EPS, residual=torch.tanh(lerps[0]),
                                       backend="triton")
        return s + inp["residual"], [o * 2 for o in lerps[1:]] + more[:1]

    eager = _run(run, inp)
    compiled = _run(torch.compile(run, backend="aot_eager", fullgraph=True), inp)
    for r, o in zip([eager[0], *eager[1], *eager[2]], [compiled[0], *compiled[1], *compiled[2]]):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_custom_ops_pass_opcheck():
    """The kernels' custom ops: schemas and fake (meta) implementations."""
    inp = {k: (v.detach() if isinstance(v, torch.Tensor) else v)
           for k, v in _inputs(2, 5, 40, 2, torch.float32, residual=True, seed=8).items()}
    x, res, mu, w, b = inp["x"], inp["residual"], inp["mu"], inp["weight"], inp["bias"]
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.flame.norm_token_shift_mix_fwd.default, (x, res, w, b, EPS, mu, None),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.flame.norm_token_shift_mix_fwd.default, (x, None, None, None, EPS, mu, None),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.flame.norm_token_shift_mix_bwd.default,
                          (x, w, b, EPS, mu, None, [g.detach() for g in inp["grads"]], inp["ds"]), test_utils=utils)


@pytest.mark.gpu
@pytest.mark.parametrize("C, N", [(1024, 6), (1024, 1), (1024, 2), (2048, 6), (2560, 1)])
@pytest.mark.parametrize("residual", [False, True], ids=["stream", "residual"])
def test_gpu_bf16_model_sizes(C, N, residual):
    """16384 tokens at the RWKV configs' hidden sizes, bf16 against PyTorch's form in fp64 (checked
    against the oracle above)."""
    inp = _inputs(8, 2048, C, N, torch.bfloat16, residual=residual, seed=9)
    ref_inp = {k: (v.detach().double().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
               for k, v in inp.items() if k != "grads"}
    ref_inp["grads"] = inp["grads"]
    _assert_matches(_run(_op("torch"), ref_inp), _run(_op("triton"), inp), RATIO[torch.bfloat16], inp)


@pytest.mark.gpu
def test_gpu_bf16_packed_documents():
    cu = make_cu_seqlens([1, 700, 2048, 3, 4096 - 2752], device=DEVICE)
    inp = _inputs(1, 4096, 1024, 6, torch.bfloat16, residual=True, seed=10)
    ref_inp = {k: (v.detach().double().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
               for k, v in inp.items() if k != "grads"}
    ref_inp["grads"] = inp["grads"]
    _assert_matches(_run(_op("torch", cu), ref_inp), _run(_op("triton", cu), inp), RATIO[torch.bfloat16], inp)
