"""Parallelising the meta-device model for training (`parallelize`), in this order: activation
checkpointing (training.activation_checkpoint, `flame.train.activation_checkpoint`), per-block
torch.compile (training.compile), replayed as CUDA graphs where `cuda_graphs_enabled`, and under
FSDP `fully_shard` per block and at the root over the data-parallel mesh (`flame.train.fsdp`), in
the run's dtypes (`flame.train.mixed_precision.Precision`).

Replicas need nothing here: they hold the whole model, are made equal after the init
(`flame.train.parallel.broadcast_replicas`) and sum their gradients in the accumulator's
all-reduce (`flame.train.accumulation`).
"""

from __future__ import annotations

import logging

from torch import nn

from flame.train.activation_checkpoint import apply_activation_checkpointing
from flame.train.fsdp import apply_fsdp, fsdp_mesh
from flame.train.mixed_precision import Precision
from flame.train.parallel import ParallelState

logger = logging.getLogger("flame.train")


def parallelize(model: nn.Module, cfg, state: ParallelState, precision: Precision) -> bool:
    """Apply activation checkpointing, compile and FSDP, as the config `cfg` says, to the
    meta-device `model` in place; return whether its compiled blocks replay as CUDA graphs."""
    cuda_graphs = cuda_graphs_enabled(cfg, state)
    apply_activation_checkpointing(model, cfg.training.activation_checkpoint)
    if cfg.training.compile:
        apply_compile(model, cuda_graphs)
    if state.fsdp:
        mesh = fsdp_mesh(state.parallel_dims)
        apply_fsdp(model, mesh, precision.param, precision.reduce, hold_weights=state.hold_weights,
                   reshard_after_forward=cfg.parallel.reshard_after_forward)
        logger.info("fsdp: %s mesh %s, params %s, reduce %s, %s", "HSDP" if mesh.ndim > 1 else "FSDP",
                    dict(zip(mesh.mesh_dim_names, mesh.shape)), precision.param, precision.reduce,
                    "weights held gathered, gradients reduced once per step" if state.hold_weights
                    else f"weights freed after use (reshard_after_forward {cfg.parallel.reshard_after_forward})")
    return cuda_graphs


def cuda_graphs_enabled(cfg, state: ParallelState) -> bool:
    """Whether the compiled blocks replay as CUDA graphs: training.cuda_graphs with training.compile
    on a CUDA device, unless FSDP frees its gathered weights (they move between calls:
    flame.train.fsdp) or the batches are varlen (their offsets change the chunk counts, and the ops
    read them on the host)."""
    if not (cfg.training.compile and cfg.training.cuda_graphs and state.device.type == "cuda"):
        return False
    for reason, applies in (("FSDP with freed weights (parallel.fsdp_hold_weights)",
                             state.fsdp and not state.hold_weights),
                            ("training.varlen", cfg.training.varlen)):
        if applies:
            logger.info("compile: training.cuda_graphs is off under %s", reason)
            return False
    return True


def apply_compile(model: nn.Module, cuda_graphs: bool = False) -> None:
    """torch.compile each block (the repeated unit compiles once and is reused); with cuda_graphs,
    in "reduce-overhead" mode: each call replays the block's kernels as one CUDA graph."""
    for block in model.layers:
        block.compile(mode="reduce-overhead" if cuda_graphs else None)
    logger.info("compile: %d blocks wrapped with torch.compile%s", len(model.layers),
                ", replayed as CUDA graphs" if cuda_graphs else "")
