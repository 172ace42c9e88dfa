"""Mixed precision: the dtypes of a run (`Precision`), and where FSDP does not shard the model
(one rank, or replicas) compute copies of the fp32 matrices with fp32 gradients (`ComputeWeights`).

`Precision.resolve` reads training.mixed_precision_param and training.mixed_precision_reduce once,
for the device and the data-parallel kind of the run, and the trainer hands its answers to the
objects that cast: FSDP's MixedPrecisionPolicy and micro-batch schedule (`param`, `reduce`), the
replicas' gradient all-reduce (`reduce`), the compute copies (`compute_weights`) and the model
calls' autocast context (`autocast`). On CPUs everything is fp32 (gloo, CI: the exact reference).

Under FSDP, its MixedPrecisionPolicy gathers every parameter in the compute dtype. Without FSDP
(one rank, or replicas) the model computes under `torch.autocast`, which
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

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from flame.config.torch_types import DTYPES


@dataclass(frozen=True)
class Precision:
    """The dtypes of a training run on `device` (module docstring)."""

    device: torch.device
    param: torch.dtype
    """The weights' compute dtype: training.mixed_precision_param on CUDA, fp32 on CPUs; FSDP
    gathers the weights in it."""
    reduce: torch.dtype
    """The dtype in which gradients are summed over the ranks (FSDP's reduce-scatter, the replicas'
    all-reduce): training.mixed_precision_reduce on CUDA, fp32 on CPUs."""
    compute_weights: torch.dtype | None
    """The dtype of the matrices' compute copies (`ComputeWeights`); None under FSDP (its
    MixedPrecisionPolicy casts), on CPUs and in fp32."""
    autocast: torch.dtype | None
    """The dtype of the model calls' torch.autocast; None where `compute_weights` is None."""

    @classmethod
    def resolve(cls, training, device: torch.device, fsdp: bool) -> Precision:
        """The dtypes of the config section `training` on `device`; `fsdp`: FSDP shards the model."""
        on_cuda = device.type == "cuda"
        param = DTYPES[training.mixed_precision_param] if on_cuda else torch.float32
        reduce = DTYPES[training.mixed_precision_reduce] if on_cuda else torch.float32
        compute = None if fsdp or param == torch.float32 else param
        return cls(device=device, param=param, reduce=reduce, compute_weights=compute, autocast=compute)

    def autocast_context(self):
        """A new mixed-precision context for model calls: torch.autocast to `autocast`, or a no-op
        context where it is None."""
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)


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
