"""Small model arguments shared by the model tests."""

from __future__ import annotations

import dataclasses

import torch

from flame.config.job import Model
from flame.models import build_model

FAMILIES = ("rwkv6", "rwkv7", "gsa")


def tiny_args(family: str, **overrides) -> Model:
    """A model small enough for CPU tests: C = 64, 3 layers, 4 RWKV heads of 16 / 2 GSA heads."""
    fields = dict(
        family=family, vocab_size=97, hidden_size=64, num_layers=3, head_dim=16, num_heads=2,
        num_slots=8, backend="torch",
    )
    fields.update(overrides)
    return Model(**fields)


def build_seeded(args: Model, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(args)


def build_on_meta(args: Model, seed: int, device="cpu"):
    """The trainer's way: seed, build on the meta device, to_empty(device), init_weights()."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()
    return model


def assert_same_state(expected, actual, label: str) -> None:
    """Two models hold bitwise-equal state dicts (same names, same values)."""
    want, got = expected.state_dict(), actual.state_dict()
    assert want.keys() == got.keys(), f"{label}: state dict names differ"
    for name in want:
        assert torch.equal(want[name], got[name]), f"{label}: {name} differs"


def with_fields(args: Model, **changes) -> Model:
    return dataclasses.replace(args, **changes)
