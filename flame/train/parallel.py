"""Process setup and model parallelisation: torch.distributed, the device mesh, the data-parallel
plan, FSDP2, AC, compile.

- Under torchrun (WORLD_SIZE set) every rank joins one process group: NCCL for CUDA tensors plus
  gloo for CPU tensors on GPUs, gloo alone on CPUs. A single process without torchrun runs without
  torch.distributed.
- Data parallelism comes in two kinds (`plan_data_parallel`). Replicated: every rank holds the
  whole model and runs the one-GPU step (fp32 weights under `torch.autocast`, compute copies of the
  matrices, `flame.train.mixed_precision`; blocks replayed as CUDA graphs), and the gradients are
  summed over the ranks in a few large all-reduces that start during the backward
  (`flame.train.accumulation`). Sharded (FSDP2, HSDP across replicas): the parameters, gradients
  and optimizer state are split over the ranks, for models whose training state does not fit on
  one device; FSDP keeps fp32 master weights and gathers bf16 compute copies
  (`MixedPrecisionPolicy`). One rank is the replicated kind with nothing to reduce.
- torchtitan's ParallelDims builds the mesh: data_parallel_shard_degree > 1 is FSDP, adding
  data_parallel_replicate_degree gives HSDP; a shard degree of 1 replicates.
- `parallelize` applies, in this order, activation checkpointing (torchtitan's FullAC /
  SelectiveAC, or flame's "elementwise" policy), per-block torch.compile, and under FSDP
  `fully_shard` per block and at the root (`flame.train.fsdp`: the mixed precision of the config,
  gradients summed, the weights held gathered or freed after use).
- Collectives time out: parallel.init_timeout_minutes until the first step is done, then
  parallel.collective_timeout_minutes (`ParallelState.set_collective_timeout`), so that a rank
  that died or hangs stops the others; `collective_failure` names the step in their error (gloo
  raises), `StallWarning` names it before NCCL's watchdog aborts the process (GPUs).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from flame.train.fsdp import apply_fsdp

logger = logging.getLogger("flame.train")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """training.device: "auto" (CUDA if available), "cuda" or "cpu"."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"training.device must be 'auto', 'cuda' or 'cpu', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device = 'cuda' but no CUDA device is available")
    return torch.device(name)


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


TRAINING_BYTES_PER_PARAMETER = 18
"""What one parameter costs a replicated rank before any activation: its fp32 weight and gradient,
AdamW's two fp32 moments and a bf16 compute copy."""
REPLICATE_MEMORY_FRACTION = 0.4
"""`plan_data_parallel` replicates when the training state takes at most this share of a device's
memory: the rest holds the activations, which a config sizes for one GPU."""
HELD_BYTES_PER_PARAMETER = 6
"""What FSDP's held weights cost a rank per parameter beyond its shards (flame.train.fsdp): the
gathered bf16 weight and, during a step, the unsharded fp32 gradient."""
SHARDED_BYTES_PER_PARAMETER = 12
"""What FSDP shards over the ranks per parameter: the fp32 weight and AdamW's two fp32 moments."""


def check_held_weights_fit(num_params: int, shards: int, device: torch.device) -> str | None:
    """A warning when FSDP's held weights and a rank's shards of the fp32 weights and AdamW state
    (SHARDED_BYTES_PER_PARAMETER over `shards` ranks) take more than REPLICATE_MEMORY_FRACTION of the
    device's memory, else None."""
    if device.type != "cuda":
        return None
    need = num_params * (HELD_BYTES_PER_PARAMETER + SHARDED_BYTES_PER_PARAMETER / shards)
    have = torch.cuda.get_device_properties(device).total_memory
    if need <= REPLICATE_MEMORY_FRACTION * have:
        return None
    return (f"fsdp: held weights and the shards of {num_params / 1e6:.0f}M parameters take {need / 2**30:.1f} GiB, "
            f"more than {REPLICATE_MEMORY_FRACTION:.0%} of this GPU's {have / 2**30:.0f} GiB; if the run runs out "
            f"of memory, set parallel.fsdp_hold_weights = false (weights gathered per block and freed after use)")


@dataclass(frozen=True)
class DataParallelPlan:
    replicate: int
    shard: int
    reason: str


def plan_data_parallel(par, world_size: int, device: torch.device, num_params: int) -> DataParallelPlan:
    """How `world_size` data-parallel ranks split the model (`par`: the [parallel] config).

    data_parallel_shard_degree > 1 shards with FSDP over that many ranks (HSDP with
    data_parallel_replicate_degree replicas of them); 1 replicates on every rank; -1 (the default)
    with a replicate degree > 1 fills the rest with shards (HSDP, or replicas when nothing is left
    to shard); -1 alone replicates when the training state of `num_params` parameters fits on one
    device (TRAINING_BYTES_PER_PARAMETER, REPLICATE_MEMORY_FRACTION of a GPU's memory; always on
    CPUs), and otherwise shards over every rank."""
    shard, replicate = par.data_parallel_shard_degree, par.data_parallel_replicate_degree
    if shard > 1:
        return DataParallelPlan(replicate, shard, "parallel.data_parallel_shard_degree > 1")
    if shard == 1:
        return DataParallelPlan(world_size, 1, "parallel.data_parallel_shard_degree = 1")
    if replicate > 1:
        return DataParallelPlan(replicate, -1, "parallel.data_parallel_replicate_degree > 1, the "
                                "shard degree -1 fills the rest")
    need = TRAINING_BYTES_PER_PARAMETER * num_params
    state = f"the training state of {num_params / 1e6:.0f}M parameters ({need / 2**30:.1f} GiB)"
    if device.type != "cuda":
        return DataParallelPlan(world_size, 1, f"{state} on CPUs")
    have = torch.cuda.get_device_properties(device).total_memory
    if need <= REPLICATE_MEMORY_FRACTION * have:
        return DataParallelPlan(world_size, 1, f"{state} fits in {REPLICATE_MEMORY_FRACTION:.0%} of "
                                f"one GPU's {have / 2**30:.0f} GiB")
    return DataParallelPlan(1, -1, f"{state} does not fit in {REPLICATE_MEMORY_FRACTION:.0%} "
                            f"of one GPU's {have / 2**30:.0f} GiB")


def setup_parallel(cfg, device: torch.device, num_params: int) -> ParallelState:
    """Join the process group (when there is one to join), choose how the data-parallel ranks split
    a model of `num_params` parameters (`plan_data_parallel`) and build the device mesh."""
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
    plan = plan_data_parallel(par, world_size, device, num_params)
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
    elif dp_world_size > 1:
        kind = f"replicated over {dp_world_size} ranks, the gradients all-reduced in buckets"
    else:
        kind = "one rank"
    state = ParallelState(device=device, rank=rank, world_size=world_size, local_rank=local_rank,
                          dp_rank=dp_rank, dp_world_size=dp_world_size, parallel_dims=parallel_dims,
                          data_parallel=f"{kind} ({plan.reason})")
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
    """`err` restated with the step and the likely cause when it is a failed collective of a
    multi-rank run; None for any other error."""
    if not state.distributed or state.world_size == 1:
        return None
    text = str(err).strip()
    if not isinstance(err, dist.DistError) and not (
            type(err) is RuntimeError and any(marker in text for marker in COLLECTIVE_ERROR_MARKERS)):
        return None
    first_line = text.splitlines()[0][:400] if text else type(err).__name__
    return CollectiveFailure(
        f"rank {state.rank}: a collective failed after step {last_step} (the last step this rank "
        f"finished): {first_line}. Another rank died or hangs (collectives time out after "
        f"parallel.init_timeout_minutes = {cfg_parallel.init_timeout_minutes:g} min until the "
        f"first step is done, parallel.collective_timeout_minutes = "
        f"{cfg_parallel.collective_timeout_minutes:g} min after it); a restart resumes from the "
        f"last complete checkpoint"
    )


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap each block of `model.layers` for recomputation in the backward: "full" (the whole
    block), "selective" (torchtitan's op policy: every second matmul), or "elementwise" (only
    the elementwise glue, `keep_matmuls_and_attention`)."""
    if mode == "none":
        return
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if mode == "full":
        FullAC(FullAC.Config()).apply(model)
    elif mode == "selective":
        SelectiveAC(SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=[])).apply(model)
    elif mode == "elementwise":
        for index, block in enumerate(model.layers):
            model.layers[index] = recompute_elementwise(block)
    else:
        raise ValueError(
            f"training.activation_checkpoint must be 'none', 'full', 'selective' or 'elementwise', "
            f"got {mode!r}"
        )


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.linear.default}


def keep_matmuls_and_attention(ctx, func, *args, **kwargs):
    """The "elementwise" policy: a block saves for its backward the outputs of its matrix
    products, of flame's ops (namespace `flame`) and of autocast's casts of its parameters, and
    recomputes the rest (norms, gates, activations). Of the token-shift lerps
    (`token_shift_mix`), it recomputes those whose recomputation moves fewer than two tensors per
    output it spares (RWKV7's six static lerps: one read and six writes for six outputs; the
    two of RWKV6's channel mix), and keeps the others (a single lerp; RWKV6's five data-dependent
    ones, which read x and five offsets).
    Compiled, the recomputation runs inside the backward's fused kernels, which read the saved
    matmul outputs anyway: about half the activation memory for a few percent of GPU time
    (bench/RESULTS.md, whole training step). The bf16 weight copies are kept: recomputed, each
    would be a kernel of its own that reads the fp32 weight again in every micro-batch's backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    if func.name() == "flame::token_shift_mix_fwd" and not _lerps_worth_saving(*args[:3]):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if func in _MATMULS or func.namespace == "flame":
        return CheckpointPolicy.MUST_SAVE
    if func in _CASTS and _is_parameter(args[0]):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _lerps_worth_saving(x, mu, m) -> bool:
    """Whether recomputing token_shift_mix(x, mu, m) would move at least two tensors per output:
    it reads x and the N_M offsets m and writes N outputs."""
    outputs, offsets = mu.shape[0], (m.shape[0] if m is not None else 0)
    return 1 + offsets + outputs >= 2 * outputs


_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _is_parameter(t) -> bool:
    """Whether `t` is a module parameter: the nn.Parameter itself in eager mode; under torch.compile
    the functional wrapper of the fake tensor that Dynamo marks as a parameter (`_is_param`)."""
    if isinstance(t, nn.Parameter):
        return True
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(t, FunctionalTensor):
        t = torch._from_functional_tensor(t.elem)
    return bool(getattr(t, "_is_param", False))


def recompute_elementwise(block: nn.Module) -> nn.Module:
    """`block` wrapped so that its backward recomputes the elementwise ops (`keep_matmuls_and_attention`)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return checkpoint_wrapper(block, preserve_rng_state=False,
                              context_fn=partial(create_selective_checkpoint_contexts, keep_matmuls_and_attention))


def cuda_graphs_enabled(cfg, state: ParallelState) -> bool:
    """Whether the compiled blocks replay as CUDA graphs: training.cuda_graphs with training.compile
    on a CUDA device, unless FSDP frees its gathered weights (they move between calls:
    flame.train.fsdp) or the batches are varlen (their offsets change the chunk counts, and the ops
    read them on the host)."""
    if not (cfg.training.compile and cfg.training.cuda_graphs and state.device.type == "cuda"):
        return False
    for reason, applies in (("FSDP with parallel.fsdp_hold_weights = false",
                             state.fsdp and not cfg.parallel.fsdp_hold_weights),
                            ("training.varlen", cfg.training.varlen)):
        if applies:
            logger.info("compile: training.cuda_graphs is off under %s", reason)
            return False
    return True


def apply_compile(model: nn.Module, cuda_graphs: bool = False) -> None:
    """torch.compile each block (the repeated unit compiles once and is reused); with cuda_graphs,
    in "reduce-overhead" mode: each call replays the block's kernels as one CUDA graph."""
    for block in model.layers:
        block.compile(mode="reduce-overhead" if cuda_graphs else None)
    logger.info("compile: %d blocks wrapped with torch.compile%s", len(model.layers),
                ", replayed as CUDA graphs" if cuda_graphs else "")


def fsdp_mesh(state: ParallelState):
    """The mesh FSDP shards over: ("dp_replicate", "fsdp") under HSDP, else ("fsdp",)."""
    dims = state.parallel_dims
    if dims.dp_replicate > 1:
        return dims.get_optional_mesh(["dp_replicate", "fsdp"])
    return dims.get_optional_mesh("fsdp")


def fsdp_dtypes(cfg, state: ParallelState) -> tuple[torch.dtype, torch.dtype]:
    """FSDP's (param, reduce) dtypes: the config's on CUDA, fp32 on CPUs (gloo, CI: the exact
    reference)."""
    param = DTYPES[cfg.training.mixed_precision_param] if state.device.type == "cuda" else torch.float32
    return param, reduce_dtype(cfg, state)


def parallelize(model: nn.Module, cfg, state: ParallelState, cuda_graphs: bool = False) -> nn.Module:
    """Activation checkpointing, compile (as CUDA graphs: `cuda_graphs_enabled`) and FSDP, as
    configured, on a (meta-device) model."""
    apply_activation_checkpointing(model, cfg.training.activation_checkpoint)
    if cfg.training.compile:
        apply_compile(model, cuda_graphs)
    if state.fsdp:
        param_dtype, grad_dtype = fsdp_dtypes(cfg, state)
        mesh = fsdp_mesh(state)
        if cfg.parallel.fsdp_hold_weights:
            warning = check_held_weights_fit(sum(p.numel() for p in model.parameters()),
                                             state.parallel_dims.dp_shard, state.device)
            if warning:
                logger.warning(warning)
        apply_fsdp(model, mesh, param_dtype, grad_dtype, hold_weights=cfg.parallel.fsdp_hold_weights,
                   reshard_after_forward=cfg.parallel.reshard_after_forward)
        logger.info("fsdp: %s mesh %s, params %s, reduce %s, %s", "HSDP" if mesh.ndim > 1 else "FSDP",
                    dict(zip(mesh.mesh_dim_names, mesh.shape)), param_dtype, grad_dtype,
                    "weights held gathered, gradients reduced once per step" if cfg.parallel.fsdp_hold_weights
                    else f"weights freed after use (reshard_after_forward {cfg.parallel.reshard_after_forward})")
    return model


def compute_weights_dtype(cfg, state: ParallelState) -> torch.dtype | None:
    """The dtype of the compute copies of the weights (`flame.train.mixed_precision`) where
    `autocast` applies, else None."""
    dtype = DTYPES[cfg.training.mixed_precision_param]
    if state.fsdp or state.device.type != "cuda" or dtype == torch.float32:
        return None
    return dtype


def reduce_dtype(cfg, state: ParallelState) -> torch.dtype:
    """The dtype of the replicas' gradient all-reduce: training.mixed_precision_reduce on CUDA,
    fp32 on CPUs (gloo), as FSDP's reduce-scatter."""
    return DTYPES[cfg.training.mixed_precision_reduce] if state.device.type == "cuda" else torch.float32


def autocast(cfg, state: ParallelState):
    """The mixed-precision context of a model that FSDP does not shard: torch.autocast to
    training.mixed_precision_param on CUDA (a no-op context for float32, on CPU and under FSDP,
    whose MixedPrecisionPolicy casts instead). Returns a function that makes a new context."""
    from contextlib import nullcontext

    dtype = compute_weights_dtype(cfg, state)
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(state.device.type, dtype=dtype)


class StallWarning:
    """A thread that warns, once per step, when a step has run for most of the collective timeout.

    On GPUs a collective that times out ends the process from NCCL's watchdog thread, whose
    message names the collective, not the step: this warning comes first and names the step."""

    def __init__(self, rank: int, timeout_minutes: float, poll_seconds: float = 5.0,
                 fraction: float = 0.9):
        self.rank = rank
        self.limit = 60 * timeout_minutes * fraction
        self.timeout_minutes = timeout_minutes
        self.poll_seconds = poll_seconds
        self.last_step, self.since, self.warned = 0, time.monotonic(), False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="flame-stall-warning", daemon=True)
        self.thread.start()

    def step_done(self, step: int) -> None:
        self.last_step, self.since, self.warned = step, time.monotonic(), False

    def watch(self) -> None:
        while not self.stopped.wait(self.poll_seconds):
            waited = time.monotonic() - self.since
            if not self.warned and waited > self.limit:
                self.warned = True
                logger.warning(
                    "rank %d: no step finished for %.1f min since step %d; collectives time out "
                    "after %g min (parallel.collective_timeout_minutes): if this rank stops then, "
                    "another rank died or hangs in step %d", self.rank, waited / 60,
                    self.last_step, self.timeout_minutes, self.last_step + 1)

    def close(self) -> None:
        self.stopped.set()
