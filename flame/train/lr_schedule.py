"""Learning-rate schedule: linear warmup, then cosine, linear or WSD decay down to lr_min.

The warmup rises linearly from `warmup_start` (by default 1 / warmup_steps) at the first update
to 1 at update `warmup_steps`.

The schedule is a multiplier of each param group's own LR (so per-group multipliers such as the
decay-bias 2x keep their ratio). `lr_min` is absolute for the base LR: the multiplier ends at
lr_min / lr. The multiplier of step s (0-based count of optimizer updates done so far) is the LR
used by update s+1.
"""

from __future__ import annotations

import logging
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger("flame.train")


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    warmup_start: float = 0.0,
    total_steps: int,
    decay_type: str,
    decay_ratio: float,
    min_ratio: float,
) -> float:
    """LR multiplier for the update after `step` completed updates. `decay_type`: "cosine",
    "linear" or "wsd" (lr_scheduler.decay_type, whose choices the config loader checks)."""
    n = step + 1  # 1-based index of the update this LR is used for
    warmup_steps = min(warmup_steps, total_steps)
    if n <= warmup_steps:
        if warmup_start <= 0 or warmup_steps == 1:
            return n / warmup_steps
        return warmup_start + (1.0 - warmup_start) * (n - 1) / (warmup_steps - 1)
    if decay_type == "wsd":
        decay_steps = max(1, round(total_steps * decay_ratio))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if n <= decay_start:
            return 1.0
        progress = (n - decay_start) / max(1, total_steps - decay_start)
        shape = 1.0 - progress  # linear decay, as in the WSD paper
    else:
        progress = (n - warmup_steps) / max(1, total_steps - warmup_steps)
        if decay_type == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        else:
            shape = 1.0 - progress
    shape = min(max(shape, 0.0), 1.0)
    return min_ratio + (1.0 - min_ratio) * shape


def build_lr_scheduler(optimizer: Optimizer, cfg, total_steps: int, peak_lr: float) -> LambdaLR:
    """A LambdaLR over `optimizer` from the `[lr_scheduler]` config section. A warmup longer
    than the run is clamped to the run (the log says so)."""
    min_ratio = cfg.lr_min / peak_lr if peak_lr > 0 else 0.0
    if cfg.warmup_steps > total_steps:
        logger.warning("lr_scheduler.warmup_steps = %d is longer than the run (training.steps = %d): "
                       "the warmup is clamped to %d steps, the LR reaches its peak at the last step "
                       "and does not decay", cfg.warmup_steps, total_steps, total_steps)

    def multiplier(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=cfg.warmup_steps,
            warmup_start=cfg.warmup_start,
            total_steps=total_steps,
            decay_type=cfg.decay_type,
            decay_ratio=cfg.decay_ratio,
            min_ratio=min_ratio,
        )

    return LambdaLR(optimizer, multiplier)
