"""Mixed precision on one data-parallel rank: compute copies of the fp32 matrices, fp32 gradients.

With two or more data-parallel ranks FSDP's MixedPrecisionPolicy gathers every parameter in the
compute dtype. One rank runs without FSDP (`flame.train.parallel`), under `torch.autocast`, which
casts each fp32 weight to the compute dtype inside every micro-batch's forward, and each weight
gradient back to fp32 in its backward. `ComputeWeights` casts the matrices once per step instead:

- every floating-point parameter of two or more dimensions (linear and LoRA weights, embeddings,
  head) gets a persistent copy in the compute dtype (a tied weight one copy);
- `active()` puts the copies in the modules' places for the model calls of a step; its outermost
  entry first refreshes them from the fp32 parameters (one foreach copy), whose values change
  only outside model calls (the optimizer, a checkpoint load);
- the backward differentiates with respect to the copies (`grad_targets`): a weight gradient
  leaves its matmul in the compute dtype and becomes fp32 once, as `add_gradients` adds it into
  the step's fp32 gradient buffer.

The copies keep fixed addresses, as CUDA graphs need of parameters. Vectors (mixing coefficients,
norm weights, biases) stay fp32 parameters that autocast casts where they meet an activation:
their gradients are sums over every token of a micro-batch, and stay fp32.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn


class ComputeWeights:
    """Copies in `dtype` of `model`'s floating-point parameters of two or more dimensions; with
    `dtype` None, none (FSDP casts instead, or the model computes in fp32): `active()` then leaves
    the modules alone and `grad_targets` returns the parameters."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None):
        self.dtype = dtype
        self.masters: list[nn.Parameter] = []
        self.copies: list[nn.Parameter] = []
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        copy_of: dict[int, nn.Parameter] = {}
        for module in model.modules() if dtype is not None else ():
            for name, param in module._parameters.items():
                if param is None or param.dim() < 2 or not param.is_floating_point() or param.dtype == dtype:
                    continue
                if id(param) not in copy_of:
                    copy = nn.Parameter(torch.empty_like(param, dtype=dtype), requires_grad=param.requires_grad)
                    copy_of[id(param)] = copy
                    self.masters.append(param)
                    self.copies.append(copy)
                self.slots.append((module, name, param, copy_of[id(param)]))
        self.copy_of = copy_of
        self.depth = 0

    def grad_targets(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """What the backward differentiates for each of `params`: its compute copy, or itself."""
        return [self.copy_of.get(id(p), p) for p in params]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the fp32 parameters into the compute copies."""
        if self.copies:
            torch._foreach_copy_(self.copies, self.masters)

    @contextmanager
    def active(self):
        """The modules hold the compute copies inside; the outermost entry refreshes them first."""
        if self.depth == 0:
            self.refresh()
            self._place(copies=True)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._place(copies=False)

    def _place(self, copies: bool) -> None:
        for module, name, master, copy in self.slots:
            module._parameters[name] = copy if copies else master


def add_gradients(buffers: list[torch.Tensor], grads: list[torch.Tensor | None], first: bool) -> None:
    """Add one micro-batch's gradients `grads` into the fp32 `buffers` (`first`: copy instead, so
    nothing of an earlier step survives). A None gradient (a parameter the loss does not reach)
    zeroes its buffer on the first micro-batch. Gradients in the compute dtype become fp32 inside
    the copy or add: one foreach call per source dtype, as ATen's multi-tensor kernels need one
    dtype per list (and a compiled add on CUDA, `_compiled_foreach_add`)."""
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    unused = []
    for buffer, grad in zip(buffers, grads, strict=True):
        if grad is None:
            unused.append(buffer)
        else:
            targets, sources = by_dtype.setdefault(grad.dtype, ([], []))
            targets.append(buffer)
            sources.append(grad)
    if first and unused:
        torch._foreach_zero_(unused)
    for dtype, (targets, sources) in by_dtype.items():
        if first:
            torch._foreach_copy_(targets, sources)
        elif dtype != targets[0].dtype and targets[0].is_cuda:
            _compiled_foreach_add()(targets, sources)
        else:
            torch._foreach_add_(targets, sources)


@functools.cache
def _compiled_foreach_add():
    """`torch._foreach_add_` compiled: ATen's multi-tensor add needs one dtype, and for an fp32 +=
    bf16 list falls back to one add per tensor, each a scalar-load kernel (rwkv7_340M's 367M
    weights: 3.3 ms, 1.1 TB/s, on an H100); Inductor's kernels convert vectorized loads, several
    tensors per launch."""
    def foreach_add(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        torch._foreach_add_(targets, sources)

    return torch.compile(foreach_add, fullgraph=True, dynamic=False)
