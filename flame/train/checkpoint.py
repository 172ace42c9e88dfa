"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP): save, load, prune.

Layout (flame.weights.layout): `<dump_folder>/<checkpoint.folder>/step-N/` holds DCP's files
(`.metadata` and `__<rank>_<i>.distcp`, one file per I/O thread of each rank), the run's
`config.toml` (the config this checkpoint was trained with, which export, generate and eval read) and
`COMPLETE`, a marker that rank 0 writes only after every rank's shards and DCP's metadata
are on disk. A folder without the marker (a run killed mid-save) is ignored when resuming and removed
when that step is saved again; a save that fails (disk full, unwritable) removes its folder itself
and leaves the older checkpoints as they were (keep_latest_k prunes only after a save that
succeeded). A checkpoint that cannot be read is a `flame.weights.WeightsError`.

What a checkpoint holds (the `state` dict given to `save` / `load`; DCP keys join the levels with
dots, e.g. `trainer.train_state.step`):
- "model": the model's weights (`ModelState`, DCP's `get_model_state_dict`: FQN-keyed,
  FSDP-sharded);
- "optimizer": AdamW's state and param groups (`OptimizerState`, `get_optimizer_state_dict`,
  keyed by the parameters' FQNs);
- "trainer": the trainer's own state dict (`Trainer.state_dict`): "train_state" (step, tokens,
  NaN counters, wandb run id, DP size), "lr_scheduler" (LambdaLR's state dict) and one
  "rank_<r>" per rank (that rank's data-loader position and RNG states, pickled bytes).

I/O: a save writes `checkpoint.io_threads` files per rank from as many threads (DCP's
FileSystemWriter), and a load reads a checkpoint's files in as many threads (`ParallelFileReader`,
each file read whole by DCP's own FileSystemReader): one stream per rank is far below what a disk or
/dev/shm delivers.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils._pytree import tree_map_only

from flame.train.fault_injection import fault_point
from flame.train.parallel import causes
from flame.weights import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    WeightsError,
    check_readable,
    complete_steps,
    first_line,
    step_dir,
)

logger = logging.getLogger("flame.train")

# Without torch.distributed, DCP warns that it assumes a single process: that is exactly the
# single-process run, so the warning is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


class CheckpointError(WeightsError):
    """A checkpoint cannot be saved, or the run refuses to resume from the one it names (another
    data-parallel size, a full resume from model-only weights). A checkpoint that cannot be read
    is its parent, WeightsError."""


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


class OptimizerStateOnHost(OptimizerState):
    """An optimizer state that a load reads into host memory and `to_device` hands to the
    optimizer later, for a model that FSDP does not shard.

    A resumed run's first step captures its compiled blocks as CUDA graphs, whose memory pool
    peaks in that step's backward. A new run allocates AdamW's moments (2 x 4 bytes per
    parameter) in the update after that peak; holding a resumed run's moments on the host until
    then makes its first step peak no higher than a new run's. The bytes cross to the device
    once either way: DCP copies a checkpoint's tensors from host memory. (Read in a background
    thread during the first step instead, the read holds Python's lock often enough to slow that
    step by more than it saves.)"""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer)
        self.loaded: dict[str, Any] | None = None

    @staticmethod
    def host_bytes(model: torch.nn.Module) -> int:
        """AdamW's two fp32 moments of `model`'s trainable parameters: the host memory they take."""
        return sum(8 * p.numel() for p in model.parameters() if p.requires_grad)

    def state_dict(self) -> dict[str, Any]:
        """The layout of the optimizer's state (DCP initialises it on the device) as host tensors
        for DCP to fill; the device's state is freed."""
        on_device = super().state_dict()
        on_host = tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"),
                                on_device)
        self.optimizer.state.clear()
        del on_device
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the freed moments back for the graphs' memory pool
        return on_host

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict

    def to_device(self) -> None:
        """Give the optimizer the loaded state, on its parameters' device. Gradients may be
        present: DCP initialises no state over them."""
        if self.loaded is not None:
            super().load_state_dict(self.loaded)
            self.loaded = None


class ParallelFileReader(FileSystemReader):
    """DCP's file reader with one thread per file: the items of a load plan are grouped by the file
    that holds them and each group goes through FileSystemReader.read_data in a thread pool of
    `threads` (the file reads and host-to-device copies release the GIL)."""

    def __init__(self, path: str | Path, threads: int):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        read_file = super().read_data
        with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(by_file)))) as pool:
            futures = [pool.submit(read_file, dataclasses.replace(plan, items=items), planner)
                       for items in by_file.values()]
            for future in futures:
                future.result().wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every rank (a host all-reduce; `ok` itself without distribution)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class SaveFailed(Exception):
    """One step of a save failed on some rank (the cause is named in the message)."""


class CheckpointManager:
    """Saves every `interval` steps or `interval_minutes`, at the end and on a stop signal; keeps
    the newest `keep_latest_k`; resumes. A failed save leaves no partial folder behind and never
    touches the complete checkpoints before it."""

    def __init__(self, cfg, dump_folder: str, clock=time.monotonic, run_config: str = ""):
        """`run_config`: the run's config as TOML, written into every step folder (none when
        empty)."""
        self.cfg = cfg
        self.run_config = run_config
        self.folder = Path(dump_folder) / cfg.folder
        self.async_mode = cfg.async_mode
        self.clock = clock
        self.last_save_began = clock()
        self.pending: tuple[int, Future, bool] | None = None
        self.async_group = None
        if self.async_mode == "async" and dist.is_initialized():
            # async saves run their collectives on a separate CPU group, off the training stream
            self.async_group = dist.new_group(backend="gloo")

    # ---- discovery -----------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return step_dir(self.folder, step)

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        return complete_steps(self.folder)

    def save_due_by_time(self) -> bool:
        """checkpoint.interval_minutes have passed since the last save began (this rank's clock)."""
        minutes = self.cfg.interval_minutes
        elapsed = self.clock() - self.last_save_began
        return self.cfg.enable and minutes > 0 and elapsed >= 60 * minutes

    def should_save(self, step: int, last_step: int, *, time_due: bool = False,
                    stopping: bool = False) -> bool:
        """Save at `step`: the interval, the last step, a timed save due or a stop signal."""
        if not self.cfg.enable:
            return False
        return (stopping or time_due or step == last_step
                or (self.cfg.interval > 0 and step % self.cfg.interval == 0))

    # ---- save ----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, required: bool = False) -> bool:
        """Write `state` to step-N; in async mode return at once (the marker follows at `wait`).

        A failed save removes its partial folder; then, unless `required` (the final save, a stop
        signal's save), checkpoint.on_save_error = "continue" logs a warning and returns False,
        and "stop" raises CheckpointError, on every rank alike."""
        self.wait()
        path = self.step_dir(step)
        self.last_save_began = self.clock()
        start = time.monotonic()
        try:
            self._create_folder(step)
            fault_point("save-start", step)
            logger.info("checkpoint: saving step %d to %s ...", step, path)
            if self.async_mode == "async":
                future = dcp.async_save(state, checkpoint_id=str(path), storage_writer=self._writer(path),
                                        process_group=self.async_group)
                self.pending = (step, future, required)
                return True
            dcp.save(state, checkpoint_id=str(path), storage_writer=self._writer(path))
            self._mark_complete(step)
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            return self._save_failed(step, err, required)
        self._prune(step)
        logger.info("checkpoint: saved step %d in %.1fs", step, time.monotonic() - start)
        return True

    def _writer(self, path: Path) -> FileSystemWriter:
        """DCP's file writer for the step folder `path`: checkpoint.io_threads files per rank."""
        return FileSystemWriter(str(path), thread_count=self.cfg.io_threads)

    def wait(self) -> bool:
        """Block until a pending async save is on disk, then mark it complete; False when it
        failed and the run goes on (see `save`)."""
        if self.pending is None:
            return True
        step, future, required = self.pending
        self.pending = None
        try:
            future.result()
            self._mark_complete(step)
        except (Exception, CheckpointException) as err:
            return self._save_failed(step, err, required)
        self._prune(step)
        logger.info("checkpoint: async save of step %d complete", step)
        return True

    def _create_folder(self, step: int) -> None:
        path = self.step_dir(step)
        error = None
        if _is_rank0():
            try:
                if path.exists():  # a stale or partial save of the same step
                    shutil.rmtree(path)
                path.mkdir(parents=True)
                if self.run_config:
                    write_run_config(path, self.run_config)
            except OSError as err:
                error = err
        if not _everywhere(error is None):
            raise SaveFailed(f"creating {path}: {_describe(error)}" if error else
                             f"rank 0 could not create {path}")

    def _mark_complete(self, step: int) -> None:
        """Every rank's shards and DCP's metadata are on disk: rank 0 writes the marker."""
        fault_point("save", step)
        _barrier()
        marker = self.step_dir(step) / COMPLETE_MARKER
        error = None
        if _is_rank0():
            try:
                with open(marker, "w") as f:
                    f.write(f"{step}\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:
                error = err
                marker.unlink(missing_ok=True)
        if not _everywhere(error is None):
            raise SaveFailed(f"writing {marker}: {_describe(error)}" if error else
                             f"rank 0 could not write {marker}")

    def _prune(self, step: int) -> None:
        """After the save of `step` succeeded: keep only the newest keep_latest_k checkpoints."""
        fault_point("purge", step)
        keep = self.cfg.keep_latest_k
        if _is_rank0() and keep > 0:
            for old in self.complete_steps()[:-keep]:
                shutil.rmtree(self.step_dir(old), ignore_errors=True)
        _barrier()

    def _save_failed(self, step: int, err: BaseException, required: bool) -> bool:
        path = self.step_dir(step)
        removed = "its partial folder was removed"
        if _is_rank0():
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as rm_err:
                removed = (f"its partial folder could not be removed ({rm_err}); it has no "
                           f"COMPLETE marker, so resuming ignores it")
        complete = self.complete_steps()
        kept = (f"the last complete checkpoint, {self.step_dir(complete[-1])}, is intact"
                if complete else "there is no complete checkpoint yet")
        message = (f"checkpoint: saving step {step} to {path} failed: {_describe(err)}; {removed}; "
                   f"{kept}")
        if required or self.cfg.on_save_error == "stop":
            why = "" if self.cfg.on_save_error == "stop" else " (the final or a stop signal's save)"
            raise CheckpointError(message + why) from _cause(err)
        logger.warning("%s; training goes on (checkpoint.on_save_error = \"continue\"), the next "
                       "save tries again", message)
        return False

    # ---- load ----------------------------------------------------------------------------

    def resume_step(self) -> int | None:
        """The step to resume from: checkpoint.load_step (WeightsError when it is not complete),
        else the latest complete one."""
        if self.cfg.load_step >= 0:
            path = self.step_dir(self.cfg.load_step)
            if not (path / COMPLETE_MARKER).is_file():
                found = self.complete_steps()
                raise WeightsError(
                    f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint at {path} "
                    f"(complete checkpoints: {found or 'none'})"
                )
            return self.cfg.load_step
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def load(self, path: str | Path, state: dict[str, Any]) -> None:
        """Load `state` in place from the checkpoint folder `path`; WeightsError when it cannot be
        read (missing, incomplete, corrupt, of another model or run)."""
        path = Path(path)
        check_readable(path)
        start = time.monotonic()
        logger.info("checkpoint: loading %s (%s) ...", path, ", ".join(sorted(state)))
        try:
            dcp.load(state, checkpoint_id=str(path),
                     storage_reader=ParallelFileReader(path, self.cfg.io_threads))
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            cause = err
            if isinstance(err, CheckpointException) and err.failures:  # per-rank (exc, trace)
                cause = next(iter(err.failures.values()))[0]
            raise WeightsError(
                f"checkpoint {path} could not be loaded, it is corrupt or does not match this "
                f"model/run: {type(cause).__name__}: {first_line(cause)}"
            ) from (err if isinstance(err, Exception) else cause)
        logger.info("checkpoint: loaded %s in %.1fs", path, time.monotonic() - start)


def write_run_config(folder: str | Path, text: str) -> None:
    """Write `text` to `folder`/config.toml through a temporary file renamed over it, so that the
    file is the old config or the new one, never a part of one."""
    path = Path(folder) / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _describe(err: BaseException) -> str:
    """The first failure inside DCP's per-rank CheckpointException, else `err`: type and line.
    The file system's own error is named where torch's stands over it (torch.save reports a full
    disk as "[enforce fail at inline_container.cc] unexpected pos", the OSError in its context)."""
    if isinstance(err, SaveFailed):
        return str(err)
    where = ""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (err, _) = next(iter(err.failures.items()))
        where = f"on rank {rank}: "
    err = _os_error(err) or err
    text = f"{type(err).__name__}: {first_line(err)}"
    if getattr(err, "errno", None) == errno.ENOSPC:
        text = f"no space left on device ({text})"
    return where + text


def _os_error(err: BaseException) -> OSError | None:
    """The first OSError in `err`'s chain of causes and contexts (`err` itself included)."""
    return next((e for e in causes(err) if isinstance(e, OSError)), None)


def _cause(err: BaseException) -> BaseException | None:
    """The exception to chain a CheckpointError to: DCP's first per-rank failure, else `err`."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err if isinstance(err, Exception) else None
