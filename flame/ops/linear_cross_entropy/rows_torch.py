"""The row math of one chunk of logits in PyTorch: per-row cross-entropy and its logits gradient."""

from __future__ import annotations

import torch

from ..utils.dtypes import accumulation_dtype

IGNORE_INDEX = -100
"""The label of a position that has none (padding, a document's last token): it counts for nothing.
The value is PyTorch's and transformers' default `ignore_index`."""
L2WRAP_FACTOR = 1e-4


def cross_entropy_rows_torch(logits: torch.Tensor, labels: torch.Tensor, l2wrap: bool, need_grad: bool):
    """Cross-entropy of each row of `logits` [n, V] against `labels` [n] (IGNORE_INDEX = no label).

    Returns (loss [n] in fp32 (fp64 for fp64 logits), 0 on ignored rows; the gradient of the loss sum
    with respect to the logits, [n, V] in the logits' dtype, or None without `need_grad`). The gradient
    is softmax - onehot(label) on valid rows, plus, with `l2wrap`, L2WRAP_FACTOR * max_logit at the
    row's arg-max column (RWKV's L2Wrap); ignored rows get exactly 0, by selection, so that a
    non-finite logit on an ignored row does not leak into the gradient.
    """
    x = logits.to(accumulation_dtype(logits.dtype))
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(x, dim=1)
    loss = torch.where(valid, lse - x.gather(1, target).squeeze(1), 0.0)
    if not need_grad:
        return loss, None
    grad = torch.exp(x - lse.unsqueeze(1))
    grad.scatter_add_(1, target, torch.full_like(lse, -1.0).unsqueeze(1))
    if l2wrap:
        max_logit, argmax = x.max(dim=1, keepdim=True)
        grad.scatter_add_(1, argmax, L2WRAP_FACTOR * max_logit)
    grad.masked_fill_(~valid.unsqueeze(1), 0.0)
    return loss, grad.to(logits.dtype)
