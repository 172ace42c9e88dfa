"""Processes, the device mesh and the collectives of a run: torch.distributed, torchtitan's
ParallelDims, the replica broadcast, collective timeouts and failures.

- Under torchrun (WORLD_SIZE set) every rank joins one process group: NCCL for CUDA tensors plus
  gloo for CPU tensors on GPUs, gloo alone on CPUs. A single process without torchrun runs without
  torch.distributed.
- Data parallelism comes in two kinds (`flame.train.data_parallel_plan`: by default by the
  estimated peak memory of a step, `flame.train.memory_estimate`, against the free memory of the
  GPU with the least: replicas where they fit, else FSDP, with its weights held where they fit,
  else freed). Replicated: every rank holds the whole model and runs the one-GPU step (fp32
  weights under `torch.autocast`, compute copies of the matrices, `flame.train.mixed_precision`;
  blocks replayed as CUDA graphs), and the gradients are summed over the ranks in a few large
  all-reduces that start during the backward (`flame.train.accumulation`). Sharded (FSDP2, HSDP
  across replicas): the parameters, gradients and optimizer state are split over the ranks, for
  models whose training state does not fit on one device; FSDP keeps fp32 master weights and
  gathers bf16 compute copies (`flame.train.fsdp`). One rank is the replicated kind with nothing
  to reduce.
- torchtitan's ParallelDims builds the mesh: data_parallel_shard_degree > 1 is FSDP, adding
  data_parallel_replicate_degree gives HSDP; a shard degree of 1 replicates.
  `flame.train.parallelize` applies activation checkpointing, compile and FSDP to the model.
- Collectives time out: parallel.init_timeout_minutes until the first step is done, then
  parallel.collective_timeout_minutes (`ParallelState.set_collective_timeout`), so that a rank
  that died or hangs stops the others; `collective_failure` names the step in their error (gloo
  raises), `flame.train.preemption.StallWarning` names it before NCCL's watchdog aborts the
  process (GPUs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from flame.train import memory_estimate
from flame.train.data_parallel_plan import plan_data_parallel


@dataclass
class ParallelState:
    """Where this process sits: device, global rank and data-parallel rank."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_world_size: int = 1
    parallel_dims: object | None = None  # torchtitan ParallelDims when distributed
    data_parallel: str = "one rank"
    """How the data-parallel ranks split the model, and why (`plan_data_parallel`), for the log."""
    hold_weights: bool = True
    """Under FSDP, whether each block's weights stay gathered over the step (flame.train.fsdp)."""
    warnings: tuple[str, ...] = ()
    """The plan's warnings (a forced path whose memory estimate does not fit), for the log."""

    @property
    def distributed(self) -> bool:
        return self.parallel_dims is not None

    @property
    def fsdp(self) -> bool:
        """Whether FSDP shards the model: a shard degree of two or more."""
        return self.distributed and self.parallel_dims.dp_shard > 1

    @property
    def replica_group(self):
        """The process group over which replicated gradients are summed (None: the model is
        sharded, or there is one data-parallel rank)."""
        if self.fsdp or self.dp_world_size <= 1:
            return None
        return self.parallel_dims.get_optional_mesh("dp_replicate").get_group()

    @property
    def shard_group(self):
        """The process group over which FSDP shards parameters and gradients (None: no sharding
        across processes)."""
        if not self.distributed or self.parallel_dims.dp_shard <= 1:
            return None
        return self.parallel_dims.get_optional_mesh("fsdp").get_group()

    def all_reduce_count(self, count: int) -> int:
        """Sum an integer over all ranks, on the host (gloo): no device sync."""
        if not self.distributed or self.world_size == 1:
            return count
        t = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t.item())

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """The largest of each integer over all ranks, on the host (gloo): no device sync."""
        if not self.distributed or self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def set_collective_timeout(self, minutes: float) -> None:
        """Make the collectives of the world group and of every mesh group time out after
        `minutes` (gloo raises; NCCL's watchdog aborts the process)."""
        if not self.distributed or self.world_size == 1:
            return
        from torch.distributed.distributed_c10d import _set_pg_timeout

        meshes = self.parallel_dims.get_all_one_dimensional_meshes().values()
        groups = [None] + [mesh.get_group() for mesh in meshes if mesh.size() > 1]
        for group in groups:
            _set_pg_timeout(timedelta(minutes=minutes), group)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a device tensor over all ranks (stays on the device, no host sync)."""
        if not self.distributed or self.world_size == 1:
            return value
        value = value.clone()
        dist.all_reduce(value)
        return value

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def smallest_free_memory(device: torch.device) -> int:
    """The free memory of the GPU with the least of it, over every rank (a host all-reduce)."""
    free = torch.tensor([memory_estimate.free_memory(device)], dtype=torch.int64)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return int(free.item())


def setup_parallel(cfg, device: torch.device, params: memory_estimate.ParamCounts) -> ParallelState:
    """Join the process group (when there is one to join), choose how the data-parallel ranks split
    a model of `params` (`plan_data_parallel`, against the free memory of the GPU with the least)
    and build the device mesh."""
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if not launched:
        return ParallelState(device=device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        timeout = timedelta(minutes=cfg.parallel.init_timeout_minutes)
        # torchrun keeps its store across worker restarts (--max-restarts): a prefix per restart
        # keeps the new ranks from reading the addresses their dead predecessors published there
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"flame-restart-{restart}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)

    # size-1 mesh axes use the "fake" backend, which this import registers
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    titan_parallel_dims.device_type = device.type  # torchtitan assumes CUDA otherwise
    par = cfg.parallel
    free = smallest_free_memory(device) if device.type == "cuda" else None
    plan = plan_data_parallel(cfg, world_size, params, free)
    try:
        parallel_dims = titan_parallel_dims.ParallelDims(
            dp_replicate=plan.replicate, dp_shard=plan.shard,
            cp=1, tp=1, pp=1, ep=1, world_size=world_size, spmd_backend="partial_dtensor",
        )
    except AssertionError as err:
        raise ValueError(
            f"parallel: data_parallel_replicate_degree ({par.data_parallel_replicate_degree}) x "
            f"data_parallel_shard_degree ({par.data_parallel_shard_degree}) must equal the "
            f"number of processes ({world_size}); -1 as the shard degree fills the rest"
        ) from err
    parallel_dims.build_mesh()
    batch_mesh = parallel_dims.get_optional_mesh("batch")
    dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    dp_world_size = parallel_dims.dp_replicate * parallel_dims.dp_shard
    if parallel_dims.dp_shard > 1:
        kind = (f"FSDP over {parallel_dims.dp_shard} ranks" if parallel_dims.dp_replicate == 1 else
                f"HSDP, {parallel_dims.dp_replicate} replicas of FSDP over {parallel_dims.dp_shard} ranks")
        kind += ", weights held gathered" if plan.hold_weights else ", weights freed after use"
    elif dp_world_size > 1:
        kind = f"replicated over {dp_world_size} ranks, the gradients all-reduced in buckets"
    else:
        kind = "one rank"
    state = ParallelState(device=device, rank=rank, world_size=world_size, local_rank=local_rank,
                          dp_rank=dp_rank, dp_world_size=dp_world_size, parallel_dims=parallel_dims,
                          data_parallel=f"{kind} ({plan.reason})", hold_weights=plan.hold_weights,
                          warnings=plan.warnings)
    state.set_collective_timeout(par.init_timeout_minutes)  # the mesh groups got torch's default
    return state


def broadcast_replicas(model: nn.Module, state: ParallelState) -> None:
    """Make every replica's parameters and buffers equal to the first replica's."""
    group = state.replica_group
    if group is None:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, group=group, group_src=0)


class CollectiveFailure(RuntimeError):
    """A collective failed or timed out: another rank died or hangs."""


COLLECTIVE_ERROR_MARKERS = ("gloo", "NCCL", "nccl", "Timed out", "timed out", "Connection reset",
                            "Connection closed", "ProcessGroup")


def collective_failure(err: BaseException, state: ParallelState, last_step: int,
                       cfg_parallel) -> CollectiveFailure | None:
    """`err` restated with this rank, its last finished step and the likely cause when a failed
    collective of a multi-rank run is `err` or caused it (a checkpoint save that failed on a dead
    peer: its message, which says what happened to the save, is kept); None for any other error."""
    if not state.distributed or state.world_size == 1:
        return None
    if not any(is_collective_error(e) for e in causes(err)):
        return None
    text = str(err).strip()
    first_line = text.splitlines()[0][:1000] if text else type(err).__name__
    return CollectiveFailure(
        f"rank {state.rank}: a collective failed after step {last_step} (the last step this rank "
        f"finished): {first_line}. Another rank died or hangs (collectives time out after "
        f"parallel.init_timeout_minutes = {cfg_parallel.init_timeout_minutes:g} min until the "
        f"first step is done, parallel.collective_timeout_minutes = "
        f"{cfg_parallel.collective_timeout_minutes:g} min after it); a restart resumes from the "
        f"last complete checkpoint"
    )


def is_collective_error(err: BaseException) -> bool:
    """Whether `err` is torch.distributed's error of a failed or timed-out collective (gloo raises
    a plain RuntimeError that names itself)."""
    text = str(err)
    return isinstance(err, dist.DistError) or (
        type(err) is RuntimeError and any(marker in text for marker in COLLECTIVE_ERROR_MARKERS))


def causes(err: BaseException):
    """`err`, then its causes and contexts (`raise ... from`, an error raised while handling
    another), each once."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__
