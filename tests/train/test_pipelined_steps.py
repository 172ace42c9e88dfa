"""The training loop queues step N+1 before it reads step N's numbers (fused AdamW, whose update
waits on a device-side finite check). It must train exactly as one step at a time: the same
losses, skips, checkpoint reloads and final weights, bitwise."""

import json
import math

import torch

from flame.train.trainer import Trainer
from tests.train.helpers import params, random_batches, tiny_config

POISON = 13  # a batch holding this token id turns non-finite in the embedding


def batches(count):
    """`count` micro-batches; those at indices 3 and 4 (steps 4 and 5) carry the poison token."""
    out = []
    for index in range(count):
        input_ids, labels = random_batches(2, 16, seed=100 + index)
        input_ids[input_ids == POISON] = POISON + 1
        if index in (3, 4):
            input_ids[0, 3] = POISON
        out.append({"input_ids": input_ids, "labels": labels})
    return out


def poison(trainer):
    return trainer.model.embeddings.register_forward_hook(
        lambda module, inputs, out: out * math.nan if bool((inputs[0] == POISON).any()) else out)


def logged(trainer):
    lines = (trainer.dump_folder / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["step"], r["loss"], r["grad_norm"], r.get("skipped", False)) for r in records if "loss" in r]


def run(tmp_path, pipelined):
    cfg = tiny_config(tmp_path, training={"steps": 9, "max_consecutive_nan_steps": 2, "nan_recovery": True},
                      optimizer={"implementation": "fused"}, checkpoint={"enable": True, "interval": 3})
    trainer = Trainer(cfg, dataloader=batches(16))
    hook = poison(trainer)
    if pipelined:
        trainer.train()
    else:
        while trainer.state.step < cfg.training.steps:
            trainer.finish_step(trainer.train_step(trainer.next_micro_batches()))
    hook.remove()
    return trainer


def test_the_pipelined_loop_trains_as_one_step_at_a_time(tmp_path):
    queued = run(tmp_path / "pipelined", pipelined=True)
    one_by_one = run(tmp_path / "one_by_one", pipelined=False)

    rows = logged(queued)
    assert [r[3] for r in rows].count(True) == 2  # the two poisoned steps were skipped ...
    assert [r[0] for r in rows] == [1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 9]  # ... and the streak reloaded step 3
    assert repr(rows) == repr(logged(one_by_one))  # NaN-aware: the same numbers, in the same order
    assert queued.state == one_by_one.state
    assert queued.batches_consumed == one_by_one.batches_consumed == 11  # 5, then steps 4-9 again
    for (name, a), b in zip(params(queued.model).items(), params(one_by_one.model).values()):
        assert torch.equal(a, b), name
    assert queued.checkpointer.complete_steps() == one_by_one.checkpointer.complete_steps() == [3, 6, 9]
    for step in (3, 6, 9):  # every checkpoint holds exactly its step's weights
        a, b = (saved_weights(t, step) for t in (queued, one_by_one))
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)


def saved_weights(trainer, step):
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty_like(v) for k, v in trainer.model.state_dict().items()}
    dcp.load({"model": state}, checkpoint_id=str(trainer.checkpointer.step_dir(step)))
    return state
