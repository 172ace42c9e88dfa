"""Checks and small facts about a model's state dict (flame names), whatever it was read from."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from flame.weights.errors import WeightsError

logger = logging.getLogger("flame.weights")


def num_layers(state_dict: dict, prefix: str) -> int:
    """1 + the largest layer index i of the names `{prefix}{i}.*` (0 when there are none)."""
    layers = {int(k[len(prefix):].split(".", 1)[0]) for k in state_dict if k.startswith(prefix)}
    return max(layers) + 1 if layers else 0


def check_state_dict(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor], tied_head: bool,
                     source: str = "the weights") -> None:
    """Raise WeightsError naming the first tensor whose name or shape differs between the model's
    state dict `expected` and `given` (a tied head may be absent from `given`)."""
    for name, tensor in expected.items():
        if name not in given:
            if tied_head and name == "lm_head.weight":
                continue
            raise WeightsError(f"{source}: no tensor {name} (shape {tuple(tensor.shape)} in the model)")
        if tuple(given[name].shape) != tuple(tensor.shape):
            raise WeightsError(f"tensor {name} has shape {tuple(given[name].shape)} in {source} but "
                               f"{tuple(tensor.shape)} in the model")
    for name in given:
        if name not in expected:
            raise WeightsError(f"{source}: tensor {name} (shape {tuple(given[name].shape)}) is not in the model")


def untie_if_different(model_args, state_dict: dict[str, torch.Tensor]):
    """`model_args`, with tie_word_embeddings turned off when the weights hold a head that differs
    from the embedding (a tied config whose head was trained apart): the weights decide, so the
    model computes what was trained."""
    head, embedding = state_dict.get("lm_head.weight"), state_dict.get("embeddings.weight")
    if model_args.tie_word_embeddings and head is not None and embedding is not None \
            and not torch.equal(head, embedding):
        logger.warning("the config ties the head to the embedding but the weights hold a different "
                       "head: keeping it (tie_word_embeddings = false)")
        return replace(model_args, tie_word_embeddings=False)
    return model_args


__all__ = ["check_state_dict", "num_layers", "untie_if_different"]
