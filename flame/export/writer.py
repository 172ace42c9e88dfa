"""Writing a run's checkpoint as an `hf` folder, an `fla` folder or an RWKV-LM `.pth`.

Everything is written into a temporary sibling of the output (`.NAME.tmp-PID`) that is renamed
to the output at the end, so an export that fails leaves nothing behind, and an existing output
is replaced only with `overwrite` and only once the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from flame.data import load_tokenizer
from flame.export.fla import check_fla_eps, fla_config
from flame.export.errors import ExportError
from flame.export.rwkv import check_rwkv_format
from flame.weights import (WeightsError, check_model_args, read_model_state_dict, read_run_checkpoint,
                           untie_if_different)
from flame.weights.fla_names import to_fla
from flame.weights.foreign import CONFIG_JSON, HF_PREFIX, SAFETENSORS_FILE, SAFETENSORS_INDEX
from flame.weights.rwkv_names import to_rwkv

FORMATS = ("hf", "fla", "rwkv")
WRITTEN_DTYPES = ("bfloat16", "float32")
"""The dtypes an export may write its weights in (names of `flame.config.torch_types.DTYPES`)."""
DEFAULT_MAX_SHARD_SIZE = "5GB"
MODELING_SOURCE = '''"""The classes of a flame model exported with `python -m flame.export`, for
`AutoModelForCausalLM.from_pretrained(this_folder, trust_remote_code=True)`. They live in the
package `flame` of the distribution flame-lm, which must be installed in this Python."""

try:  # in a try block, so that transformers leaves the import to this file and its message
    from flame.export.hf import FlameConfig, FlameForCausalLM
except ModuleNotFoundError as err:
    if not (err.name or "").startswith("flame"):
        raise
    raise ModuleNotFoundError(
        "this model runs the model classes of flame (the distribution flame-lm, imported as "
        "flame): install it into this Python with `pip install -e .` in a checkout of its "
        "source, or `pip install flame-lm` from a package index that has it; `pip install flame` "
        "installs an unrelated package, and fla-org/flame, also imported as flame, lacks these "
        f"classes ({err})"
    ) from err

__all__ = ["FlameConfig", "FlameForCausalLM"]
'''
"""The `modeling_flame.py` of an `hf` export."""


def check_output(out: Path, fmt: str, overwrite: bool) -> None:
    """Refuse an output that exists and is not empty (unless `overwrite`), or a bad name."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "rwkv" and out.suffix != ".pth":
        raise ExportError(f"--format rwkv writes one RWKV-LM .pth file: --out must end with .pth, got {out}")
    if fmt != "rwkv" and out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a folder")
    occupied = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if occupied and not overwrite:
        raise ExportError(f"output {out} already exists and is not empty; pass --overwrite to replace it")


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "hf", dtype: torch.dtype = torch.float32,
                      step: int | None = None, overwrite: bool = False,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Export the checkpoint that `checkpoint` names (see `find_step_dir`) to `out`; returns `out`.
    The model's config is the one the checkpoint was trained with (`find_run_config`), checked
    against the checkpoint's tensors before anything is written."""
    out = Path(out)
    check_output(out, fmt, overwrite)
    run = read_run_checkpoint(checkpoint, step)
    family = run.model_args.family
    if fmt == "rwkv":
        check_rwkv_format(run.model_args)
    if fmt == "fla":
        check_fla_eps(run.model_args)
    tokens = None if fmt == "rwkv" else token_ids(run.tokenizer)
    state = read_model_state_dict(run.step_dir, dtype)
    run.model_args = untie_if_different(run.model_args, state)
    try:  # the written config must describe the written tensors
        check_model_args(run.model_args, state, source=f"checkpoint {run.step_dir}")
    except WeightsError as err:
        raise ExportError(f"the config {run.config} does not match the weights it would describe: "
                          f"{err}") from err
    new_parents = [p for p in out.absolute().parents if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    _remove(tmp)
    try:
        if fmt == "rwkv":
            torch.save(to_rwkv(state, family, run.model_args.tie_word_embeddings), str(tmp))
        else:
            tmp.mkdir()
            if run.model_args.tie_word_embeddings:
                state.pop("lm_head.weight", None)  # the loader ties it to the embedding
            if fmt == "hf":
                write_hf_config(tmp, run.model_args, tokens, dtype)
                weights = {HF_PREFIX + name: tensor for name, tensor in state.items()}
            else:
                config = fla_config(run.model_args, state, tokens["ids"])
                config["torch_dtype"] = str(dtype).removeprefix("torch.")
                (tmp / CONFIG_JSON).write_text(json.dumps(config, indent=2) + "\n")
                weights = to_fla(state, family)
            del state
            write_safetensors(weights, tmp, max_shard_size)
            write_generation_config(tmp, tokens["ids"])
            write_tokenizer(tmp, run.tokenizer, tokens["eod_token"])
        if out.exists():
            _remove(out)
        os.replace(tmp, out)
    except BaseException:
        _remove(tmp)
        for parent in new_parents:  # innermost first: the folders this export created
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
        raise
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def token_ids(tokenizer_path: str) -> dict:
    """The run's end-of-document token, which is also its begin-of-document and padding token
    (flame's data pipeline ends every document with it)."""
    tokenizer = load_tokenizer(tokenizer_path)
    eod = tokenizer.eod_id
    return {"eod_token": tokenizer.backend.id_to_token(eod),
            "ids": {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}}


def write_hf_config(folder: Path, model_args, tokens: dict, dtype: torch.dtype) -> None:
    from flame.export.hf import AUTO_MAP, MODELING_FILE, FlameConfig

    config = FlameConfig(**asdict(model_args), **tokens["ids"])
    config.architectures = ["FlameForCausalLM"]
    config.auto_map = dict(AUTO_MAP)
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(str(folder))
    (folder / MODELING_FILE).write_text(MODELING_SOURCE)


def write_safetensors(state: dict[str, torch.Tensor], folder: Path, max_shard_size: int | str) -> None:
    """`model.safetensors`, or shards of at most `max_shard_size` and their index (the layout
    `from_pretrained` reads)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name].contiguous() for name in names}, str(folder / filename),
                  metadata={"format": "pt"})
        os.chmod(folder / filename, new_file_mode())  # safetensors creates its files 0600
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    elif not (folder / SAFETENSORS_FILE).is_file():
        raise ExportError(f"safetensors wrote no {SAFETENSORS_FILE} into {folder}")


def new_file_mode() -> int:
    """The mode a file that Python's open() creates gets under this process's umask (0644 under
    the usual umask 022), the mode of every other file of an export."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_generation_config(folder: Path, ids: dict) -> None:
    from transformers import GenerationConfig

    GenerationConfig(**ids).save_pretrained(str(folder))


def write_tokenizer(folder: Path, tokenizer_path: str, eod_token: str) -> None:
    """The run's tokenizer as a `PreTrainedTokenizerFast` (tokenizer.json + tokenizer_config.json),
    so that `AutoTokenizer.from_pretrained(folder)` and flame's own loader both read it."""
    from transformers import PreTrainedTokenizerFast

    source = Path(tokenizer_path)
    file = source / "tokenizer.json" if source.is_dir() else source
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(file), eos_token=eod_token, bos_token=eod_token,
                                        pad_token=eod_token)
    tokenizer.save_pretrained(str(folder))


__all__ = ["FORMATS", "WRITTEN_DTYPES", "check_output", "export_checkpoint"]
