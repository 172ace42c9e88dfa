"""token_shift_mix (flame.ops.token_shift) against an fp64 token-by-token oracle with autograd.

CPU runs use the Triton interpreter (set by conftest) at small shapes, chosen so that the channel
count is not a multiple of the kernels' channel block and the backward spans several programs of
rows; GPU tests (`-m gpu`) run bf16 at the 340M layers' size.
"""

import pytest
import torch

from flame.ops.token_shift import token_shift_mix
from flame.ops.token_shift.mix_triton import BLOCK_CHANNELS, BLOCK_ROWS, BWD_LAUNCHES
from tests.ops.assertions import assert_close
from tests.ops.inputs import make_cu_seqlens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def oracle(x, mu, m=None, starts=(), previous=None):
    """The N lerps in fp64, built token by token: the predecessor of token t of row b is x[b, t-1],
    `previous[b]` (or zeros) at t = 0, zeros at every t in `starts`."""
    x, mu = x.double(), mu.double()
    B, T, C = x.shape
    n_static = mu.shape[0] - (m.shape[0] if m is not None else 0)
    rows = []
    for t in range(T):
        if t in starts or (t == 0 and previous is None):
            before = torch.zeros(B, C, dtype=torch.float64, device=x.device)
        else:
            before = previous.double() if t == 0 else x[:, t - 1]
        delta = before - x[:, t]
        rows.append(torch.stack([x[:, t] + delta * (mu[i] + (m[i - n_static, :, t].double() if i >= n_static else 0))
                                 for i in range(mu.shape[0])]))
    return list(torch.stack(rows, dim=2).unbind(0))


def _inputs(B, T, C, N, N_M, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(DEVICE, dtype).requires_grad_()
    mu = torch.rand(N, C, generator=gen).to(DEVICE).requires_grad_()  # fp32, as the layers' parameters
    m = (0.1 * torch.randn(N_M, B, T, C, generator=gen)).to(DEVICE, dtype).requires_grad_() if N_M else None
    grads = [torch.randn(B, T, C, generator=gen).to(DEVICE, dtype) for _ in range(N)]
    return x, mu, m, grads


def _run(fn, x, mu, m, grads, used=None):
    """Outputs and the gradients of x, mu, m for sum_i <out_i, grads_i> over the outputs in `used`."""
    outs = fn(x, mu, m)
    used = range(len(outs)) if used is None else used
    loss = sum((outs[i].double() * grads[i].double()).sum() for i in used)
    leaves = [x, mu] + ([m] if m is not None else [])
    return outs, torch.autograd.grad(loss, leaves)


def _assert_matches_oracle(x, mu, m, grads, ratio, used=None, starts=(), **kw):
    ref_outs, ref_grads = _run(lambda *a: oracle(*a, starts=starts), x, mu, m, grads, used)
    outs, got_grads = _run(lambda *a: token_shift_mix(*a, backend="triton", **kw), x, mu, m, grads, used)
    assert len(outs) == mu.shape[0]
    for i, (r, o) in enumerate(zip(ref_outs, outs)):
        assert o.dtype == x.dtype
        assert_close(f"out{i}", r, o, ratio)
    for name, r, g in zip(("dx", "dmu", "dm"), ref_grads, got_grads):
        assert g.dtype == {"dx": x.dtype, "dmu": mu.dtype, "dm": x.dtype}[name]
        assert_close(name, r, g, ratio)


@pytest.mark.parametrize("N, N_M", [(6, 5), (6, 0), (2, 0), (1, 0), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_oracle(N, N_M, dtype):
    # 2 x 70 rows: row blocks across the batch boundary and a partial last one; C = 1100: several
    # channel blocks and a partial last one, forward and backward, at every launch shape
    for channels, rows, _ in BWD_LAUNCHES:
        assert 70 % rows and 140 % rows and channels < 1100 and 1100 % channels
    assert 70 % BLOCK_ROWS and 140 % BLOCK_ROWS and BLOCK_CHANNELS < 1100 and 1100 % BLOCK_CHANNELS
    _assert_matches_oracle(*_inputs(2, 70, 1100, N, N_M, dtype), RATIO[dtype])


def test_packed_documents_shift_zeros_at_every_start():
    lengths = [5, 1, 24, 10, 300 - 40]  # a one-token document; a document across the programs' rows
    cu = make_cu_seqlens(lengths, device=DEVICE)
    starts = set(cu[:-1].tolist())
    _assert_matches_oracle(*_inputs(1, 300, 72, 6, 5, torch.float32, seed=1), RATIO[torch.float32],
                           starts=starts, cu_seqlens=cu)


def test_gradient_does_not_cross_document_boundaries():
    x, mu, m, _ = _inputs(1, 40, 16, 2, 1, torch.float32, seed=2)
    cu = make_cu_seqlens([17, 23], device=DEVICE)
    outs = token_shift_mix(x, mu, m, cu_seqlens=cu, backend="triton")
    (dx,) = torch.autograd.grad(outs[0][0, 17].sum() + outs[1][0, 17].sum(), [x])  # first token of document 2
    assert dx[0, 16].abs().max() == 0  # the last token of document 1 is not its predecessor
    assert dx[0, 17].abs().max() > 0


def test_unused_outputs_have_no_gradient():
    x, mu, m, grads = _inputs(2, 33, 40, 6, 5, torch.float32, seed=3)
    ref_outs, ref_grads = _run(oracle, x, mu, m, grads, used=[1, 4])
    _, got = _run(lambda *a: token_shift_mix(*a, backend="triton"), x, mu, m, grads, used=[1, 4])
    for name, r, g in zip(("dx", "dmu", "dm"), ref_grads, got):
        assert_close(name, r, g, RATIO[torch.float32])
    assert got[1][[0, 2, 3, 5]].abs().max() == 0  # dmu of the unused branches


def test_previous_token_continues_the_shift():
    """Decoding: the stored last token of the previous call precedes t = 0."""
    x, mu, m, _ = _inputs(3, 4, 24, 6, 5, torch.float32, seed=4)
    previous = torch.randn(3, 24, device=DEVICE)
    outs = token_shift_mix(x, mu, m, previous=previous, backend="auto")
    full = torch.cat([previous[:, None], x.detach()], dim=1)
    m_full = torch.cat([torch.zeros_like(m[:, :, :1]), m.detach()], dim=2)
    ref = oracle(full, mu.detach(), m_full)
    for o, r in zip(outs, ref):
        assert_close("out", r[:, 1:], o, RATIO[torch.float32])


def test_torch_backend_matches_triton():
    x, mu, m, grads = _inputs(2, 50, 40, 6, 5, torch.float32, seed=5)
    a = _run(lambda *t: token_shift_mix(*t, backend="torch"), x, mu, m, grads)
    b = _run(lambda *t: token_shift_mix(*t, backend="triton"), x, mu, m, grads)
    for r, o in zip([*a[0], *a[1]], [*b[0], *b[1]]):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_autocast_computes_in_the_autocast_dtype():
    x, mu, m, _ = _inputs(1, 20, 32, 6, 5, torch.float32, seed=6)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        outs = token_shift_mix(x, mu, m, backend="triton")
    assert all(o.dtype == torch.bfloat16 for o in outs)
    ref = oracle(x.detach().bfloat16(), mu.detach(), m.detach().bfloat16())
    assert_close("out", ref[3], outs[3], RATIO[torch.bfloat16])


@pytest.mark.parametrize("bad, message", [
    (dict(mu=torch.zeros(7, 8)), "mu must be"),
    (dict(mu=torch.zeros(2, 9)), "mu must be"),
    (dict(m=torch.zeros(3, 1, 5, 8)), "m must be"),
    (dict(m=torch.zeros(1, 1, 4, 8)), "m must be"),
    (dict(x=torch.zeros(5, 8)), "x must be"),
    (dict(previous=torch.zeros(2, 8)), "previous must be"),
    (dict(x=torch.zeros(1, 5, 8, dtype=torch.int64)), "x must be floating"),
])
def test_bad_inputs_are_named(bad, message):
    args = dict(x=torch.zeros(1, 5, 8), mu=torch.zeros(2, 8), m=None, previous=None) | bad
    with pytest.raises((ValueError, TypeError), match=message):
        token_shift_mix(args["x"], args["mu"], args["m"], previous=args["previous"])


@pytest.mark.gpu
@pytest.mark.parametrize("N, N_M", [(6, 5), (6, 0), (1, 0)])
def test_gpu_bf16_layer_size(N, N_M):
    _assert_matches_oracle_fast(*_inputs(8, 2048, 1024, N, N_M, torch.bfloat16, seed=7))


@pytest.mark.gpu
def test_gpu_bf16_packed_documents():
    cu = make_cu_seqlens([1, 700, 2048, 3, 4096 - 2752], device=DEVICE)
    _assert_matches_oracle_fast(*_inputs(1, 4096, 1024, 6, 5, torch.bfloat16, seed=8), cu_seqlens=cu)


def _assert_matches_oracle_fast(x, mu, m, grads, cu_seqlens=None):
    """The oracle's fp64 sums at scale: PyTorch's form in fp64 (its shift is checked against the
    token-by-token oracle above)."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, mu, m)]
    ref = _run(lambda *a: token_shift_mix(*a, cu_seqlens=cu_seqlens, backend="torch"), *leaves, grads)
    got = _run(lambda *a: token_shift_mix(*a, cu_seqlens=cu_seqlens, backend="triton"), x, mu, m, grads)
    for name, r, o in zip([f"out{i}" for i in range(len(ref[0]))] + ["dx", "dmu", "dm"],
                          [*ref[0], *ref[1]], [*got[0], *got[1]]):
        assert_close(name, r, o, RATIO[torch.bfloat16])


def test_inside_torch_compile_equals_eager():
    """The trainer compiles each block: the op is a custom op pair that the compiled graph calls."""
    torch._dynamo.reset()
    x, mu, m, grads = _inputs(2, 24, 40, 6, 5, torch.float32, seed=9)

    def run(x, mu, m):
        return [o * 2 for o in token_shift_mix(x * 1.0, mu, m, backend="triton")]

    eager = _run(run, x, mu, m, grads)
    compiled = _run(torch.compile(run, backend="aot_eager", fullgraph=True), x, mu, m, grads)
    for r, o in zip([*eager[0], *eager[1]], [*compiled[0], *compiled[1]]):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
