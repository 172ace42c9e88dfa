"""Time-based checkpoints: `checkpoint.interval_minutes` saves at whichever of the step interval and
the minutes comes first."""

from __future__ import annotations


import torch

from flame.train.checkpoint import CheckpointManager
from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config


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
