"""L2Wrap (RWKV6 and RWKV7, docs/kernels.md#l2wrap): leave the loss alone, nudge the largest logit towards zero.

The forward returns the loss unchanged. The backward passes the loss gradient through and adds,
at each valid token's arg-max logit, `grad_loss * 1e-4 * max_logit / normalizer`, where
`normalizer` is the number of tokens the loss is averaged over (the official code uses B*T). In a
plain `loss.backward()` grad_loss is 1, so the added gradient is exactly
`1e-4 * max_logit / normalizer`; when the trainer scales the wrapped loss (e.g. by 1/accumulation
steps), the penalty is scaled with it, so it stays a fixed part of the objective.
"""

from __future__ import annotations

import torch

from flame.ops.linear_cross_entropy.rows_torch import L2WRAP_FACTOR  # the fused head adds the same term


class _L2Wrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits, valid_mask, normalizer):
        ctx.save_for_backward(logits, valid_mask)
        ctx.normalizer = normalizer
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, valid_mask = ctx.saved_tensors
        max_logit, argmax = logits.max(dim=-1, keepdim=True)
        penalty = max_logit * (grad_loss * (L2WRAP_FACTOR / ctx.normalizer)).to(logits.dtype)
        penalty = torch.where(valid_mask.unsqueeze(-1), penalty, torch.zeros_like(penalty))
        grad_logits = torch.zeros_like(logits).scatter_(-1, argmax, penalty)
        return grad_loss, grad_logits, None, None


def l2wrap(loss: torch.Tensor, logits: torch.Tensor, valid_mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """The loss, unchanged; its backward also pushes each valid token's largest logit towards 0.

    loss: scalar tensor computed from `logits` [..., vocab]; valid_mask: bool [...] (True where
    the token has a label); normalizer: the token count the loss is averaged over (> 0)."""
    if loss.dim() != 0:
        raise ValueError(f"l2wrap expects a scalar loss, got shape {tuple(loss.shape)}")
    if valid_mask.dtype != torch.bool or tuple(valid_mask.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"l2wrap valid_mask must be a bool tensor of shape {tuple(logits.shape[:-1])} (logits without the "
            f"vocab dim), got {valid_mask.dtype} {tuple(valid_mask.shape)}"
        )
    if not float(normalizer) > 0:
        raise ValueError(f"l2wrap normalizer must be > 0, got {normalizer}")
    return _L2Wrap.apply(loss, logits, valid_mask, normalizer)
