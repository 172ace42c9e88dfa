"""A run SIGKILLed at ten points of its steps and saves (inside a step, between steps, during a save,
during the pruning of old checkpoints), then restarted each time: it ends bitwise equal to the
uninterrupted run of the same config (final losses, every tensor of the final checkpoint: parameters and
optimizer state; tests/train/faults.py launches and reads the runs)."""

from __future__ import annotations

import signal

import pytest

from flame.train.run_lock import LOCK_NAME
from tests.train.faults import assert_same_run, complete_steps, resumed_from, run


# (point, step, the step the next run resumes from): saves at 3, 6, 9, 12, the two newest kept
KILLS = [
    ("forward", 2, None),      # inside step 2, before any checkpoint
    ("boundary", 3, None),     # between steps: step 3 done, not saved
    ("save-start", 3, None),   # during the save: its folder made, nothing written
    ("save", 3, None),         # during the save: shards and metadata written, no COMPLETE
    ("update", 5, 3),          # inside step 5, after the optimizer update
    ("save", 6, 3),
    ("forward", 7, 6),
    ("purge", 9, 9),           # step 9 COMPLETE, step 3 not yet pruned
    ("boundary", 11, 9),
    ("save", 12, 9),           # during the final save
]


@pytest.mark.slow
def test_sigkill_at_ten_points_then_restarts_end_bitwise_equal(config, reference, tmp_path):
    dump = tmp_path / "killed"
    for point, step, resume_step in KILLS:
        killed = run(config, dump, faults=f"{point}:{step}")
        assert killed.returncode == -signal.SIGKILL, killed.output
        assert f"fault injection: kill at {point} of step {step}" in killed.output
        assert (dump / LOCK_NAME).exists()  # a SIGKILL leaves the lock behind
        if point in ("save-start", "save"):
            assert (dump / "checkpoint" / f"step-{step}").is_dir()
            assert step not in complete_steps(dump)
        assert (max(complete_steps(dump)) if complete_steps(dump) else None) == resume_step
    final = run(config, dump)
    assert final.returncode == 0, final.output
    assert resumed_from(final.output) == 9
    assert "taking over the lock" in final.output and "no longer runs on this host" in final.output
    assert not (dump / LOCK_NAME).exists()
    assert complete_steps(dump) == [9, 12]
    assert_same_run(dump, reference)
