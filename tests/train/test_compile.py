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


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_compiled_blocks_with_activation_checkpointing_train_like_eager(tmp_path, ac):
    eager = losses(tmp_path, "eager")
    compiled = losses(tmp_path, f"compiled-{ac}", compile=True, activation_checkpoint=ac)
    assert compiled == pytest.approx(eager, rel=1e-4)
