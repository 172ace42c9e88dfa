"""The flame trainer: config in; trained model, metrics and checkpoints out.

`Trainer(cfg).train()` reads like the story of a run: set up the processes, build tokenizer, data,
the checkpointer, the model (initialised unless a checkpoint of the run replaces its weights), the
step (gradient buffers, optimizer, LR schedule), resume if there is something to resume, then step.
One optimizer step = `gradient_accumulation_steps` micro-batches on each data-parallel rank; its
objective is the token-mean cross-entropy over every valid token of the step, on all ranks
(`flame.train.loss`).

Each concern has a module of its own, met here at a few marked places: queuing and reading a step
(`flame.train.step_pipeline`), its gradients (`flame.train.accumulation`), non-finite steps
(`flame.train.nonfinite`), the dump-folder lock (`flame.train.run_lock`), stop signals and the
ranks' agreement at each step's end (`flame.train.preemption`), collective failures
(`flame.train.parallel.collective_failure`), checkpoints (`flame.train.checkpoint`: the trainer is
the DCP `Stateful` of a run's counters, LR schedule, data position and RNG) and the test-only
fault hooks (`flame.train.fault_injection`).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import use_deterministic_algorithms
from torch.distributed.checkpoint.stateful import Stateful

from flame.config import to_toml
from flame.config.torch_types import resolve_device
from flame.data import build_job_dataloader, load_tokenizer
from flame.models import build_model
from flame.train import fault_injection
from flame.ops.utils.checks import value_checks_off
from flame.train.accumulation import GradientAccumulator
from flame.train.checkpoint import (CheckpointError, CheckpointManager, ModelState, OptimizerState,
                                    OptimizerStateOnHost,
                                    write_run_config)
from flame.train.compile_cache import CompileCache
from flame.train.fault_injection import fault_point
from flame.train.fsdp import MicroBatchSchedule
from flame.train.loss import IGNORE_INDEX
from flame.train.lr_schedule import build_lr_scheduler
from flame.train.memory_estimate import ParamCounts
from flame.train.metrics import MetricsLogger, StepLog, setup_logging
from flame.train.mixed_precision import ComputeWeights, Precision
from flame.train.nonfinite import NonFiniteGuard, NonFiniteTrainingError
from flame.train.optimizer import build_optimizer
from flame.train.parallel import ParallelState, broadcast_replicas, collective_failure, setup_parallel
from flame.train.parallelize import parallelize
from flame.train.preemption import Preempted, StepBoundary, StopSignals
from flame.train.profiling import StepProfiler
from flame.train.run_lock import RunLock, lock_dump_folder
from flame.train.step_pipeline import LaunchedStep, Outcome, StepEnd, StepPipeline, StepResult
from flame.weights import is_foreign_weights, load_exported_weights

logger = logging.getLogger("flame.train")


@dataclass
class TrainState:
    """Counters that a checkpoint carries across a restart (identical on every rank)."""

    step: int = 0
    """Optimizer steps taken (skipped non-finite steps included)."""
    tokens: int = 0
    """Valid tokens trained on, over all ranks."""
    nan_skips: int = 0
    """Non-finite steps skipped in total."""
    consecutive_nan_skips: int = 0
    """Non-finite steps skipped in a row, up to now."""
    wandb_run_id: str = ""
    dp_world_size: int = 1

    def count(self, result: StepResult) -> None:
        """Count a read step: its tokens when it was applied, its skip when it was not."""
        self.step += 1
        if result.skipped:
            self.nan_skips += 1
            self.consecutive_nan_skips += 1
        else:
            self.tokens += result.valid_tokens
            self.consecutive_nan_skips = 0


class Trainer(Stateful):
    def __init__(self, cfg, *, dataloader=None, model_factory=None):
        """`dataloader`: an already built training loader (else built from cfg.data).
        `model_factory(cfg.model)`: builds the model in place of `flame.models.build_model` (it runs
        under the meta device and gets the same parallelisation, initialisation, loss and optimizer);
        the model follows `flame.models.CausalLM`'s contract: `layers`, `init_weights()`,
        `num_flops_per_token()` (MFU's FLOPs per token) and the forward's signature (logits without
        labels; with `labels=` and `loss_scale=`, the scaled CE sum over valid tokens, the training
        loss)."""
        self.cfg = cfg
        training = cfg.training

        # 1. the processes: device, ranks and mesh (sized by the model), the run's dtypes, seed, dump folder
        with torch.device("meta"):
            model = (model_factory or build_model)(cfg.model)
        self.parallel: ParallelState = setup_parallel(cfg, resolve_device(training.device, "training.device"),
                                                      ParamCounts.of(model))
        self.device, self.rank = self.parallel.device, self.parallel.rank
        self.precision = Precision.resolve(training, self.device, fsdp=self.parallel.fsdp)
        setup_logging(self.rank)
        self.seed_everything()
        self.dump_folder = Path(cfg.job.dump_folder)
        # preemption safety: one run per dump folder (rank 0 holds the lock; a refusal stops all)
        self.run_lock = RunLock(self.dump_folder, cfg.job.name, force=cfg.job.force_unlock)
        lock_dump_folder(self.run_lock, self.parallel)
        logger.info("job %s: dump folder %s, %d process(es) on %s", cfg.job.name,
                    self.dump_folder, self.parallel.world_size, self.device)
        logger.info("data parallel: %s", self.parallel.data_parallel)
        for warning in self.parallel.warnings:
            logger.warning(warning)

        # 2. tokenizer and data
        logger.info("data: loading the tokenizer and %s data ...", cfg.data.dataset)
        start = time.monotonic()
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.tokenizer.check_vocab_size(cfg.model.vocab_size)
        self.dataloader = dataloader if dataloader is not None else self.build_dataloader("train")
        self.batches = iter(self.dataloader)
        self.batches_consumed = 0
        self.val_loader = None
        logger.info("data: ready in %.1fs", time.monotonic() - start)

        # 3. model: parallelised (and whether its blocks replay as CUDA graphs), materialised,
        # initialised (the same on every replica) unless the run resumes from a checkpoint of its
        # own, whose weights replace every parameter; the compiled code is cached where a restart
        # finds it. Every checkpoint holds the config it was trained with.
        self.compile_cache = CompileCache.setup(training, cfg.job.dump_folder, self.rank)
        if sys.pycache_prefix is not None:  # flame.train.bytecode, or the user's PYTHONPYCACHEPREFIX
            logger.info("python bytecode: kept in %s", sys.pycache_prefix)
        self.checkpointer = CheckpointManager(cfg.checkpoint, str(self.dump_folder), run_config=to_toml(cfg))
        resume_step = self.resume_step()
        self.model = self.materialize(model, initialise=resume_step is None)

        # 4. the step: gradient buffers, optimizer, LR schedule, non-finite guard
        compute_weights = ComputeWeights(self.model, self.precision.compute_weights)
        params = [p for p in self.model.parameters() if p.requires_grad]
        accumulator = None if self.parallel.fsdp else GradientAccumulator(
            params, compute_weights.grad_targets(params), self.parallel.replica_group, self.precision.reduce)
        fsdp_schedule = MicroBatchSchedule(
            self.model, self.parallel.hold_weights, self.cuda_graphs, self.precision.param,
            self.precision.reduce) if self.parallel.fsdp else None
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, training.steps,
                                               cfg.optimizer.lr)
        self.pipeline = StepPipeline(
            self.model, self.optimizer, self.lr_scheduler, self.parallel, accumulator=accumulator,
            fsdp_schedule=fsdp_schedule, compute_weights=compute_weights, autocast=self.precision.autocast_context,
            cuda_graphs=self.cuda_graphs, max_norm=training.max_norm,
            fused_update=cfg.optimizer.implementation == "fused")
        self.guard = NonFiniteGuard(training, self.model, self.parallel, self.pipeline.forward)

        # 5. the resume when there is one, preemption, metrics
        self.state = TrainState(dp_world_size=self.parallel.dp_world_size)
        self.optimizer_on_host: OptimizerStateOnHost | None = None
        self.resume(resume_step)
        self.stop_signals = StopSignals(training.stop_signals)
        self.boundary = StepBoundary(self.parallel, self.stop_signals, self.checkpointer,
                                     cfg.parallel.collective_timeout_minutes)
        self.profiler = StepProfiler(cfg.profiling, self.dump_folder, self.rank, self.device)
        self.metrics = MetricsLogger(
            str(self.dump_folder), cfg.metrics, enabled=self.rank == 0, run_name=cfg.job.name,
            config_dict=asdict(cfg), wandb_run_id=self.state.wandb_run_id or None,
        )
        self.state.wandb_run_id = self.broadcast_object(self.metrics.wandb_run_id or "")
        if self.state.step > 0:
            self.metrics.mark_resume(self.state.step)
        self.step_log = StepLog(self.metrics, cfg, self.parallel.world_size, self.device,
                                self.model.num_flops_per_token())

        # 6. the run's record, once the data, the model and the checkpoint are accepted: a refused
        # start leaves the config.toml of the run before it as it was
        if self.rank == 0:
            write_run_config(self.dump_folder, self.checkpointer.run_config)

    # ---- building ------------------------------------------------------------------------

    def seed_everything(self) -> None:
        seed = self.cfg.job.seed
        if self.parallel.distributed:
            from torchtitan.config import DebugConfig
            from torchtitan.distributed.utils import set_determinism

            set_determinism(self.parallel.parallel_dims, self.device,
                            DebugConfig(seed=seed, deterministic=self.cfg.job.deterministic), [])
        else:
            torch.manual_seed(seed)
            if self.cfg.job.deterministic:
                use_deterministic_algorithms(True)

    def build_dataloader(self, split: str):
        """This rank's loader of the "train" split or of the held-out "validation" split."""
        return build_job_dataloader(
            self.cfg.data, self.cfg.training, tokenizer=self.tokenizer, split=split,
            job_seed=self.cfg.job.seed, dp_rank=self.parallel.dp_rank,
            dp_world_size=self.parallel.dp_world_size)

    def materialize(self, model: torch.nn.Module, initialise: bool = True) -> torch.nn.Module:
        """The meta-device `model` parallelised (AC, compile, FSDP: `parallelize`, which decides
        `self.cuda_graphs`), on the device, initialised (`initialise`; else its values are
        undefined until a checkpoint load, which is strict: it fills every parameter or fails)."""
        logger.info("model: %s, parallelising and initialising ...", self.cfg.model.family)
        start = time.monotonic()
        self.cuda_graphs = parallelize(model, self.cfg, self.parallel, self.precision)
        # materialise in place (swap each parameter's contents, keep the Parameter objects), so that a
        # tied head and embedding stay one parameter; a plain to_empty gives each module a new one
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to_empty(device=self.device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        if initialise:
            torch.manual_seed(self.cfg.job.seed)  # the same full init on every rank and any sharding
            with torch.no_grad():
                model.init_weights()
            broadcast_replicas(model, self.parallel)
        else:
            logger.info("model: not initialised, the checkpoint's weights replace it")
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        logger.info("model: %s, %.2fM parameters, ready in %.1fs", self.cfg.model.family,
                    num_params / 1e6, time.monotonic() - start)
        return model

    # ---- the loop ------------------------------------------------------------------------

    def train(self, stop_at_step: int | None = None) -> TrainState:
        """Run the step loop to training.steps (or to `stop_at_step`, as if killed there).

        Step N+1's forward and backward are queued before step N's numbers are read, so the host's
        per-step work overlaps the device's; a step whose end validates, saves or stops (`StepEnd`)
        and every step of an optimizer that cannot skip an update on the device is read before the
        next is queued. A stop signal (training.stop_signals) on any rank ends the loop at the next
        step boundary, the same step on every rank, after a checkpoint there: `Preempted` is raised."""
        cfg = self.cfg
        last_step = cfg.training.steps if stop_at_step is None else min(stop_at_step, cfg.training.steps)
        logger.info("training: steps %d -> %d, batch %d x GA %d x DP %d, seq_len %d",
                    self.state.step, cfg.training.steps, cfg.training.batch_size,
                    cfg.training.gradient_accumulation_steps, self.parallel.dp_world_size,
                    cfg.training.seq_len)
        with self.running():
            for _ in self.run_steps(last_step):
                pass
        logger.info("training: done at step %d, %d tokens, %d skipped step(s)",
                    self.state.step, self.state.tokens, self.state.nan_skips)
        return self.state

    def run_steps(self, last_step: int):
        """The loop to `last_step`: yields each step's result once the step is read, logged,
        validated and saved. Step N+1's forward and backward are queued before step N is read."""
        pending: LaunchedStep | None = None
        while self.steps_launched(pending) < last_step:
            micro_batches = self.next_micro_batches()
            gradients = self.pipeline.gradients(micro_batches)
            if pending is not None:
                result = self.end_step(pending)  # waits for step N's two numbers only
                yield result
                if result.outcome is Outcome.RELOADED:  # the gradients just queued are of the old weights
                    gradients = self.pipeline.gradients(micro_batches)
            step = self.pipeline.launch(gradients)
            step.end = self.plan_step_end(self.state.step + 1, last_step)
            pending = step if step.update_queued and not step.end.pause else None
            if pending is None:
                yield self.end_step(step)

    def steps_launched(self, pending: LaunchedStep | None) -> int:
        """Steps read (the state's count, which a reload sets back) and the one launched but not
        read yet, if any."""
        return self.state.step + (pending is not None)

    def end_step(self, step: LaunchedStep) -> StepResult:
        """Read a launched step and finish it as its `StepEnd` says."""
        result = self.read_step(step)
        self.finish_step(result, step.end)
        return result

    @contextmanager
    def running(self):
        """The context of a run of the loop: the folder lock, the stop signals' handlers and test
        faults; a failed collective restated with its step; everything closed at the end."""
        lock_dump_folder(self.run_lock, self.parallel)
        fault_injection.arm(self)
        self.stop_signals.install()
        self.pipeline.restart_clock()
        self.step_log.restart()
        try:
            yield
            self.checkpointer.wait()
        except RuntimeError as err:  # preemption safety: a rank died or hangs; name the step
            failure = collective_failure(err, self.parallel, self.state.step, self.cfg.parallel)
            if failure is None:
                raise
            raise failure from err
        finally:
            self.profiler.stop()
            self.metrics.close()
            self.stop_signals.restore()
            self.boundary.close()
            if self.rank == 0:
                self.run_lock.release()

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over `micro_batches`, this rank's share of the global batch, read
        back and counted before it returns (no log, validation or checkpoint: `finish_step`)."""
        return self.read_step(self.pipeline.launch(self.pipeline.gradients(micro_batches)))

    def read_step(self, step: LaunchedStep) -> StepResult:
        """Read a launched step's numbers (`StepPipeline.resolve`), count it (`TrainState.count`)
        and act on its `Outcome` (`NonFiniteGuard.check`): a streak of non-finite steps stops the
        run (STOPPED) or reloads the last good checkpoint (RELOADED)."""
        result = self.pipeline.resolve(step)
        self.state.count(result)
        self.compile_cache.first_step_done(self.state.step, result.seconds)
        result.outcome = self.guard.check(result, step, self.state, self.batches_consumed)
        if result.outcome is Outcome.STOPPED:
            raise NonFiniteTrainingError(
                f"{self.guard.streak(self.state)}. Stopping; {self.last_good_checkpoint()}.")
        if result.outcome is Outcome.RELOADED:
            self.reload_after_streak()
        return result

    def plan_step_end(self, step: int, last_step: int | None = None) -> StepEnd:
        """Decide what follows step `step`: validation, checkpoint, stop. The one place that
        decides it, while the step runs; one host all-reduce makes every rank agree."""
        total = self.cfg.training.steps
        agreed = self.boundary.agree(step)
        val_freq = self.cfg.metrics.val_freq
        save = self.checkpointer.should_save(step, total, time_due=agreed.save_due, stopping=agreed.stop)
        return StepEnd(validate=val_freq > 0 and step % val_freq == 0, save=save, stop=agreed.stop,
                       last=step >= (last_step or total), signal_name=agreed.signal_name)

    def finish_step(self, result: StepResult, end: StepEnd | None = None) -> None:
        """Log step `self.state.step`, whose result this is, then validate, save and stop as `end`
        (decided while the step ran; now when None) says."""
        step, total = self.state.step, self.cfg.training.steps
        self.step_log.add(step, result, self.state)
        self.boundary.step_done(step)
        self.profiler.step_done(step)
        if result.outcome is Outcome.RELOADED:  # the state is the checkpoint's: nothing more of this step
            return
        end = end if end is not None else self.plan_step_end(step)
        fault_point("boundary", step)
        if end.validate:
            self.log_validation()
        if end.save:
            self.save_checkpoint(required=end.stop or step == total)
        if end.stop and step < total:
            self.checkpointer.wait()
            saved = self.checkpointer.step_dir(step) if self.cfg.checkpoint.enable else None
            raise Preempted(step, end.signal_name, saved)

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next step (a new pass starts at the data's end)."""
        micro_batches = []
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            try:
                batch = next(self.batches)
            except StopIteration:
                logger.info("data: end of the training data, starting a new pass")
                self.batches = iter(self.dataloader)
                batch = next(self.batches)
            micro_batches.append(batch)
        self.batches_consumed += len(micro_batches)
        return micro_batches

    # ---- non-finite streaks --------------------------------------------------------------

    def last_good_checkpoint(self) -> str:
        """Where the run's last good checkpoint is, for the error that stops a non-finite streak."""
        self.checkpointer.wait()
        complete = self.checkpointer.complete_steps()
        if not complete:
            return (f"no checkpoint was written to {self.checkpointer.folder} (checkpoint.enable "
                    f"= {str(self.cfg.checkpoint.enable).lower()})")
        return (f"the last good checkpoint, {self.checkpointer.step_dir(complete[-1])}, is intact "
                f"(set training.nan_recovery = true to reload it and skip this data)")

    def reload_after_streak(self) -> None:
        """End a streak of non-finite steps with training.nan_recovery: reload the last good
        checkpoint but keep the data position, so that the bad window is skipped."""
        streak = self.guard.streak(self.state)
        self.checkpointer.wait()
        step = self.checkpointer.resume_step()
        if step is None:
            raise NonFiniteTrainingError(f"{streak}; no checkpoint to recover from")
        skips = self.state.nan_skips
        data_state = self.dataloader.state_dict() if hasattr(self.dataloader, "state_dict") else None
        consumed = self.batches_consumed
        self.load_full_checkpoint(self.checkpointer.step_dir(step))
        if data_state is not None:
            self.dataloader.load_state_dict(data_state)
            self.batches = iter(self.dataloader)
        self.batches_consumed = consumed
        self.state.nan_skips = skips
        self.state.consecutive_nan_skips = 0
        self.metrics.mark_resume(step)
        logger.warning("%s; recovered: reloaded step %d, training continues after the data that "
                       "caused it (micro-batch %d)", streak, step, consumed)

    # ---- validation and logging ----------------------------------------------------------

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Token-mean CE over `metrics.val_steps` micro-batches per rank of the held-out split."""
        if self.val_loader is None:
            self.val_loader = self.build_dataloader("validation")
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        batches = iter(self.val_loader)
        for _ in range(self.cfg.metrics.val_steps):
            try:
                batch = next(batches)
            except StopIteration:  # a small split: go round again, every rank the same count
                batches = iter(self.val_loader)
                batch = next(batches)
            with value_checks_off():
                totals[0] += self.pipeline.loss(batch, 1.0).double()
            totals[1] += (batch["labels"] != IGNORE_INDEX).sum()
        self.model.train()
        ce_sum, count = self.parallel.all_reduce_sum(totals).tolist()
        return ce_sum / max(count, 1.0)

    def log_validation(self) -> None:
        start = time.monotonic()
        val_loss = self.validation_loss()
        logger.info("step %6d | validation loss %.4f (%.1fs)", self.state.step, val_loss,
                    time.monotonic() - start)
        self.metrics.log({"step": self.state.step, "val_loss": val_loss}, console=False)

    def broadcast_object(self, value):
        """Rank 0's value of a small picklable object, on every rank."""
        if not self.parallel.distributed or self.parallel.world_size == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    # ---- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's counters and LR schedule (the same on every rank), and this rank's data
        position and RNG states."""
        rank_state = {
            "dataloader": self.dataloader.state_dict() if hasattr(self.dataloader, "state_dict") else None,
            "batches_consumed": self.batches_consumed,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        return {"train_state": asdict(self.state), "lr_scheduler": self.lr_scheduler.state_dict(),
                f"rank_{self.rank}": pickle.dumps(rank_state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = TrainState(**state_dict["train_state"])
        self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        rank_state = pickle.loads(state_dict[f"rank_{self.rank}"])
        if rank_state["dataloader"] is not None:
            self.dataloader.load_state_dict(rank_state["dataloader"])
            self.batches = iter(self.dataloader)
        self.batches_consumed = rank_state["batches_consumed"]
        torch.set_rng_state(rank_state["rng"])
        if rank_state["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rank_state["cuda_rng"], self.device)

    def save_checkpoint(self, required: bool = False) -> None:
        """Save the run at this step; `required`: a failure stops the run whatever
        checkpoint.on_save_error says."""
        self.checkpointer.save(self.state.step, self.checkpoint_state(), required=required)
        self.metrics.write_plot()

    def checkpoint_state(self, model_only: bool = False) -> dict[str, Any]:
        """The objects a checkpoint holds; DCP reads or fills them in place."""
        self.optimizer_state_to_device()  # a save or a load finds the optimizer's own state
        state: dict[str, Any] = {"model": ModelState(self.model)}
        if not model_only:
            state["optimizer"] = OptimizerState(self.model, self.optimizer)
            state["trainer"] = self
        return state

    def optimizer_state_to_device(self) -> None:
        """Hand a resume's optimizer state, held on the host through the first step's forward and
        backward (`OptimizerStateOnHost`), to the optimizer: at its first update (a step pre-hook,
        whichever path applies the update), or earlier when a save or a load needs that state."""
        if self.optimizer_on_host is not None:
            self.optimizer_on_host.to_device()
            self.optimizer_on_host = None

    def resume_step(self) -> int | None:
        """The step of this run's own checkpoint to resume from (the latest complete one, or
        checkpoint.load_step), or None for a new run."""
        ckpt = self.cfg.checkpoint
        return self.checkpointer.resume_step() if ckpt.enable or ckpt.load_step >= 0 else None

    def resume(self, step: int | None) -> None:
        """Resume from this run's checkpoint at `step` (`resume_step`); without one, start from
        initial_load_path if given. A checkpoint past training.steps is refused: the run would end
        at once, at the checkpoint's step, without a step of training, and report that as done."""
        ckpt = self.cfg.checkpoint
        if step is not None:
            self.load_full_checkpoint(self.checkpointer.step_dir(step), optimizer_on_host=self.cuda_graphs)
        elif ckpt.initial_load_path:
            if is_foreign_weights(ckpt.initial_load_path):
                if not ckpt.initial_load_model_only:
                    raise CheckpointError(
                        f"checkpoint.initial_load_path {ckpt.initial_load_path} holds model weights "
                        f"only (an exported folder or an RWKV-LM .pth): set "
                        f"checkpoint.initial_load_model_only = true"
                    )
                load_exported_weights(self.model, ckpt.initial_load_path, self.cfg.model.family)
            elif ckpt.initial_load_model_only:
                self.checkpointer.load(ckpt.initial_load_path, self.checkpoint_state(model_only=True))
                logger.info("model: weights loaded from %s (model only, a new run)",
                            ckpt.initial_load_path)
            else:
                self.load_full_checkpoint(Path(ckpt.initial_load_path), optimizer_on_host=self.cuda_graphs)
        if self.state.step > self.cfg.training.steps:
            loaded = self.checkpointer.step_dir(step) if step is not None else ckpt.initial_load_path
            raise CheckpointError(
                f"checkpoint {loaded} is at step {self.state.step}, past training.steps = "
                f"{self.cfg.training.steps}: set training.steps to {self.state.step} or more to "
                f"continue this run, or choose another job.dump_folder for a new one"
            )

    def load_full_checkpoint(self, path: Path, optimizer_on_host: bool = False) -> None:
        """Load the model, the optimizer and the trainer's state from `path`. `optimizer_on_host`
        (a resume under CUDA graphs, whose first step captures them): the optimizer's state waits
        in host memory until that step's update, so that the capture peaks as a new run's does."""
        # read the run's data-parallel size first, so that a mismatch gets a clear refusal
        header = {"trainer": {"train_state": {"dp_world_size": 0}}}
        self.checkpointer.load(path, header)
        saved_dp = header["trainer"]["train_state"]["dp_world_size"]
        if saved_dp != self.parallel.dp_world_size:
            raise CheckpointError(
                f"checkpoint {path} was written with data-parallel size {saved_dp}, this run has "
                f"{self.parallel.dp_world_size}: its data position and optimizer state cannot be "
                f"resumed. Start a new run from its weights instead, with "
                f"checkpoint.initial_load_path = \"{path}\" and "
                f"checkpoint.initial_load_model_only = true."
            )
        state = self.checkpoint_state()
        if optimizer_on_host and self.optimizer_fits_on_host():
            self.optimizer_on_host = state["optimizer"] = OptimizerStateOnHost(self.model, self.optimizer)
        self.checkpointer.load(path, state)
        if self.optimizer_on_host is not None:
            def hand_over(*_):
                self.optimizer_state_to_device()
                handle.remove()

            handle = self.optimizer.register_step_pre_hook(hand_over)
        logger.info("resumed from %s: step %d, %d tokens seen%s", path, self.state.step, self.state.tokens,
                    "; the optimizer's state waits in host memory for the first update"
                    if self.optimizer_on_host is not None else "")

    def optimizer_fits_on_host(self) -> bool:
        """Whether this node's host memory holds the optimizer's state of its ranks with half of
        it to spare (`OptimizerStateOnHost`); if not, a resume loads that state on the device."""
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        needed = ranks * OptimizerStateOnHost.host_bytes(self.model)
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # no such query on this system: load on the device
            logger.info("checkpoint: the host's available memory is unknown: the optimizer's state is "
                        "loaded on the device")
            return False
        if 2 * needed <= available:
            return True
        logger.info("checkpoint: the optimizer's state of %d rank(s) (%.1f GiB) would take more than half "
                    "of the host's available memory (%.1f GiB): it is loaded on the device", ranks,
                    needed / 2**30, available / 2**30)
        return False
