"""The logged step time is the device time of that step: with the loop reading step N after it
queues step N+1, each step's time runs from the previous step's numbers to its own, so the times of
a run add up to its time on the device and the last step is no exception."""

import json

from flame.train import readback
from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config


def test_each_logged_step_time_is_that_steps_own(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(readback, "host_clock", lambda: clock[0])
    cfg = tiny_config(tmp_path, training={"steps": 6, "gradient_accumulation_steps": 2},
                      optimizer={"implementation": "fused"}, metrics={"log_freq": 1})
    trainer = Trainer(cfg)

    def one_second_per_forward(module, args):
        clock[0] += 1.0

    trainer.model.register_forward_pre_hook(one_second_per_forward)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["step_time_s"] for r in steps] == [2.0] * 6  # two micro-batches, one second each
    tokens = cfg.training.batch_size * cfg.training.seq_len * 2
    assert [r["tokens_per_s"] for r in steps] == [tokens / 2.0] * 6
