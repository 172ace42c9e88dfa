"""Faults of two processes: one rank's signal stops every rank at the same step, a killed or hung
rank makes the other exit with a message (a stalled step is named before the collective timeout),
torchrun restarts after SIGKILLs resume; every resumed run matches the uninterrupted one bitwise,
as one process's does (the two ranks sum each gradient as a + b, the same on either rank and in
every run, and OMP_NUM_THREADS=1 fixes each rank's own order)."""

from __future__ import annotations

import signal
import time

import pytest

from flame.train.preemption import PREEMPTED_EXIT_CODE
from tests.train import faults
from tests.train.faults import (
    assert_same_run, checkpoint_tensors, complete_steps, losses, resumed_from, start_ranks, wait_all,
    wait_for,
)


pytestmark = pytest.mark.xdist_group("two_rank_faults")
"""One pytest worker runs this module (scripts/test.sh distributes with --dist loadgroup), so that
its module fixtures, the suite's longest two-rank runs, run once."""

TWO_RANK_STEPS = 8
HUNG_TIMEOUT_MINUTES = 0.25
"""The collective timeout of the hung stage (15 s): far above any wait of a working step for the
other rank on a busy runner (a checkpoint save, a descheduled process), so that only the hang
reaches it."""


@pytest.fixture(scope="module")
def two_rank_reference(config):
    dump = config.parent / "two-rank-reference"
    results = wait_all(start_ranks(config, dump, "--training.steps", str(TWO_RANK_STEPS)))
    assert [r.returncode for r in results] == [0, 0], results[0].output + results[1].output
    return losses(dump), checkpoint_tensors(dump / "checkpoint" / f"step-{TWO_RANK_STEPS}")


@pytest.fixture(scope="module")
def two_rank_story(config):
    """Two ranks without a launcher: rank 1 gets SIGUSR1; then rank 1 is killed; then it hangs
    (HUNG_TIMEOUT_MINUTES); then the run goes to its end. {stage: (results, seconds)}."""
    dump = config.parent / "two-ranks"
    steps = ("--training.steps", str(TWO_RANK_STEPS))
    stories = {}
    for stage, faults_, extra in (
        ("signal", "forward:4:SIGUSR1:rank=1", ()),
        ("killed", "forward:6:rank=1", ()),
        ("hung", "forward:6:hang:rank=1", ("--parallel.collective_timeout_minutes", str(HUNG_TIMEOUT_MINUTES))),
        ("end", "", ()),
    ):
        ranks = start_ranks(config, dump, *steps, *extra, faults=faults_, tag=stage)
        began = time.monotonic()
        if stage == "hung":  # rank 0 must give up on its own; rank 1 sleeps until killed
            results = [wait_all(ranks[:1], timeout=90)[0]]
            seconds = time.monotonic() - began
            ranks[1][0].kill()
            results += wait_all(ranks[1:])
        else:
            results = wait_all(ranks, timeout=90)
            seconds = time.monotonic() - began
        stories[stage] = (results, seconds, complete_steps(dump))
    return dump, stories


@pytest.mark.slow
def test_one_ranks_signal_stops_every_rank_at_the_same_step(two_rank_story):
    dump, stories = two_rank_story
    (rank0, rank1), _, complete = stories["signal"]
    assert (rank0.returncode, rank1.returncode) == (PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE), (
        rank0.output + rank1.output)
    assert "step 4: SIGUSR1 received (on another rank)" in rank0.output
    assert "stopped by SIGUSR1 at step 4" in rank0.output and "stopped by SIGUSR1 at step 4" in rank1.output
    assert complete == [3, 4]


@pytest.mark.slow
def test_a_killed_rank_makes_the_other_exit_with_a_message(two_rank_story):
    dump, stories = two_rank_story
    (rank0, rank1), seconds, _ = stories["killed"]
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode == 1, rank0.output
    # rank 0 was in step 6's forward, with step 5 queued before it and not read yet
    assert "rank 0: a collective failed after step 4 (the last step this rank finished)" in rank0.output
    assert "Another rank died or hangs" in rank0.output


@pytest.mark.slow
def test_a_hung_rank_makes_the_other_time_out_with_a_message(two_rank_story):
    dump, stories = two_rank_story
    (rank0, rank1), seconds, _ = stories["hung"]
    assert rank0.returncode == 1, rank0.output
    assert "rank 0: a collective failed after step 4" in rank0.output
    assert "Timed out" in rank0.output and f"collective_timeout_minutes = {HUNG_TIMEOUT_MINUTES} min" in rank0.output
    assert resumed_from(rank0.output) == 4


@pytest.mark.slow
def test_the_two_rank_run_resumed_equals_the_uninterrupted_one(two_rank_story, two_rank_reference):
    dump, stories = two_rank_story
    results, _, _ = stories["end"]
    assert [r.returncode for r in results] == [0, 0], results[0].output
    assert resumed_from(results[0].output) == 4
    assert_same_run(dump, two_rank_reference, TWO_RANK_STEPS)


@pytest.mark.slow
def test_torchrun_restarts_after_sigkills_resume_and_match(config, two_rank_reference, tmp_path):
    dump = tmp_path / "torchrun"
    kills = ",".join([
        "save:3:rank=0:attempt=0",      # rank 0 during the save of step 3: restart from step 0
        "boundary:5:rank=1:attempt=1",  # rank 1 between steps 5 and 6: restart from step 3
    ])
    done = faults.torchrun(config, dump, "--training.steps", str(TWO_RANK_STEPS), faults=kills,
                           max_restarts=2)
    assert done.returncode == 0, done.output
    for kill in ("kill at save of step 3", "kill at boundary of step 5"):
        assert f"fault injection: {kill}" in done.output
    assert "taking over the lock" in done.output  # rank 0's, left by the SIGKILL
    assert "resumed from" in done.output and f"{dump}/checkpoint/step-3: step 3" in done.output
    assert_same_run(dump, two_rank_reference, TWO_RANK_STEPS)


def test_a_stalled_step_is_named_before_the_collective_timeout(flame_log):
    from flame.train.preemption import StallWarning

    watch = StallWarning(rank=1, timeout_minutes=0.005, poll_seconds=0.02)  # 0.3 s
    try:
        watch.step_done(41)
        wait_for(lambda: any("since step 41" in m for m in flame_log), 5, "the stall warning")
    finally:
        watch.close()
    assert "rank 1: no step finished" in flame_log[-1] and "hangs in step 42" in flame_log[-1]


def test_a_short_collective_timeout_is_warned_of_before_it_ends():
    from flame.train.preemption import StallWarning

    for minutes, poll in ((5.0, 5.0), (0.5, 1.5), (0.01, 0.03)):
        watch = StallWarning(rank=0, timeout_minutes=minutes)
        watch.close()
        assert watch.poll_seconds == pytest.approx(poll)
        # the last look that can still find the step under the limit comes before the timeout
        assert watch.limit + watch.poll_seconds < 60 * minutes


def test_a_save_that_a_dead_rank_failed_is_a_collective_failure_naming_rank_and_step():
    from types import SimpleNamespace

    import torch

    from flame.train.checkpoint import CheckpointError
    from flame.train.parallel import ParallelState, collective_failure

    state = ParallelState(device=torch.device("cpu"), rank=3, world_size=4, parallel_dims=object())
    limits = SimpleNamespace(init_timeout_minutes=20.0, collective_timeout_minutes=0.5)
    save = ("checkpoint: saving step 8 to /run/checkpoint/step-8 failed: RuntimeError: [gloo] Read error; "
            "its partial folder was removed; the last complete checkpoint, /run/checkpoint/step-4, is intact")
    try:
        try:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                               "[127.0.0.1]:43426: Connection reset by peer")
        except RuntimeError as peer:
            raise CheckpointError(save) from peer
    except CheckpointError as err:
        failure = collective_failure(err, state, 8, limits)
    assert failure is not None
    assert str(failure).startswith(
        f"rank 3: a collective failed after step 8 (the last step this rank finished): {save}. "
        "Another rank died or hangs")
    assert "collective_timeout_minutes = 0.5 min" in str(failure)
    # a save that failed on its own (a full disk) stays a checkpoint error
    assert collective_failure(CheckpointError("no space left on device"), state, 8, limits) is None
