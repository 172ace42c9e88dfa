"""Step metrics: the console log, a progress line per logged step, `metrics.jsonl` (with a marker
row at each resume; `flame.run_metrics` reads it back), its plot `loss.png`, and optionally wandb /
TensorBoard.

Only rank 0 writes. wandb and tensorboard are imported lazily, when enabled; matplotlib when a
plot is drawn (`flame.plot`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import torch

from flame.plot import RUN_PLOT, PlotError, PlotLibraryMissing, write_run_plot
from flame.run_metrics import FILE_NAME, RESUME_KEY

logger = logging.getLogger("flame.train")


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


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def progress_line(record: dict) -> str:
    """One human-readable line from a metrics record."""
    parts = [
        f"step {record['step']:>6d}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.3e}",
        f"gnorm {record['grad_norm']:.3f}",
        f"tok/s {record['tokens_per_s']:,.0f}",
        f"tokens {record['tokens']:,d}",
    ]
    if "mfu" in record:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if "memory_gib" in record:
        reserved = f" (reserved {record['memory_reserved_gib']:.1f})" if "memory_reserved_gib" in record else ""
        parts.append(f"mem {record['memory_gib']:.1f}GiB{reserved}")
    if record.get("nan_skips"):
        parts.append(f"nan-skips {record['nan_skips']}")
    parts.append(f"eta {format_duration(record.get('eta_s', float('nan')))}")
    return " | ".join(parts)


def device_peak_flops(device: torch.device) -> float:
    """The peak dense bf16 FLOP/s of one `device`, MFU's denominator (docs/architecture.md, "FLOPs per
    token and MFU"): on CUDA, torchtitan's table by device name (H100 SXM and H200 989e12; an H100
    named by `lspci` wins over the CUDA name; an unknown GPU gets A100's 312e12 and torchtitan's
    warning); 0 elsewhere (CPU: no MFU is logged)."""
    if device.type != "cuda":
        return 0.0
    from torchtitan.tools.utils import get_peak_flops

    return float(get_peak_flops(torch.cuda.get_device_name(device)))


class StepLog:
    """The training records of metrics.jsonl: every metrics.log_freq steps (and at the last and a
    skipped step) the step's numbers and the throughput of the window of steps since the last
    record, its valid tokens over the device time of its steps (so the steps' times add up to the
    run's time on the device). `mfu` = tokens_per_s_per_device * flops_per_token (the model's
    `num_flops_per_token()`) / `device_peak_flops(device)`, where that peak is known."""

    def __init__(self, metrics: MetricsLogger, cfg, world_size: int, device, flops_per_token: int):
        self.metrics = metrics
        self.log_freq = max(1, cfg.metrics.log_freq)
        self.total_steps = cfg.training.steps
        self.world_size = world_size
        self.device = device
        self.flops_per_token = int(flops_per_token)
        self.peak_flops = device_peak_flops(device)
        if self.peak_flops > 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            logger.info("MFU: %s FLOPs per token over %s's peak of %.0f TFLOP/s",
                        f"{self.flops_per_token:,d}", name, self.peak_flops / 1e12)
        self.restart()

    def restart(self) -> None:
        self.tokens, self.seconds, self.steps = 0, 0.0, 0

    def add(self, step: int, result, state) -> None:
        """Step `step`, whose read result this is, with the run's counters `state` after it."""
        self.tokens += result.valid_tokens
        self.seconds += result.seconds
        self.steps += 1
        if step % self.log_freq and step != self.total_steps and not result.skipped:
            return
        tokens_per_s = self.tokens / max(self.seconds, 1e-9)
        per_device = tokens_per_s / self.world_size
        step_time = self.seconds / max(self.steps, 1)
        self.restart()
        record = {
            "step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
            "tokens": state.tokens, "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
            "step_time_s": step_time, "eta_s": step_time * (self.total_steps - step),
            "nan_skips": state.nan_skips,
        }
        if self.peak_flops > 0:
            record["mfu"] = self.flops_per_token * per_device / self.peak_flops
        if result.skipped:
            record["skipped"] = True
        if self.device.type == "cuda":
            # the peak of the tensors allocated, and of what the caching allocator holds from the
            # GPU: CUDA-graph memory pools and freed blocks count there, and it is what must fit
            record["memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            record["memory_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        self.metrics.log(record)


class MetricsLogger:
    """Writes each logged step to the console, `<dump_folder>/metrics.jsonl` and the dashboards."""

    def __init__(self, dump_folder: str, cfg, *, enabled: bool, run_name: str, config_dict: dict,
                 wandb_run_id: str | None = None):
        self.enabled = enabled
        self.path = Path(dump_folder) / FILE_NAME
        self.wandb_run = None
        self.tensorboard = None
        self.plotting = True
        """False once a plot found no matplotlib: said once, then no more tries."""
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.enable_wandb:
            self.wandb_run = _start_wandb(cfg.wandb_project, run_name, dump_folder, config_dict,
                                          wandb_run_id, cfg.wandb_init_timeout_seconds)
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(Path(dump_folder) / "tensorboard"))

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, record: dict, *, console: bool = True) -> None:
        if not self.enabled:
            return
        if console:
            logger.info(progress_line(record))
        self._append(record)
        step = record["step"]
        numbers = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.wandb_run is not None:
            self.wandb_run.log(numbers, step=step)
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)

    def mark_resume(self, step: int) -> None:
        """Write the row that says the run continues from the checkpoint of `step`: the steps after
        it that metrics.jsonl already holds are logged again."""
        if self.enabled:
            self._append({"step": step, RESUME_KEY: step})

    def _append(self, row: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:  # appended line by line: a killed
            f.write(json.dumps(row) + "\n")                   # run loses nothing it logged

    def write_plot(self) -> None:
        """Draw `<dump_folder>/loss.png` from metrics.jsonl. Without matplotlib the log says so once
        and the run writes no plot; a plot that fails is a warning, never the end of a run."""
        if not self.enabled or not self.plotting or not self.path.is_file():
            return
        try:
            write_run_plot(self.path.parent)
        except PlotLibraryMissing as err:
            logger.info("plot: %s; the run writes no %s", err, RUN_PLOT)
            self.plotting = False
        except (PlotError, OSError, ValueError) as err:
            logger.warning("plot: %s not written: %s", self.path.parent / RUN_PLOT, err)

    def close(self) -> None:
        if not self.enabled:
            return
        self.write_plot()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def _start_wandb(project: str, name: str, dump_folder: str, config_dict: dict, run_id: str | None,
                 init_timeout_s: float):
    """Start (or resume, with `run_id`) a wandb run. With an API key (or WANDB_MODE set) online,
    waiting at most `init_timeout_s` for the server; without a key, or when the online start fails,
    offline: the mode goes to `wandb.init` itself, which takes it even after a failed start in the
    same process (an environment variable set then is ignored), and the run trains on."""
    import wandb

    kwargs = dict(project=project, name=name, dir=dump_folder, config=config_dict)
    if run_id:
        kwargs.update(id=run_id, resume="allow")
    run = None
    if os.environ.get("WANDB_API_KEY") or _wandb_logged_in() or os.environ.get("WANDB_MODE"):
        try:
            run = wandb.init(**kwargs, settings=wandb.Settings(init_timeout=init_timeout_s))
        except Exception as err:  # wandb raises several types for an unreachable server
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            logger.warning("wandb: the online start failed (%s; metrics.wandb_init_timeout_seconds "
                           "= %g); logging offline instead", first_line, init_timeout_s)
    else:
        logger.info("wandb: no API key found (WANDB_API_KEY or `wandb login`)")
    if run is None:
        run = wandb.init(**kwargs, mode="offline")
    if run.settings.mode in ("offline", "dryrun"):
        logger.info("wandb: logging offline to %s; upload it later with `wandb sync %s`",
                    run.settings.sync_dir, run.settings.sync_dir)
    return run


def _wandb_logged_in() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
