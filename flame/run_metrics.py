"""A run's `metrics.jsonl`, read back: the rows `flame.train.metrics` writes, one JSON object a line.

Three kinds of row: a training record (`step`, `loss`, `lr`, `grad_norm`, `tokens`,
`tokens_per_s`, ...), a validation record (`step`, `val_loss`) and a resume marker (`step` and
`resumed_from_step`, both the step of the checkpoint a restart continued from). A resumed run logs
the steps after its checkpoint again, so a step can appear more than once: the last row written
for it is the one that counts (the run's weights went on from it), and a resume marker drops the
rows of the steps after its checkpoint written before it (a restart undid them, even those it does
not reach again). Stdlib only, so that the plot command and the benchmark tools read a run without
importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FILE_NAME = "metrics.jsonl"
RESUME_KEY = "resumed_from_step"
"""The key of a resume marker row: the step of the checkpoint that a restart continued from."""


class MetricsFileError(ValueError):
    """A metrics file that cannot be read; the message names it and says why."""


@dataclass
class RunMetrics:
    """The rows of one metrics.jsonl, sorted by step, one row per step and kind."""

    path: Path
    train: list[dict] = field(default_factory=list)
    """Training records, one per step: the last one written."""
    validation: list[dict] = field(default_factory=list)
    """Validation records, one per step: the last one written."""
    resumed_from: list[int] = field(default_factory=list)
    """The step of each resume, in the order the run wrote them."""
    unreadable_lines: list[int] = field(default_factory=list)
    """Line numbers that are not JSON (a line cut short by a killed run); skipped."""


def metrics_path(run: str | Path) -> Path:
    """The metrics.jsonl of `run`: a run's dump folder, or the file itself."""
    path = Path(run)
    return path / FILE_NAME if path.is_dir() else path


def read_run_metrics(run: str | Path) -> RunMetrics:
    """The rows of `run`'s metrics.jsonl (`run`: its dump folder or the file)."""
    path = metrics_path(run)
    if not path.is_file():
        raise MetricsFileError(f"{path} does not exist: no run has logged there")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise MetricsFileError(f"cannot read {path}: {err}") from None
    metrics = RunMetrics(path)
    train: dict[int, dict] = {}
    validation: dict[int, dict] = {}
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            metrics.unreadable_lines.append(number)
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            metrics.unreadable_lines.append(number)
        elif RESUME_KEY in row:  # the steps logged after that checkpoint were undone
            metrics.resumed_from.append(row[RESUME_KEY])
            for rows in (train, validation):
                for step in [step for step in rows if step > row[RESUME_KEY]]:
                    del rows[step]
        elif "loss" in row:
            train[row["step"]] = row
        elif "val_loss" in row:
            validation[row["step"]] = row
    metrics.train = [train[step] for step in sorted(train)]
    metrics.validation = [validation[step] for step in sorted(validation)]
    return metrics
