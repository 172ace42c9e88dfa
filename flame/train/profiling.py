"""A torch.profiler trace of a few optimizer steps of a run (the [profiling] config section).

The trace starts when the step before `profiling.start_step` is done and stops when
`profiling.steps` more are done, each rank writing `<dump_folder>/<profiling.folder>/rank<R>.json`
(host and GPU activity, the collectives among it). Under the trainer's pipelined loop, the traced
steps' device work is whole, and the host work of the next step's forward and backward is in too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger("flame.train")


class StepProfiler:
    def __init__(self, cfg, dump_folder: Path, rank: int, device: torch.device):
        self.enabled = cfg.enable
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.path = dump_folder / cfg.folder / f"rank{rank}.json"
        self.device = device
        self.profile = None

    def step_done(self, step: int) -> None:
        """Called once step `step` is done: start before `start_step`, stop after the last."""
        if not self.enabled:
            return
        if step == self.first - 1 and self.profile is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.profile = profile(activities=activities)
            self.profile.__enter__()
        elif step == self.last and self.profile is not None:
            self.stop()

    def stop(self) -> None:
        """End a trace in progress and write it."""
        if self.profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profile.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profile.export_chrome_trace(str(self.path))
        self.profile = None
        logger.info("profiling: steps %d-%d traced in %s", self.first, self.last, self.path)
