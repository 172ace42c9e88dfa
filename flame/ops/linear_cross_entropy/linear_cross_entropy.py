"""linear_cross_entropy: the LM head's matmul and the token cross-entropy, in chunks of rows.

The plain head materialises logits [N, V] and, for the loss, an fp32 copy and its gradient: 4 N V
bytes per fp32 tensor, gigabytes at a pretraining batch. Here the rows go through in chunks:
per chunk the logits h_c @ W^T (compute dtype, fp32 accumulation), the per-row loss and the logits
gradient (rows_torch / rows_triton), then at once grad_h_c = g_c @ W and grad_W += g_c^T @ h_c (fp32;
on CUDA, cuBLAS adds the product of 16-bit operands into the fp32 sum directly).
The chunk's logits are freed before the next chunk, so the peak holds one chunk of logits, not N rows.

The gradients are computed in the forward, for a loss of scale 1, and saved; the backward only
multiplies them by grad_output * scale (the gradient is linear in scale, L2Wrap's term included).
"""

from __future__ import annotations

import torch

from ..utils.backend import resolve_backend, run_eager
from ..utils.checks import value_checks_enabled
from ..utils.dtypes import accumulation_dtype, autocast_off, to_compute_dtype
from .rows_torch import IGNORE_INDEX, cross_entropy_rows_torch

CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk at most: 8192 rows at V = 32000


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk such that the chunk's logits take at most CHUNK_BYTES in fp32, rounded down to
    a multiple of 256 rows (whole matmul tiles; 8192 rows at V = 32000: 16384-token micro-batches
    split into two equal chunks)."""
    rows = max(1, CHUNK_BYTES // (4 * vocab))
    return rows // 256 * 256 if rows >= 256 else rows


def _check_inputs(hidden, weight, labels, scale, chunk_rows) -> None:
    op = "linear_cross_entropy"
    for name, x in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{op}: hidden must be [N, D] and weight [V, D], got shapes {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden [N, D] and weight [V, D] must share D, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"{op}: hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"{op}: labels must be [N] = [{hidden.shape[0]}], got shape {tuple(labels.shape)}")
    if labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: labels must be int64 (or int32) class indices, got {labels.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"{op}: hidden, weight and labels must be on one device, got {hidden.device}, "
                         f"{weight.device} and {labels.device}")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.device not in (hidden.device, torch.device("cpu")):
            raise ValueError(f"{op}: a tensor scale must hold one value on the inputs' device, got shape "
                             f"{tuple(scale.shape)} on {scale.device}")
    elif not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a float or a one-element tensor, got {type(scale).__name__}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"{op}: chunk_rows must be a positive int or None, got {chunk_rows!r}")
    if value_checks_enabled() and labels.numel():
        vocab = weight.shape[0]
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            first = int(labels[bad][0])
            raise ValueError(f"{op}: labels must lie in [0, {vocab}) or be {IGNORE_INDEX} (ignored), got {first}")


def _rows_fn(backend: str):
    if backend == "triton":
        from .rows_triton import cross_entropy_rows_triton
        return cross_entropy_rows_triton
    return cross_entropy_rows_torch


def chunked_linear_cross_entropy(hidden, weight, labels, l2wrap, chunk_rows, backend, need_hidden_grad,
                                 need_weight_grad):
    """(CE sum over valid rows, d sum / d hidden or None, d sum / d weight in fp32 or None), one chunk
    of rows at a time. hidden and weight share one dtype; labels are int64."""
    rows_fn = _rows_fn(backend)
    n, d = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = accumulation_dtype(hidden.dtype)
    need_grad = need_hidden_grad or need_weight_grad
    total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
    grad_weight = None
    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        h = hidden[start:end]
        logits = h @ weight.t()
        loss_rows, grad_logits = rows_fn(logits, labels[start:end], l2wrap, need_grad)
        total += loss_rows.sum()
        del logits
        if need_hidden_grad:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        if need_weight_grad:
            grad_weight = _add_product(grad_weight, grad_logits.t(), h, acc_dtype)
        del grad_logits
    if need_weight_grad and grad_weight is None:  # no rows
        grad_weight = torch.zeros(vocab, d, dtype=acc_dtype, device=hidden.device)
    return total, grad_hidden, grad_weight


def _add_product(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                 acc_dtype: torch.dtype) -> torch.Tensor:
    """acc + a @ b in acc_dtype (acc None: a @ b). On CUDA, cuBLAS multiplies 16-bit operands straight
    into the fp32 accumulator (`out_dtype`): no 16-bit product to round, add and free, and no zeroed
    buffer first. Elsewhere the product is formed in the operands' dtype and added."""
    if a.dtype == acc_dtype:
        return a @ b if acc is None else acc.addmm_(a, b)
    if a.is_cuda:
        if acc is None:
            return torch.mm(a, b, out_dtype=acc_dtype)
        return torch.addmm(acc, a, b, out_dtype=acc_dtype, out=acc)
    product = (a @ b).to(acc_dtype)
    return product if acc is None else acc.add_(product)


def _scaled(total: torch.Tensor, scale) -> torch.Tensor:
    """total * scale for a float or a one-element tensor scale (moved to total's device, no host sync)."""
    if isinstance(scale, torch.Tensor):
        return total * scale.reshape(()).to(device=total.device, dtype=total.dtype, non_blocking=True)
    return total * scale


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, l2wrap, chunk_rows, backend):
        total, grad_hidden, grad_weight = chunked_linear_cross_entropy(
            hidden, weight, labels, l2wrap, chunk_rows, backend,
            ctx.needs_input_grad[0], ctx.needs_input_grad[1],
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.scale = scale
        ctx.weight_dtype = weight.dtype
        return _scaled(total, scale)

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        factor = _scaled(grad_output.to(accumulation_dtype(grad_output.dtype)), ctx.scale)
        if grad_hidden is not None:
            # a 0-dim fp32 factor keeps grad_hidden's dtype and multiplies in fp32: 1 / N is not rounded
            # to bf16
            grad_hidden = grad_hidden * factor
        if grad_weight is not None:
            # scaled in fp32 and rounded to the weight's dtype as it is stored: one kernel
            rounded = torch.empty(grad_weight.shape, dtype=ctx.weight_dtype, device=grad_weight.device)
            grad_weight = torch.mul(grad_weight, factor, out=rounded)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden, weight, labels, *, scale=1.0, l2wrap=False, chunk_rows=None, backend="auto"):
    """scale * (sum over rows with a label of cross_entropy(hidden @ weight.T, label)), without ever
    holding the full [N, V] logits.

    Args:
        hidden: [N, D] floating (the final norm's output, flattened over batch and time).
        weight: [V, D] floating (the head's weight). hidden and weight are cast to one compute dtype
            (flame.ops.utils.dtypes: the autocast dtype under autocast, else the promoted one); the logits
            are computed in it with fp32 accumulation, the loss math in fp32.
        labels: [N] int64 class indices; IGNORE_INDEX (-100) rows count for nothing.
        scale: float or one-element tensor multiplying the sum (the trainer passes 1 / the step's
            valid-token count); a constant, not differentiated.
        l2wrap: add RWKV's L2Wrap term to the gradient (flame.models.l2wrap with its normalizer folded
            into scale): scale * 1e-4 * max_logit at the arg-max logit of each row with a label. The
            loss value is unchanged.
        chunk_rows: rows per chunk; None picks default_chunk_rows(V) (a chunk's fp32 logits <= 1 GiB).
        backend: "auto" (Triton row kernel for CUDA tensors, PyTorch on CPU), "triton" or "torch".

    Returns a scalar tensor, fp32 (fp64 for fp64 inputs). When gradients are needed they are computed
    during this call; the backward only scales them.

    Raises TypeError / ValueError naming the argument for bad shapes, dtypes or devices, and, while value
    checks are on (flame.ops.utils.checks; one host sync), for labels outside [0, V) other than -100.
    """
    _check_inputs(hidden, weight, labels, scale, chunk_rows)
    hidden, weight = to_compute_dtype(hidden, weight)
    labels = labels.long()
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(weight.shape[0])
    with autocast_off(hidden.device):
        backend = resolve_backend(backend, hidden.device, "linear_cross_entropy")
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return run_eager(LinearCrossEntropyFunction.apply, hidden, weight, labels, scale, l2wrap, rows, backend)
        total, _, _ = chunked_linear_cross_entropy(hidden, weight, labels, l2wrap, rows, backend, False, False)
        return _scaled(total, scale)
