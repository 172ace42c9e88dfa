"""Reading a flame run's weights: a DCP checkpoint (saved by any number of ranks) or an exported folder.

A run's dump folder holds `config.toml` (the whole job config, written by the trainer) and
`<checkpoint.folder>/step-N/` checkpoints, complete once their `COMPLETE` marker exists. Only the
model's entries of a checkpoint are read (never the optimizer state): each tensor is allocated
once, at its full shape, from the checkpoint's metadata, and DCP copies every rank's shard into
it, so the reader holds exactly one copy of the weights whatever the number of saving ranks.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from flame.config.job import TRAINING_MEMORY_FIELDS
from flame.train.checkpoint import COMPLETE_MARKER, STEP_DIR

logger = logging.getLogger("flame.export")

MODEL_KEY = "model"
"""The checkpoint entry (see flame.train.checkpoint) that holds the model's state dict."""
CONFIG_FILE = "config.toml"
CONFIG_SEARCH_DEPTH = 4
"""How many folders above a step folder are searched for the run's config.toml (a nested
checkpoint.folder such as "ckpt/main" puts it more than two levels up)."""


class ExportError(RuntimeError):
    """A checkpoint or exported folder cannot be read or written: the message says why."""


@dataclass
class RunCheckpoint:
    """One complete checkpoint of a run and what is needed to rebuild its model."""

    step_dir: Path
    step: int
    model_args: object
    """The run's `flame.config.Model` section."""
    tokenizer: str
    """The run's tokenizer: a tokenizer.json or a tokenizer directory."""


# ---- finding the step folder ------------------------------------------------------------------

def complete_steps(folder: Path) -> list[int]:
    """Steps of `folder` with a complete checkpoint, oldest first."""
    steps = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        match = STEP_DIR.match(entry.name)
        if match and (entry / COMPLETE_MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _step_dirs(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name)] if folder.is_dir() else []


def find_step_dir(path: str | Path, step: int | None = None) -> Path:
    """The step folder that `path` names: a step-N folder itself, a checkpoint folder holding
    step-N folders, or a run's dump folder (its config.toml names the checkpoint folder). The
    latest complete step unless `step` is given. Raises ExportError naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"checkpoint path {path} does not exist")
    match = STEP_DIR.match(path.name)
    if match and path.is_dir():
        if step is not None and int(match.group(1)) != step:
            raise ExportError(f"{path} is the checkpoint of step {match.group(1)}, not of step {step}")
        _check_complete(path)
        return path
    folder = path
    if not _step_dirs(folder) and (path / CONFIG_FILE).is_file():
        folder = path / _read_toml(path / CONFIG_FILE).get("checkpoint", {}).get("folder", "checkpoint")
    candidates = _step_dirs(folder)
    if not candidates:
        raise ExportError(f"no checkpoint found in {path}: expected step-N folders, a checkpoint "
                          f"folder holding them, or a run's dump folder with {CONFIG_FILE}")
    done = complete_steps(folder)
    if step is not None:
        chosen = folder / f"step-{step}"
        if not chosen.is_dir():
            raise ExportError(f"no checkpoint of step {step} in {folder} "
                              f"(complete checkpoints: {done or 'none'})")
        _check_complete(chosen)
        return chosen
    if not done:
        names = ", ".join(sorted(p.name for p in candidates))
        raise ExportError(f"no complete checkpoint in {folder}: {names} lack the {COMPLETE_MARKER} "
                          f"marker (interrupted saves)")
    return folder / f"step-{done[-1]}"


def _check_complete(step_dir: Path) -> None:
    if not (step_dir / COMPLETE_MARKER).is_file():
        raise ExportError(f"checkpoint {step_dir} is incomplete: it has no {COMPLETE_MARKER} marker "
                          f"(the save was interrupted)")
    if not (step_dir / ".metadata").is_file():
        raise ExportError(f"checkpoint {step_dir} is incomplete: its DCP metadata file .metadata is missing")


# ---- the run's config -------------------------------------------------------------------------

def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ExportError(f"cannot read the run's config {path}: {err}") from err


def find_run_config(step_dir: Path) -> Path:
    """The config.toml of the run that wrote `step_dir` (in one of the folders above it)."""
    for parent in list(step_dir.resolve().parents)[:CONFIG_SEARCH_DEPTH]:
        if (parent / CONFIG_FILE).is_file():
            return parent / CONFIG_FILE
    raise ExportError(f"cannot find the run's {CONFIG_FILE} in the folders above {step_dir}; "
                      f"the trainer writes it to the dump folder")


def read_run_checkpoint(path: str | Path, step: int | None = None) -> RunCheckpoint:
    """Locate the checkpoint (see `find_step_dir`) and read its run's model section and tokenizer."""
    from flame.config import ConfigError, config_from_dict
    from flame.data.tokenizer import EMBEDDED_TOKENIZER

    step_dir = find_step_dir(path, step)
    config_path = find_run_config(step_dir)
    try:
        cfg = config_from_dict(_read_toml(config_path), {"": f"in {config_path}"})
    except ConfigError as err:
        raise ExportError(f"the run's config {config_path} is not valid: {err}") from err
    tokenizer = cfg.data.tokenizer or str(EMBEDDED_TOKENIZER)
    return RunCheckpoint(step_dir, int(STEP_DIR.match(step_dir.name).group(1)), cfg.model, tokenizer)


# ---- reading the weights ----------------------------------------------------------------------

def read_model_state_dict(step_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict (flame names, on CPU) from the DCP checkpoint `step_dir`,
    whatever the number of ranks that saved it. `dtype` converts floating-point tensors while
    reading (None keeps the stored dtype)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = Path(step_dir)
    _check_complete(step_dir)
    try:
        metadata = FileSystemReader(str(step_dir)).read_metadata()
    except Exception as err:
        raise ExportError(f"checkpoint {step_dir}: cannot read its DCP metadata: {err}") from err
    prefix = MODEL_KEY + "."
    state: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        stored = meta.properties.dtype
        target = dtype if dtype is not None and stored.is_floating_point else stored
        state[key[len(prefix):]] = torch.empty(meta.size, dtype=target)
    if not state:
        raise ExportError(f"checkpoint {step_dir} holds no model weights (no '{MODEL_KEY}' entries)")
    try:
        dcp.load({MODEL_KEY: state}, checkpoint_id=str(step_dir), no_dist=True)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise ExportError(f"checkpoint {step_dir} could not be read, it is corrupt: "
                          f"{type(err).__name__}: {_first_line(err)}") from err
    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


# ---- a model from weights ---------------------------------------------------------------------

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


def build_with_weights(model_args, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu"):
    """flame's model of `model_args` holding `state_dict` (flame names) without a second copy of
    the weights (the model is built on the meta device and takes the tensors as they are). A
    tied head may be absent from `state_dict`. Raises ExportError on a missing, unexpected or
    misshapen tensor."""
    from flame.models import build_model

    with torch.device("meta"):
        model = build_model(model_args)
    check_state_dict(model.state_dict(), state_dict, tied_head=model.tie_word_embeddings)
    state_dict = {k: v for k, v in state_dict.items()
                  if not (model.tie_word_embeddings and k == "lm_head.weight")}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()


def check_state_dict(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor], tied_head: bool,
                     source: str = "the weights") -> None:
    """Raise ExportError naming the first tensor whose name or shape differs between the model's
    state dict `expected` and `given` (a tied head may be absent from `given`)."""
    for name, tensor in expected.items():
        if name not in given:
            if tied_head and name == "lm_head.weight":
                continue
            raise ExportError(f"{source}: no tensor {name} (shape {tuple(tensor.shape)} in the model)")
        if tuple(given[name].shape) != tuple(tensor.shape):
            raise ExportError(f"tensor {name} has shape {tuple(given[name].shape)} in {source} but "
                              f"{tuple(tensor.shape)} in the model")
    for name in given:
        if name not in expected:
            raise ExportError(f"{source}: tensor {name} (shape {tuple(given[name].shape)}) is not in the model")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               step: int | None = None, backend: str = "auto"):
    """`(model, model_args, tokenizer_path)` from a run's checkpoint (anything `find_step_dir`
    takes), an exported `hf` or `fla` folder, or an RWKV-LM `.pth` (with `tokenizer_path` None):
    flame's own model in eval mode, on `device` in `dtype`, its attention on `backend`."""
    from flame.export import formats

    path = Path(path)
    if formats.is_exported_folder(path) or formats.is_rwkv_file(path):
        model_args, state_dict, tokenizer = formats.read_exported(path)
    else:
        run = read_run_checkpoint(path, step)
        model_args, tokenizer = run.model_args, run.tokenizer
        state_dict = read_model_state_dict(run.step_dir, dtype)
    model_args = untie_if_different(model_args, state_dict)
    model_args = replace(model_args, backend=backend, **dict.fromkeys(TRAINING_MEMORY_FIELDS, False))
    return build_with_weights(model_args, state_dict, dtype, device), model_args, tokenizer


__all__ = [
    "ExportError",
    "RunCheckpoint",
    "build_with_weights",
    "check_state_dict",
    "complete_steps",
    "find_run_config",
    "find_step_dir",
    "load_model",
    "read_model_state_dict",
    "read_run_checkpoint",
]
