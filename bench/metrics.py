"""Reading a training run's metrics.jsonl, the trainer's log of one JSON record per logged step (and per
validation), for the tools that compare or measure runs (bench.compare_runs, bench.scale)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


class MetricsError(RuntimeError):
    """A metrics file that cannot be read; the message says which and why."""


def read_metrics(path: Path, start_line: int = 0) -> list[dict]:
    """The training records (not validation ones) of metrics.jsonl from line `start_line` on."""
    if not path.is_file():
        raise MetricsError(f"{path} is missing: the run logged nothing")
    records = []
    for number, line in enumerate(path.read_text().splitlines()[start_line:], start_line + 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill: not a record
            print(f"note: {path}:{number} is not JSON (cut by a kill?), skipped", file=sys.stderr)
            continue
        if "loss" in record:
            records.append(record)
    return records
