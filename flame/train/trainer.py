"""The flame trainer: config in, trained model, metrics and checkpoints out.

`Trainer(cfg).train()` reads like the story of a run: set up the process, build tokenizer, data,
model, optimizer, LR schedule and checkpointer, resume if there is something to resume, then step.
One optimizer step = `gradient_accumulation_steps` micro-batches; its objective is the token-mean
cross-entropy over every valid token of the step (see `flame.train.loss`).
"""

from __future__ import annotations

import logging
import math
import pickle
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flame.train.checkpoint import CheckpointError, CheckpointManager, ModelState, OptimizerState
from flame.train.loss import count_valid_tokens, micro_batch_loss
from flame.train.lr_schedule import build_lr_scheduler
from flame.train.metrics import MetricsLogger, format_duration
from flame.train.optimizer import build_optimizer

logger = logging.getLogger("flame.train")


@dataclass
class TrainState:
    """Counters that a checkpoint carries across a restart."""

    step: int = 0
    """Optimizer steps taken (skipped non-finite steps included)."""
    tokens: int = 0
    """Valid tokens seen over all ranks."""
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


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("training.device = 'cuda' but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"training.device must be 'auto', 'cuda' or 'cpu', got {name!r}")
    return torch.device(name)


def setup_logging(rank: int = 0) -> None:
    """Console logging for the trainer: rank 0 at INFO, other ranks only warnings."""
    flame_logger = logging.getLogger("flame")
    if flame_logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank{rank}] " if rank else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
    flame_logger.addHandler(handler)
    flame_logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    flame_logger.propagate = False


def first_nonfinite_grad(model: torch.nn.Module) -> str | None:
    """Name of the first parameter whose (local) gradient holds a NaN or Inf."""
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if not bool(torch.isfinite(local).all()):
            return name
    return None


class Trainer:
    def __init__(self, cfg):
        from flame.config import to_toml
        from flame.data import load_tokenizer

        self.cfg = cfg
        training = cfg.training

        # 1. the process: device, rank, seed, dump folder
        self.device = resolve_device(training.device)
        self.rank, self.world_size = 0, 1
        self.dp_rank, self.dp_world_size = 0, 1
        setup_logging(self.rank)
        torch.manual_seed(cfg.job.seed)
        self.dump_folder = Path(cfg.job.dump_folder)
        if self.rank == 0:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / "config.toml").write_text(to_toml(cfg))
        logger.info("job %s: dump folder %s, device %s", cfg.job.name, self.dump_folder, self.device)

        # 2. tokenizer and data
        logger.info("data: loading tokenizer and dataset %s ...", cfg.data.dataset)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.tokenizer.check_vocab_size(cfg.model.vocab_size)
        self.dataloader = self.build_dataloader("train")
        self.batches = iter(self.dataloader)

        # 3. model: built on the meta device, then materialised and initialised
        self.model = self.build_model()
        num_params = sum(p.numel() for p in self.model.parameters())
        logger.info("model: %s, %.2fM parameters", cfg.model.family, num_params / 1e6)
        self.l2wrap = None
        if cfg.model.family == "rwkv7" and cfg.model.l2wrap:
            from flame.models import l2wrap

            self.l2wrap = l2wrap

        # 4. optimizer, LR schedule, checkpoints
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, cfg.lr_scheduler, training.steps, cfg.optimizer.lr
        )
        self.checkpointer = CheckpointManager(cfg.checkpoint, str(self.dump_folder))
        self.state = TrainState(dp_world_size=self.dp_world_size)
        self.batches_consumed = 0
        self.resume()

        # 5. metrics
        self.metrics = MetricsLogger(
            str(self.dump_folder), cfg.metrics, enabled=self.rank == 0, run_name=cfg.job.name,
            config_dict=asdict(cfg), wandb_run_id=self.state.wandb_run_id or None,
        )
        if self.metrics.wandb_run_id:
            self.state.wandb_run_id = self.metrics.wandb_run_id

    # ---- building ------------------------------------------------------------------------

    def build_dataloader(self, split: str):
        """This rank's loader of the "train" or the held-out "validation" split."""
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
            varlen=cfg.training.varlen,
            tokenizer=self.tokenizer,
            batch_size=cfg.training.batch_size,
            seq_len=cfg.training.seq_len,
            split=split,
            seed=cfg.job.seed,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
        )

    def build_model(self) -> torch.nn.Module:
        from flame.models import build_model

        with torch.device("meta"):
            model = build_model(self.cfg.model)
        model.to_empty(device=self.device)
        torch.manual_seed(self.cfg.job.seed)
        with torch.no_grad():
            model.init_weights()
        model.train()
        return model

    # ---- the loop ------------------------------------------------------------------------

    def train(self, stop_at_step: int | None = None) -> TrainState:
        """Run the step loop to training.steps (or to `stop_at_step`, as if killed there)."""
        cfg = self.cfg
        total_steps = cfg.training.steps
        last_step = total_steps if stop_at_step is None else min(stop_at_step, total_steps)
        log_freq = max(1, cfg.metrics.log_freq)
        logger.info(
            "training: steps %d, batch %d x GA %d x DP %d, seq_len %d",
            total_steps, cfg.training.batch_size, cfg.training.gradient_accumulation_steps,
            self.dp_world_size, cfg.training.seq_len,
        )
        window_start, window_tokens, window_loss, window_steps = time.perf_counter(), 0, 0.0, 0
        try:
            while self.state.step < last_step:
                result = self.train_step(self.next_micro_batches())
                window_tokens += result.valid_tokens
                window_steps += 1
                if not result.skipped:
                    window_loss = result.loss
                step = self.state.step
                if step % log_freq == 0 or step == total_steps or result.skipped:
                    elapsed = time.perf_counter() - window_start
                    self.log_step(result, window_tokens, elapsed, window_steps, total_steps)
                    window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
                if self.checkpointer.should_save(step, total_steps):
                    self.save_checkpoint()
            self.checkpointer.wait()
        finally:
            self.metrics.close()
        logger.info("training done: %d steps, %d tokens, %d skipped steps",
                    self.state.step, self.state.tokens, self.state.nan_skips)
        return self.state

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of the next optimizer step (restarting the data at its end)."""
        micro_batches = []
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            try:
                batch = next(self.batches)
            except StopIteration:
                logger.info("data: end of the dataset, starting a new pass")
                self.batches = iter(self.dataloader)
                batch = next(self.batches)
            micro_batches.append(batch)
        self.batches_consumed += len(micro_batches)
        return micro_batches

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """Accumulate the gradients of the step objective; returns (this rank's loss share, the
        step's valid-token count over all ranks).

        The normaliser, the valid tokens of the whole step over all micro-batches and ranks, is
        counted before the first forward, so every micro-batch divides its CE sum by it.
        """
        valid_tokens = self.all_reduce_count(count_valid_tokens(micro_batches))
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for batch in micro_batches:
            input_ids = batch["input_ids"].to(self.device, non_blocking=True)
            labels = batch["labels"].to(self.device, non_blocking=True)
            cu_seqlens = batch.get("cu_seqlens")
            if cu_seqlens is not None:
                cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)
            logits = self.model(input_ids, cu_seqlens=cu_seqlens)
            loss = micro_batch_loss(logits, labels, max(valid_tokens, 1), self.l2wrap)
            loss.backward()
            loss_sum += loss.detach()
            del logits, loss
        return loss_sum, valid_tokens

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over `micro_batches` (this rank's share of the global batch)."""
        loss_sum, valid_tokens = self.forward_backward(micro_batches)
        max_norm = self.cfg.training.max_norm
        grad_norm = self.clip_grad_norm(max_norm if max_norm > 0 else math.inf)
        loss_global = self.all_reduce_sum(loss_sum)
        # the one host sync of the step: both numbers for logging and the finite check
        loss_value, norm_value = torch.stack([loss_global, grad_norm.float()]).tolist()

        lr = self.current_lr()
        self.state.step += 1
        finite = math.isfinite(loss_value) and math.isfinite(norm_value) and valid_tokens > 0
        if finite:
            self.optimizer.step()
            self.lr_scheduler.step()
            self.state.consecutive_nan_skips = 0
            self.state.tokens += valid_tokens
            culprit = None
        else:
            culprit = first_nonfinite_grad(self.model)
            self.state.nan_skips += 1
            self.state.consecutive_nan_skips += 1
        self.optimizer.zero_grad(set_to_none=True)
        result = StepResult(loss_value, norm_value, lr, valid_tokens, not finite, culprit)
        if not finite:
            self.handle_nonfinite(result)
        return result

    def handle_nonfinite(self, result: StepResult) -> None:
        first = self.batches_consumed - self.cfg.training.gradient_accumulation_steps
        logger.warning(
            "step %d: non-finite loss %s / grad norm %s; update skipped (%d in a row, %d total); "
            "data micro-batches [%d, %d) of rank %d; first non-finite gradient: %s",
            self.state.step, result.loss, result.grad_norm, self.state.consecutive_nan_skips,
            self.state.nan_skips, first, self.batches_consumed, self.rank,
            result.first_nonfinite_param or "none on this rank",
        )
        limit = self.cfg.training.max_consecutive_nan_steps
        if self.state.consecutive_nan_skips >= limit:
            raise NonFiniteTrainingError(
                f"{self.state.consecutive_nan_skips} consecutive steps had a non-finite loss or "
                f"gradient (training.max_consecutive_nan_steps = {limit}); stopping at step "
                f"{self.state.step}. The last good checkpoint is left intact in "
                f"{self.checkpointer.folder}."
            )

    # ---- distributed reductions (single process: identities) ------------------------------

    def all_reduce_count(self, count: int) -> int:
        return count

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        from torchtitan.distributed.utils import clip_grad_norm_

        return clip_grad_norm_(
            [p for p in self.model.parameters() if p.grad is not None], max_norm, foreach=True
        )

    # ---- logging -------------------------------------------------------------------------

    def current_lr(self) -> float:
        group = self.optimizer.param_groups[0]
        return group["lr"] / group.get("lr_multiplier", 1.0)

    def log_step(self, result: StepResult, window_tokens: int, elapsed: float,
                 window_steps: int, total_steps: int) -> None:
        tokens_per_s = window_tokens / max(elapsed, 1e-9)
        step_time = elapsed / max(window_steps, 1)
        record: dict[str, Any] = {
            "step": self.state.step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": self.state.tokens,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "step_time_s": step_time,
            "eta_s": step_time * (total_steps - self.state.step),
            "nan_skips": self.state.nan_skips,
        }
        if result.skipped:
            record["skipped"] = True
        if self.device.type == "cuda":
            record["memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.metrics.log(record)

    # ---- checkpoints ---------------------------------------------------------------------

    def checkpoint_state(self, model_only: bool = False) -> dict[str, Any]:
        state: dict[str, Any] = {"model": ModelState(self.model)}
        if model_only:
            return state
        train_state = asdict(self.state)
        train_state["lr_scheduler_last_epoch"] = self.lr_scheduler.last_epoch
        state["optimizer"] = OptimizerState(self.model, self.optimizer)
        state["train_state"] = train_state
        rank_state = {
            "dataloader": self.dataloader.state_dict(),
            "batches_consumed": self.batches_consumed,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
        }
        state[f"rank_{self.rank}"] = pickle.dumps(rank_state)
        return state

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.state.step, self.checkpoint_state())

    def resume(self) -> None:
        """Resume from the latest complete checkpoint, or start from initial_load_path."""
        ckpt = self.cfg.checkpoint
        step = self.checkpointer.resume_step() if ckpt.enable or ckpt.load_step >= 0 else None
        if step is not None:
            self.load_full_checkpoint(self.checkpointer.step_dir(step))
        elif ckpt.initial_load_path:
            if ckpt.initial_load_model_only:
                self.checkpointer.load(ckpt.initial_load_path, self.checkpoint_state(model_only=True))
                logger.info("initialised the model from %s (model only)", ckpt.initial_load_path)
            else:
                self.load_full_checkpoint(Path(ckpt.initial_load_path))

    def load_full_checkpoint(self, path: Path) -> None:
        state = self.checkpoint_state()
        # peek at the run's data-parallel size first, so a mismatch gets a clear refusal
        header = {"train_state": {"dp_world_size": 0}}
        self.checkpointer.load(path, header)
        saved_dp = header["train_state"]["dp_world_size"]
        if saved_dp != self.dp_world_size:
            raise CheckpointError(
                f"checkpoint {path} was written with data-parallel size {saved_dp}, this run has "
                f"{self.dp_world_size}: the data position and optimizer shards cannot be resumed. "
                f"Start a new run from its weights with checkpoint.initial_load_path={path} and "
                f"checkpoint.initial_load_model_only=true."
            )
        self.checkpointer.load(path, state)
        train_state = dict(state["train_state"])
        last_epoch = train_state.pop("lr_scheduler_last_epoch")
        self.state = TrainState(**train_state)
        self.lr_scheduler.last_epoch = last_epoch
        self.lr_scheduler._step_count = last_epoch + 1
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_lr()):
            group["lr"] = lr
        self.lr_scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        rank_state = pickle.loads(state[f"rank_{self.rank}"])
        self.dataloader.load_state_dict(rank_state["dataloader"])
        self.batches = iter(self.dataloader)
        self.batches_consumed = rank_state["batches_consumed"]
        torch.set_rng_state(rank_state["rng"])
        if rank_state["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rank_state["cuda_rng"])
        logger.info("resumed from %s at step %d (%d tokens seen)", path, self.state.step,
                    self.state.tokens)
