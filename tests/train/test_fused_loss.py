"""The trainer's fused loss (model(..., labels=, loss_scale=), flame.ops.linear_cross_entropy) equals
the plain path it replaces: logits, cross_entropy_sum / step valid-token count, and RWKV's L2Wrap
through flame.models.l2wrap (flame.train.loss.micro_batch_loss)."""

from __future__ import annotations

import pytest
import torch

from flame.models import build_model, l2wrap
from flame.train.loss import count_valid_tokens, cross_entropy_sum, micro_batch_loss
from flame.train.trainer import Trainer
from tests.models.helpers import tiny_args
from tests.train.helpers import grads, random_batches, split_rows, tiny_config


def plain_forward_backward(trainer, micro_batches, use_l2wrap):
    """The step's loss and gradients on materialised logits."""
    valid_tokens = count_valid_tokens(micro_batches)
    total = torch.zeros(())
    for batch in micro_batches:
        logits, labels = trainer.pipeline.forward(batch)
        loss = micro_batch_loss(logits, labels, valid_tokens, l2wrap if use_l2wrap else None)
        loss.backward()
        total += loss.detach()
    return total


@pytest.mark.parametrize("family,use_l2wrap", [("rwkv7", True), ("rwkv7", False), ("rwkv6", True)])
def test_fused_step_equals_the_plain_logits_step(tmp_path, family, use_l2wrap):
    cfg = tiny_config(tmp_path, model={"family": family, "l2wrap": use_l2wrap},
                      training={"batch_size": 2, "gradient_accumulation_steps": 2})
    trainer = Trainer(cfg, dataloader=())
    assert trainer.model.l2wrap is use_l2wrap
    input_ids, labels = random_batches(4, 16, seed=3)
    labels[0, 5:] = -100  # uneven valid counts between the two micro-batches
    labels[3, :2] = -100
    micro_batches = split_rows(input_ids, labels, 2)

    gradients = trainer.pipeline.gradients(micro_batches)
    loss, valid_tokens = gradients.loss_sum, gradients.valid_tokens
    fused_grads = grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    plain_loss = plain_forward_backward(trainer, micro_batches, use_l2wrap)
    plain_grads = grads(trainer.model)

    assert valid_tokens == int((labels != -100).sum())
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    assert fused_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        scale = float(plain_grads[name].abs().max())
        torch.testing.assert_close(fused_grads[name], plain_grads[name], rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m: f"{name}: {m}")


def test_model_loss_matches_its_logits_and_l2wrap_follows_the_family_args():
    model = build_model(tiny_args("rwkv7"))
    assert model.l2wrap is True
    assert build_model(tiny_args("rwkv7", l2wrap=False)).l2wrap is False
    assert build_model(tiny_args("rwkv6")).l2wrap is True  # RWKV-LM's x060 step has L2Wrap too
    assert build_model(tiny_args("rwkv6", l2wrap=False)).l2wrap is False
    assert build_model(tiny_args("gsa")).l2wrap is False
    input_ids, labels = random_batches(2, 10, seed=4)
    input_ids, labels = input_ids % 97, labels % 97
    labels[1, 3:] = -100
    with torch.no_grad():
        want = cross_entropy_sum(model(input_ids), labels) / 7
        got = model(input_ids, labels=labels, loss_scale=1 / 7)
    assert got.dim() == 0 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="labels must have the shape of input_ids"):
        model(input_ids, labels=labels[:, :5])


def test_validation_loss_is_the_token_mean_of_the_plain_ce(tmp_path):
    cfg = tiny_config(tmp_path, metrics={"val_steps": 2})
    trainer = Trainer(cfg, dataloader=())
    input_ids, labels = random_batches(4, 16, seed=5)
    labels[1, 4:] = -100
    trainer.val_loader = split_rows(input_ids, labels, 2)
    with torch.no_grad():
        logits = trainer.model(input_ids)
        want = cross_entropy_sum(logits, labels).item() / int((labels != -100).sum())
    assert trainer.validation_loss() == pytest.approx(want, rel=1e-6)
    assert trainer.model.training
