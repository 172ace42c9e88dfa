"""One optimizer step on the device, in two halves: queue it (`gradients`, then `launch`), read it
back (`resolve`).

A step's objective is the token-mean cross-entropy over every valid token of the step, on all
ranks (`flame.train.loss`): each micro-batch's CE sum is divided by the step's global valid-token
count, known before the first forward, and the micro-batches' gradients are summed
(`flame.train.accumulation` where FSDP does not shard the model, FSDP's own hooks where it does,
scheduled over the micro-batches by `flame.train.fsdp.MicroBatchSchedule`).
`launch` then queues the gradient norm and clipping, the global loss and, with fused AdamW, the
update behind a device-side finite check: fused AdamW skips an update whose `found_inf` flag is
set, so a non-finite step changes nothing on any rank (the loss and the norm are global, so every
rank sets the same flag), and it applies the clip itself, as its `grad_scale`. `resolve` reads the
loss and the norm, the step's one host sync, which waits for those two numbers and not for the work
queued after them (`flame.train.readback`), and applies the update there when the optimizer cannot
skip one on its own.

The trainer's loop queues step N+1's forward and backward before it resolves step N, so the host's
per-step work overlaps the device's. Step N+1's update is queued after step N is resolved: its LR
depends on whether step N was skipped.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from flame.ops.utils.checks import value_checks_off
from flame.train.accumulation import GradientAccumulator
from flame.train.fsdp import MicroBatchSchedule
from flame.train.gradients import GradNorms, clip_grad_norm
from flame.train.loss import count_valid_tokens
from flame.train.readback import DeviceClock, DeviceScalars


class Outcome(enum.Enum):
    """What a read step is to the run: the pipeline reads OK or SKIPPED (`StepPipeline.resolve`);
    the non-finite guard tells whether a skip ends a streak (`flame.train.nonfinite`)."""

    OK = "ok"
    """Finite: the update is applied and the step's tokens count."""
    SKIPPED = "skipped"
    """The loss or the gradient norm is not finite: the update was skipped on every rank."""
    STOPPED = "stopped"
    """Skipped, and the last of `training.max_consecutive_nan_steps` in a row: the run stops."""
    RELOADED = "reloaded"
    """Skipped, and the last of such a streak with `training.nan_recovery`: the trainer reloads
    the last good checkpoint and keeps the data position; its state is that checkpoint's."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    valid_tokens: int
    outcome: Outcome
    seconds: float
    """Device time from the previous step's numbers to this step's (`flame.train.readback`)."""
    first_nonfinite_param: str | None = None
    first_nonfinite_module: str | None = None  # set when the loss itself is non-finite

    @property
    def skipped(self) -> bool:
        """The step's update was skipped: its loss or gradient norm is not finite."""
        return self.outcome is not Outcome.OK


@dataclass
class StepEnd:
    """What follows a step once it is done, decided while it runs, the same on every rank
    (`Trainer.plan_step_end`)."""

    validate: bool
    save: bool
    stop: bool
    """A stop signal reached some rank: save at this step and exit."""
    last: bool
    signal_name: str = ""

    @property
    def pause(self) -> bool:
        """The loop reads this step's numbers before it queues the next step's update: the
        validation, the checkpoint and the stop must see exactly this step's weights."""
        return self.validate or self.save or self.stop or self.last


@dataclass
class Gradients:
    """A step's forward and backward, queued: the gradients are in the parameters' .grad."""

    micro_batches: list[dict[str, torch.Tensor]]
    loss_sum: torch.Tensor
    """This rank's share of the step loss (device)."""
    valid_tokens: int
    """Valid tokens of the step over all micro-batches and ranks."""


@dataclass
class LaunchedStep:
    """An optimizer step whose work is queued on the device and whose numbers are not read yet."""

    micro_batches: list[dict[str, torch.Tensor]]
    norms: GradNorms
    numbers: DeviceScalars
    """The loss and the gradient norm, copied to the host as soon as they exist."""
    valid_tokens: int
    lr: float
    update_queued: bool
    """The update is queued behind the device-side finite check; otherwise `resolve` applies it
    after reading the numbers."""
    end: StepEnd | None = None
    """What follows once the step is done, decided while it runs."""


class StepPipeline:
    """Queues optimizer steps of `model` and reads them back.

    `accumulator`: the step's gradient buffers where FSDP does not shard the model (None under
    FSDP); `fsdp_schedule`: when FSDP reduces and frees over the micro-batches (under FSDP);
    `compute_weights`: the matrices' compute copies (`flame.train.mixed_precision`);
    `autocast()`: the model calls' mixed-precision context; `cuda_graphs`: the compiled blocks
    replay as CUDA graphs."""

    def __init__(self, model, optimizer, lr_scheduler, parallel, *, accumulator: GradientAccumulator | None,
                 fsdp_schedule: MicroBatchSchedule | None, compute_weights, autocast, cuda_graphs: bool, max_norm: float, fused_update: bool):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.parallel = parallel
        self.device = parallel.device
        self.accumulator = accumulator
        self.fsdp_schedule = fsdp_schedule
        self.compute_weights = compute_weights
        self.autocast = autocast
        self.cuda_graphs = cuda_graphs
        self.max_norm = max_norm if max_norm > 0 else math.inf
        self.fused_update = fused_update
        self.clock = DeviceClock(self.device)

    # ---- model calls ---------------------------------------------------------------------

    def model_inputs(self, batch: dict[str, torch.Tensor]):
        """(input_ids, labels, cu_seqlens or None) of a micro-batch, on the device."""
        input_ids = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        cu_seqlens = batch.get("cu_seqlens")
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)
        return input_ids, labels, cu_seqlens

    def loss(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        """`scale` * the micro-batch's CE sum over its valid tokens, from the model's fused head
        (the full logits are never held; RWKV's L2Wrap, when the model has it, is in the gradient)."""
        input_ids, labels, cu_seqlens = self.model_inputs(batch)
        self._begin_model_call()
        with self.compute_weights.active(), self.autocast():
            return self.model(input_ids, cu_seqlens=cu_seqlens, labels=labels, loss_scale=scale)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, labels) of a micro-batch: the plain head, for the non-finite search, whose
        hooks then see the head's output too."""
        input_ids, labels, cu_seqlens = self.model_inputs(batch)
        self._begin_model_call()
        with self.compute_weights.active(), self.autocast():
            return self.model(input_ids, cu_seqlens=cu_seqlens), labels

    def _begin_model_call(self) -> None:
        """Under CUDA graphs, tell the graphs that a new forward begins: the outputs of the previous
        micro-batch's replays (whose backward has run) may be overwritten."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    # ---- the step ------------------------------------------------------------------------

    def gradients(self, micro_batches: list[dict[str, torch.Tensor]]) -> Gradients:
        """Queue the forward and backward of the step's micro-batches: afterwards each trainable
        parameter's .grad holds the gradient of the step objective, summed over micro-batches and
        data-parallel ranks, whatever it held before."""
        valid_tokens = self.parallel.all_reduce_count(count_valid_tokens(micro_batches))
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        scale = 1.0 / max(valid_tokens, 1)
        if self.accumulator is None:
            self.zero_grad()
        with value_checks_off(), self.compute_weights.active():  # refreshed once for the step
            for index, batch in enumerate(micro_batches):
                if self.fsdp_schedule is not None:
                    self.fsdp_schedule.begin(index, len(micro_batches))
                loss = self.loss(batch, scale)
                if self.accumulator is None:
                    loss.backward()  # FSDP's hooks reduce-scatter and accumulate the shards
                else:
                    self.accumulator.backward(loss, first=index == 0, last=index == len(micro_batches) - 1)
                loss_sum += loss.detach()
                del loss
        if self.accumulator is not None:
            if not micro_batches:
                self.accumulator.zero()
            self.accumulator.finish()
        return Gradients(micro_batches, loss_sum, valid_tokens)

    def launch(self, gradients: Gradients) -> LaunchedStep:
        """Queue the rest of the step: the gradient norm and clipping by it, the global loss and,
        with fused AdamW, the update behind the device-side finite check."""
        queued = self.fused_update and gradients.valid_tokens > 0
        # a queued update clips in fused AdamW, which divides every gradient by `grad_scale` as it reads it
        norms = clip_grad_norm(self.model.named_parameters(), self.max_norm, self.parallel.shard_group,
                               scale=not queued)
        loss = self.parallel.all_reduce_sum(gradients.loss_sum)
        numbers = DeviceScalars(loss, norms.total)
        if queued:
            finite = torch.isfinite(loss) & torch.isfinite(norms.total)
            self.optimizer.found_inf = (~finite).float()  # read by fused AdamW: skip the update
            if norms.coefficient is not None:
                self.optimizer.grad_scale = norms.coefficient.reciprocal()
            try:
                self.optimizer.step()
            finally:
                self.optimizer.found_inf = None
                self.optimizer.grad_scale = None
            self.zero_grad()
        return LaunchedStep(gradients.micro_batches, norms, numbers, gradients.valid_tokens,
                            self.current_lr(), queued)

    def resolve(self, step: LaunchedStep) -> StepResult:
        """Read a launched step's loss and gradient norm, and apply its update if it is not queued
        yet: a step whose loss or gradient norm is not finite is skipped on every rank (both
        numbers are global), and the LR schedule moves only past a step that was not."""
        loss, norm = step.numbers.values()
        seconds = step.numbers.clock.seconds_since(self.clock)
        self.clock = step.numbers.clock
        skipped = not (math.isfinite(loss) and math.isfinite(norm) and step.valid_tokens > 0)
        if not skipped:
            if not step.update_queued:
                self.optimizer.step()
            self.lr_scheduler.step()
        if not step.update_queued:
            self.zero_grad()
        return StepResult(loss, norm, step.lr, step.valid_tokens,
                          Outcome.SKIPPED if skipped else Outcome.OK, seconds)

    def restart_clock(self) -> None:
        """Time the next resolved step from here (a run's first step, not its setup)."""
        self.clock = DeviceClock(self.device)

    def current_lr(self) -> float:
        group = self.optimizer.param_groups[0]
        return group["lr"] / group.get("lr_multiplier", 1.0)

    def zero_grad(self) -> None:
        """End the step's gradients: every parameter's .grad back to None. Under FSDP that frees
        the gradient shards, and the next backward starts new ones. Otherwise the accumulator's
        buffers keep the memory, which the next step overwrites, so nothing is zeroed; .grad is
        None in between so that nothing reads a finished step's gradients as current (DCP's
        optimizer state_dict, for one, skips initialising an empty optimizer state when
        gradients are present)."""
        self.optimizer.zero_grad(set_to_none=True)
