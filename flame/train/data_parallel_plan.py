"""How the data-parallel ranks split the model: replicas or FSDP, and under FSDP held or freed
weights (`plan_data_parallel`), from the config and the estimated peak memory of a step
(`flame.train.memory_estimate`) against the free memory of the GPU with the least.
`flame.train.parallel.setup_parallel` builds the device mesh from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from flame.train import memory_estimate


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
