"""flame's model holding weights read from disk: a new model from a run's checkpoint or any
export (`load_model`), or a training run's model, sharded or not, taking an export's weights
(`load_exported_weights`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from flame.config.job import TRAINING_MEMORY_FIELDS
from flame.models import build_model
from flame.weights.dcp_reader import read_model_state_dict
from flame.weights.errors import WeightsError
from flame.weights.foreign import is_foreign_weights, read_exported
from flame.weights.layout import read_run_checkpoint
from flame.weights.state_dicts import check_state_dict, untie_if_different

logger = logging.getLogger("flame.weights")


def check_model_args(model_args, state_dict: dict[str, torch.Tensor], source: str = "the weights"):
    """flame's model of `model_args` on the meta device, once `state_dict` (flame names; a tied
    head may be absent) fits it: WeightsError naming the first missing, unexpected or misshapen
    tensor, with both shapes, and `source`."""
    with torch.device("meta"):
        model = build_model(model_args)
    check_state_dict(model.state_dict(), state_dict, tied_head=model.tie_word_embeddings, source=source)
    return model


def build_with_weights(model_args, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu"):
    """flame's model of `model_args` holding `state_dict` (flame names) without a second copy of
    the weights (the model is built on the meta device and takes the tensors as they are). A
    tied head may be absent from `state_dict`. Raises WeightsError on a missing, unexpected or
    misshapen tensor."""
    model = check_model_args(model_args, state_dict)
    state_dict = {k: v for k, v in state_dict.items()
                  if not (model.tie_word_embeddings and k == "lm_head.weight")}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               step: int | None = None, backend: str = "auto"):
    """`(model, model_args, tokenizer_path)` from a run's checkpoint (anything `find_step_dir`
    takes), an exported `hf` or `fla` folder, or an RWKV-LM `.pth` (with `tokenizer_path` None):
    flame's own model in eval mode, on `device` in `dtype`, its attention on `backend`."""
    if is_foreign_weights(path):
        model_args, state_dict, tokenizer = read_exported(path)
    else:
        run = read_run_checkpoint(path, step)
        model_args, tokenizer = run.model_args, run.tokenizer
        state_dict = read_model_state_dict(run.step_dir, dtype)
    model_args = untie_if_different(model_args, state_dict)
    model_args = replace(model_args, backend=backend, **dict.fromkeys(TRAINING_MEMORY_FIELDS, False))
    return build_with_weights(model_args, state_dict, dtype, device), model_args, tokenizer


def load_exported_weights(model: torch.nn.Module, path: str | Path, family: str) -> None:
    """Load model weights only from an exported `hf` or `fla` folder or an RWKV-LM `.pth`
    (flame.export's formats) into `model`, sharded or not: converted to flame's names, checked
    against the model (the first missing, unexpected or misshapen tensor is named, with both
    shapes), then handed to `set_model_state_dict` as a full state dict that every rank holds.
    A failed read is a WeightsError whose message starts with the config key."""
    try:
        _, state, _ = read_exported(path, family)
        expected = get_model_state_dict(model)  # sharded tensors report their full shapes
        tied = bool(getattr(model, "tie_word_embeddings", False))
        check_state_dict(expected, state, tied_head=tied, source=str(path))
    except WeightsError as err:
        raise WeightsError(f"checkpoint.initial_load_path: {err}") from err
    if tied and "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["embeddings.weight"]):
        raise WeightsError(
            f"checkpoint.initial_load_path: {path} holds a head (lm_head.weight) that differs from "
            f"its embedding, but this run ties them (model.tie_word_embeddings = true)"
        )
    if tied and "lm_head.weight" in expected:
        state["lm_head.weight"] = state["embeddings.weight"]
    state = {name: state[name].to(expected[name].dtype) for name in expected}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    logger.info("model: weights loaded from %s (model only, a new run)", path)


__all__ = ["build_with_weights", "check_model_args", "load_exported_weights", "load_model"]
