"""decode_matmul: the PyTorch form against an explicit composition (an fp64 LayerNorm, the lerps,
matmuls, activations, residual add), and the Triton kernel (the interpreter on CPU) against the
PyTorch form, for batch sizes on both of the kernel's paths (the GEMV of up to GEMV_ROWS rows and
tl.dot tiles, by the fallback launch or a given configuration), odd widths, bf16 and fp32, and every
prologue and epilogue."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from flame.ops.utils.backend import triton_interpreter_enabled
from flame.ops.decode_matmul import Segment, decode_matmul
from flame.ops.decode_matmul.decode_matmul import decode_matmul_torch
from flame.ops.decode_matmul.decode_matmul_triton import (
    GEMV_ROWS, check_table, decode_matmul_triton, fallback_config, fit_shared_memory, launch_config,
)
from flame.ops.decode_matmul.decode_matmul_tuning import TABLE

needs_triton = pytest.mark.skipif(not triton_interpreter_enabled(), reason="Triton on CPU needs TRITON_INTERPRET=1")

K = 37  # odd: a masked tail in every K walk
SEGMENTS = (Segment(19, 2), Segment(5, 0, "tanh"), Segment(33, 1, "sigmoid"), Segment(9, 2, "sqrelu"))


def make(B, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    rows = sum(s.weight_rows for s in SEGMENTS)
    return dict(x=rand(B, K).to(dtype), stack=rand(3, B, 2 * K).to(dtype)[..., :K],
                weight=(rand(rows, K) / 4).to(dtype),
                nw=rand(K), nb=rand(K), previous=rand(B, K).to(dtype), mu=torch.rand(3, K, generator=gen),
                mix=rand(3, B, K).to(dtype), residual=rand(B, 66).to(dtype), gate=rand(B, 80).to(dtype)[:, :66],
                src=rand(B, 66).to(dtype))


def tolerance(dtype):
    """fp32: the summation order of fp32 accumulation over K (tiles, tl.dot against a sequential
    sum); bf16: a lerp or h that rounds one bf16 step apart."""
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)


def layer_norm_fp64(x, weight, bias, eps):
    """LayerNorm over the last dimension, written out in fp64."""
    z = x.double()
    mean = z.mean(-1, keepdim=True)
    var = (z - mean).square().mean(-1, keepdim=True)
    return (z - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_form_equals_the_composition(dtype):
    t = make(3, dtype)
    acc = torch.float32
    # norm, lerps with a data-dependent part, four segments
    previous = t["previous"].clone()
    h_out = torch.empty_like(t["x"])
    got = decode_matmul(t["x"], t["weight"], SEGMENTS, norm="layer", norm_weight=t["nw"], norm_bias=t["nb"], eps=1e-5,
                        previous=previous, mu=t["mu"], mix=t["mix"], h_out=h_out, backend="torch")
    # h: the fp64 norm up to fp32 arithmetic and one rounding to dtype (bf16: at most one step)
    one_rounding = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(h_out.double(), layer_norm_fp64(t["x"], t["nw"], t["nb"], 1e-5), **one_rounding)
    h = h_out
    lerps = (h.to(acc) + (t["previous"].to(acc) - h.to(acc)) * (t["mu"][:, None] + t["mix"].to(acc))).to(dtype)
    w = t["weight"].to(acc)
    want = torch.cat([lerps[2].to(acc) @ w[:19].T, torch.tanh(lerps[0].to(acc) @ w[19:24].T),
                      torch.sigmoid(lerps[1].to(acc) @ w[24:57].T), torch.relu(lerps[2].to(acc) @ w[57:].T) ** 2], 1)
    torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
    assert torch.equal(previous, t["previous"])  # only read: the commit writes it
    # a plain stack of inputs into a gated residual add, with a commit
    residual, dst = t["residual"].clone(), torch.zeros_like(t["src"])
    decode_matmul(t["stack"], t["weight"][:66], (Segment(66, 1),), residual=residual, residual_gate=t["gate"],
                  commit=(t["src"], dst), backend="torch")
    y = torch.sigmoid(t["gate"].to(acc)) * (t["stack"][1].to(acc) @ w[:66].T)
    torch.testing.assert_close(residual, (t["residual"].to(acc) + y).to(dtype), rtol=0, atol=0)
    assert torch.equal(dst, t["src"])
    # swiglu over an RMS-normed silu input
    got = decode_matmul(t["x"], t["weight"][:40], (Segment(20, 0, "swiglu"),), norm="rms", norm_weight=t["nw"],
                        eps=1e-6, silu=True, backend="torch")
    h = F.rms_norm(F.silu(t["x"].to(acc)), (K,), t["nw"], 1e-6).to(dtype).to(acc)
    want = F.silu(h @ w[:20].T) * (h @ w[20:40].T)
    torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3, 17])
def test_triton_equals_torch(B, dtype):
    t = make(B, dtype, seed=B)
    tol = tolerance(dtype)

    def both(fn, *buffers):
        results = []
        for backend in ("torch", "triton"):
            copies = [b.clone() for b in buffers]
            results.append([fn(backend, *copies), *copies])
        for want, got in zip(*results):
            torch.testing.assert_close(got.float(), want.float(), **tol)

    both(lambda be, h: decode_matmul(t["x"], t["weight"], SEGMENTS, norm="layer", norm_weight=t["nw"],
                                     norm_bias=t["nb"], eps=1e-5, previous=t["previous"], mu=t["mu"], mix=t["mix"],
                                     h_out=h, backend=be), torch.zeros_like(t["x"]))
    both(lambda be: decode_matmul(t["x"], t["weight"], SEGMENTS, norm="layer", norm_weight=t["nw"], norm_bias=t["nb"],
                                  eps=1e-5, previous=t["previous"], mu=t["mu"], backend=be))
    both(lambda be: decode_matmul(t["stack"], t["weight"], SEGMENTS, backend=be))
    both(lambda be, res, dst: decode_matmul(t["stack"], t["weight"][:66], (Segment(66, 2),), residual=res,
                                            residual_gate=t["gate"], commit=(t["src"], dst), backend=be),
         t["residual"], torch.zeros_like(t["src"]))
    both(lambda be, res: decode_matmul(t["x"], t["weight"][:66], (Segment(66),), norm="rms", norm_weight=t["nw"],
                                       eps=1e-6, silu=True, residual=res, backend=be), t["residual"])
    both(lambda be: decode_matmul(t["x"], t["weight"][:46], (Segment(23, 0, "swiglu"),), norm="rms",
                                  norm_weight=t["nw"], eps=1e-6, backend=be))


def config(dot, bb, bn, bk, warps=4, stages=2):
    return dict(DOT=dot, BB=bb, BN=bn, BK=bk, num_warps=warps, num_stages=stages)


@needs_triton
@pytest.mark.parametrize("B, cfg", [
    (3, config(False, 2, 8, 16, warps=2, stages=1)),  # GEMV over two row tiles, a short K block
    (3, config(True, 16, 16, 16)),  # tl.dot with 13 padded rows
    (17, config(True, 16, 32, 64, stages=3)),  # tl.dot over two row tiles, one K block over all of K
])
def test_launch_configs_equal_torch(B, cfg):
    """Explicit launch configurations (what the tuning table may pick): the full prologue with h
    written once per row tile, and a gated residual add with its commit."""
    t = make(B, torch.float32, seed=B)
    tol = tolerance(torch.float32)
    prologue = (t["x"], t["weight"], SEGMENTS, "layer", t["nw"], t["nb"], 1e-5, False, t["previous"], t["mu"],
                t["mix"])
    h_want, h_got = torch.zeros_like(t["x"]), torch.zeros_like(t["x"])
    want = decode_matmul_torch(*prologue, h_want, None, None, None)
    got = decode_matmul_triton(*prologue, h_got, None, None, None, config=cfg)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(h_got, h_want, **tol)  # every row tile writes its rows of h
    res_want, res_got = t["residual"].clone(), t["residual"].clone()
    dst_want, dst_got = torch.zeros_like(t["src"]), torch.zeros_like(t["src"])
    plain = (t["stack"], t["weight"][:66], (Segment(66, 2),), None, None, None, 1e-5, False, None, None, None, None)
    decode_matmul_torch(*plain, res_want, t["gate"], (t["src"], dst_want))
    decode_matmul_triton(*plain, res_got, t["gate"], (t["src"], dst_got), config=cfg)
    torch.testing.assert_close(res_got, res_want, **tol)
    assert torch.equal(dst_got, dst_want)


def test_launches_are_fitted_to_shared_memory():
    """A bf16 launch of the table on fp32 operands loses stages, then K block length, until its staged
    tiles fit; one that fits is unchanged."""
    tuned = config(True, 64, 32, 256, stages=4)  # 4 x (64 + 32) x 256 x 2 bytes = 192 KiB in bf16
    h100 = 227 * 1024
    assert fit_shared_memory(tuned, 2, h100) == tuned
    fp32 = fit_shared_memory(tuned, 4, h100)
    assert (fp32["num_stages"], fp32["BK"]) == (2, 256)
    swiglu = fit_shared_memory(tuned, 2, h100, weight_tiles=2)  # gate and up tiles: 4 x 128 x 256 x 2
    assert (swiglu["num_stages"], swiglu["BK"]) == (3, 256)
    small = fit_shared_memory(tuned, 4, 99 * 1024)
    assert (small["num_stages"], small["BK"]) == (2, 64)
    assert small["num_stages"] * (64 + 32) * small["BK"] * 4 <= 0.9 * 99 * 1024
    tiny = fit_shared_memory(config(True, 64, 64, 16, stages=3), 4, 16 * 1024)
    assert (tiny["num_stages"], tiny["BK"]) == (1, 16)  # the smallest it can be
    assert launch_config(64, 1024, 1024, element_size=4, shared_memory=h100)["num_stages"] <= \
        launch_config(64, 1024, 1024)["num_stages"]


def test_tuning_table_is_checked_and_unseen_shapes_fall_back():
    good = config(True, 16, 32, 64)
    table = {(64, 1024, 1024): good}
    assert launch_config(40, 1024, 1024, table=table) == good  # batch bucket 64
    assert launch_config(65, 1024, 1024, table=table) == fallback_config(65, 1024, 1024, 132)
    assert launch_config(64, 1024, 4096, table=table) == fallback_config(64, 1024, 4096, 132)
    check_table(TABLE)  # the shipped table is well formed
    for bad, match in [({(48, 1024, 1024): good}, "power-of-two bucket"), ({(64, 1024): good}, "three positive"),
                       ({(64, 1024, 1024): config(True, 8, 32, 64)}, "needs BB, BN and BK >= 16"),
                       ({(64, 1024, 1024): config(False, 4, 24, 64)}, "BN must be a power of two"),
                       ({(64, 1024, 1024): {**good, "BM": 4}}, "exactly"),
                       ({(64, 1024, 1024): config(False, 4, 8, 64, warps=3)}, "num_warps"),
                       ([good], "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            launch_config(64, 1024, 1024, table=bad)


@pytest.mark.parametrize("B, N, K", [(1, 1024, 1024), (1, 4096, 1024), (3, 1024, 4096), (8, 1024, 4096),
                                     (16, 1024, 1024), (64, 1024, 1024), (64, 4096, 1024), (256, 5120, 32)])
def test_fallback_spreads_the_weight_over_the_sms(B, N, K):
    cfg = fallback_config(B, N, K, sms=132)
    check_table({(1, N, K): cfg})
    programs = triton.cdiv(N, cfg["BN"]) * triton.cdiv(B, cfg["BB"])
    floor = triton.cdiv(N, 8) if B <= GEMV_ROWS else triton.cdiv(N, 16) * triton.cdiv(B, 16)  # the blocks' lower bounds
    assert programs >= min(2 * 132, floor)
    assert cfg["DOT"] == (B > GEMV_ROWS) and cfg["BK"] <= max(16, triton.next_power_of_2(K))


def test_bad_input_is_named():
    t = make(2, torch.float32)
    with pytest.raises(ValueError, match="segments cover"):
        decode_matmul(t["stack"], t["weight"], (Segment(5),), backend="torch")
    with pytest.raises(ValueError, match="source"):
        decode_matmul(t["stack"], t["weight"][:5], (Segment(5, 3),), backend="torch")
    with pytest.raises(ValueError, match="swiglu"):
        decode_matmul(t["stack"], t["weight"][:7], (Segment(2, 0, "swiglu"), Segment(3)), backend="torch")
    with pytest.raises(ValueError, match="x's dtype"):
        decode_matmul(t["stack"], t["weight"].double(), SEGMENTS, backend="torch")
    with pytest.raises(ValueError, match="norm prologue"):
        decode_matmul(t["stack"], t["weight"], SEGMENTS, mu=t["mu"], backend="torch")
    with pytest.raises(ValueError, match="residual must be"):
        decode_matmul(t["stack"], t["weight"], SEGMENTS, residual=t["residual"][:, :60].clone(), backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 5, 8, 9, 64, 100, 256])
def test_compiled_kernel_equals_torch_on_cuda(B, dtype):
    """The compiled kernel (both paths, every block-size regime of launch_config) against the PyTorch
    form on the GPU, at the 340M models' widths, with the full prologue and a gated residual add."""
    gen = torch.Generator(device="cuda").manual_seed(B)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    C, R = 1024, 160
    segments = (Segment(C, 0), Segment(C, 1), Segment(R, 2, "tanh"), Segment(R, 1, "sigmoid"),
                Segment(4 * C, 2, "sqrelu"))
    weight = (rand(6 * C + 2 * R, C) / C ** 0.5).to(dtype)
    x, previous = rand(B, C).to(dtype), rand(B, C).to(dtype)
    mu, mix = torch.rand(3, C, generator=gen, device="cuda").to(dtype), rand(3, B, C).to(dtype)
    norm = dict(norm="layer", norm_weight=rand(C), norm_bias=rand(C), eps=1e-5)
    outs = [decode_matmul(x, weight, segments, **norm, previous=previous, mu=mu, mix=mix, backend=be)
            for be in ("torch", "triton")]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **tolerance(dtype))
    hidden = outs[0][:, -4 * C:]
    down = (rand(C, 4 * C) / (4 * C) ** 0.5).to(dtype)
    residuals = [x.clone() for _ in range(2)]
    for be, residual in zip(("torch", "triton"), residuals):
        decode_matmul(hidden[None], down, residual=residual, residual_gate=outs[0][:, :C], backend=be)
    torch.testing.assert_close(residuals[1].float(), residuals[0].float(), **tolerance(dtype))
