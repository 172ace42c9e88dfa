"""Activation checkpointing recomputes the blocks in the backward: same loss and gradients."""

import pytest
import torch

from flame.train.trainer import Trainer
from tests.train.helpers import grads, random_batches, split_rows, tiny_config


def first_step(tmp_path, mode):
    trainer = Trainer(tiny_config(tmp_path / mode, training={"activation_checkpoint": mode}),
                      dataloader=())
    input_ids, labels = random_batches(2, 16, seed=3)
    loss = trainer.pipeline.gradients(split_rows(input_ids, labels, 2)).loss_sum
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


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["rwkv7", "rwkv6"])
def test_elementwise_policy_saves_the_weight_casts_and_recomputes_the_glue(tmp_path, family):
    """Compiled under autocast, an "elementwise" block's backward recomputes its norms and static
    lerps but takes autocast's bf16 copies of the weights from the forward (a recomputed cast would
    read every fp32 weight a second time per micro-batch) and RWKV6's data-dependent lerps."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from flame.models import build_model
    from flame.ops.utils.checks import set_value_checks, value_checks_enabled
    from flame.train.activation_checkpoint import recompute_elementwise

    cfg = tiny_config(tmp_path, model={"family": family, "hidden_size": 64, "num_layers": 2, "head_dim": 16,
                                       "backend": "triton"})
    model = build_model(cfg.model)
    model.init_weights()
    block = recompute_elementwise(model.layers[1])
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm.graph
            return gm
        return compiler

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                     partition_fn=min_cut_rematerialization_partition)

    checks = value_checks_enabled()
    set_value_checks(False)  # their host read would break the graph
    try:
        compiled = torch.compile(block, backend=backend)
        x = torch.randn(2, 32, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x, torch.randn(2, 32, 64)) if family == "rwkv7" else compiled(x)
        if family == "rwkv7":
            out = out[0]
        out.float().sum().backward()
    finally:
        set_value_checks(checks)

    backward = graphs["backward"]
    inputs = {node for node in backward.nodes if node.op == "placeholder"}
    recasts = [node for node in backward.nodes
               if node.target in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
               and node.args[0] in inputs and node.args[0].meta["val"].dtype == torch.float32
               and node.args[0].meta["val"].dim() == 2]
    assert not recasts, [str(node) for node in recasts]
    recomputed = {node.target for node in backward.nodes}
    # both norms: the block's first, and the second with the residual add before it
    assert {torch.ops.flame.norm_fwd.default, torch.ops.flame.add_norm_fwd.default} <= recomputed
    lerps = [node for node in backward.nodes if node.target == torch.ops.flame.token_shift_mix_fwd.default]
    # recomputed: RWKV7's six static lerps, RWKV6's channel-mix pair; kept: single lerps and RWKV6's
    # data-dependent ones
    assert sorted(node.args[1].meta["val"].shape[0] for node in lerps) == {"rwkv7": [6], "rwkv6": [2]}[family]
    assert all(node.args[2] is None for node in lerps)
