"""Token shift restarts at document boundaries, and a packed varlen forward of several documents
equals the per-document forwards, for every family."""

from __future__ import annotations

import pytest
import torch

from flame.models.varlen import check_cu_seqlens
from flame.ops.token_shift import token_shift
from tests.models.helpers import FAMILIES, build_seeded, tiny_args


def test_token_shift_without_boundaries_is_the_previous_token():
    x = torch.randn(2, 6, 3)
    prev = token_shift(x)
    assert torch.equal(prev[:, 0], torch.zeros(2, 3))
    assert torch.equal(prev[:, 1:], x[:, :-1])


def test_token_shift_resets_at_cu_seqlens_boundaries():
    x = torch.randn(1, 10, 4) + 5  # no accidental zeros
    cu = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    prev = token_shift(x, cu)
    for t in range(10):
        expected = torch.zeros(4) if t in (0, 3, 7) else x[0, t - 1]
        assert torch.equal(prev[0, t], expected), f"position {t}"


def test_token_shift_gradient_does_not_cross_boundaries():
    x = torch.randn(1, 8, 2, requires_grad=True)
    cu = torch.tensor([0, 5, 8])
    token_shift(x, cu)[0, 5].sum().backward()  # first token of document 2
    assert torch.count_nonzero(x.grad) == 0


@pytest.mark.parametrize(
    "cu, message",
    [
        ([0, 3, 9], "end at the sequence length"),
        ([1, 3, 10], "start at 0"),
        ([0, 6, 4, 10], "non-decreasing"),
        ([10], "N\\+1 offsets"),
    ],
)
def test_bad_cu_seqlens_is_rejected_with_a_clear_error(cu, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(torch.tensor(cu), 1, 10)


def test_cu_seqlens_needs_batch_size_one():
    model = build_seeded(tiny_args("rwkv7", num_layers=1))
    with pytest.raises(ValueError, match="batch size 1"):
        model(torch.zeros(2, 10, dtype=torch.long), cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_varlen_forward_equals_per_document_forwards(family):
    args = tiny_args(family, num_layers=2)
    model = build_seeded(args, seed=11)
    with torch.no_grad():  # move every zero-initialised projection off zero so all paths matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lengths = [7, 1, 12]
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, args.vocab_size, (1, n), generator=gen) for n in lengths]
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), cu_seqlens=cu)
        separate = torch.cat([model(doc) for doc in docs], dim=1)
        unpacked = model(torch.cat(docs, dim=1))
    torch.testing.assert_close(packed, separate, atol=2e-5, rtol=1e-4)
    # without cu_seqlens the later documents see earlier ones: the check above is not vacuous
    assert (unpacked[0, 7:] - separate[0, 7:]).abs().max() > 1e-3
