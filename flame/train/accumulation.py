"""The step's gradients when FSDP does not shard the model: fp32 buffers of the trainer's own, summed
over micro-batches and, on several data-parallel replicas, over ranks.

One flat fp32 tensor holds every trainable parameter's gradient (each parameter's buffer is a view
of it), allocated once. A backward differentiates the micro-batch's loss with respect to the grad
targets (`flame.train.mixed_precision.ComputeWeights.grad_targets`: the compute copies of the
matrices, the fp32 parameters elsewhere) and foreach ops add the gradients into the buffers. The
step's first micro-batch copies instead of adding, so the buffers are never zeroed and nothing of
an earlier step survives. Autograd's own
accumulation into .grad would be one add kernel per parameter and micro-batch plus a memset of
every gradient per step; and under CUDA graphs a compiled block's gradient output lives in the
graphs' memory pool, where the next micro-batch's replay overwrites it (the add is queued before
that replay).

Replicas: the buffer is cut into buckets of consecutive parameters in the reverse of their
registration order, which is about the order in which the backward produces their gradients
(head first, embeddings last). In the step's last micro-batch, hooks on the targets collect the
gradients as autograd produces them, and once every gradient of a bucket is in, the bucket's
gradients are added and its all-reduce (a sum: the loss is already divided by the global token count)
starts on the communication stream while the backward goes on; `finish` waits for the last ones.
Buckets launch in index order on every rank, whatever order the hooks fire in, so the ranks
issue the same collectives in the same order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_ELEMENTS = 32 * 2**20
"""Gradient elements per all-reduce bucket (128 MB of fp32): few collectives per step, and a last
bucket small enough that the communication left after the backward is short."""


@dataclass
class _Bucket:
    indices: list[int]
    """Positions in the accumulator's parameter list."""
    flat: torch.Tensor
    """The slice of the flat gradient buffer that holds these parameters' gradients."""
    grads: dict[int, torch.Tensor] | None = None
    """This micro-batch's gradients that have arrived, by position; None once they are added."""
    reduced: torch.Tensor | None = None
    work: object | None = None


class GradientAccumulator:
    """fp32 gradient buffers for `params`, filled from the gradients of `targets` (one per
    parameter, the tensor the backward differentiates); `group`: the process group whose ranks
    hold replicas of the model (None: no reduction); `reduce_dtype`: the dtype of the all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter], targets: list[torch.Tensor], group=None,
                 reduce_dtype: torch.dtype = torch.float32):
        self.params = params
        self.targets = targets
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.reduce_dtype = reduce_dtype
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.buffers: list[torch.Tensor] = [torch.empty(0)] * len(params)
        self.buckets: list[_Bucket] = []
        self.bucket_of: list[int] = [0] * len(params)
        offset, indices = 0, []
        for index in reversed(range(len(params))):  # about the order the backward produces them
            numel = params[index].numel()
            self.buffers[index] = self.flat[offset:offset + numel].view_as(params[index])
            if indices and sum(params[i].numel() for i in indices) + numel > BUCKET_ELEMENTS:
                self._close_bucket(indices, offset)
                indices = []
            indices.append(index)
            offset += numel
        if indices:
            self._close_bucket(indices, offset)
        self.first = False
        self.next_launch = 0

    def _close_bucket(self, indices: list[int], end: int) -> None:
        start = end - sum(self.params[i].numel() for i in indices)
        for index in indices:
            self.bucket_of[index] = len(self.buckets)
        self.buckets.append(_Bucket(list(indices), self.flat[start:end]))

    def backward(self, loss: torch.Tensor, first: bool, last: bool) -> None:
        """Add `loss`'s gradients into the buffers (`first`: the step's first micro-batch, copy
        instead); `last`: the step's last micro-batch, whose backward starts the reduction."""
        if self.group is None or not last:
            grads = torch.autograd.grad(loss, self.targets, allow_unused=True)
            add_gradients(self.buffers, list(grads), first)
            return
        # hooks registered now run after any the model or a test registered on the same tensors
        self.first, self.next_launch = first, 0
        for bucket in self.buckets:
            bucket.grads = {}
        handles = [target.register_hook(functools.partial(self._on_grad, index))
                   for index, target in enumerate(self.targets)]
        try:
            torch.autograd.grad(loss, self.targets, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for position, bucket in enumerate(self.buckets):  # a parameter the loss did not reach
            if bucket.grads is not None:
                self._complete(position)

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        position = self.bucket_of[index]
        bucket = self.buckets[position]
        bucket.grads[index] = grad
        if len(bucket.grads) == len(bucket.indices):
            self._complete(position)

    def _complete(self, position: int) -> None:
        """Put bucket `position`'s gradients into its buffers (one that did not arrive is zero on
        the first micro-batch and unchanged after), then start the reductions that are due."""
        bucket = self.buckets[position]
        grads = [bucket.grads.get(index) for index in bucket.indices]
        add_gradients([self.buffers[index] for index in bucket.indices], grads, self.first)
        bucket.grads = None
        self._launch_due()

    def _launch_due(self) -> None:
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].grads is None:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.reduced = bucket.flat if self.reduce_dtype == torch.float32 else bucket.flat.to(self.reduce_dtype)
        bucket.work = dist.all_reduce(bucket.reduced, group=self.group, async_op=True)

    def zero(self) -> None:
        """A step without micro-batches: every gradient zero."""
        self.flat.zero_()

    def finish(self) -> None:
        """Wait for the reductions (the device stream waits, the host does not), make every
        parameter's .grad its buffer, and reset the buckets for the next step."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                if bucket.reduced is not bucket.flat:
                    bucket.flat.copy_(bucket.reduced)
            bucket.work = bucket.reduced = None
        for param, buffer in zip(self.params, self.buffers):
            param.grad = buffer


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
    bf16 list falls back to one scalar-load add kernel per tensor; Inductor's kernels convert
    vectorized loads, several tensors per launch."""
    def foreach_add(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        torch._foreach_add_(targets, sources)

    return torch.compile(foreach_add, fullgraph=True, dynamic=False)
