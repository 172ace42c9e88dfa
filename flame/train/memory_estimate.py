"""GPU memory per rank of a training step, estimated before the model is built: the numbers that
choose replicas or FSDP and, under FSDP, held or freed weights (`flame.train.data_parallel_plan`).

Each total is the step's peak on one rank, in bytes, from the parameter counts and the config
(P parameters; S ranks that FSDP shards over; w, r: the bytes of an element in
training.mixed_precision_param and training.mixed_precision_reduce, 2 and 4 by default):

- **replicas** (`replicated`): every parameter's fp32 weight, fp32 gradient and AdamW's two fp32
  moments (16 bytes) and its compute copy (w bytes, `flame.train.mixed_precision`; none in fp32);
  under a reduce dtype other than fp32, the buckets' copies in flight (r bytes); then the larger of
  one micro-batch's activations and the compute copies' gradients, which a backward of the
  accumulation returns all at once (w bytes per parameter, `flame.train.accumulation`).
- **FSDP, weights freed after use** (`fsdp(..., hold_weights=False)`): the rank's shards of the
  fp32 weights, gradients and AdamW state (16 / S bytes per parameter); the gathered weights of two
  blocks, the one computing and the one prefetched (every block's with
  parallel.reshard_after_forward = "never"), and one block's unsharded gradients, in the compute
  and in the reduce dtype; the root's parameters (embeddings, final norm, head), gathered from its
  forward to its backward, and their gradients; one micro-batch's activations.
- **FSDP, weights held** (`fsdp(..., hold_weights=True)`): the same shards and activations; every
  weight gathered (w bytes per parameter) and the step's unsharded gradients, accumulated in the
  reduce dtype until the last micro-batch (r bytes per parameter, `flame.train.fsdp`), and one
  block's gradients in the compute dtype as its backward makes them.

Activations of one micro-batch of T = training.batch_size x training.seq_len tokens through L
blocks of width C (`activation_bytes`):

    T x (L x saved(C) + working(C)) x w / 2  +  head

saved: what a block keeps for its backward, per token; working: what the backward of one block
holds beyond that per token (the recomputed block under activation checkpointing, the gradients in
flight). Both are a + b C bytes (`PerToken`) per family and training.activation_checkpoint
(ACTIVATION_BYTES, in bf16, with compiled blocks replayed as CUDA graphs: the graphs' memory pool
included; `python -m bench.activation_memory` measures them on one GPU); RWKV7's
model.cache_intermediates and model.recompute_states add to `saved` (RWKV7_FLAG_BYTES). head: the
LM head's workspace (`head_workspace_bytes`, flame.ops.linear_cross_entropy).

A total fits when it takes at most FIT_FRACTION of the free memory of the rank with the least
(`torch.cuda.mem_get_info` once the process has its CUDA context, the minimum over the ranks);
the rest is left to what the estimate does not count: the allocator's cached but unused blocks,
NCCL's buffers, cuBLAS's and Triton's workspaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flame.config.torch_types import DTYPES
from flame.ops.linear_cross_entropy.linear_cross_entropy import default_chunk_rows

FIT_FRACTION = 0.9
"""The share of a rank's free memory that a total may take and still fit."""

SHARDED_BYTES_PER_PARAMETER = 16
"""What FSDP shards over the ranks per parameter: the fp32 weight and gradient and AdamW's two fp32
moments (replicas hold all of it on every rank)."""
GATHERED_BLOCKS = 2
"""Blocks whose weights FSDP holds gathered at once when it frees them after use: the one
computing and the next, prefetched."""


@dataclass(frozen=True)
class PerToken:
    """Bytes per token as a + b C, for a model of hidden size C."""

    a: float
    b: float

    def at(self, hidden_size: int) -> float:
        return self.a + self.b * hidden_size


# (family, training.activation_checkpoint): (saved per block, working of the backward), bytes per
# token, in bf16, RWKV7's model.cache_intermediates and model.recompute_states off.
#
# `python -m bench.activation_memory` measures every entry on one GPU and prints the table to put
# here. Until it has run on an H100, the entries are b C (a = 0) from the peak memory of whole
# training steps measured on H100s (bench/RESULTS.md, issue 39), less what the rest of this module
# counts (weights, gradients, AdamW state, compute copies or shards and gathered weights, the
# head's workspace), per token and block; with the working term taken as one block's saved
# tensors, `saved` is L / (L + 1) of that per-block figure. Where no run was measured, the entry
# counts what a block keeps for its backward, in bf16 (2 bytes a value):
# - "none": rwkv7 64.9 C (rwkv7_340M, 32.7 GiB at batch 8; rwkv7_1B's 42.1 GiB at batch 4 gives
#   44.7 C: the larger is kept); rwkv6 43.3 C ("none" keeps at least what "elementwise" keeps,
#   below; rwkv6_1B's 39.2 GiB at batch 4 gives 34.3 C); gsa 27.4 C (gsa_1B, 45.8 GiB at batch 8).
# - "elementwise": rwkv7 34.1 C (issue 39's 6.9B RWKV7: 49 GiB per GPU under FSDP over 4 with
#   freed weights at batch 2; rwkv7_340M without the cache, about 20 GiB at batch 8, gives 32.3 C,
#   issue 39's 2.9B one, 47.9 GiB under FSDP over 2 with held weights, 31.9 C); rwkv6 43.3 C
#   (rwkv6_340M, 24.6 GiB); gsa 25.4 C (gsa_340M, 27.2 GiB at batch 16).
# - "selective" (torchtitan's policy keeps the outputs of a block's 1st, 3rd, ... matrix product
#   and of batched products; the chunk kernels run again in the backward), counted: the block's
#   input and rwkv7's r, v, the second products of the w, v, a and gate LoRAs and the channel
#   mix's key product (4 C values): 22 C; rwkv6's mixing LoRA output (5 C values), k, g, the decay
#   LoRA's output, the channel mix's key (3.5 C values) and value: 27 C; gsa's q, v, o and the
#   MLP's up product (8/3 C values): 13.5 C. Working: one block recomputed, the family's "none".
# - "full": the block's input, 2 C; working: one block recomputed, the family's "none".
ACTIVATION_BYTES: dict[tuple[str, str], tuple[PerToken, PerToken]] = {
    ("rwkv7", "none"): (PerToken(0, 64.9), PerToken(0, 64.9)),
    ("rwkv7", "selective"): (PerToken(0, 22.0), PerToken(0, 64.9)),
    ("rwkv7", "elementwise"): (PerToken(0, 34.1), PerToken(0, 34.1)),
    ("rwkv7", "full"): (PerToken(0, 2.0), PerToken(0, 64.9)),
    ("rwkv6", "none"): (PerToken(0, 43.3), PerToken(0, 43.3)),
    ("rwkv6", "selective"): (PerToken(0, 27.0), PerToken(0, 43.3)),
    ("rwkv6", "elementwise"): (PerToken(0, 43.3), PerToken(0, 43.3)),
    ("rwkv6", "full"): (PerToken(0, 2.0), PerToken(0, 43.3)),
    ("gsa", "none"): (PerToken(0, 27.4), PerToken(0, 27.4)),
    ("gsa", "selective"): (PerToken(0, 13.5), PerToken(0, 27.4)),
    ("gsa", "elementwise"): (PerToken(0, 25.4), PerToken(0, 25.4)),
    ("gsa", "full"): (PerToken(0, 2.0), PerToken(0, 27.4)),
}

RWKV7_FLAG_BYTES: dict[str, PerToken] = {
    "cache_intermediates": PerToken(0, 23.0),
    "recompute_states": PerToken(0, -8.0),
}
"""What RWKV7's chunk kernel keeps per block and token beyond ACTIVATION_BYTES when a flag is on
(negative: less); none under "full", whose backward runs the kernel's forward again. Until
bench.activation_memory has measured them, from the kernel's own count (flame/ops/rwkv7/chunk_triton.py,
64-wide heads, chunks of 32): the cached intermediates, 1600 bytes per token and head less the WY
inverse that the forward keeps anyway (128), 23 C; the per-chunk states, 64 x 64 fp32 per chunk of
32 tokens and head, 8 C."""


@dataclass(frozen=True)
class ParamCounts:
    """What the estimate needs of the model: its parameters, those of its largest block and those
    outside the blocks (FSDP's root unit: embeddings, final norm, head)."""

    total: int
    largest_block: int
    root: int

    @classmethod
    def of(cls, model: nn.Module) -> ParamCounts:
        """The counts of a model with `layers` (a meta-device model will do)."""
        blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers]
        total = sum(p.numel() for p in model.parameters())
        return cls(total=total, largest_block=max(blocks, default=0), root=total - sum(blocks))


@dataclass(frozen=True)
class Estimate:
    """A rank's peak memory in one training step, by part (bytes)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def fits(self, free_bytes: int) -> bool:
        """Whether the total takes at most FIT_FRACTION of `free_bytes`."""
        return self.total <= FIT_FRACTION * free_bytes

    def describe(self) -> str:
        """'48.9 GiB (shards 25.7, ..., activations 19.4)': the total and its non-zero parts."""
        parts = ", ".join(f"{name} {gib(size)}" for name, size in self.parts.items() if size)
        return f"{gib(self.total)} GiB ({parts})"


def gib(size: float) -> str:
    return f"{size / 2**30:.1f}"


def activation_table_entry(family: str, policy: str) -> tuple[PerToken, PerToken]:
    """ACTIVATION_BYTES of a family and training.activation_checkpoint; a clear error for a pair
    the table lacks."""
    try:
        return ACTIVATION_BYTES[family, policy]
    except KeyError:
        known = ", ".join(f"{f}/{p}" for f, p in ACTIVATION_BYTES)
        raise ValueError(f"no activation measurement for model.family {family!r} with "
                         f"training.activation_checkpoint {policy!r} (measured: {known}); "
                         f"bench.activation_memory measures it") from None


def head_workspace_bytes(cfg) -> int:
    """The LM head's memory in one micro-batch (flame.ops.linear_cross_entropy, which computes the
    gradients in the forward): one chunk of logits, overwritten by their gradient, in the compute
    dtype; the head's input and its gradient ([T, C] each, compute dtype); the head's weight
    gradient in fp32, the compute-dtype product added into it, and in the backward its scaled fp32
    copy and the cast to the weight's dtype (4 + w + 4 + w bytes per head weight)."""
    m, t = cfg.model, cfg.training
    w = DTYPES[t.mixed_precision_param].itemsize
    tokens = t.batch_size * t.seq_len
    rows = min(tokens, default_chunk_rows(m.vocab_size))
    head = m.vocab_size * m.hidden_size
    return rows * m.vocab_size * w + 2 * tokens * m.hidden_size * w + head * (8 + 2 * w)


def activation_bytes(cfg) -> int:
    """One micro-batch's activations on a rank (module docstring): the blocks' saved tensors, the
    backward's working memory and the LM head's workspace."""
    m, t = cfg.model, cfg.training
    saved, working = activation_table_entry(m.family, t.activation_checkpoint)
    per_block = saved.at(m.hidden_size)
    if m.family == "rwkv7" and t.activation_checkpoint != "full":
        for flag, extra in RWKV7_FLAG_BYTES.items():
            if getattr(m, flag):
                per_block += extra.at(m.hidden_size)
    tokens = t.batch_size * t.seq_len
    scale = DTYPES[t.mixed_precision_param].itemsize / 2  # measured in bf16
    blocks = tokens * (m.num_layers * per_block + working.at(m.hidden_size)) * scale
    return int(blocks) + head_workspace_bytes(cfg)


def replicated(cfg, params: ParamCounts, ranks: int) -> Estimate:
    """A replica's peak over `ranks` data-parallel ranks (module docstring)."""
    t = cfg.training
    w, r = DTYPES[t.mixed_precision_param].itemsize, DTYPES[t.mixed_precision_reduce].itemsize
    copies = 0 if t.mixed_precision_param == "float32" else w
    reducing = r if ranks > 1 and t.mixed_precision_reduce != "float32" else 0
    return Estimate({
        "weights, gradients and AdamW state": SHARDED_BYTES_PER_PARAMETER * params.total,
        "compute copies": copies * params.total,
        "reduce buckets": reducing * params.total,
        # the backward returns every gradient at once, in the compute dtype (w bytes)
        "activations": max(activation_bytes(cfg), w * params.total),
    })


def fsdp(cfg, params: ParamCounts, shards: int, hold_weights: bool) -> Estimate:
    """A rank's peak under FSDP over `shards` ranks, with held or freed weights (module docstring)."""
    t = cfg.training
    w, r = DTYPES[t.mixed_precision_param].itemsize, DTYPES[t.mixed_precision_reduce].itemsize
    shard_bytes = -(-SHARDED_BYTES_PER_PARAMETER * params.total // shards)
    if hold_weights:
        gathered = params.total * (w + r) + params.largest_block * w
        gathered_name = "held weights and gradients"
    else:
        blocks = params.total - params.root
        held_blocks = blocks if cfg.parallel.reshard_after_forward == "never" else (
            min(GATHERED_BLOCKS * params.largest_block, blocks))
        gathered = held_blocks * w + params.largest_block * (w + r) + params.root * (2 * w + r)
        gathered_name = "gathered weights and gradients"
    return Estimate({
        "shards": shard_bytes,
        gathered_name: gathered,
        "activations": activation_bytes(cfg),
    })


def free_memory(device: torch.device) -> int:
    """The free memory of `device` (bytes) as the driver reports it."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)
