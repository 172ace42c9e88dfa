"""Reading a run's metrics.jsonl, for the tools that compare or summarise runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_metrics(path: Path, start_line: int = 0) -> list[dict]:
    """The training records (not validation ones) of metrics.jsonl from line `start_line` on; a
    line that is not JSON (cut by a kill) is reported and skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run logged nothing")
    records = []
    for number, line in enumerate(path.read_text().splitlines()[start_line:], start_line + 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            print(f"note: {path}:{number} is not JSON (cut by a kill?), skipped", file=sys.stderr)
            continue
        if "loss" in record:
            records.append(record)
    return records
