"""flame's model holding weights read from disk: a run's checkpoint or any export."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from flame.config.job import TRAINING_MEMORY_FIELDS
from flame.models import build_model
from flame.weights.dcp_reader import read_model_state_dict
from flame.weights.foreign import is_foreign_weights, read_exported
from flame.weights.layout import read_run_checkpoint
from flame.weights.state_dicts import check_state_dict, untie_if_different


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


__all__ = ["build_with_weights", "check_model_args", "load_model"]
