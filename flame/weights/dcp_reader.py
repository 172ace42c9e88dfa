"""The model's tensors of a DCP checkpoint, whatever the number of ranks that saved it.

Only the model's entries are read (never the optimizer state): each tensor is allocated once, at
its full shape, from the checkpoint's metadata, and DCP copies every rank's shard into it, so the
reader holds exactly one copy of the weights.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from flame.weights.errors import WeightsError, first_line
from flame.weights.layout import MODEL_KEY, check_complete

# Without torch.distributed, DCP warns that it assumes a single process: a reader is exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


def read_model_state_dict(step_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict (flame names, on CPU) from the complete DCP checkpoint
    `step_dir`. `dtype` converts floating-point tensors while reading (None keeps the stored dtype)."""
    step_dir = Path(step_dir)
    check_complete(step_dir)
    try:
        metadata = FileSystemReader(str(step_dir)).read_metadata()
    except Exception as err:
        raise WeightsError(f"checkpoint {step_dir}: cannot read its DCP metadata: {err}") from err
    prefix = MODEL_KEY + "."
    state: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        stored = meta.properties.dtype
        target = dtype if dtype is not None and stored.is_floating_point else stored
        state[key[len(prefix):]] = torch.empty(meta.size, dtype=target)
    if not state:
        raise WeightsError(f"checkpoint {step_dir} holds no model weights (no '{MODEL_KEY}' entries)")
    try:
        dcp.load({MODEL_KEY: state}, checkpoint_id=str(step_dir), no_dist=True)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise WeightsError(f"checkpoint {step_dir} could not be read, it is corrupt: "
                           f"{type(err).__name__}: {first_line(err)}") from err
    return state


__all__ = ["read_model_state_dict"]
