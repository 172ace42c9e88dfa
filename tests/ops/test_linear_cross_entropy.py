"""linear_cross_entropy (the chunked LM-head cross-entropy) against the loss on materialised logits.

The reference is flame.train.loss.cross_entropy_sum on logits = hidden @ weight.T (and
flame.models.l2wrap for the L2Wrap term), differentiated by autograd. CPU runs use the PyTorch row
math and, under the Triton interpreter (set by conftest), the Triton row kernel on small shapes; the
GPU tests run the 340M head's shape in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flame.models import l2wrap as l2wrap_reference
from flame.ops.linear_cross_entropy import linear_cross_entropy
from flame.ops.linear_cross_entropy.linear_cross_entropy import default_chunk_rows
from flame.ops.linear_cross_entropy.rows_torch import cross_entropy_rows_torch
from flame.ops.linear_cross_entropy.rows_triton import cross_entropy_rows_triton
from flame.train.loss import cross_entropy_sum



def make_inputs(n, d, vocab, dtype=torch.float64, seed=0, device="cpu"):
    """hidden [n, d], weight [vocab, d] (logits of a few units of spread), labels [n] with about a
    quarter ignored, so that valid counts differ between chunks."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64) * (2.0 / d ** 0.5)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.25] = -100
    return (hidden.to(device, dtype).requires_grad_(), weight.to(device, dtype).requires_grad_(),
            labels.to(device))


def reference(hidden, weight, labels, scale, l2wrap=False):
    """scale * CE sum on the materialised logits (fp64 stays fp64: cross_entropy_sum's fp32 upcast
    would lower it), with the L2Wrap gradient term of flame.models.l2wrap (normalizer = 1 / scale)."""
    logits = hidden @ weight.t()
    if logits.dtype == torch.float64:
        ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    else:
        ce = cross_entropy_sum(logits, labels)
    normalizer = 1.0 / scale
    loss = ce / normalizer
    if l2wrap:
        loss = l2wrap_reference(loss, logits, labels != -100, normalizer)
    return loss


def value_and_grads(fn, hidden, weight, upstream=0.5):
    loss = fn(hidden, weight)
    grad_hidden, grad_weight = torch.autograd.grad(loss * upstream, (hidden, weight))
    return loss.detach(), grad_hidden, grad_weight


def assert_matches_reference(hidden, weight, labels, scale, l2wrap, rtol, atol, **kw):
    want = value_and_grads(lambda h, w: reference(h, w, labels, scale, l2wrap), hidden, weight)
    got = value_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, scale=scale, l2wrap=l2wrap, **kw),
                          hidden, weight)
    for name, g, w in zip(("loss", "grad hidden", "grad weight"), got, want):
        assert g.dtype == w.dtype if name != "loss" else g.dtype == torch.promote_types(w.dtype, torch.float32)
        torch.testing.assert_close(g.to(w.dtype), w, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("chunk_rows", [None, 7, 16, 50, 64])
@pytest.mark.parametrize("l2wrap", [False, True])
def test_fp64_value_and_grads_equal_the_materialised_loss(chunk_rows, l2wrap):
    """50 rows: one chunk (None, 64, 50), or chunks of 7 / 16 with a ragged last one; rows 7-13 are
    all ignored (a whole chunk of 7 without a label)."""
    hidden, weight, labels = make_inputs(50, 12, 37)
    labels[7:14] = -100
    labels[40:] = -100
    scale = 1.0 / int((labels != -100).sum())
    assert_matches_reference(hidden, weight, labels, scale, l2wrap, rtol=1e-10, atol=1e-12,
                             chunk_rows=chunk_rows, backend="torch")


@pytest.mark.parametrize("chunk_rows", [None, 9])
def test_fp32_matches_cross_entropy_sum(chunk_rows):
    hidden, weight, labels = make_inputs(40, 16, 300, dtype=torch.float32, seed=1)
    assert_matches_reference(hidden, weight, labels, 0.125, False, rtol=1e-5, atol=1e-6,
                             chunk_rows=chunk_rows, backend="torch")


def test_all_ignored_labels_give_zero_loss_and_zero_hidden_grads():
    hidden, weight, labels = make_inputs(20, 8, 30)
    labels[:] = -100
    loss = linear_cross_entropy(hidden, weight, labels, chunk_rows=6, l2wrap=True, backend="torch")
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad_hidden) == 0 and torch.count_nonzero(grad_weight) == 0


def test_l2wrap_gradient_equals_the_l2wrap_module():
    """The L2Wrap term alone (fused with minus without) is flame.models.l2wrap's term: at each valid
    row's arg-max logit, upstream * 1e-4 * max_logit / normalizer, pushed through the head."""
    hidden, weight, labels = make_inputs(30, 10, 23, seed=3)
    normalizer = float((labels != -100).sum())
    fused = [value_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, scale=1 / normalizer, l2wrap=flag,
                                                                 chunk_rows=8, backend="torch"),
                             hidden, weight, upstream=0.25) for flag in (False, True)]
    plain = [value_and_grads(lambda h, w: reference(h, w, labels, 1 / normalizer, l2wrap=flag), hidden, weight,
                             upstream=0.25) for flag in (False, True)]
    assert fused[1][0] == fused[0][0]  # the loss value is unchanged
    for i in (1, 2):
        term_fused = fused[1][i] - fused[0][i]
        term_plain = plain[1][i] - plain[0][i]
        assert term_plain.abs().max() > 0
        torch.testing.assert_close(term_fused, term_plain, rtol=1e-9, atol=1e-15)


def test_tensor_scale_and_no_grad_give_the_same_loss():
    hidden, weight, labels = make_inputs(24, 8, 19, seed=4)
    loss = linear_cross_entropy(hidden, weight, labels, scale=0.3, backend="torch")
    from_tensor = linear_cross_entropy(hidden, weight, labels, scale=torch.tensor(0.3, dtype=torch.float64),
                                       backend="torch")
    with torch.no_grad():
        no_grad = linear_cross_entropy(hidden, weight, labels, scale=0.3, backend="torch")
    assert not no_grad.requires_grad
    torch.testing.assert_close(from_tensor, loss, rtol=1e-15, atol=0)
    torch.testing.assert_close(no_grad, loss.detach(), rtol=1e-15, atol=0)
    grads = torch.autograd.grad(loss, (hidden, weight))
    grads_tensor = torch.autograd.grad(from_tensor, (hidden, weight))
    for a, b in zip(grads_tensor, grads):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)


def test_only_the_needed_gradient_is_computed():
    hidden, weight, labels = make_inputs(16, 8, 11, seed=5)
    frozen = weight.detach()
    loss = linear_cross_entropy(hidden, frozen, labels, backend="torch")
    (grad_hidden,) = torch.autograd.grad(loss, (hidden,))
    want = torch.autograd.grad(reference(hidden, frozen, labels, 1.0), (hidden,))[0]
    torch.testing.assert_close(grad_hidden, want, rtol=1e-10, atol=1e-12)


def test_bf16_inputs_match_the_bf16_head():
    """bf16 hidden and weight: the logits are bf16 (as the plain bf16 head's), the loss fp32, and the
    gradients bf16 within bf16 rounding of the plain path's."""
    hidden, weight, labels = make_inputs(64, 32, 200, dtype=torch.bfloat16, seed=6)
    want = value_and_grads(lambda h, w: reference(h, w, labels, 1 / 48), hidden, weight)
    got = value_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, scale=1 / 48, chunk_rows=24,
                                                            backend="torch"), hidden, weight)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        scale = w.float().abs().max()
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * scale)


def test_mixed_dtypes_compute_in_the_promoted_dtype_and_in_the_autocast_dtype():
    hidden, weight, labels = make_inputs(16, 8, 13, dtype=torch.float32, seed=7)
    half_weight = weight.detach().to(torch.bfloat16).requires_grad_()
    loss = linear_cross_entropy(hidden, half_weight, labels, backend="torch")
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, half_weight))
    assert grad_hidden.dtype == torch.float32 and grad_weight.dtype == torch.bfloat16
    want = reference(hidden, half_weight.float(), labels, 1.0)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = linear_cross_entropy(hidden, weight, labels, backend="torch")
    want_bf16 = reference(hidden.to(torch.bfloat16), weight.to(torch.bfloat16), labels, 1.0)
    torch.testing.assert_close(under_autocast, want_bf16, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_one_line_errors():
    hidden, weight, labels = make_inputs(8, 4, 10)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        linear_cross_entropy(hidden, weight, torch.full((8,), 10), backend="torch")
    with pytest.raises(ValueError, match="share D"):
        linear_cross_entropy(hidden, weight[:, :3], labels, backend="torch")
    with pytest.raises(ValueError, match=r"labels must be \[N\]"):
        linear_cross_entropy(hidden, weight, labels[:5], backend="torch")
    with pytest.raises(TypeError, match="labels must be int64"):
        linear_cross_entropy(hidden, weight, labels.float(), backend="torch")
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, weight, labels, chunk_rows=0, backend="torch")


def test_default_chunk_keeps_fp32_logits_within_one_gib():
    rows = default_chunk_rows(32000)
    assert rows == 8192 and rows * 32000 * 4 <= 2 ** 30
    assert default_chunk_rows(2 ** 22) * 2 ** 22 * 4 <= 2 ** 30 and default_chunk_rows(2 ** 31) == 1


# ---- the Triton row kernel (interpreter on CPU) -------------------------------------------------

@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the inf row, interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l2wrap", [False, True])
def test_triton_rows_equal_torch_rows(dtype, l2wrap):
    """V = 5000 spans two 4096-column blocks: the online max / sum / arg-max cross a block edge (row 1
    has its max in the second block, row 2 in the first). Row 3 is ignored and holds an inf, which
    must give a zero gradient row, not NaN."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(8)
    logits = (3 * torch.randn(5, 5000, generator=gen)).to(device, dtype)
    logits[1, 4500] = 40.0
    logits[2, 17] = 40.0
    logits[3, 100] = float("inf")
    labels = torch.tensor([4, 4500, 9, -100, 4999], device=device)
    want_loss, want_grad = cross_entropy_rows_torch(logits, labels, l2wrap, True)
    got_loss, got_grad = cross_entropy_rows_triton(logits.clone(), labels, l2wrap, True)
    assert got_grad.dtype == dtype and torch.count_nonzero(got_grad[3]) == 0
    assert got_loss[3].item() == 0.0
    torch.testing.assert_close(got_loss, want_loss.float(), rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=tol, atol=tol)
    loss_only, none = cross_entropy_rows_triton(logits.clone(), labels, l2wrap, False)
    assert none is None
    torch.testing.assert_close(loss_only, got_loss, rtol=0, atol=0)


@pytest.mark.parametrize("l2wrap", [False, True])
def test_triton_backend_equals_torch_backend(l2wrap):
    hidden, weight, labels = make_inputs(30, 16, 97, dtype=torch.float32, seed=9,
                                         device="cuda" if torch.cuda.is_available() else "cpu")
    labels[8:16] = -100
    got = value_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, scale=0.1, l2wrap=l2wrap, chunk_rows=8,
                                                            backend="triton"), hidden, weight)
    want = value_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, scale=0.1, l2wrap=l2wrap, chunk_rows=8,
                                                             backend="torch"), hidden, weight)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ---- GPU: the 340M head's shape in bf16 ----------------------------------------------------------

def plain_head_loss(hidden, weight, labels, scale):
    return cross_entropy_sum(hidden @ weight.t(), labels) * scale


@pytest.mark.gpu
@pytest.mark.parametrize("l2wrap", [False, True])
def test_gpu_bf16_340M_head_matches_the_plain_loss_and_uses_less_memory(l2wrap):
    n, d, vocab = 16384, 1024, 32000
    hidden, weight, labels = make_inputs(n, d, vocab, dtype=torch.bfloat16, seed=10, device="cuda")
    labels[: n // 3] = torch.where(labels[: n // 3] % 3 == 0, -100, labels[: n // 3])  # uneven valid counts
    normalizer = float((labels != -100).sum())

    def run(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = value_and_grads(fn, hidden, weight, upstream=1.0)
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base

    want, plain_peak = run(lambda h, w: reference(h, w, labels, 1 / normalizer, l2wrap))
    got, fused_peak = run(lambda h, w: linear_cross_entropy(h, w, labels, scale=1 / normalizer, l2wrap=l2wrap))
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=0)
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == torch.bfloat16
        err = ((g.float() - w.float()).norm() / w.float().norm()).item()
        assert err < 1e-2, f"relative error {err:.2e}"
    assert fused_peak < 0.5 * plain_peak, f"fused peak {fused_peak / 2**30:.2f} GiB, plain {plain_peak / 2**30:.2f} GiB"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rows_loss_is_the_same_with_and_without_the_gradient_over_many_launches(dtype):
    """The row kernel writes the gradient over the logits in place: every launch must give the loss
    that the launch without the gradient gives, bit for bit (a row's loss taken from a column that
    another warp had already overwritten with its gradient would differ by nats)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4096, 32000, device="cuda", generator=gen).mul_(3).to(dtype)
    labels = torch.randint(0, 32000, (4096,), device="cuda", generator=gen)
    labels[::97] = -100
    expected, _ = cross_entropy_rows_triton(logits, labels, l2wrap=True, need_grad=False)
    work = torch.empty_like(logits)
    mismatched = []
    for launch in range(1000):
        work.copy_(logits)
        loss, _ = cross_entropy_rows_triton(work, labels, l2wrap=True, need_grad=True)
        if not torch.equal(loss, expected):
            rows = torch.nonzero(loss != expected).flatten().tolist()
            mismatched.append((launch, rows[:4], (loss - expected).abs().max().item()))
    assert not mismatched, f"{len(mismatched)} of 1000 launches differ: {mismatched[:5]}"
