"""Initialization helpers shared by the model families.

Formula values are computed on the CPU (so they are bitwise the same whatever device the model
is built on); random values are drawn on the parameter's device. Every helper builds the new value
as a full fp32 tensor, then copies it in. That one path works for plain parameters (any dtype), for parameters materialised from the
meta device with `to_empty()`, and for FSDP2-sharded DTensors (each rank computes the same full
value from the same seed and keeps its own shard, with no communication).

The official RWKV formulas (docs/initialization.md) are written in terms of the layer index l of
L layers and the channel index n of C channels; `layer_ratios` and `channel_ramps` give those
quantities once, so each layer's init reads like the formula.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def _local_device(param: torch.Tensor) -> torch.device:
    return param.to_local().device if isinstance(param, DTensor) else param.device


@torch.no_grad()
def assign_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` (the full, unsharded tensor) into `param`, keeping param's dtype and sharding."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"init value of shape {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}")
    value = value.to(_local_device(param))
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def _fresh(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(param.shape, dtype=torch.float32, device=_local_device(param))


def zeros_(param: torch.Tensor) -> None:
    assign_(param, torch.zeros(param.shape, dtype=torch.float32, device="cpu"))


def constant_(param: torch.Tensor, value: float) -> None:
    assign_(param, torch.full(param.shape, float(value), dtype=torch.float32, device="cpu"))


def uniform_(param: torch.Tensor, bound: float) -> None:
    """U(-bound, bound)."""
    assign_(param, nn.init.uniform_(_fresh(param), -bound, bound))


def normal_(param: torch.Tensor, std: float) -> None:
    """N(0, std^2)."""
    assign_(param, nn.init.normal_(_fresh(param), 0.0, std))


def orthogonal_(param: torch.Tensor, gain: float) -> None:
    """A (semi-)orthogonal matrix times `gain` (torch.nn.init.orthogonal_)."""
    assign_(param, nn.init.orthogonal_(_fresh(param), gain=gain))


def lora_orthogonal_(param: torch.Tensor, scale: float) -> None:
    """RWKV7's rule for the second LoRA matrices ([rank, C], applied as x @ W): orthogonal with
    gain scale * sqrt(rows / cols) when rows > cols, else scale. The projection weights do not
    follow it: RWKV-LM's generate_init_weight sets them orthogonal with the plain gain (see
    docs/initialization.md)."""
    rows, cols = param.shape
    gain = math.sqrt(rows / cols) if rows > cols else 1.0
    orthogonal_(param, gain * scale)


def layer_ratios(layer_id: int, num_layers: int) -> tuple[float, float]:
    """(r0, r1) of the official init: r0 = l / (L - 1) runs 0 -> 1 over the layers (0 for a
    one-layer model), r1 = 1 - l / L runs 1 -> ~0."""
    r0 = layer_id / (num_layers - 1) if num_layers > 1 else 0.0
    r1 = 1.0 - layer_id / num_layers
    return r0, r1


def channel_ramps(channels: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Per-channel ramps of the official init, fp32 [C]:
    ddd = n / C; ramp = n / (C - 1) (0 -> 1); linear = ramp - 0.5;
    zigzag = z |z| with z = ((n mod N) - (N - 1)/2) / ((N - 1)/2), N = head_dim."""
    n = torch.arange(channels, dtype=torch.float64, device="cpu")
    ramp = n / (channels - 1) if channels > 1 else torch.zeros_like(n)
    half = (head_dim - 1) / 2
    z = ((n % head_dim) - half) / half if head_dim > 1 else torch.zeros_like(n)
    out = {"ddd": n / channels, "ramp": ramp, "linear": ramp - 0.5, "zigzag": z * z.abs()}
    return {name: t.float() for name, t in out.items()}


def rwkv7_lora_ranks(hidden_size: int) -> dict[str, int]:
    """The official RWKV7 LoRA-rank suggestions (docs/initialization.md):
    decay, a: max(32, round(2.5 sqrt(C) / 32) * 32); v: 1.7 sqrt(C); gate: 5 sqrt(C)."""

    def rank(factor: float) -> int:
        return max(32, int(round(factor * math.sqrt(hidden_size) / 32)) * 32)

    return {"decay": rank(2.5), "a": rank(2.5), "v": rank(1.7), "gate": rank(5.0)}


@contextmanager
def default_init_skipped():
    """Build modules without letting their default initialisation advance the CPU RNG.

    `init_weights()` sets every parameter afterwards, so the default inits of nn.Linear and
    nn.Embedding are wasted work; running them on a forked RNG keeps the global RNG where it was,
    so a model built on CPU (or CUDA) and one built on the meta device then materialised draw
    exactly the same numbers in `init_weights()`."""
    device = torch.get_default_device()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        forked = torch.random.fork_rng(devices=[index], device_type="cuda")
    else:
        forked = torch.random.fork_rng(devices=[])
    with forked:
        yield
