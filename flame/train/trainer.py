"""The flame trainer: config in; trained model, metrics and checkpoints out.

`Trainer(cfg).train()` reads like the story of a run: set up the processes, build tokenizer, data,
model, optimizer, LR schedule and checkpointer, resume if there is something to resume, then step.
One optimizer step = `gradient_accumulation_steps` micro-batches on each data-parallel rank; its
objective is the token-mean cross-entropy over every valid token of the step, on all ranks (see
`flame.train.loss`).

Preemption safety lives in its own modules and meets the loop at a few marked places: the
dump-folder lock (`flame.train.run_lock`, taken in `__init__`), the stop signals and the per-step
boundary decision (`flame.train.preemption`), the collective-failure message
(`flame.train.parallel.collective_failure`) and the test-only fault hooks
(`flame.train.fault_injection`).
"""

from __future__ import annotations

import logging
import math
import pickle
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flame.train import fault_injection
from flame.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelState,
    OptimizerState,
    load_exported_weights,
)
from flame.train.gradients import GradNorms, clip_grad_norm
from flame.train.loss import IGNORE_INDEX, count_valid_tokens
from flame.train.lr_schedule import build_lr_scheduler
from flame.train.metrics import MetricsLogger
from flame.train.mixed_precision import ComputeWeights, add_gradients
from flame.train.optimizer import build_optimizer
from flame.train.parallel import (ParallelState, autocast, collective_failure, compute_weights_dtype,
                                  cuda_graphs_enabled, parallelize, setup_parallel)
from flame.train.preemption import Preempted, StepBoundary, StopSignals
from flame.train.readback import DeviceScalars
from flame.train.run_lock import RunLock, lock_dump_folder

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


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    valid_tokens: int
    skipped: bool
    first_nonfinite_param: str | None = None
    first_nonfinite_module: str | None = None  # set when the loss itself is non-finite
    reloaded: bool = False
    """This step ended a non-finite streak by reloading the last good checkpoint
    (training.nan_recovery): the trainer's state is that checkpoint's, not this step's."""


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
    """The update is queued behind the device-side finite check (fused AdamW skips it when the
    loss or the gradient norm is not finite); otherwise `resolve_step` applies it after reading
    the numbers."""


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"training.device must be 'auto', 'cuda' or 'cpu', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device = 'cuda' but no CUDA device is available")
    return torch.device(name)


class _StdoutHandler(logging.StreamHandler):
    """A StreamHandler that writes to sys.stdout as it is when a record is emitted, not as it was when
    the handler was made (as logging's own last-resort handler does for stderr): a process that swaps
    sys.stdout (a test's capture, a notebook) must not leave the handler on a closed stream."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(rank: int = 0) -> None:
    """Console logging: rank 0 at INFO, other ranks only warnings (prefixed with their rank)."""
    flame_logger = logging.getLogger("flame")
    if not flame_logger.handlers:
        handler = _StdoutHandler()
        prefix = f"[rank{rank}] " if rank else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
        flame_logger.addHandler(handler)
        flame_logger.propagate = False
    flame_logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


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


@contextmanager
def op_value_checks_off():
    """Switch off the ops' value checks (a device sync each, and an exception on a NaN decay)
    while training: the trainer's own finite check, once per step, handles non-finite values."""
    from flame.ops.checks import set_value_checks, value_checks_enabled

    previous = value_checks_enabled()
    set_value_checks(False)
    try:
        yield
    finally:
        set_value_checks(previous)


class Trainer:
    def __init__(self, cfg, *, dataloader=None, model_factory=None):
        """`dataloader`: an already built training loader (else built from cfg.data).
        `model_factory(cfg.model)`: builds the model in place of `flame.models.build_model` (it runs
        under the meta device and gets the same parallelisation, initialisation, loss and optimizer);
        the model follows `flame.models.CausalLM`'s contract: `layers`, `init_weights()`,
        `num_flops_per_token(seq_len)` and the forward's signature (logits without labels; with
        `labels=` and `loss_scale=`, the scaled CE sum over valid tokens, the training loss)."""
        from flame.config import to_toml
        from flame.data import load_tokenizer

        self.cfg = cfg
        training = cfg.training

        # 1. the processes: device, ranks and mesh, seed, dump folder
        self.parallel: ParallelState = setup_parallel(cfg, resolve_device(training.device))
        self.device = self.parallel.device
        self.rank = self.parallel.rank
        setup_logging(self.rank)
        self.seed_everything()
        self.dump_folder = Path(cfg.job.dump_folder)
        # preemption safety: one run per dump folder (rank 0 holds the lock; a refusal stops all)
        self.run_lock = RunLock(self.dump_folder, cfg.job.name, force=cfg.job.force_unlock)
        lock_dump_folder(self.run_lock, self.parallel)
        if self.rank == 0:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / "config.toml").write_text(to_toml(cfg))
        logger.info("job %s: dump folder %s, %d process(es) on %s", cfg.job.name,
                    self.dump_folder, self.parallel.world_size, self.device)

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

        # 3. model: built on the meta device, parallelised, materialised, initialised
        self.cuda_graphs = cuda_graphs_enabled(cfg, self.parallel)
        self.model = self.build_model(model_factory)
        self.autocast = autocast(cfg, self.parallel)
        self.trainable_params = [p for p in self.model.parameters() if p.requires_grad]
        # one rank: the step's gradients, one fp32 buffer per trainable parameter (`backward`), and
        # under mixed precision the matrices' compute copies, which the model calls run on
        self.grad_buffers = [] if self.parallel.fsdp else [torch.empty_like(p) for p in self.trainable_params]
        self.compute_weights = ComputeWeights(self.model, compute_weights_dtype(cfg, self.parallel))
        self.grad_targets = self.compute_weights.grad_targets(self.trainable_params)

        # 4. optimizer, LR schedule, checkpoints (and a resume when there is one)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        # fused AdamW skips an update on a device flag, so a step's update is queued before its
        # numbers are read and the host runs ahead of the device
        self.fused_optimizer = cfg.optimizer.implementation == "fused"
        self.reloads = 0  # checkpoint reloads after non-finite streaks (training.nan_recovery)
        self.log_window = (time.perf_counter(), 0, 0)  # start, valid tokens, steps since the last log
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, cfg.lr_scheduler, training.steps, cfg.optimizer.lr
        )
        self.checkpointer = CheckpointManager(cfg.checkpoint, str(self.dump_folder))
        self.state = TrainState(dp_world_size=self.parallel.dp_world_size)
        self.resume()
        # preemption safety: stop signals (handled while train() runs), the per-step decision
        self.stop_signals = StopSignals(cfg.training.stop_signals)
        self.boundary = StepBoundary(self.parallel, self.stop_signals, self.checkpointer,
                                     cfg.parallel.collective_timeout_minutes)

        # 5. metrics (a resumed run continues its wandb run)
        self.metrics = MetricsLogger(
            str(self.dump_folder), cfg.metrics, enabled=self.rank == 0, run_name=cfg.job.name,
            config_dict=asdict(cfg), wandb_run_id=self.state.wandb_run_id or None,
        )
        self.state.wandb_run_id = self.broadcast_object(self.metrics.wandb_run_id or "")
        self.flops_per_token, self.peak_flops = self.flops_budget()

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
                torch.use_deterministic_algorithms(True)

    def build_dataloader(self, split: str):
        """This rank's loader of the "train" split or of the held-out "validation" split."""
        from flame.data import build_dataloader

        cfg = self.cfg
        return build_dataloader(
            dataset=cfg.data.dataset,
            data_files=cfg.data.data_files,
            text_field=cfg.data.text_field,
            name=cfg.data.name,
            dataset_split=cfg.data.split,
            streaming=cfg.data.streaming,
            val_fraction=cfg.data.val_fraction,
            num_workers=cfg.data.num_workers,
            sources=cfg.data.sources,
            probs=cfg.data.probs,
            context_len=cfg.data.context_len,
            shard_dir=cfg.data.shard_dir,
            allow_dp_resplit=cfg.data.allow_dp_resplit,
            varlen=cfg.training.varlen,
            tokenizer=self.tokenizer,
            batch_size=cfg.training.batch_size,
            seq_len=cfg.training.seq_len,
            split=split,
            seed=cfg.job.seed,
            dp_rank=self.parallel.dp_rank,
            dp_world_size=self.parallel.dp_world_size,
        )

    def build_model(self, model_factory=None) -> torch.nn.Module:
        from flame.models import build_model

        logger.info("model: building %s on the meta device ...", self.cfg.model.family)
        start = time.monotonic()
        with torch.device("meta"):
            model = (model_factory or build_model)(self.cfg.model)
        model = parallelize(model, self.cfg, self.parallel, self.cuda_graphs)
        # materialise in place (swap each parameter's contents, keep the Parameter objects), so that a
        # tied head and embedding stay one parameter; a plain to_empty gives each module a new one
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to_empty(device=self.device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        torch.manual_seed(self.cfg.job.seed)  # the same full init on every rank and any sharding
        with torch.no_grad():
            model.init_weights()
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        logger.info("model: %s, %.2fM parameters, ready in %.1fs", self.cfg.model.family,
                    num_params / 1e6, time.monotonic() - start)
        return model

    def flops_budget(self) -> tuple[int, float]:
        """(training FLOPs per token, peak FLOP/s of one device; 0 when unknown, e.g. on CPU)."""
        flops = int(self.model.num_flops_per_token(self.cfg.training.seq_len))
        peak = 0.0
        if self.device.type == "cuda":
            from torchtitan.tools.utils import get_peak_flops

            peak = get_peak_flops(torch.cuda.get_device_name(self.device))
        return flops, peak

    # ---- the loop ------------------------------------------------------------------------

    def train(self, stop_at_step: int | None = None) -> TrainState:
        """Run the step loop to training.steps (or to `stop_at_step`, as if killed there).

        A stop signal (training.stop_signals) on any rank ends it at the next step boundary, the
        same step on every rank, after a checkpoint there: `Preempted` is raised."""
        cfg = self.cfg
        total_steps = cfg.training.steps
        last_step = total_steps if stop_at_step is None else min(stop_at_step, total_steps)
        logger.info(
            "training: steps %d -> %d, batch %d x GA %d x DP %d, seq_len %d",
            self.state.step, total_steps, cfg.training.batch_size,
            cfg.training.gradient_accumulation_steps, self.parallel.dp_world_size,
            cfg.training.seq_len,
        )
        self.log_window = (time.perf_counter(), 0, 0)
        # preemption safety: the folder lock, the stop signals' handlers, test faults
        lock_dump_folder(self.run_lock, self.parallel)
        fault_injection.arm(self)
        self.stop_signals.install()
        try:
            for result in self.run_steps(last_step):
                self.after_step(result)
            self.checkpointer.wait()
        except RuntimeError as err:  # preemption safety: a rank died or hangs; name the step
            failure = collective_failure(err, self.parallel, self.state.step, cfg.parallel)
            if failure is None:
                raise
            raise failure from err
        finally:
            self.metrics.close()
            self.stop_signals.restore()
            self.boundary.close()
            if self.rank == 0:
                self.run_lock.release()
        logger.info("training: done at step %d, %d tokens, %d skipped step(s)",
                    self.state.step, self.state.tokens, self.state.nan_skips)
        return self.state

    def run_steps(self, last_step: int):
        """Step until `last_step`, yielding each step's result once its numbers are read.

        Step N+1's forward and backward are queued before step N's numbers are read, so the
        host's per-step work (gathering, clipping, the optimizer's launches, the next batch)
        overlaps the device's work instead of idling it. The loop pauses (reads a step's numbers
        before queuing the next) where the next step must see exactly this step's weights: before
        a validation or a checkpoint, and at the end; and after every step when the optimizer
        cannot skip an update on its own (not fused); and after a step that a stop signal or a
        timed checkpoint ends, as every rank decides while the step runs (`StepBoundary`)."""
        pending: LaunchedStep | None = None
        while self.state.step + (pending is not None) < last_step:
            step, previous = self.launch_step(self.next_micro_batches(), pending)
            pending = None
            if previous is not None:
                yield previous
            # preemption safety: stop or save after this step? (one host all-reduce, every rank alike)
            decision = self.boundary.decide(self.state.step + 1)
            if step.update_queued and not (decision.stop or decision.save_due
                                           or self.pauses_after(self.state.step + 1, last_step)):
                pending = step
            else:
                yield self.resolve_step(step)

    def pauses_after(self, step: int, last_step: int) -> bool:
        """Whether the loop reads step `step`'s numbers before queuing the next step: at the
        end, and before a validation or a checkpoint, which must see exactly that step's weights."""
        val_freq = self.cfg.metrics.val_freq
        return (step >= last_step or (val_freq > 0 and step % val_freq == 0)
                or self.checkpointer.should_save(step, self.cfg.training.steps))

    def after_step(self, result: StepResult) -> None:
        """Logs, validation and checkpoints after step `self.state.step`, whose result this is."""
        cfg = self.cfg
        step, total_steps = self.state.step, cfg.training.steps
        start, tokens, steps = self.log_window
        tokens, steps = tokens + result.valid_tokens, steps + 1
        if step % max(1, cfg.metrics.log_freq) == 0 or step == total_steps or result.skipped:
            self.log_step(result, tokens, time.perf_counter() - start, steps)
            self.log_window = (time.perf_counter(), 0, 0)
        else:
            self.log_window = (start, tokens, steps)
        if result.reloaded:
            # the state is the reloaded checkpoint's, and the next step may already be queued:
            # no validation or checkpoint for this step
            return
        if cfg.metrics.val_freq > 0 and step % cfg.metrics.val_freq == 0:
            self.log_validation()
        # preemption safety: the decision taken while this step ran (run_steps)
        decision = self.boundary.decision_for(step)
        if self.checkpointer.should_save(step, total_steps, time_due=decision.save_due,
                                         stopping=decision.stop):
            self.save_checkpoint(required=decision.stop or step == total_steps)
        if decision.stop and step < total_steps:
            self.checkpointer.wait()
            saved = self.checkpointer.step_dir(step) if cfg.checkpoint.enable else None
            raise Preempted(step, decision.signal_name, saved)

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

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """Compute the gradients of the step objective: after it, each trainable parameter's .grad
        holds the sum of the micro-batches' gradients (`backward`), whatever it held before.

        Returns (this rank's share of the step loss, as a device tensor; the step's valid-token
        count over all micro-batches and ranks). That count is known before the first forward, so
        each micro-batch divides its CE sum by it.
        """
        valid_tokens = self.parallel.all_reduce_count(count_valid_tokens(micro_batches))
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.parallel.fsdp:
            self.zero_grad()
        elif not micro_batches and self.grad_buffers:
            torch._foreach_zero_(self.grad_buffers)
        with self.compute_weights.active():  # refreshed once for all micro-batches
            for index, batch in enumerate(micro_batches):
                loss = self.loss(batch, 1.0 / max(valid_tokens, 1))
                self.backward(loss, first=index == 0)
                loss_sum += loss.detach()
                del loss
        if not self.parallel.fsdp:
            for param, buffer in zip(self.trainable_params, self.grad_buffers):
                param.grad = buffer
        return loss_sum, valid_tokens

    def backward(self, loss: torch.Tensor, first: bool) -> None:
        """Add one micro-batch's gradients to the step's; `first`: the step's first micro-batch.

        Under FSDP, `loss.backward()`: FSDP's hooks reduce-scatter each gradient and accumulate the
        shards in .grad. On one rank, `torch.autograd.grad` returns the micro-batch's gradients
        (of the compute copies, for the matrices under mixed precision) and foreach ops put them
        into `grad_buffers`, fp32 buffers allocated once (`add_gradients`): the first micro-batch
        copies into them, so they need no zeroing and nothing of an earlier step survives; later
        ones add. Autograd's own accumulation into .grad would be one add kernel per parameter
        and micro-batch plus a memset of every gradient per step, and under CUDA graphs .grad has
        to be a buffer of its own anyway: a compiled block's gradient output lives in the graphs'
        memory pool, where the next micro-batch's replay overwrites it (the copy here is queued
        before that replay)."""
        if self.parallel.fsdp:
            loss.backward()
            return
        grads = torch.autograd.grad(loss, self.grad_targets, allow_unused=True)
        add_gradients(self.grad_buffers, list(grads), first)

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
        (the full logits are never held; RWKV7's L2Wrap, when the model has it, is in the gradient)."""
        input_ids, labels, cu_seqlens = self.model_inputs(batch)
        self.begin_model_call()
        with self.compute_weights.active(), self.autocast():
            return self.model(input_ids, cu_seqlens=cu_seqlens, labels=labels, loss_scale=scale)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, labels) of a micro-batch: the plain head, for the non-finite search, whose
        hooks then see the head's output too."""
        input_ids, labels, cu_seqlens = self.model_inputs(batch)
        self.begin_model_call()
        with self.compute_weights.active(), self.autocast():
            return self.model(input_ids, cu_seqlens=cu_seqlens), labels

    def begin_model_call(self) -> None:
        """Under CUDA graphs, tell the graphs that a new forward begins: the outputs of the previous
        micro-batch's replays (whose backward has run) may be overwritten."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def zero_grad(self) -> None:
        """End the step's gradients: every parameter's .grad back to None. Under FSDP that frees
        the gradient shards, and the next backward starts new ones. On one rank `grad_buffers`
        keep the memory, which the next `forward_backward` overwrites, so nothing is zeroed; .grad
        is None in between so that nothing reads a finished step's gradients as current (DCP's
        optimizer state_dict, for one, skips initialising an empty optimizer state when
        gradients are present)."""
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over `micro_batches`, this rank's share of the global batch, with
        its numbers read before it returns."""
        step, _ = self.launch_step(micro_batches)
        return self.resolve_step(step)

    def launch_step(self, micro_batches: list[dict[str, torch.Tensor]],
                    previous: LaunchedStep | None = None) -> tuple[LaunchedStep, StepResult | None]:
        """Queue one optimizer step: forward and backward, the gradient norm and clipping, and,
        with fused AdamW, the update behind a device-side finite check. With `previous`, that
        step's numbers are read (`resolve_step`) once this step's backward is queued, and before
        this step's update, whose LR depends on whether the previous one was skipped.
        Returns (this step, the previous step's result or None)."""
        with op_value_checks_off():
            loss_sum, valid_tokens = self.forward_backward(micro_batches)
        previous_result = None
        if previous is not None:
            previous_result = self.resolve_step(previous)
            if previous_result.reloaded:
                # the previous step's non-finite streak reloaded a checkpoint: this step's
                # gradients belong to the weights before the reload, so they are computed again
                with op_value_checks_off():
                    loss_sum, valid_tokens = self.forward_backward(micro_batches)
        max_norm = self.cfg.training.max_norm
        norms = self.clip_grad_norm(max_norm if max_norm > 0 else math.inf)
        loss = self.parallel.all_reduce_sum(loss_sum)
        numbers = DeviceScalars(loss, norms.total)
        lr = self.current_lr()
        queued = self.fused_optimizer and valid_tokens > 0
        if queued:
            finite = torch.isfinite(loss) & torch.isfinite(norms.total)
            self.optimizer.found_inf = (~finite).float()  # read by fused AdamW: skip the update
            try:
                self.optimizer.step()
            finally:
                self.optimizer.found_inf = None
            self.zero_grad()
        return LaunchedStep(micro_batches, norms, numbers, valid_tokens, lr, queued), previous_result

    def resolve_step(self, step: LaunchedStep) -> StepResult:
        """Read a launched step's loss and gradient norm (the one host sync of a step, which waits
        for those two numbers, not for the work queued after them), apply its
        update if it is not queued yet, and count it: a step whose loss or gradient norm is not
        finite is skipped on every rank (both numbers are global) and the LR schedule stays."""
        loss_value, norm_value = step.numbers.values()
        self.state.step += 1
        finite = math.isfinite(loss_value) and math.isfinite(norm_value) and step.valid_tokens > 0
        culprit = module = None
        if finite:
            if not step.update_queued:
                self.optimizer.step()
            self.lr_scheduler.step()
            self.state.consecutive_nan_skips = 0
            self.state.tokens += step.valid_tokens
        else:
            culprit = step.norms.first_nonfinite()
            if not math.isfinite(loss_value):
                module = self.locate_nonfinite_forward(step.micro_batches)
            self.state.nan_skips += 1
            self.state.consecutive_nan_skips += 1
        if not step.update_queued:
            self.zero_grad()
        result = StepResult(loss_value, norm_value, step.lr, step.valid_tokens, not finite, culprit, module)
        if not finite:
            reloads = self.reloads
            self.handle_nonfinite(result)
            result.reloaded = self.reloads != reloads
        return result

    def locate_nonfinite_forward(self, micro_batches: list[dict[str, torch.Tensor]]) -> str | None:
        """After a non-finite loss (a global decision, so every rank is here): run the forward of
        this rank's micro-batches again, with hooks, until one turns non-finite; the answer names
        the first rank that found one. Costs one extra forward, on non-finite steps only."""
        found = None
        for batch in micro_batches:
            with op_value_checks_off():
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

    def clip_grad_norm(self, max_norm: float) -> GradNorms:
        """Clip to `max_norm` by the global norm over all shards; returns the norms before."""
        return clip_grad_norm(self.model.named_parameters(), max_norm, self.parallel.shard_group)

    # ---- non-finite steps ----------------------------------------------------------------

    def handle_nonfinite(self, result: StepResult) -> None:
        first = self.batches_consumed - self.cfg.training.gradient_accumulation_steps
        logger.warning(
            "step %d: non-finite loss %s / grad norm %s, update skipped (%d in a row, %d in "
            "total); data: micro-batches [%d, %d) of dp rank %d; first non-finite gradient on "
            "rank %d: %s%s",
            self.state.step, result.loss, result.grad_norm, self.state.consecutive_nan_skips,
            self.state.nan_skips, first, self.batches_consumed, self.parallel.dp_rank, self.rank,
            result.first_nonfinite_param or "none",
            f"; the forward turns non-finite in {result.first_nonfinite_module}"
            if result.first_nonfinite_module else "",
        )
        limit = self.cfg.training.max_consecutive_nan_steps
        if self.state.consecutive_nan_skips < limit:
            return
        message = (
            f"{self.state.consecutive_nan_skips} consecutive steps had a non-finite loss or "
            f"gradient (training.max_consecutive_nan_steps = {limit}), at step {self.state.step}"
        )
        if not self.cfg.training.nan_recovery:
            self.checkpointer.wait()
            complete = self.checkpointer.complete_steps()
            last = complete[-1] if complete else None
            if last is None:
                where = (f"no checkpoint was written to {self.checkpointer.folder} (checkpoint.enable "
                         f"= {str(self.cfg.checkpoint.enable).lower()})")
            else:
                where = (f"the last good checkpoint, {self.checkpointer.step_dir(last)}, is intact (set "
                         f"training.nan_recovery = true to reload it and skip this data)")
            raise NonFiniteTrainingError(f"{message}. Stopping; {where}.")
        self.recover_from_nonfinite(message)

    def recover_from_nonfinite(self, message: str) -> None:
        """Reload the last good checkpoint but keep the data position: the bad window is skipped."""
        self.checkpointer.wait()
        step = self.checkpointer.resume_step()
        if step is None:
            raise NonFiniteTrainingError(f"{message}; no checkpoint to recover from")
        skips = self.state.nan_skips
        data_state = self.dataloader.state_dict() if hasattr(self.dataloader, "state_dict") else None
        consumed = self.batches_consumed
        self.load_full_checkpoint(self.checkpointer.step_dir(step))
        self.reloads += 1
        if data_state is not None:
            self.dataloader.load_state_dict(data_state)
            self.batches = iter(self.dataloader)
        self.batches_consumed = consumed
        self.state.nan_skips = skips
        self.state.consecutive_nan_skips = 0
        logger.warning("%s; recovered: reloaded step %d, training continues after the data that "
                       "caused it (micro-batch %d)", message, step, consumed)

    # ---- validation ----------------------------------------------------------------------

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
            with op_value_checks_off():
                totals[0] += self.loss(batch, 1.0).double()
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

    # ---- logging -------------------------------------------------------------------------

    def current_lr(self) -> float:
        group = self.optimizer.param_groups[0]
        return group["lr"] / group.get("lr_multiplier", 1.0)

    def log_step(self, result: StepResult, window_tokens: int, elapsed: float,
                 window_steps: int) -> None:
        tokens_per_s = window_tokens / max(elapsed, 1e-9)
        per_device = tokens_per_s / self.parallel.world_size
        step_time = elapsed / max(window_steps, 1)
        record: dict[str, Any] = {
            "step": self.state.step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": self.state.tokens,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "step_time_s": step_time,
            "eta_s": step_time * (self.cfg.training.steps - self.state.step),
            "nan_skips": self.state.nan_skips,
        }
        if self.peak_flops > 0:
            record["mfu"] = self.flops_per_token * per_device / self.peak_flops
        if result.skipped:
            record["skipped"] = True
        if self.device.type == "cuda":
            record["memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.metrics.log(record)

    def broadcast_object(self, value):
        """Rank 0's value of a small picklable object, on every rank."""
        if not self.parallel.distributed or self.parallel.world_size == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    # ---- checkpoints ---------------------------------------------------------------------

    def checkpoint_state(self, model_only: bool = False) -> dict[str, Any]:
        """The objects a checkpoint holds; DCP reads or fills them in place."""
        state: dict[str, Any] = {"model": ModelState(self.model)}
        if model_only:
            return state
        train_state = asdict(self.state)
        train_state["lr_scheduler_last_epoch"] = self.lr_scheduler.last_epoch
        state["optimizer"] = OptimizerState(self.model, self.optimizer)
        state["train_state"] = train_state
        rank_state = {
            "dataloader": self.dataloader.state_dict() if hasattr(self.dataloader, "state_dict") else None,
            "batches_consumed": self.batches_consumed,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        state[f"rank_{self.rank}"] = pickle.dumps(rank_state)
        return state

    def save_checkpoint(self, required: bool = False) -> None:
        """Save at this step; `required`: a failure stops the run whatever on_save_error says."""
        self.checkpointer.save(self.state.step, self.checkpoint_state(), required=required)

    def resume(self) -> None:
        """Resume from the latest complete checkpoint (or load_step); else initial_load_path."""
        ckpt = self.cfg.checkpoint
        step = self.checkpointer.resume_step() if ckpt.enable or ckpt.load_step >= 0 else None
        if step is not None:
            self.load_full_checkpoint(self.checkpointer.step_dir(step))
        elif ckpt.initial_load_path:
            from flame.export.formats import is_foreign_weights

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
                self.load_full_checkpoint(Path(ckpt.initial_load_path))

    def load_full_checkpoint(self, path: Path) -> None:
        # read the run's data-parallel size first, so that a mismatch gets a clear refusal
        header = {"train_state": {"dp_world_size": 0}}
        self.checkpointer.load(path, header)
        saved_dp = header["train_state"]["dp_world_size"]
        if saved_dp != self.parallel.dp_world_size:
            raise CheckpointError(
                f"checkpoint {path} was written with data-parallel size {saved_dp}, this run has "
                f"{self.parallel.dp_world_size}: its data position and optimizer state cannot be "
                f"resumed. Start a new run from its weights instead, with "
                f"checkpoint.initial_load_path = \"{path}\" and "
                f"checkpoint.initial_load_model_only = true."
            )
        state = self.checkpoint_state()
        self.checkpointer.load(path, state)
        train_state = dict(state["train_state"])
        last_epoch = train_state.pop("lr_scheduler_last_epoch")
        self.state = TrainState(**train_state)
        self.set_lr_schedule_position(last_epoch)
        rank_state = pickle.loads(state[f"rank_{self.rank}"])
        if rank_state["dataloader"] is not None:
            self.dataloader.load_state_dict(rank_state["dataloader"])
            self.batches = iter(self.dataloader)
        self.batches_consumed = rank_state["batches_consumed"]
        torch.set_rng_state(rank_state["rng"])
        if rank_state["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rank_state["cuda_rng"], self.device)
        logger.info("resumed from %s: step %d, %d tokens seen", path, self.state.step,
                    self.state.tokens)

    def set_lr_schedule_position(self, last_epoch: int) -> None:
        """Put the LR schedule at `last_epoch` updates and set every group's LR accordingly."""
        scheduler = self.lr_scheduler
        scheduler.last_epoch = last_epoch
        scheduler._step_count = last_epoch + 1
        lrs = [base * fn(last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs
