"""Reading a training run's metrics.jsonl (`flame.run_metrics`: one training record per step, the last
one written when a resumed run logged a step again) for the tools that compare or measure runs
(bench.compare_runs, bench.scale); a file that cannot be read raises
`flame.run_metrics.MetricsFileError`."""

from __future__ import annotations

import sys
from pathlib import Path

from flame.run_metrics import read_run_metrics


def read_metrics(path: Path) -> list[dict]:
    """The training records (not validation ones) of metrics.jsonl, one per step, by step."""
    metrics = read_run_metrics(path)
    for number in metrics.unreadable_lines:
        print(f"note: {path}:{number} is not JSON (cut by a kill?), skipped", file=sys.stderr)
    return metrics.train
