"""Mixed precision where FSDP does not shard the model (one rank, or replicas): compute copies of
the fp32 matrices, fp32 gradients.

Under FSDP, its MixedPrecisionPolicy gathers every parameter in the compute dtype. Without FSDP
(`flame.train.parallel`) the model computes under `torch.autocast`, which
casts each fp32 weight to the compute dtype inside every micro-batch's forward, and each weight
gradient back to fp32 in its backward. `ComputeWeights` casts the matrices once per step instead:

- every floating-point parameter of two or more dimensions (linear and LoRA weights, embeddings,
  head) gets a persistent copy in the compute dtype (a tied weight one copy);
- `active()` puts the copies in the modules' places for the model calls of a step; its outermost
  entry first refreshes them from the fp32 parameters (one foreach copy), whose values change
  only outside model calls (the optimizer, a checkpoint load);
- the backward differentiates with respect to the copies (`grad_targets`): a weight gradient
  leaves its matmul in the compute dtype and becomes fp32 once, as it is added into the step's
  fp32 gradient buffer (`flame.train.accumulation`).

The copies keep fixed addresses, as CUDA graphs need of parameters. Vectors (mixing coefficients,
norm weights, biases) stay fp32 parameters that autocast casts where they meet an activation:
their gradients are sums over every token of a micro-batch, and stay fp32.
"""

from __future__ import annotations

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
