"""l2wrap: the loss value is untouched; the backward adds exactly 1e-4 * max_logit / normalizer
(times the incoming gradient) at each valid token's arg-max logit, and nothing else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flame.models import l2wrap


def ce_loss(logits, labels, normalizer):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / normalizer


@pytest.mark.parametrize("upstream", [1.0, 0.25])
def test_l2wrap_keeps_the_loss_and_adds_the_documented_gradient(upstream):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, 1] = labels[1, 4] = -100
    valid = labels != -100
    normalizer = float(valid.sum())

    plain = ce_loss(logits, labels, normalizer)
    (grad_plain,) = torch.autograd.grad(plain * upstream, logits)
    wrapped = l2wrap(ce_loss(logits, labels, normalizer), logits, valid, normalizer)
    assert torch.equal(wrapped, plain)
    (grad_wrapped,) = torch.autograd.grad(wrapped * upstream, logits)

    expected = torch.zeros_like(logits)
    for b in range(2):
        for t in range(5):
            if valid[b, t]:
                i = int(logits[b, t].argmax())
                expected[b, t, i] = upstream * 1e-4 * logits[b, t, i] / normalizer
    torch.testing.assert_close(grad_wrapped - grad_plain, expected, atol=1e-15, rtol=1e-12)
    assert torch.count_nonzero(expected) == int(valid.sum())


def test_l2wrap_rejects_bad_arguments():
    logits = torch.randn(2, 3, 4, requires_grad=True)
    loss = logits.sum()
    with pytest.raises(ValueError, match="valid_mask"):
        l2wrap(loss, logits, torch.ones(2, 3), 6.0)
    with pytest.raises(ValueError, match="valid_mask"):
        l2wrap(loss, logits, torch.ones(3, 2, dtype=torch.bool), 6.0)
    with pytest.raises(ValueError, match="scalar loss"):
        l2wrap(logits.sum(-1), logits, torch.ones(2, 3, dtype=torch.bool), 6.0)
    with pytest.raises(ValueError, match="normalizer"):
        l2wrap(loss, logits, torch.ones(2, 3, dtype=torch.bool), 0)
