"""The row math of one chunk of logits as one Triton kernel: per-row cross-entropy, and the logits
gradient written over the logits.

One program per row walks the vocabulary twice in blocks of BLOCK_V columns:
- pass 1 keeps the running maximum m (with the first column that reaches it, for L2Wrap) and the
  running sum s of exp(x - m), rescaled whenever m grows, so lse = m + log(s) comes out of one read;
  it also picks the label's logit out of the block that holds it, so the loss is complete before
  any gradient is written (pass 2 overwrites the row in place, and another warp of the program may
  store over the label's column before a separate load of it would run);
- pass 2 reads each block again and writes softmax - onehot(label) (+ L2WRAP_FACTOR * m at the
  arg-max column with L2Wrap) over it, in the logits' dtype, or 0 on an ignored row.
Two reads and one write of the chunk, where the eager form (fp32 copy, logsumexp, exp, scatter,
mask, cast) makes about six passes. The arithmetic is fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rows_torch import IGNORE_INDEX, L2WRAP_FACTOR


@triton.jit
def _cross_entropy_rows_kernel(
    logits, labels, loss, V, stride,
    IGNORE: tl.constexpr, FACTOR: tl.constexpr, BLOCK_V: tl.constexpr,
    L2WRAP: tl.constexpr, STORE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    label = tl.load(labels + row).to(tl.int64)
    valid = label != IGNORE
    cols = tl.arange(0, BLOCK_V)

    m = float("-inf")
    s = 0.0
    arg = 0
    picked = 0.0
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        if L2WRAP:
            block_arg = tl.min(tl.where(x == block_max, idx, V), 0)
            arg = tl.where(block_max > m, block_arg, arg)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        picked += tl.sum(tl.where(idx == label, x, 0.0), 0)
    lse = m + tl.log(s)
    tl.store(loss + row, tl.where(valid, lse - picked, 0.0))

    if STORE_GRAD:
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            mask = idx < V
            x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(idx == label, g - 1.0, g)
            if L2WRAP:
                g = tl.where(idx == arg, g + FACTOR * m, g)
            g = tl.where(valid, g, 0.0)
            tl.store(base + idx, g.to(logits.dtype.element_ty), mask=mask)


def cross_entropy_rows_triton(logits: torch.Tensor, labels: torch.Tensor, l2wrap: bool, need_grad: bool):
    """`cross_entropy_rows_torch`'s contract, with the gradient written over `logits` (returned as
    the second element; the logits are gone afterwards). `logits` [n, V] must have unit column stride."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_rows_triton: logits need unit column stride, got strides {logits.stride()}")
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return loss, logits if need_grad else None
    block = min(triton.next_power_of_2(vocab), 4096)
    _cross_entropy_rows_kernel[(n,)](
        logits, labels, loss, vocab, logits.stride(0),
        IGNORE=IGNORE_INDEX, FACTOR=L2WRAP_FACTOR, BLOCK_V=block, L2WRAP=l2wrap, STORE_GRAD=need_grad,
        num_warps=8 if block >= 2048 else 4,
    )
    return loss, logits if need_grad else None
