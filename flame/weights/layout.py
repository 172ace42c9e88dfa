"""A run's folders on disk: where its checkpoints are and which are complete.

A run's dump folder holds `config.toml` (the whole job config of the run's latest start, written
by the trainer once the start is accepted) and `<checkpoint.folder>/step-N/` folders. A step folder
holds DCP's shards and its `.metadata`, the `config.toml` that checkpoint was trained with, and is
complete once its `COMPLETE` marker exists: rank 0 writes the marker after every rank's shards and
the metadata are on disk, so a folder without it is an interrupted save. The model's tensors are
the checkpoint's `model.*` entries. A step folder without its own config.toml (a checkpoint saved
before step folders held one) is read with the run's config.toml in a folder above it.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from flame.config import ConfigError, config_from_dict
from flame.data.tokenizer import EMBEDDED_TOKENIZER
from flame.weights.errors import WeightsError

COMPLETE_MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")
DCP_METADATA = ".metadata"
"""DCP's metadata file, written last by the save: a folder without it cannot be read."""
CONFIG_FILE = "config.toml"
MODEL_KEY = "model"
"""The checkpoint entry that holds the model's state dict."""
CONFIG_SEARCH_DEPTH = 4
"""How many folders above a step folder are searched for the run's config.toml (a nested
checkpoint.folder such as "ckpt/main" puts it more than two levels up)."""


@dataclass
class RunCheckpoint:
    """One complete checkpoint of a run and what is needed to rebuild its model."""

    step_dir: Path
    step: int
    config: Path
    """The config.toml it was read with."""
    model_args: object
    """The run's `flame.config.Model` section."""
    tokenizer: str
    """The run's tokenizer: a tokenizer.json or a tokenizer directory."""


def step_dir(folder: str | Path, step: int) -> Path:
    """The folder of step `step`'s checkpoint in the checkpoint folder `folder`."""
    return Path(folder) / f"step-{step}"


def complete_steps(folder: str | Path) -> list[int]:
    """Steps of the checkpoint folder `folder` with a complete checkpoint, oldest first."""
    folder = Path(folder)
    steps = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        match = STEP_DIR.match(entry.name)
        if match and (entry / COMPLETE_MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def check_readable(path: str | Path) -> None:
    """WeightsError unless `path` is a DCP checkpoint folder with its metadata."""
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"checkpoint folder {path} does not exist")
    if not (path / DCP_METADATA).is_file():
        raise WeightsError(f"checkpoint {path} is incomplete: its DCP metadata file {DCP_METADATA} is missing")


def check_complete(path: str | Path) -> None:
    """WeightsError unless `path` is a complete step folder (marker and metadata)."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise WeightsError(f"checkpoint {path} is incomplete: it has no {COMPLETE_MARKER} marker "
                           f"(the save was interrupted)")
    check_readable(path)


def _step_dirs(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name)] if folder.is_dir() else []


def find_step_dir(path: str | Path, step: int | None = None) -> Path:
    """The step folder that `path` names: a step-N folder itself, a checkpoint folder holding
    step-N folders, or a run's dump folder (its config.toml names the checkpoint folder). The
    latest complete step unless `step` is given. Raises WeightsError naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"checkpoint path {path} does not exist")
    match = STEP_DIR.match(path.name)
    if match and path.is_dir():
        if step is not None and int(match.group(1)) != step:
            raise WeightsError(f"{path} is the checkpoint of step {match.group(1)}, not of step {step}")
        check_complete(path)
        return path
    folder = path
    if not _step_dirs(folder) and (path / CONFIG_FILE).is_file():
        folder = path / _read_toml(path / CONFIG_FILE).get("checkpoint", {}).get("folder", "checkpoint")
    candidates = _step_dirs(folder)
    if not candidates:
        raise WeightsError(f"no checkpoint found in {path}: expected step-N folders, a checkpoint "
                           f"folder holding them, or a run's dump folder with {CONFIG_FILE}")
    done = complete_steps(folder)
    if step is not None:
        chosen = step_dir(folder, step)
        if not chosen.is_dir():
            raise WeightsError(f"no checkpoint of step {step} in {folder} "
                               f"(complete checkpoints: {done or 'none'})")
        check_complete(chosen)
        return chosen
    if not done:
        names = ", ".join(sorted(p.name for p in candidates))
        raise WeightsError(f"no complete checkpoint in {folder}: {names} lack the {COMPLETE_MARKER} "
                           f"marker (interrupted saves)")
    return step_dir(folder, done[-1])


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise WeightsError(f"cannot read the run's config {path}: {err}") from err


def find_run_config(step_dir: Path) -> Path:
    """The config that `step_dir` was trained with: its own config.toml, else the run's (in one of
    the folders above it)."""
    if (Path(step_dir) / CONFIG_FILE).is_file():
        return Path(step_dir) / CONFIG_FILE
    for parent in list(Path(step_dir).resolve().parents)[:CONFIG_SEARCH_DEPTH]:
        if (parent / CONFIG_FILE).is_file():
            return parent / CONFIG_FILE
    raise WeightsError(f"cannot find the run's {CONFIG_FILE} in the folders above {step_dir}; "
                       f"the trainer writes it to the dump folder")


def read_run_checkpoint(path: str | Path, step: int | None = None) -> RunCheckpoint:
    """Locate the checkpoint (see `find_step_dir`) and read its run's model section and tokenizer."""
    found = find_step_dir(path, step)
    config_path = find_run_config(found)
    try:
        cfg = config_from_dict(_read_toml(config_path), {"": f"in {config_path}"})
    except ConfigError as err:
        raise WeightsError(f"the run's config {config_path} is not valid: {err}") from err
    tokenizer = cfg.data.tokenizer or str(EMBEDDED_TOKENIZER)
    return RunCheckpoint(found, int(STEP_DIR.match(found.name).group(1)), config_path, cfg.model, tokenizer)


__all__ = [
    "COMPLETE_MARKER",
    "CONFIG_FILE",
    "DCP_METADATA",
    "MODEL_KEY",
    "STEP_DIR",
    "RunCheckpoint",
    "check_complete",
    "check_readable",
    "complete_steps",
    "find_run_config",
    "find_step_dir",
    "read_run_checkpoint",
    "step_dir",
]
