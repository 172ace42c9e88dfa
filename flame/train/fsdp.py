"""FSDP2 for the models whose training state does not fit replicated: how a model is sharded and
how its gathers and reductions are scheduled over a step's micro-batches.

Every block and the root are `fully_shard` units over the data-parallel mesh, with the
MixedPrecisionPolicy of the config (fp32 master weights and AdamW state sharded over the ranks,
bf16 weights gathered for compute) and FSDP's own gradient averaging off: the loss is already
normalised by the global valid-token count, so the gradients are summed.

Two schedules (parallel.fsdp_hold_weights; "auto", the default, holds the weights where the
estimated peak of a rank's step with them fits in the free memory of the GPU with the least, else
frees them: `flame.train.memory_estimate`, `flame.train.data_parallel_plan`):

- **Held weights**. A block's weights are gathered once per step, at the first
  micro-batch's forward, and stay gathered until the step's last backward; its gradients
  accumulate unsharded over the micro-batches and are reduce-scattered once, at the last
  micro-batch. The gathered weights keep their memory between steps (`hold_gathered_weights`):
  the next step's all-gather writes into the same buffers, so every block reads its weights at
  the same addresses at every step and the compiled blocks replay as CUDA graphs, the one-GPU
  step. Memory beyond the shards: the gathered weights (2 bytes per parameter in bf16) and, during
  a step, the unsharded gradients (4 bytes per parameter in fp32).
- **Freed weights**: FSDP's own schedule, for models whose gathered weights do not fit. A block
  frees its gathered weights after its forward (parallel.reshard_after_forward) and again after
  its backward, and reduce-scatters its gradients after every micro-batch: the least memory, one
  all-gather or two and one reduce-scatter per block and micro-batch, no CUDA graphs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

logger = logging.getLogger("flame.train")


def fsdp_mesh(parallel_dims):
    """The mesh FSDP shards over, of torchtitan's `parallel_dims`: ("dp_replicate", "fsdp") under
    HSDP, else ("fsdp",)."""
    if parallel_dims.dp_replicate > 1:
        return parallel_dims.get_optional_mesh(["dp_replicate", "fsdp"])
    return parallel_dims.get_optional_mesh("fsdp")


def apply_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype, *,
               hold_weights: bool, reshard_after_forward: str = "default") -> None:
    """fully_shard each block and the root over `mesh`; gradients are summed, not averaged.
    `hold_weights`: parallel.fsdp_hold_weights; `reshard_after_forward`:
    parallel.reshard_after_forward, for freed weights (module docstring)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers)
    for index, block in enumerate(blocks):
        if hold_weights:
            reshard = False
        else:  # the last block's weights are needed again at once by the backward: keep them
            reshard = {"always": True, "never": False}.get(reshard_after_forward, index < len(blocks) - 1)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # plain SUM collectives: no PREMUL_SUM, which gloo lacks, and no post-division
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    if hold_weights:
        hold_gathered_weights(model)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def hold_gathered_weights(model: nn.Module) -> None:
    """Keep the memory of every gathered weight of `model` from one gather to the next.

    FSDP2 frees a unit's gathered weights when it reshards and allocates them again at the next
    gather, wherever the allocator puts them. Here resharding still marks the weights as stale (so
    the next forward gathers the updated shards) but leaves their buffers allocated, and the
    gather writes into them: FSDP allocates a buffer only when it has no memory. FSDP2 has no public
    switch for this; `FSDPParam.free_unsharded_param` is the one place that frees, and it is
    replaced per parameter of this model."""
    params = []
    for module in fsdp_modules(model):
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        if group is not None:
            params.extend(group.fsdp_params)
    if not params or not all(callable(getattr(p, "free_unsharded_param", None)) for p in params):
        raise RuntimeError(
            "parallel.fsdp_hold_weights needs FSDP2's FSDPParam.free_unsharded_param, which this "
            f"torch ({torch.__version__}) lacks; set parallel.fsdp_hold_weights = false")
    for param in params:
        param.free_unsharded_param = _keep_memory


def _keep_memory() -> None:
    """A gathered weight's buffer stays allocated at a reshard (`hold_gathered_weights`)."""


class MicroBatchSchedule:
    """When FSDP reduce-scatters the gradients and frees the gathered weights over a step's
    micro-batches: with held weights, once, at the last micro-batch; with freed weights, at every
    one (module docstring).

    Under CUDA graphs a block's gradients are outputs of a graph, overwritten by its next replay;
    FSDP accumulates unsharded gradients in a buffer of its own only where the reduce dtype differs
    from the weights' dtype, and otherwise in the gradient it was given, so with equal dtypes every
    micro-batch reduce-scatters."""

    def __init__(self, model: nn.Module, hold_weights: bool, cuda_graphs: bool,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.model = model
        self.once_per_step = hold_weights and not (cuda_graphs and param_dtype == reduce_dtype)
        self.hold_weights = hold_weights

    def begin(self, index: int, count: int) -> None:
        """Before micro-batch `index` of `count`'s forward."""
        last = index == count - 1
        if self.once_per_step:
            self.model.set_requires_gradient_sync(last)
        if self.hold_weights:
            self.model.set_reshard_after_backward(last)
