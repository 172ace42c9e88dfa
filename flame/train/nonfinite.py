"""Steps whose loss or gradient norm is not finite: skipped on every rank, located, and after too
many in a row either the run stops or the last good checkpoint is reloaded.

The step pipeline already skipped the update (`flame.train.step_pipeline`) and the trainer counted
the skip (`TrainState.count`). `NonFiniteGuard.check` names the first parameter whose gradient is
not finite and, when the loss itself is not finite, the module where the forward turns non-finite
(one extra forward, on such steps only), logs the step's data position, and returns the step's
`Outcome`: SKIPPED, or after `training.max_consecutive_nan_steps` skips in a row STOPPED, or
RELOADED with `training.nan_recovery`. Besides the culprits' names in the step's result it
changes nothing: the counters, the stop and the reload are the trainer's (`Trainer.read_step`),
which owns the checkpoints.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from flame.ops.utils.checks import value_checks_off
from flame.train.step_pipeline import LaunchedStep, Outcome, StepResult

logger = logging.getLogger("flame.train")


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def first_nonfinite_module(model: torch.nn.Module, run_forward) -> str | None:
    """Where a non-finite forward starts: the first module, in execution order, whose output holds
    a NaN or Inf while all of its floating-point inputs are finite (the NaN is born inside it;
    an op called by the module, such as an attention kernel, is reported as that module).
    Falls back to the first module with a non-finite output. `run_forward()` runs the model once;
    it is called under no_grad with a hook on every submodule."""
    origin: list[str] = []
    first_bad: list[str] = []

    def finite(value) -> bool:
        if torch.is_tensor(value) and value.is_floating_point():
            return bool(torch.isfinite(value).all())
        if isinstance(value, (tuple, list)):
            return all(finite(item) for item in value)
        return True

    def check(name):
        def hook(module, args, output):
            if origin or finite(output):
                return
            label = f"{name} ({type(module).__name__})"
            first_bad.append(label)
            if finite(args):
                origin.append(label)
        return hook

    handles = [module.register_forward_hook(check(name)) for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    return (origin or first_bad or [None])[0]


class NonFiniteGuard:
    """Locates and reports non-finite steps and tells when a streak of them ends the run or
    reloads (`training`: the config's [training] section; `forward(batch)`: the model's plain
    forward of a micro-batch)."""

    def __init__(self, training, model, parallel, forward: Callable):
        self.max_in_a_row = training.max_consecutive_nan_steps
        self.recover = training.nan_recovery
        self.gradient_accumulation_steps = training.gradient_accumulation_steps
        self.model = model
        self.parallel = parallel
        self.forward = forward

    def check(self, result: StepResult, step: LaunchedStep, state, batches_consumed: int) -> Outcome:
        """The outcome of step `state.step`, whose `result` is read and counted in `state`: OK, or
        SKIPPED (logged, `result` names the culprits), or at the end of a streak STOPPED or
        RELOADED (with training.nan_recovery)."""
        if not result.skipped:
            return Outcome.OK
        result.first_nonfinite_param = step.norms.first_nonfinite()
        if not math.isfinite(result.loss):
            result.first_nonfinite_module = self.locate(step.micro_batches)
        first = batches_consumed - self.gradient_accumulation_steps
        logger.warning(
            "step %d: non-finite loss %s / grad norm %s, update skipped (%d in a row, %d in "
            "total); data: micro-batches [%d, %d) of dp rank %d; first non-finite gradient on "
            "rank %d: %s%s",
            state.step, result.loss, result.grad_norm, state.consecutive_nan_skips,
            state.nan_skips, first, batches_consumed, self.parallel.dp_rank, self.parallel.rank,
            result.first_nonfinite_param or "none",
            f"; the forward turns non-finite in {result.first_nonfinite_module}"
            if result.first_nonfinite_module else "",
        )
        if state.consecutive_nan_skips < self.max_in_a_row:
            return Outcome.SKIPPED
        return Outcome.RELOADED if self.recover else Outcome.STOPPED

    def streak(self, state) -> str:
        """The end of a streak, in words, for the stop's error and the reload's warning."""
        return (f"{state.consecutive_nan_skips} consecutive steps had a non-finite loss or "
                f"gradient (training.max_consecutive_nan_steps = {self.max_in_a_row}), at step {state.step}")

    def locate(self, micro_batches: list[dict[str, torch.Tensor]]) -> str | None:
        """After a non-finite loss (a global decision, so every rank is here): run the forward of
        this rank's micro-batches again, with hooks, until one turns non-finite; the answer names
        the first rank that found one."""
        found = None
        for batch in micro_batches:
            with value_checks_off():
                found = first_nonfinite_module(self.model, lambda: self.forward(batch))
            if found is not None:
                break
        if self.parallel.fsdp:
            # the search may run before a queued update: the next forward gathers the new weights
            self.model.reshard()
        if not self.parallel.distributed or self.parallel.world_size == 1:
            return found
        gathered: list[str | None] = [None] * self.parallel.world_size
        dist.all_gather_object(gathered, found)
        return next((f"{name} on rank {rank}" for rank, name in enumerate(gathered) if name), None)
