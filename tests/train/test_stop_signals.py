"""Stop signals in one process: SIGTERM, SIGUSR1 from outside, SIGINT, a second signal during the
save, a repeated signal; each stop saves at the step where it stopped and exits with its code, and the
run resumed from that checkpoint ends bitwise equal to the uninterrupted one."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from flame.train import preemption
from flame.train.preemption import ABORTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Preempted, StopSignals
from flame.train.run_lock import LOCK_NAME
from flame.train.trainer import Trainer
from tests.train import faults
from tests.train.faults import (
    assert_same_run, checkpoint_tensors, complete_steps, metrics, resumed_from, run, start,
)
from tests.train.helpers import params, tiny_config

pytestmark = pytest.mark.xdist_group("stop_signals")
"""One pytest worker runs this module (scripts/test.sh distributes with --dist loadgroup), so that
its module fixtures, the signalled run and its reference, run once."""


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
