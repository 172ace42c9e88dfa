"""model.tie_word_embeddings: the trainer's model keeps one parameter for the head and the embedding
(built on the meta device and materialised in place), and training keeps it one."""

import pytest

from flame.train.trainer import Trainer
from tests.train.helpers import random_batches, split_rows, tiny_config


@pytest.mark.parametrize("family", ["rwkv7", "gsa"])
def test_tied_head_stays_the_embedding_through_training(tmp_path, family):
    tied = Trainer(tiny_config(tmp_path / "tied", model={"family": family, "tie_word_embeddings": True,
                                                          "num_heads": 2, "num_slots": 8}), dataloader=())
    untied = Trainer(tiny_config(tmp_path / "untied", model={"family": family, "num_heads": 2, "num_slots": 8}),
                     dataloader=())
    model = tied.model
    assert model.lm_head.weight is model.embeddings.weight
    vocab_by_width = model.embeddings.weight.numel()
    assert sum(p.numel() for p in model.parameters()) == (
        sum(p.numel() for p in untied.model.parameters()) - vocab_by_width)
    before = model.embeddings.weight.detach().clone()
    input_ids, labels = random_batches(2, 16, seed=0)
    assert not tied.train_step(split_rows(input_ids, labels, 2)).skipped
    assert model.lm_head.weight is model.embeddings.weight
    # rows of tokens absent from the batch move too: the head's gradient reaches the shared weight
    unused = sorted(set(range(before.shape[0])) - set(input_ids.flatten().tolist()))[:5]
    assert not model.embeddings.weight[unused].detach().equal(before[unused])
