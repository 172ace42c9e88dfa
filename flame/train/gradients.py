"""The gradient norm of a step and clipping by it, on the device, without a host sync.

FSDP2 gradients are DTensors sharded over the data-parallel shard group (and replicated over
the replicate group under HSDP). The norm works on their local shards: one fused per-parameter
norm over every local gradient, the squares summed, one all-reduce over the shard group (the
replicas hold equal gradients), then one fused multiply when the norm exceeds the limit. Going
through the DTensor dispatcher instead costs a sharding propagation per parameter on the host.
A caller whose fused AdamW applies the clip passes `scale=False` and skips the multiply: the
optimizer divides each gradient by 1 / factor (its `grad_scale`) as it reads it, which saves a
pass over every fp32 gradient.

The per-parameter norms stay on the device: they name the first non-finite gradient of a
skipped step after the gradients themselves are gone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class GradNorms:
    """The step's gradient norm before clipping and this rank's per-parameter norms (device)."""

    total: torch.Tensor
    per_param: torch.Tensor | None
    names: list[str]
    coefficient: torch.Tensor | None = None
    """The clipping factor min(1, max_norm / (total + 1e-6)) (device), None without a limit."""

    def first_nonfinite(self) -> str | None:
        """Name of the first parameter whose gradient (this rank's shard) is not finite; syncs."""
        if self.per_param is None:
            return None
        bad = torch.nonzero(~torch.isfinite(self.per_param)).flatten().tolist()
        return self.names[bad[0]] if bad else None


@torch.no_grad()
def clip_grad_norm(named_params, max_norm: float, shard_group=None, scale: bool = True) -> GradNorms:
    """Scale the gradients so that their global L2 norm is at most `max_norm` (math.inf: leave
    them); returns the norm before clipping and the clipping factor. `shard_group`: the process
    group over which the gradients are sharded (None: they are whole on this rank). `scale`
    False: only compute the factor; the caller applies it (fused AdamW's `grad_scale`)."""
    names, grads = [], []
    for name, param in named_params:
        if param.grad is not None:
            names.append(name)
            grads.append(local_tensor(param.grad))
    if not grads:
        zero = torch.zeros((), dtype=torch.float32)
        return GradNorms(zero, None, [])
    per_param = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    squares = per_param.square().sum()
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        dist.all_reduce(squares, group=shard_group)
    total = squares.sqrt()
    coef = None if max_norm == math.inf else torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if coef is not None and scale:
        by_device: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, dtype), group in by_device.items():
            torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))
    return GradNorms(total, per_param, names, coef)
