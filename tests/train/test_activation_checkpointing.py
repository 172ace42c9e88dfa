"""Activation checkpointing recomputes the blocks in the backward: same loss and gradients."""

import pytest
import torch

from flame.train.trainer import Trainer
from tests.train.helpers import grads, random_batches, split_rows, tiny_config


def first_step(tmp_path, mode):
    trainer = Trainer(tiny_config(tmp_path / mode, training={"activation_checkpoint": mode}),
                      dataloader=())
    input_ids, labels = random_batches(2, 16, seed=3)
    loss, _ = trainer.forward_backward(split_rows(input_ids, labels, 2))
    return trainer, loss, grads(trainer.model)


@pytest.mark.parametrize("mode", ["full", "selective", "elementwise"])
def test_activation_checkpointing_keeps_loss_and_gradients(tmp_path, mode):
    _, loss_ref, grads_ref = first_step(tmp_path, "none")
    trainer, loss, grads_ac = first_step(tmp_path, mode)
    wrapped = [type(block).__name__ for block in trainer.model.layers]
    assert all(name == "CheckpointWrapper" for name in wrapped), wrapped
    assert torch.equal(loss, loss_ref)
    # parameter names gain the wrapper's prefix; the values must not change
    strip = lambda name: name.replace("._checkpoint_wrapped_module", "")
    assert {strip(n) for n in grads_ac} == set(grads_ref)
    for name, value in grads_ac.items():
        torch.testing.assert_close(value, grads_ref[strip(name)], rtol=1e-6, atol=1e-8)


def test_unknown_activation_checkpoint_mode_is_named(tmp_path):
    with pytest.raises(ValueError, match="activation_checkpoint"):
        Trainer(tiny_config(tmp_path, training={"activation_checkpoint": "sometimes"}),
                dataloader=())
