"""Fault injection: runs killed, signalled, locked out, cut off from a rank or out of disk, each
against an uninterrupted run of the same config (tests/train/faults.py launches and reads them).

One process must end bitwise equal to the uninterrupted run (final losses, every tensor of the
final checkpoint: parameters and optimizer state); two processes within fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from flame.train import preemption
from flame.train.checkpoint import CheckpointError, CheckpointManager
from flame.train.preemption import ABORTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Preempted, StopSignals
from flame.train.run_lock import LOCK_NAME, LockHolder, RunLock, RunLockedError
from flame.train.trainer import Trainer
from tests.train import faults
from tests.train.faults import (
    STEPS,
    checkpoint_tensors,
    complete_steps,
    losses,
    metrics,
    resumed_from,
    run,
    start,
    start_ranks,
    wait_all,
    wait_for,
)
from tests.train.helpers import params, tiny_config


@pytest.fixture
def flame_log():
    """The messages of the "flame.train" logger (it does not propagate to pytest's caplog)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("flame.train").addHandler(handler)
    yield messages
    logging.getLogger("flame.train").removeHandler(handler)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return faults.write_config(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def reference(config):
    """The uninterrupted one-process run: its losses and the tensors of its final checkpoint."""
    dump = config.parent / "reference"
    done = run(config, dump)
    assert done.returncode == 0, done.output
    return losses(dump), checkpoint_tensors(dump / "checkpoint" / f"step-{STEPS}")


def assert_same_run(dump, reference, steps=STEPS, exact=True):
    """`dump` ended where the reference did: every logged loss (each restart's, repeated steps
    included) and every tensor of the final checkpoint; bitwise, or within fp32 rounding."""
    ref_losses, ref_tensors = reference
    for record in metrics(dump):
        expected = ref_losses[record["step"]]
        assert record["loss"] == (expected if exact else pytest.approx(expected, rel=1e-5)), record
    assert sorted(losses(dump)) == list(range(1, steps + 1))
    final = checkpoint_tensors(dump / "checkpoint" / f"step-{steps}")
    assert final.keys() == ref_tensors.keys()
    for key, value in ref_tensors.items():
        if exact:
            assert torch.equal(final[key], value), key
        else:
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=key)


# ---- SIGKILL at 10 points, one process -------------------------------------------------------

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


# ---- stop signals, one process: SIGTERM, SIGUSR1 from outside, a second signal ----------------

@pytest.fixture(scope="module")
def signalled(config):
    """One run stopped three times: a second signal during a save, SIGTERM, SIGUSR1 from
    outside; then resumed to its end. {stage: (result, complete steps after it)}."""
    dump = config.parent / "signalled"
    stages = {}
    stages["second signal"] = run(config, dump, faults="forward:4:SIGUSR1,save:4:SIGTERM")
    stages["second signal", "complete"] = complete_steps(dump)
    stages["sigterm"] = run(config, dump, faults="forward:5:SIGTERM")
    stages["sigterm", "complete"] = complete_steps(dump)
    log = config.parent / "signalled.sigusr1.log"
    proc = start(config, dump, faults="forward:8:sleep=3", log=log)  # the signal lands in step 8
    faults.send_when(proc, signal.SIGUSR1, lambda: "sleep=3 at forward of step 8" in log.read_text())
    proc.wait(timeout=60)
    stages["sigusr1"] = faults.Finished(proc.returncode, log.read_text())
    stages["sigusr1", "complete"] = complete_steps(dump)
    stages["sigusr1", "last logged"] = metrics(dump)[-1]["step"]
    stages["resumed"] = run(config, dump)
    return dump, stages


def test_a_second_signal_during_the_save_aborts_and_the_last_complete_checkpoint_is_used(signalled):
    dump, stages = signalled
    aborted = stages["second signal"]
    assert aborted.returncode == ABORTED_EXIT_CODE, aborted.output
    assert "SIGTERM while stopping on SIGUSR1 at step 4: aborting now" in aborted.output
    assert stages["second signal", "complete"] == [3]  # step-4 was left without COMPLETE
    assert resumed_from(stages["sigterm"].output) == 3


def test_sigterm_saves_at_the_step_where_it_stopped_and_exits_75(signalled):
    dump, stages = signalled
    stopped = stages["sigterm"]
    assert stopped.returncode == PREEMPTED_EXIT_CODE == 75, stopped.output
    assert "stopped by SIGTERM at step 5" in stopped.output
    assert stages["sigterm", "complete"] == [3, 5]


def test_sigusr1_from_outside_saves_at_the_step_where_it_stopped(signalled):
    dump, stages = signalled
    stopped = stages["sigusr1"]
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.output
    assert resumed_from(stopped.output) == 5
    assert "stopped by SIGUSR1 at step 8" in stopped.output
    assert stages["sigusr1", "last logged"] == 8
    assert stages["sigusr1", "complete"][-1] == 8


def test_the_signalled_run_resumed_equals_the_uninterrupted_one(signalled, reference):
    dump, stages = signalled
    resumed = stages["resumed"]
    assert resumed.returncode == 0, resumed.output
    assert resumed_from(resumed.output) == 8
    assert_same_run(dump, reference)


def test_sigint_in_process_saves_raises_preempted_and_restores_the_handlers(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, training={"steps": 6},
                                  checkpoint={"enable": True, "interval": 10}))
    before = signal.getsignal(signal.SIGINT)
    trainer.model.register_forward_pre_hook(
        lambda module, args: os.kill(os.getpid(), signal.SIGINT) if trainer.state.step == 1 else None)
    with pytest.raises(Preempted, match="stopped by SIGINT at step 2") as stop:
        trainer.train()
    assert stop.value.checkpoint == tmp_path / "checkpoint" / "step-2"
    assert (stop.value.checkpoint / "COMPLETE").is_file()
    assert signal.getsignal(signal.SIGINT) is before
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_stop_in_the_pipelined_loop_saves_exactly_the_weights_of_the_step_it_names(tmp_path):
    # fused AdamW queues step N+1 before step N's numbers are read: the stop decided while step 3
    # runs must pause the loop after step 3, so that step-3 holds step 3's weights, not step 4's
    def config(dump):
        return tiny_config(dump, training={"steps": 6}, optimizer={"implementation": "fused"},
                           checkpoint={"enable": True, "interval": 10})

    straight = Trainer(config(tmp_path / "straight"))
    straight.train(stop_at_step=3)
    trainer = Trainer(config(tmp_path / "stopped"))
    forwards = []

    def signal_in_the_third_step(module, args):
        forwards.append(1)
        if len(forwards) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    trainer.model.register_forward_pre_hook(signal_in_the_third_step)
    with pytest.raises(Preempted, match="stopped by SIGUSR1 at step 3"):
        trainer.train()
    saved = checkpoint_tensors(tmp_path / "stopped" / "checkpoint" / "step-3")
    for name, value in params(straight.model).items():
        assert torch.equal(saved[f"model.{name}"], value), name
    assert trainer.batches_consumed == straight.batches_consumed == 3


def test_a_repeated_signal_within_the_window_counts_once():
    signals = StopSignals(["SIGUSR1", "SIGUSR2"])
    before = signal.getsignal(signal.SIGUSR1)
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a launcher's duplicate: no abort
        assert signals.requested and signals.received == signal.SIGUSR1
        assert time.monotonic() - signals.received_at < preemption.DUPLICATE_WINDOW_S
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


# ---- time-based checkpoints ------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_interval_minutes_saves_whichever_of_steps_or_minutes_comes_first(tmp_path):
    cfg = tiny_config(tmp_path, checkpoint={"enable": True, "interval": 100, "interval_minutes": 2.0})
    clock = FakeClock()
    manager = CheckpointManager(cfg.checkpoint, str(tmp_path), clock=clock)
    assert not manager.save_due_by_time()
    clock.now += 119
    assert not manager.save_due_by_time()
    clock.now += 1
    assert manager.save_due_by_time()
    assert manager.should_save(7, 1000, time_due=True) and not manager.should_save(7, 1000)
    assert manager.should_save(100, 1000)  # the step interval still counts
    manager.save(7, {"x": torch.zeros(2)})
    assert not manager.save_due_by_time()  # the clock restarts when a save begins
    assert manager.complete_steps() == [7]


def test_interval_minutes_in_the_loop(tmp_path):
    # a timed save is due at every step boundary: every step is saved, the interval is 100
    trainer = Trainer(tiny_config(tmp_path, training={"steps": 3}, checkpoint={
        "enable": True, "interval": 100, "interval_minutes": 1e-9, "keep_latest_k": 0}))
    trainer.train()
    assert trainer.checkpointer.complete_steps() == [1, 2, 3]


# ---- one run per dump folder -----------------------------------------------------------------

@pytest.mark.slow
def test_a_second_run_on_the_folder_is_refused_and_a_killed_runs_lock_taken_over(config, tmp_path):
    dump = tmp_path / "locked"
    first = start(config, dump, faults="forward:2:hang", log=tmp_path / "first.log")
    try:
        wait_for(lambda: "fault injection: hang" in (tmp_path / "first.log").read_text(), 60,
                 "the first run to hold the lock")
        second = run(config, dump, "--training.steps", "2")
        assert second.returncode == 1, second.output
        assert f"dump folder {dump} is in use by job 'flame', pid {first.pid} on host" in second.output
        assert "--job.force_unlock true" in second.output
    finally:
        first.kill()
        first.wait()
    third = run(config, dump, "--training.steps", "2")
    assert third.returncode == 0, third.output
    assert f"taking over the lock of job 'flame', pid {first.pid}" in third.output
    assert not (dump / LOCK_NAME).exists()


def write_lock(folder, **changes) -> RunLock:
    holder = LockHolder.this_process("other")
    for name, value in changes.items():
        setattr(holder, name, value)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(dataclasses.asdict(holder)))
    return RunLock(folder, "mine")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_held_by_a_live_process_is_refused_and_names_it(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        lock = write_lock(tmp_path, pid=sleeper.pid, pid_start_ticks=None)
        with pytest.raises(RunLockedError, match=rf"in use by job 'other', pid {sleeper.pid} on host"):
            lock.acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stale_locks_are_taken_over(tmp_path, flame_log):
    lock = write_lock(tmp_path / "dead", pid=dead_pid())
    lock.acquire()
    assert lock.held and "no longer runs on this host" in flame_log[-1]
    lock.release()
    assert not (tmp_path / "dead" / LOCK_NAME).exists()
    # a pid that now belongs to another process (its start time differs)
    lock = write_lock(tmp_path / "reused", pid=os.getpid(), pid_start_ticks=1)
    lock.acquire()
    lock.release()


def test_other_hosts_locks_need_force_unlock_unless_from_the_same_slurm_job(tmp_path, monkeypatch):
    with pytest.raises(RunLockedError, match="pid 4242 on host elsewhere"):
        write_lock(tmp_path / "a", host="elsewhere", pid=4242).acquire()
    lock = write_lock(tmp_path / "b", host="elsewhere", pid=4242)
    lock.force = True
    lock.acquire()
    lock.release()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeue of job 77 on another node
    lock = write_lock(tmp_path / "c", host="elsewhere", pid=4242, slurm_job_id="77",
                      slurm_restart_count=0)
    lock.acquire()
    lock.release()
    with pytest.raises(RunLockedError):  # the same incarnation: maybe another step of it
        write_lock(tmp_path / "d", host="elsewhere", pid=4242, slurm_job_id="77",
                   slurm_restart_count=1).acquire()


def test_release_leaves_a_lock_that_another_run_took(tmp_path):
    lock = RunLock(tmp_path, "mine")
    lock.acquire()
    (tmp_path / LOCK_NAME).write_text('{"host": "x", "pid": 1}')  # forced away by another run
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()


# ---- a full or unwritable disk during a save --------------------------------------------------

@contextmanager
def failing_writes(monkeypatch, step: int, error: int):
    """DCP's file writes into step-N fail with `error` after a few bytes (a disk filling up)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            if f"step-{step}" in str(path) and "w" in mode:
                stream.write(b"\0" * 16)
                raise OSError(error, os.strerror(error), str(path))
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    yield
    monkeypatch.setattr(FileSystem, "create_stream", real)


def disk_config(dump, **checkpoint):
    return tiny_config(dump, training={"steps": 6}, checkpoint={
        "enable": True, "interval": 2, "keep_latest_k": 1, **checkpoint})


@pytest.fixture(scope="module")
def straight_disk_run(tmp_path_factory):
    trainer = Trainer(disk_config(tmp_path_factory.mktemp("disk") / "straight"))
    trainer.train()
    return params(trainer.model)


def test_a_full_disk_stops_the_run_and_loses_nothing(tmp_path, monkeypatch, straight_disk_run):
    trainer = Trainer(disk_config(tmp_path))
    with failing_writes(monkeypatch, 4, errno.ENOSPC):
        with pytest.raises(CheckpointError, match=r"saving step 4 to .*step-4 failed: .*OSError: "
                           r"\[Errno 28\] No space left on device.*partial folder was removed.*"
                           r"step-2, is intact"):
            trainer.train()
    assert complete_steps(tmp_path) == [2] and not (tmp_path / "checkpoint" / "step-4").exists()
    resumed = Trainer(disk_config(tmp_path))  # keep_latest_k pruned nothing on the failed save
    assert resumed.state.step == 2
    resumed.train()
    for name, value in straight_disk_run.items():
        assert torch.equal(params(resumed.model)[name], value), name


def test_with_continue_training_goes_on_and_the_next_save_retries(tmp_path, monkeypatch, flame_log,
                                                                  straight_disk_run):
    trainer = Trainer(disk_config(tmp_path, on_save_error="continue", keep_latest_k=0))
    with failing_writes(monkeypatch, 4, errno.EROFS):
        trainer.train()
    warning = next(m for m in flame_log if "saving step 4" in m and "failed" in m)
    assert "Read-only file system" in warning and "the next save tries again" in warning
    assert complete_steps(tmp_path) == [2, 6]
    assert not (tmp_path / "checkpoint" / "step-4").exists()
    for name, value in straight_disk_run.items():
        assert torch.equal(params(trainer.model)[name], value), name


def test_a_failed_marker_write_removes_the_folder_and_the_final_save_must_succeed(tmp_path,
                                                                                  monkeypatch):
    import flame.train.checkpoint as checkpoint

    def full_for_markers(path, *args, **kwargs):
        if str(path).endswith("COMPLETE"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return open(path, *args, **kwargs)

    trainer = Trainer(disk_config(tmp_path, on_save_error="continue"))
    trainer.train(stop_at_step=2)
    monkeypatch.setattr(checkpoint, "open", full_for_markers, raising=False)
    with pytest.raises(CheckpointError, match=r"step 6 .* failed: writing .*step-6/COMPLETE: "
                       r"OSError.*the final or a stop signal's save"):
        trainer.train()
    monkeypatch.undo()
    assert complete_steps(tmp_path) == [2]  # 4 and 6 failed; 2 was never pruned


# ---- two processes ---------------------------------------------------------------------------

TWO_RANK_STEPS = 8


@pytest.fixture(scope="module")
def two_rank_reference(config):
    dump = config.parent / "two-rank-reference"
    results = wait_all(start_ranks(config, dump, "--training.steps", str(TWO_RANK_STEPS)))
    assert [r.returncode for r in results] == [0, 0], results[0].output + results[1].output
    return losses(dump), checkpoint_tensors(dump / "checkpoint" / f"step-{TWO_RANK_STEPS}")


@pytest.fixture(scope="module")
def two_rank_story(config):
    """Two ranks without a launcher: rank 1 gets SIGUSR1; then rank 1 is killed; then it hangs
    (1.5 s collective timeout); then the run goes to its end. {stage: (results, seconds)}."""
    dump = config.parent / "two-ranks"
    steps = ("--training.steps", str(TWO_RANK_STEPS))
    stories = {}
    for stage, faults_, extra in (
        ("signal", "forward:4:SIGUSR1:rank=1", ()),
        ("killed", "forward:6:rank=1", ()),
        ("hung", "forward:6:hang:rank=1", ("--parallel.collective_timeout_minutes", "0.025")),
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
    assert "Timed out" in rank0.output and "collective_timeout_minutes = 0.025 min" in rank0.output
    assert resumed_from(rank0.output) == 4


@pytest.mark.slow
def test_the_two_rank_run_resumed_equals_the_uninterrupted_one(two_rank_story, two_rank_reference):
    dump, stories = two_rank_story
    results, _, _ = stories["end"]
    assert [r.returncode for r in results] == [0, 0], results[0].output
    assert resumed_from(results[0].output) == 4
    assert_same_run(dump, two_rank_reference, TWO_RANK_STEPS, exact=False)


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
    assert_same_run(dump, two_rank_reference, TWO_RANK_STEPS, exact=False)



# ---- Slurm: the batch script forwards the time-limit signal and requeues ---------------------

def test_the_batch_script_asks_for_the_signal_and_requeues():
    sbatch = (faults.ROOT / "launch" / "slurm.sbatch").read_text()
    for script in ("slurm.sbatch", "train.sh"):
        assert subprocess.run(["bash", "-n", str(faults.ROOT / "launch" / script)]).returncode == 0
    directives = [line.split()[1] for line in sbatch.splitlines() if line.startswith("#SBATCH")]
    assert "--signal=B:USR1@300" in directives and "--requeue" in directives
    assert 'scontrol requeue "$SLURM_JOB_ID"' in sbatch and "trap forward_stop USR1" in sbatch
    assert "SIGUSR1" in (faults.ROOT / "launch" / "train.sh").read_text()


def slurm_shims(folder):
    """Stand-ins for srun (runs its command in place) and scontrol (records requeues)."""
    folder.mkdir()
    (folder / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                 'exec "$@"\n')
    (folder / "scontrol").write_text('#!/usr/bin/env bash\ncase "$1" in\n'
                                     '  show) echo 127.0.0.1 ;;\n'
                                     '  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;\n'
                                     'esac\n')
    for shim in ("srun", "scontrol"):
        (folder / shim).chmod(0o755)
    return folder


@pytest.mark.slow
def test_slurm_time_limit_signal_saves_requeues_and_the_requeued_job_resumes(config, tmp_path):
    shims, dump, requeues = slurm_shims(tmp_path / "bin"), tmp_path / "slurm-run", tmp_path / "requeues"

    def sbatch(restart: int, fault: str, log):
        env = faults.environment(fault, SLURM_NNODES="1", SLURM_JOB_NODELIST="node0",
                                 SLURM_JOB_ID="4242", SLURM_NODEID="0",
                                 SLURM_RESTART_COUNT=str(restart), NGPU="1",
                                 MASTER_PORT=str(faults.free_port()), LOG_DIR=str(tmp_path / "logs"),
                                 SCONTROL_LOG=str(requeues), SHUTDOWN_TIMEOUT="60")
        env["PATH"] = os.pathsep.join([str(shims), os.path.dirname(sys.executable), env["PATH"]])
        return subprocess.Popen(["bash", "launch/slurm.sbatch", "--config", str(config),
                                 "--job.dump_folder", str(dump)], cwd=faults.ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)

    with open(tmp_path / "first.log", "w") as log:
        job = sbatch(0, "forward:3:sleep=4", log)  # step 3 lasts 4 s more: the signal lands in it
        faults.send_when(job, signal.SIGUSR1,
                         lambda: "sleep=4 at forward of step 3" in (tmp_path / "first.log").read_text())
        assert job.wait(timeout=120) == 0
    output = (tmp_path / "first.log").read_text()
    assert "SIGUSR1 from Slurm" in output and "stopped by SIGUSR1 at step 3" in output, output
    assert requeues.read_text() == "requeue 4242\n"
    assert complete_steps(dump) == [3] and not (dump / LOCK_NAME).exists()

    with open(tmp_path / "second.log", "w") as log:
        assert sbatch(1, "", log).wait(timeout=120) == 0
    output = (tmp_path / "second.log").read_text()
    assert resumed_from(output) == 3 and "exit status 0" in output, output
    assert requeues.read_text() == "requeue 4242\n"  # done: not requeued again
    assert complete_steps(dump) == [9, 12]


def test_a_stalled_step_is_named_before_the_collective_timeout(flame_log):
    from flame.train.parallel import StallWarning

    watch = StallWarning(rank=1, timeout_minutes=0.005, poll_seconds=0.02)  # 0.3 s
    try:
        watch.step_done(41)
        wait_for(lambda: any("since step 41" in m for m in flame_log), 5, "the stall warning")
    finally:
        watch.close()
    assert "rank 1: no step finished" in flame_log[-1] and "hangs in step 42" in flame_log[-1]
