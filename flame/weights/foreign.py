"""Weights in another layout than flame's DCP checkpoints, read into flame's names: an `hf`
folder (flame's own export), an `fla` folder, or an RWKV-LM `.pth`.

Used by `load_model` (to run an exported model) and by the trainer's
`checkpoint.initial_load_path` (to continue pretraining from released weights). safetensors is
imported only when a folder is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from flame.config import Model
from flame.config.job import TRAINING_MEMORY_FIELDS
from flame.weights import fla_names, rwkv_names
from flame.weights.errors import WeightsError

CONFIG_JSON = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_MODEL_TYPE = "flame"
HF_PREFIX = "model."
"""An `hf` folder stores flame's names under the wrapper's `model.` attribute."""


def is_rwkv_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".pth" and path.is_file()


def is_exported_folder(path: str | Path) -> bool:
    return (Path(path) / CONFIG_JSON).is_file()


def read_config_json(folder: Path) -> dict:
    try:
        return json.loads((folder / CONFIG_JSON).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise WeightsError(f"cannot read {folder / CONFIG_JSON}: {err}") from err


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's model.safetensors or of the shards its index names (memory-mapped
    by safetensors, so nothing is read twice)."""
    from safetensors.torch import load_file

    if (folder / SAFETENSORS_INDEX).is_file():
        index = json.loads((folder / SAFETENSORS_INDEX).read_text())
        files = sorted(set(index["weight_map"].values()))
    elif (folder / SAFETENSORS_FILE).is_file():
        files = [SAFETENSORS_FILE]
    else:
        raise WeightsError(f"{folder} has no {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise WeightsError(f"{folder} is missing the weight shard {name} that its index names")
        state.update(load_file(str(folder / name)))
    return state


def read_rwkv_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise WeightsError(f"cannot read {path} as a PyTorch state dict: {type(err).__name__}: {err}") from err
    if not isinstance(state, dict):
        raise WeightsError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def folder_format(config: dict) -> str:
    """"hf" (flame's own model type) or "fla" for an exported folder's config.json."""
    model_type = config.get("model_type")
    if model_type == HF_MODEL_TYPE:
        return "hf"
    if model_type in fla_names.FLA_MODEL_TYPES.values():
        return "fla"
    raise WeightsError(f"config.json has model_type {model_type!r}: not a flame export ({HF_MODEL_TYPE!r}) nor an "
                      f"fla model ({', '.join(fla_names.FLA_MODEL_TYPES.values())})")


def model_args_from_hf_config(config: dict):
    """flame's `Model` from an `hf` export's config.json (its fields are `Model`'s)."""
    names = {f.name for f in dataclasses.fields(Model)} - {"backend", *TRAINING_MEMORY_FIELDS}
    return Model(**{k: v for k, v in config.items() if k in names})


def read_exported(path: str | Path, family: str | None = None):
    """`(model_args, state_dict in flame names, tokenizer folder or None)` of an exported folder
    or an RWKV-LM `.pth`. With `family`, weights of another family are a WeightsError."""
    path = Path(path)
    if is_rwkv_file(path):
        state = read_rwkv_file(path)
        model_args = rwkv_names.model_args_from_rwkv(state)
        _, state = rwkv_names.from_rwkv(state, family)
        return model_args, state, None
    if not is_exported_folder(path):
        raise WeightsError(f"{path} is neither an exported folder (with {CONFIG_JSON}) nor an RWKV-LM .pth file")
    config = read_config_json(path)
    kind = folder_format(config)
    if kind == "hf":
        model_args = model_args_from_hf_config(config)
    else:
        model_args = fla_names.model_args_from_fla_config(config)
    if family is not None and model_args.family != family:
        raise WeightsError(f"{path} holds a {model_args.family} model, not {family}")
    state = read_safetensors(path)
    if kind == "hf":
        outside = next((k for k in state if not k.startswith(HF_PREFIX)), None)
        if outside is not None:
            raise WeightsError(f"{path}: tensor {outside} is not under {HF_PREFIX!r} as flame's hf export writes it")
        state = {k[len(HF_PREFIX):]: v for k, v in state.items()}
    else:
        state = fla_names.from_fla(state, model_args.family)
    tokenizer = str(path) if (path / "tokenizer.json").is_file() else None
    return model_args, state, tokenizer


def is_foreign_weights(path: str | Path) -> bool:
    """True for what `read_exported` reads (an exported folder or a .pth), False for a DCP folder."""
    return is_rwkv_file(path) or is_exported_folder(path)


__all__ = [
    "CONFIG_JSON",
    "HF_MODEL_TYPE",
    "HF_PREFIX",
    "SAFETENSORS_FILE",
    "SAFETENSORS_INDEX",
    "is_exported_folder",
    "is_foreign_weights",
    "is_rwkv_file",
    "read_exported",
    "read_safetensors",
]
