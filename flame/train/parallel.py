"""Process setup and model parallelisation: torch.distributed, the device mesh, the data-parallel
plan, FSDP2, AC, compile.

- Under torchrun (WORLD_SIZE set) every rank joins one process group: NCCL for CUDA tensors plus
  gloo for CPU tensors on GPUs, gloo alone on CPUs. A single process without torchrun runs without
  torch.distributed.
- Data parallelism comes in two kinds (`plan_data_parallel`: by default by the estimated peak
  memory of a step, `flame.train.memory_estimate`, against the free memory of the GPU with the
  least: replicas where they fit, else FSDP, with its weights held where they fit, else freed).
  Replicated: every rank holds the whole model and runs the one-GPU step (fp32 weights under
  `torch.autocast`, compute copies of the matrices, `flame.train.mixed_precision`; blocks replayed
  as CUDA graphs), and the gradients are summed over the ranks in a few large all-reduces that
  start during the backward (`flame.train.accumulation`). Sharded (FSDP2, HSDP across replicas):
  the parameters, gradients and optimizer state are split over the ranks, for models whose
  training state does not fit on one device; FSDP keeps fp32 master weights and gathers bf16
  compute copies (`MixedPrecisionPolicy`). One rank is the replicated kind with nothing to reduce.
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

from flame.train import memory_estimate
from flame.train.compile_cache import source_fingerprint
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


@dataclass(frozen=True)
class DataParallelPlan:
    """How the data-parallel ranks split the model (`plan_data_parallel`)."""

    replicate: int
    shard: int
    """-1: the ranks that replication leaves (torchtitan's ParallelDims fills it)."""
    hold_weights: bool
    """Under FSDP: each block's weights stay gathered over the step (flame.train.fsdp)."""
    reason: str
    """Why, with the memory estimates where they decided, for the log."""
    warnings: tuple[str, ...] = ()
    """A path the config forces whose estimate does not fit."""


SMALLER_STEP = ("lower training.batch_size (and raise training.gradient_accumulation_steps), or set "
                "training.activation_checkpoint to \"elementwise\" or \"full\"")
"""What to change when even the path of the least memory does not fit."""


def plan_data_parallel(cfg, world_size: int, params: memory_estimate.ParamCounts,
                       free_bytes: int | None) -> DataParallelPlan:
    """How `world_size` data-parallel ranks split a model of `params` under the config `cfg`, whose
    ranks have at least `free_bytes` of free GPU memory each (None: CPUs).

    parallel.data_parallel_shard_degree > 1 shards with FSDP over that many ranks (HSDP with
    data_parallel_replicate_degree replicas of them); 1 replicates on every rank; -1 (the default)
    with a replicate degree > 1 fills the rest with shards (HSDP, or replicas when nothing is left
    to shard); -1 alone replicates when a replica's estimated peak fits (`memory_estimate`; always
    on CPUs), and otherwise shards over every rank. Under FSDP, parallel.fsdp_hold_weights "auto"
    holds the weights when the held estimate fits (always on CPUs), else frees them. The reason
    names the settings and, on GPUs, gives the estimates that were compared."""
    par = cfg.parallel
    shard, replicate = par.data_parallel_shard_degree, par.data_parallel_replicate_degree
    report = MemoryReport(free_bytes)
    replicas = memory_estimate.replicated(cfg, params, world_size)
    if shard > 1:
        shards, setting = shard, f"parallel.data_parallel_shard_degree = {shard}"
    elif shard == -1 and replicate > 1:
        shards = world_size // replicate
        setting = (f"parallel.data_parallel_replicate_degree = {replicate}, the shard degree -1 fills "
                   f"the rest")
    elif shard == 1:
        report.compare("replicas", replicas)
        warnings = report.warn_unless_fits(replicas, "replicas", "set parallel.data_parallel_shard_degree = -1 "
                                           "(FSDP where replicas do not fit)")
        return DataParallelPlan(world_size, 1, True, report.reason("parallel.data_parallel_shard_degree = 1"),
                                warnings)
    else:
        setting = "parallel.data_parallel_shard_degree = -1"
        if free_bytes is None or report.compare("replicas", replicas):
            return DataParallelPlan(world_size, 1, True, report.reason(setting))
        shards = world_size
    if shards <= 1:  # nothing left to shard: replicas (ParallelDims checks the degrees)
        warnings = report.warn_unless_fits(replicas, "replicas", SMALLER_STEP)
        return DataParallelPlan(replicate, -1, True, report.reason(setting), warnings)
    hold = par.fsdp_hold_weights
    setting += f", parallel.fsdp_hold_weights = {hold_setting_text(hold)}"
    if free_bytes is None:
        return DataParallelPlan(replicate, shard if shard > 1 else -1, hold is not False, report.reason(setting))
    held = memory_estimate.fsdp(cfg, params, shards, hold_weights=True)
    freed = memory_estimate.fsdp(cfg, params, shards, hold_weights=False)
    held_fits = report.compare(f"FSDP over {shards} with held weights", held)
    report.compare("with freed weights", freed)
    warnings = ()
    if hold == "auto":
        hold = held_fits
        if hold and par.reshard_after_forward != "default":
            warnings = (f"parallel.reshard_after_forward = {par.reshard_after_forward!r} does not apply: "
                        f"parallel.fsdp_hold_weights = \"auto\" holds the weights, which fit; set it to false "
                        f"to free them",)
    if hold:
        warnings += report.warn_unless_fits(held, "fsdp: with held weights", "set parallel.fsdp_hold_weights = "
                                            "\"auto\" (freed weights where held ones do not fit)")
    else:
        warnings = report.warn_unless_fits(freed, "fsdp: with freed weights", SMALLER_STEP)
    return DataParallelPlan(replicate, shard if shard > 1 else -1, hold, report.reason(setting), warnings)


class MemoryReport:
    """The memory estimates that `plan_data_parallel` compares against the free memory of the GPU
    with the least (`free_bytes`; None on CPUs), for its reason and warnings."""

    def __init__(self, free_bytes: int | None):
        self.free_bytes = free_bytes
        self.verdicts: list[str] = []

    def compare(self, name: str, estimate: memory_estimate.Estimate) -> bool:
        """Whether `estimate` fits (on CPUs: nothing is compared, False)."""
        if self.free_bytes is None:
            return False
        fits = estimate.fits(self.free_bytes)
        self.verdicts.append(f"{name} {estimate.describe()} {'fit' if fits else 'do not fit'}")
        return fits

    @property
    def usable(self) -> str:
        return (f"{memory_estimate.gib(memory_estimate.FIT_FRACTION * self.free_bytes)} GiB usable "
                f"({memory_estimate.FIT_FRACTION:.0%} of the {memory_estimate.gib(self.free_bytes)} GiB free on "
                f"the GPU with the least)")

    def reason(self, setting: str) -> str:
        if self.free_bytes is None:
            return f"{setting}; CPUs"
        return f"{setting}; estimated memory per GPU, against {self.usable}: {', '.join(self.verdicts)}"

    def warn_unless_fits(self, estimate: memory_estimate.Estimate, name: str, advice: str) -> tuple[str, ...]:
        """A warning when `estimate` does not fit, with `advice`; () when it does or on CPUs."""
        if self.free_bytes is None or estimate.fits(self.free_bytes):
            return ()
        return (f"{name}: the estimated peak per GPU, {estimate.describe()}, exceeds the {self.usable}; "
                f"if the run runs out of memory, {advice}",)


def hold_setting_text(setting) -> str:
    """parallel.fsdp_hold_weights as a config file writes it."""
    return f'"{setting}"' if isinstance(setting, str) else str(setting).lower()


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

    context_fn = partial(create_selective_checkpoint_contexts, keep_matmuls_and_attention)
    context_fn.cache_hash = source_fingerprint()  # torch's compile cache keys the policy on it
    return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)


def cuda_graphs_enabled(cfg, state: ParallelState) -> bool:
    """Whether the compiled blocks replay as CUDA graphs: training.cuda_graphs with training.compile
    on a CUDA device, unless FSDP frees its gathered weights (they move between calls:
    flame.train.fsdp) or the batches are varlen (their offsets change the chunk counts, and the ops
    read them on the host)."""
    if not (cfg.training.compile and cfg.training.cuda_graphs and state.device.type == "cuda"):
        return False
    for reason, applies in (("FSDP with freed weights (parallel.fsdp_hold_weights)",
                             state.fsdp and not state.hold_weights),
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
        apply_fsdp(model, mesh, param_dtype, grad_dtype, hold_weights=state.hold_weights,
                   reshard_after_forward=cfg.parallel.reshard_after_forward)
        logger.info("fsdp: %s mesh %s, params %s, reduce %s, %s", "HSDP" if mesh.ndim > 1 else "FSDP",
                    dict(zip(mesh.mesh_dim_names, mesh.shape)), param_dtype, grad_dtype,
                    "weights held gathered, gradients reduced once per step" if state.hold_weights
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
