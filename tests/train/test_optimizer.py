import pytest
import torch
from torch import nn

from flame.config import Optimizer
from flame.train.optimizer import build_optimizer, split_param_groups


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=True)
        self.ln = nn.LayerNorm(d)
        self.x_r = nn.Parameter(torch.zeros(d))       # a mixing vector
        self.w0 = nn.Parameter(torch.zeros(d))        # RWKV7 decay bias
        self.time_decay = nn.Parameter(torch.zeros(d))  # RWKV6 decay bias


class Toy(nn.Module):
    def __init__(self, d=8, vocab=16, tie=False):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embeddings.weight


def names(groups, key):
    return sorted(n for n, _ in groups[key])


def test_weight_decay_only_on_linear_weights():
    groups = split_param_groups(Toy())
    assert names(groups, "decay") == ["layers.0.proj.weight", "lm_head.weight"]
    assert names(groups, "decay_bias") == ["layers.0.time_decay", "layers.0.w0"]
    assert names(groups, "no_decay") == sorted([
        "embeddings.weight", "layers.0.proj.bias", "layers.0.ln.weight", "layers.0.ln.bias",
        "layers.0.x_r", "norm.weight", "norm.bias",
    ])


def test_tied_head_is_not_decayed():
    groups = split_param_groups(Toy(tie=True))
    assert "lm_head.weight" not in names(groups, "decay")
    assert "embeddings.weight" in names(groups, "no_decay")


def test_optimizer_groups_carry_decay_and_lr_multiplier():
    model = Toy()
    opt = build_optimizer(model, Optimizer(lr=1e-3, weight_decay=0.1, decay_lr_multiplier=2.0,
                                           implementation="for-loop"))
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["decay"]["weight_decay"] == 0.1 and by_name["decay"]["lr"] == 1e-3
    assert by_name["no_decay"]["weight_decay"] == 0.0 and by_name["no_decay"]["lr"] == 1e-3
    assert by_name["decay_bias"]["weight_decay"] == 0.0
    assert by_name["decay_bias"]["lr"] == pytest.approx(2e-3)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_decay_bias_moves_twice_as_fast():
    model = Toy()
    for p in model.parameters():
        nn.init.zeros_(p)
    opt = build_optimizer(model, Optimizer(lr=1e-2, weight_decay=0.0, implementation="foreach"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # Adam's first step moves every coordinate by lr
    assert torch.allclose(model.layers[0].w0, torch.full((8,), -2e-2))
    assert torch.allclose(model.layers[0].x_r, torch.full((8,), -1e-2))


def test_decay_embeddings_puts_the_embedding_in_the_decay_group():
    default = split_param_groups(Toy())
    assert "embeddings.weight" in names(default, "no_decay")
    groups = split_param_groups(Toy(), decay_embeddings=True)
    assert "embeddings.weight" in names(groups, "decay")
    assert "lm_head.weight" in names(groups, "decay")
    assert "layers.0.ln.weight" in names(groups, "no_decay")
    optimizer = build_optimizer(Toy(), Optimizer(weight_decay=0.001, decay_embeddings=True))
    decay = next(g for g in optimizer.param_groups if g["name"] == "decay")
    assert "embeddings.weight" in decay["param_names"] and decay["weight_decay"] == 0.001
