"""The torch objects that the names of a config or a command line stand for: dtypes (`DTYPES`)
and devices (`resolve_device`).

This module imports torch; `import flame.config` does not import it, so a config is read and
checked with the standard library alone."""

from __future__ import annotations

import torch

from flame.config.job import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""Each dtype name that a config or a command line may give, and its torch dtype."""


def resolve_device(name: str, setting: str) -> torch.device:
    """The device that `name` stands for: "auto" is CUDA when available, else the CPU; any other
    name ("cpu", "cuda", "cuda:1") must name a device of this machine. `setting` is where the name
    came from (training.device, --device), for the error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"{setting} {name!r} is not a device name ({err})") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting} {name} asks for CUDA, which this machine does not have")
    return device
