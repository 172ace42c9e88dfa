"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout: `<dump_folder>/<checkpoint.folder>/step-N/`, the DCP shards plus `COMPLETE`, a marker that
rank 0 writes only after every rank's shards and DCP's metadata are on disk. A folder without the
marker (a run killed mid-save) is ignored when resuming and removed when that step is saved again.

What a checkpoint holds (the `state` dict given to `save` / `load`):
- "model", "optimizer": `Stateful`s built on DCP's `get_state_dict` (FSDP-sharded, FQN-keyed);
- "train_state": step, tokens, NaN counters, LR-scheduler position, wandb run id, DP size;
- "rank_<r>": one rank's data-loader position and RNG states (pickled bytes), per rank.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger("flame.train")

COMPLETE_MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")

# Without torch.distributed, DCP warns that it assumes a single process: that is exactly the
# single-process run, so the warning is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: missing, incomplete, corrupt or incompatible."""


class ModelState(Stateful):
    """The model's (possibly sharded) state dict, with canonical FQNs."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


class OptimizerState(Stateful):
    """The optimizer's state dict keyed by parameter FQN (independent of sharding)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Saves every `interval` steps and at the end, keeps the newest `keep_latest_k`, resumes."""

    def __init__(self, cfg, dump_folder: str):
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.async_mode = cfg.async_mode
        if self.async_mode not in ("disabled", "async"):
            raise ValueError(
                f"checkpoint.async_mode must be 'disabled' or 'async', got {self.async_mode!r}"
            )
        self.pending: tuple[int, Future] | None = None
        self.async_group = None
        if self.async_mode == "async" and dist.is_initialized():
            # async saves run their collectives on a separate CPU group, off the training stream
            self.async_group = dist.new_group(backend="gloo")

    # ---- discovery -----------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            match = STEP_DIR.match(entry.name)
            if match and (entry / COMPLETE_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def should_save(self, step: int, last_step: int) -> bool:
        if not self.cfg.enable:
            return False
        return step == last_step or (self.cfg.interval > 0 and step % self.cfg.interval == 0)

    # ---- save ----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Write `state` to step-N; returns at once in async mode (the marker follows later)."""
        self.wait()
        path = self.step_dir(step)
        if _is_rank0():
            if path.exists():  # a stale or partial save of the same step
                shutil.rmtree(path)
            path.mkdir(parents=True)
        _barrier()
        start = time.monotonic()
        logger.info("checkpoint: saving step %d to %s ...", step, path)
        if self.async_mode == "async":
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self.async_group)
            self.pending = (step, future)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._finish(step)
            logger.info("checkpoint: saved step %d in %.1fs", step, time.monotonic() - start)

    def wait(self) -> None:
        """Block until a pending async save is on disk, then mark it complete."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        future.result()
        self._finish(step)
        logger.info("checkpoint: async save of step %d complete", step)

    def _finish(self, step: int) -> None:
        _barrier()
        if _is_rank0():
            marker = self.step_dir(step) / COMPLETE_MARKER
            with open(marker, "w") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            self._purge()
        _barrier()

    def _purge(self) -> None:
        keep = self.cfg.keep_latest_k
        if keep <= 0:
            return
        for old in self.complete_steps()[:-keep]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    # ---- load ----------------------------------------------------------------------------

    def resume_step(self) -> int | None:
        """The step to resume from: checkpoint.load_step, else the latest complete one."""
        if self.cfg.load_step >= 0:
            path = self.step_dir(self.cfg.load_step)
            if not (path / COMPLETE_MARKER).is_file():
                found = self.complete_steps()
                raise CheckpointError(
                    f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint at {path} "
                    f"(complete checkpoints: {found or 'none'})"
                )
            return self.cfg.load_step
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def load(self, path: str | Path, state: dict[str, Any]) -> None:
        """Load `state` in place from the checkpoint folder `path`, with clear errors."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint folder {path} does not exist")
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: DCP metadata file .metadata is missing"
            )
        start = time.monotonic()
        logger.info("checkpoint: loading %s (%s) ...", path, ", ".join(sorted(state)))
        try:
            dcp.load(state, checkpoint_id=str(path))
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            cause = err
            if isinstance(err, CheckpointException) and err.failures:  # per-rank (exc, trace)
                cause = next(iter(err.failures.values()))[0]
            raise CheckpointError(
                f"checkpoint {path} could not be loaded, it is corrupt or does not match this "
                f"model/run: {type(cause).__name__}: {_first_line(cause)}"
            ) from (err if isinstance(err, Exception) else cause)
        logger.info("checkpoint: loaded %s in %.1fs", path, time.monotonic() - start)


def load_exported_weights(model: torch.nn.Module, path: str | Path, family: str) -> None:
    """Load model weights only from an exported `hf` or `fla` folder or an RWKV-LM `.pth`
    (flame.export's formats) into `model`, sharded or not: converted to flame's names, checked
    against the model (the first missing, unexpected or misshapen tensor is named, with both
    shapes), then handed to `set_model_state_dict` as a full state dict that every rank holds."""
    from flame.export.checkpoint_reader import ExportError, check_state_dict
    from flame.export.formats import read_exported

    try:
        _, state, _ = read_exported(path, family)
        expected = get_model_state_dict(model)  # sharded tensors report their full shapes
        tied = bool(getattr(model, "tie_word_embeddings", False))
        check_state_dict(expected, state, tied_head=tied, source=str(path))
    except ExportError as err:
        raise CheckpointError(f"checkpoint.initial_load_path: {err}") from err
    if tied and "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["embeddings.weight"]):
        raise CheckpointError(
            f"checkpoint.initial_load_path: {path} holds a head (lm_head.weight) that differs from "
            f"its embedding, but this run ties them (model.tie_word_embeddings = true)"
        )
    if tied and "lm_head.weight" in expected:
        state["lm_head.weight"] = state["embeddings.weight"]
    state = {name: state[name].to(expected[name].dtype) for name in expected}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    logger.info("model: weights loaded from %s (model only, a new run)", path)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:500] if text else ""
