"""Non-finite steps: skipped on every rank, parameters and optimizer state untouched, counted.

Each case runs with the for-loop AdamW, whose update waits for the host to read the step's
numbers, and with fused AdamW, whose update is queued behind a device-side finite check."""

import math

import pytest
import torch

from flame.train.step_pipeline import Outcome
from flame.train.trainer import NonFiniteTrainingError, Trainer
from tests.train.helpers import params, random_batches, split_rows, tiny_config


def batches(seed):
    input_ids, labels = random_batches(2, 16, seed=seed)
    return split_rows(input_ids, labels, 2)


def optimizer_state(trainer):
    return {
        (g, i, k): v.clone() if torch.is_tensor(v) else v
        for g, group in enumerate(trainer.optimizer.param_groups)
        for i, p in enumerate(group["params"])
        for k, v in trainer.optimizer.state[p].items()
    }


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture(params=["for-loop", "fused"])
def implementation(request):
    return request.param


@pytest.fixture
def trainer(tmp_path, implementation):
    cfg = tiny_config(tmp_path, training={"steps": 10, "max_consecutive_nan_steps": 3},
                      optimizer={"implementation": implementation})
    return Trainer(cfg, dataloader=())  # the tests feed their own micro-batches


def test_nan_in_the_batch_skips_the_step(trainer):
    trainer.train_step(batches(0))  # one good step, so the optimizer has state
    before_params, before_opt = params(trainer.model), optimizer_state(trainer)
    lr_epoch = trainer.lr_scheduler.last_epoch

    # a NaN in the embedded batch, as a corrupt input would produce
    hook = trainer.model.embeddings.register_forward_hook(lambda m, i, out: out * math.nan)
    result = trainer.train_step(batches(1))
    hook.remove()

    assert result.outcome is Outcome.SKIPPED and result.skipped and math.isnan(result.loss)
    assert result.first_nonfinite_param is not None
    assert_same(params(trainer.model), before_params)
    assert_same(optimizer_state(trainer), before_opt)
    assert trainer.lr_scheduler.last_epoch == lr_epoch  # the schedule does not advance
    assert all(p.grad is None for p in trainer.model.parameters())  # gradients zeroed
    assert (trainer.state.nan_skips, trainer.state.consecutive_nan_skips) == (1, 1)

    # training continues, and the streak counter resets
    result = trainer.train_step(batches(2))
    assert result.outcome is Outcome.OK and not result.skipped and math.isfinite(result.loss)
    assert trainer.lr_scheduler.last_epoch == lr_epoch + 1
    assert (trainer.state.nan_skips, trainer.state.consecutive_nan_skips) == (1, 0)
    assert trainer.state.step == 3


def test_inf_in_one_gradient_skips_the_step_and_names_the_parameter(trainer):
    trainer.train_step(batches(0))
    before_params, before_opt = params(trainer.model), optimizer_state(trainer)
    name, param = list(trainer.model.named_parameters())[-1]
    hook = param.register_hook(lambda g: torch.full_like(g, math.inf))
    result = trainer.train_step(batches(1))
    hook.remove()

    assert result.skipped and math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
    assert result.first_nonfinite_param == name
    assert_same(params(trainer.model), before_params)
    assert_same(optimizer_state(trainer), before_opt)
    assert trainer.state.nan_skips == 1
    assert not trainer.train_step(batches(2)).skipped


def test_too_many_consecutive_nan_steps_stop_the_run(trainer):
    hook = trainer.model.embeddings.register_forward_hook(lambda m, i, out: out * math.nan)
    trainer.train_step(batches(0))
    trainer.train_step(batches(1))
    with pytest.raises(NonFiniteTrainingError, match="max_consecutive_nan_steps = 3"):
        trainer.train_step(batches(2))
    hook.remove()
    assert trainer.state.nan_skips == 3


def test_nan_recovery_reloads_the_last_good_checkpoint_and_skips_the_data(tmp_path, implementation):
    cfg = tiny_config(tmp_path, training={"steps": 10, "max_consecutive_nan_steps": 2,
                                          "nan_recovery": True},
                      checkpoint={"enable": True, "interval": 2}, optimizer={"implementation": implementation})
    trainer = Trainer(cfg)
    trainer.train(stop_at_step=2)
    good = params(trainer.model)
    trainer.train_step(trainer.next_micro_batches())  # step 3: fine, not checkpointed
    hook = trainer.model.embeddings.register_forward_hook(lambda m, i, out: out * math.nan)
    assert trainer.train_step(trainer.next_micro_batches()).outcome is Outcome.SKIPPED  # step 4
    # step 5: skipped, the second in a row
    assert trainer.train_step(trainer.next_micro_batches()).outcome is Outcome.RELOADED
    hook.remove()
    assert trainer.state.step == 2  # back at the checkpoint ...
    assert_same(params(trainer.model), good)
    assert trainer.batches_consumed == 5  # ... but the data goes on after the bad window
    assert (trainer.state.nan_skips, trainer.state.consecutive_nan_skips) == (2, 0)
    assert not trainer.train_step(trainer.next_micro_batches()).skipped
    assert trainer.state.step == 3


def test_a_nan_born_in_the_forward_is_traced_to_its_module(trainer):
    trainer.train_step(batches(0))
    # the NaN appears inside layer 1's attention: its inputs are finite, its output is not
    target = trainer.model.layers[1].attn
    hook = target.register_forward_hook(
        lambda m, i, out: (out[0] * math.nan, *out[1:]) if isinstance(out, tuple) else out * math.nan)
    result = trainer.train_step(batches(1))
    hook.remove()
    assert result.skipped and math.isnan(result.loss)
    assert result.first_nonfinite_module is not None
    assert result.first_nonfinite_module.startswith("layers.1.attn ("), result.first_nonfinite_module
    # a finite loss with a non-finite gradient runs no forward search
    name, param = list(trainer.model.named_parameters())[-1]
    grad_hook = param.register_hook(lambda g: torch.full_like(g, math.inf))
    result = trainer.train_step(batches(2))
    grad_hook.remove()
    assert result.skipped and result.first_nonfinite_module is None


def test_the_stop_message_says_when_no_checkpoint_exists(tmp_path, implementation):
    cfg = tiny_config(tmp_path, training={"steps": 10, "max_consecutive_nan_steps": 2},
                      checkpoint={"enable": False}, optimizer={"implementation": implementation})
    trainer = Trainer(cfg, dataloader=())
    hook = trainer.model.embeddings.register_forward_hook(lambda m, i, out: out * math.nan)
    trainer.train_step(batches(1))
    with pytest.raises(NonFiniteTrainingError, match="no checkpoint was written .*checkpoint.enable = false"):
        trainer.train_step(batches(2))
    hook.remove()
