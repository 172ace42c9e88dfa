"""The token-weighted loss of one optimizer step.

The objective of a step is the sum of per-token cross-entropy over every valid token (label !=
-100) of every micro-batch on every data-parallel rank, divided by the count of those tokens.
The count is known before the first forward (labels come with the batch), so each micro-batch's
loss is its CE sum divided by that global count, and the accumulated gradients are exactly the
gradients of the step objective, whatever the split into micro-batches and ranks. A mean of
micro-batch means would weight tokens unequally whenever the micro-batches hold different numbers
of valid tokens (docs/known-failures.md#loss-scaled-by-gradient-accumulation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flame.ops.linear_cross_entropy import IGNORE_INDEX


def count_valid_tokens(micro_batches: list[dict[str, torch.Tensor]]) -> int:
    """Valid (not ignored) label positions summed over the micro-batches of one rank."""
    return sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies over valid labels, computed in fp32."""
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def micro_batch_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    normalizer: torch.Tensor | float,
    l2wrap=None,
) -> torch.Tensor:
    """This micro-batch's share of the step objective: CE sum / valid tokens of the whole step.

    `l2wrap`, when given, is `flame.models.l2wrap`: it leaves the loss value unchanged and adds the
    RWKV7 logit penalty to the gradient, scaled by the same normalizer.
    """
    loss = cross_entropy_sum(logits, labels) / normalizer
    if l2wrap is not None:
        loss = l2wrap(loss, logits, labels != IGNORE_INDEX, normalizer)
    return loss
