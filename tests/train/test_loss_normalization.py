"""Abnormal loss with gradient accumulation, a known failure
(docs/known-failures.md#loss-scaled-by-gradient-accumulation).

The loss and gradients of one optimizer step must be identical for any split of the same global
batch into micro-batches, accumulation steps (and ranks: see test_distributed.py), including
micro-batches with different numbers of valid tokens.
"""

import pytest
import torch
import torch.nn.functional as F

from flame.train.loss import count_valid_tokens
from flame.train.trainer import Trainer
from tests.train.helpers import grads, params, random_batches, split_rows, tiny_config

SEQ = 16
STEPS = 3


def make_trainer(tmp_path, name, batch_size, ga):
    cfg = tiny_config(tmp_path / name, training={
        "batch_size": batch_size, "gradient_accumulation_steps": ga, "seq_len": SEQ,
        "steps": STEPS,
    })
    trainer = Trainer(cfg, dataloader=())  # the tests feed their own micro-batches
    # Adam's update g / (sqrt(v) + eps) turns fp32 rounding differences of a gradient entry near 0
    # into differences of up to lr per step, which depend on the CPU and its thread count; an eps above
    # that noise keeps such entries' updates small, while any real normalization error (a relative
    # change of the gradients) still moves the parameters
    for group in trainer.optimizer.param_groups:
        group["eps"] = 1e-6
    return trainer


def step_data(uneven: bool):
    """Three steps of 8 rows each; with `uneven`, the micro-batches of 2 rows have 32, 20, 9
    and 1 valid labels (padding and masked document boundaries)."""
    data = []
    for step in range(STEPS):
        input_ids, labels = random_batches(8, SEQ, seed=100 + step)
        if uneven:
            labels[2, 4:] = -100
            labels[4:6, 3:] = -100
            labels[6, 1:] = -100
            labels[7, :] = -100
            labels[5, 0] = -100
        data.append((input_ids, labels))
    return data


def assert_tensors_close(a: dict, b: dict, rtol: float, atol: float, atol_of_max: bool = False):
    """Per tensor, |a - b| <= atol + rtol * |b|; with `atol_of_max` the absolute part is atol *
    max|b|, relative to the tensor's own scale: summation order (the thread count) moves small
    entries of a gradient by a few ulps of its largest entry."""
    assert a.keys() == b.keys()
    for name in a:
        scale = float(b[name].abs().max()) if atol_of_max and b[name].numel() else 1.0
        torch.testing.assert_close(a[name], b[name], msg=lambda m: f"{name}: {m}", rtol=rtol,
                                   atol=atol * scale)


def run_and_compare(tmp_path, uneven: bool):
    whole = make_trainer(tmp_path, "b8ga1", batch_size=8, ga=1)
    split = make_trainer(tmp_path, "b2ga4", batch_size=2, ga=4)
    assert_tensors_close(params(whole.model), params(split.model), rtol=0, atol=0)
    data = step_data(uneven)

    # gradients of the first step, before any update
    input_ids, labels = data[0]
    g_whole = whole.pipeline.gradients(split_rows(input_ids, labels, 8))
    g_split = split.pipeline.gradients(split_rows(input_ids, labels, 2))
    loss_whole, n_whole, loss_split, n_split = g_whole.loss_sum, g_whole.valid_tokens, g_split.loss_sum, g_split.valid_tokens
    assert n_whole == n_split == int((labels != -100).sum())
    torch.testing.assert_close(loss_split, loss_whole, rtol=1e-6, atol=0)
    assert_tensors_close(grads(split.model), grads(whole.model), rtol=1e-5, atol=1e-5, atol_of_max=True)
    whole.optimizer.zero_grad()
    split.optimizer.zero_grad()

    # three optimizer steps: same losses, same parameters
    for input_ids, labels in data:
        r_whole = whole.train_step(split_rows(input_ids, labels, 8))
        r_split = split.train_step(split_rows(input_ids, labels, 2))
        assert not r_whole.skipped and not r_split.skipped
        assert r_split.loss == pytest.approx(r_whole.loss, rel=1e-6)
        assert r_split.grad_norm == pytest.approx(r_whole.grad_norm, rel=1e-5)
    assert_tensors_close(params(split.model), params(whole.model), rtol=1e-5, atol=3e-5)
    return whole, data


def test_batch8_ga1_equals_batch2_ga4(tmp_path):
    run_and_compare(tmp_path, uneven=False)


def test_uneven_valid_tokens_use_the_token_mean(tmp_path):
    whole, data = run_and_compare(tmp_path, uneven=True)

    # the logged loss is the token mean over the whole step; the mean of micro-batch means is not
    input_ids, labels = data[0]
    fresh = make_trainer(tmp_path, "check", batch_size=8, ga=1)
    with torch.no_grad():
        logits = fresh.model(input_ids).float()
        token_mean = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=-100)
        micro_means = [
            F.cross_entropy(logits[i:i + 2].reshape(-1, logits.shape[-1]),
                            labels[i:i + 2].reshape(-1), ignore_index=-100)
            for i in range(0, 8, 2)
        ]
    mean_of_means = torch.stack(micro_means).mean()
    result = fresh.train_step(split_rows(input_ids, labels, 2))
    assert result.loss == pytest.approx(token_mean.item(), rel=1e-6)
    assert abs(mean_of_means.item() - token_mean.item()) > 1e-3 * token_mean.item()


def plain_backward_grads(trainer, micro_batches):
    """The step's gradients as the sum of each micro-batch's gradients from a plain
    `loss.backward()` into fresh .grad tensors (the trainer's .grad is None before and after)."""
    scale = 1.0 / max(count_valid_tokens(micro_batches), 1)
    total: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.pipeline.loss(batch, scale).backward()
        for name, grad in grads(trainer.model).items():
            total[name] = total[name] + grad if name in total else grad
    trainer.optimizer.zero_grad(set_to_none=True)
    return total


def test_accumulated_gradients_are_the_sum_of_the_micro_batch_gradients(tmp_path):
    """GA 3: after `pipeline.gradients` every gradient is the sum of the three micro-batches' plain
    backward gradients, in two consecutive steps with an update between them (nothing of the first
    step stays in the second); the second step's last micro-batch has no valid label."""
    trainer = make_trainer(tmp_path, "ga3", batch_size=2, ga=3)
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    for step in range(2):
        input_ids, labels = random_batches(6, SEQ, seed=200 + step)
        labels[1, 7:] = -100
        if step == 1:
            labels[4:, :] = -100
        micro_batches = split_rows(input_ids, labels, 2)
        want = plain_backward_grads(trainer, micro_batches)
        trainer.pipeline.gradients(micro_batches)
        got = grads(trainer.model)
        assert got.keys() == want.keys() == trainable
        assert_tensors_close(got, want, rtol=1e-6, atol=1e-6, atol_of_max=True)
        trainer.train_step(micro_batches)  # the update between the two steps
        assert all(p.grad is None for p in trainer.model.parameters())


def test_a_parameter_the_loss_does_not_reach_gets_a_zero_gradient(tmp_path):
    """A parameter that no micro-batch of a step uses ends the step with a zero gradient, also
    when it had one in the step before; one used by some micro-batches (not the first) gets the
    sum over those."""
    from torch import nn

    from flame.models import build_model

    def with_extra_parameters(args):
        model = build_model(args)
        model.never = nn.Parameter(torch.empty(3))
        model.sometimes = nn.Parameter(torch.empty(args.hidden_size))
        # `sometimes` enters the micro-batches whose first token id is odd
        model.embeddings.register_forward_hook(
            lambda module, inputs, out: out + model.sometimes if int(inputs[0][0, 0]) % 2 else out)
        return model

    cfg = tiny_config(tmp_path, training={"batch_size": 2, "gradient_accumulation_steps": 3, "seq_len": SEQ})
    trainer = Trainer(cfg, dataloader=(), model_factory=with_extra_parameters)
    with torch.no_grad():
        trainer.model.never.fill_(0.5)
        trainer.model.sometimes.fill_(0.01)
    for step, odd_micro_batches in enumerate([(1, 2), ()]):
        input_ids, labels = random_batches(6, SEQ, seed=300 + step)
        input_ids[:, 0] = input_ids[:, 0] // 2 * 2
        for index in odd_micro_batches:
            input_ids[2 * index, 0] += 1
        micro_batches = split_rows(input_ids, labels, 2)
        want = plain_backward_grads(trainer, micro_batches)
        trainer.pipeline.gradients(micro_batches)
        got = grads(trainer.model)
        assert torch.equal(got["never"], torch.zeros(3))
        if odd_micro_batches:
            assert want["sometimes"].abs().max() > 0
        else:
            assert "sometimes" not in want
            want["sometimes"] = torch.zeros(cfg.model.hidden_size)
        want["never"] = torch.zeros(3)
        assert_tensors_close(got, want, rtol=1e-6, atol=1e-6, atol_of_max=True)
        trainer.pipeline.zero_grad()
