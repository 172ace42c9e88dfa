"""training.compile and training.activation_checkpoint: the compiled, checkpointed model trains like
the eager one (the Triton backend under the interpreter, as on a GPU the kernels run uncompiled)."""

import pytest

from flame.train.trainer import Trainer
from tests.train.helpers import random_batches, split_rows, tiny_config


def losses(tmp_path, name, **training):
    cfg = tiny_config(tmp_path / name, training=training, model={"backend": "triton"})
    trainer = Trainer(cfg, dataloader=())
    out = []
    for seed in range(3):
        input_ids, labels = random_batches(2, 16, seed=seed)
        out.append(trainer.train_step(split_rows(input_ids, labels, 2)).loss)
    return out


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    """The eager model's losses, once for every activation-checkpointing policy compared with it."""
    return losses(tmp_path_factory.mktemp("compile"), "eager")


@pytest.mark.parametrize("ac", ["full", "selective", "elementwise"])
def test_compiled_blocks_with_activation_checkpointing_train_like_eager(tmp_path, eager_losses, ac):
    compiled = losses(tmp_path, f"compiled-{ac}", compile=True, activation_checkpoint=ac)
    assert compiled == pytest.approx(eager_losses, rel=1e-4)


GPU_MODELS = {
    "rwkv7": {"family": "rwkv7", "head_dim": 64},
    "rwkv6": {"family": "rwkv6", "head_dim": 64},
    "gsa": {"family": "gsa", "num_heads": 4, "num_slots": 32},
}


def gpu_losses(tmp_path, name, family, compile, device="cuda", steps=10, activation_checkpoint="none",
               cuda_graphs=True):
    """Losses of `steps` trainer steps of a 10-layer model (past Dynamo's recompile limit of 8, so that
    every layer has to share the compiled graphs) with bf16 mixed precision (autocast) on one GPU,
    four micro-batches per step (CUDA graphs replay each block's forward and backward four times)."""
    cfg = tiny_config(tmp_path / name, model={**GPU_MODELS[family], "hidden_size": 256, "num_layers": 10,
                                              "backend": "auto"},
                      training={"device": device, "compile": compile, "batch_size": 1, "seq_len": 256,
                                "gradient_accumulation_steps": 4, "steps": steps,
                                "activation_checkpoint": activation_checkpoint, "cuda_graphs": cuda_graphs},
                      optimizer={"implementation": "fused"})
    trainer = Trainer(cfg, dataloader=())
    out = []
    for seed in range(steps):
        input_ids, labels = random_batches(4, 256, seed=seed)
        out.append(trainer.train_step(split_rows(input_ids, labels, 1)).loss)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(GPU_MODELS))
def test_compiled_training_equals_eager_on_the_gpu(tmp_path, family):
    """Ten bf16 steps, eager and compiled (replayed as CUDA graphs, also with "elementwise"
    recomputation, and without graphs): the same losses within bf16 noise (fusion changes the
    rounding of the glue, and the difference grows a little with each update)."""
    eager = gpu_losses(tmp_path, "eager", family, compile=False)
    compiled = gpu_losses(tmp_path, "compiled", family, compile=True)
    elementwise = gpu_losses(tmp_path, "elementwise", family, compile=True, activation_checkpoint="elementwise")
    no_graphs = gpu_losses(tmp_path, "no_graphs", family, compile=True, cuda_graphs=False)
    for run in (compiled, elementwise, no_graphs):
        assert run[0] == pytest.approx(eager[0], rel=5e-3)
        assert run == pytest.approx(eager, rel=2e-2)


@pytest.mark.gpu
def test_a_non_finite_micro_batch_is_skipped_under_cuda_graphs(tmp_path):
    """A NaN in one micro-batch of a step, with the blocks replayed as CUDA graphs: that step is
    skipped, the non-finite search names a module, and the next steps train on finite numbers."""
    import math

    cfg = tiny_config(tmp_path, model={**GPU_MODELS["rwkv7"], "hidden_size": 256, "num_layers": 2,
                                       "backend": "auto"},
                      training={"device": "cuda", "compile": True, "batch_size": 1, "seq_len": 256,
                                "gradient_accumulation_steps": 2, "steps": 6},
                      optimizer={"implementation": "fused"})
    trainer = Trainer(cfg, dataloader=())
    assert trainer.cuda_graphs
    poisoned = {"on": False}
    trainer.model.embeddings.register_forward_hook(
        lambda module, inputs, out: out * math.nan if poisoned["on"] else out)
    results = []
    for step in range(6):
        input_ids, labels = random_batches(2, 256, seed=step)
        poisoned["on"] = step == 3
        results.append(trainer.train_step(split_rows(input_ids, labels, 1)))
    assert [r.skipped for r in results] == [False, False, False, True, False, False]
    assert results[3].first_nonfinite_module is not None
    assert all(math.isfinite(r.loss) for i, r in enumerate(results) if i != 3)
