"""Batches from token streams: fixed windows, per-epoch shuffling, rank sharding, mixtures,
varlen packing, and a state that resumes at exactly the next batch.

Every source is one token stream (flame.data.tokens: `EOD d0 EOD d1 EOD ...`), either tokenized
in memory from text or memory-mapped from pre-tokenized shards. The stream is cut into fixed
windows of `L + 1` tokens (consecutive windows share one token), so window i gives
`input_ids = w[:-1]` and `labels = w[1:]`; L is seq_len, or batch_size * seq_len in varlen mode.

Training order: in epoch e, the windows of source s are permuted by a generator seeded with
(seed, s, e); rank r of W reads permuted positions r, r + W, r + 2W, ... (a disjoint part), and
each rank reads the same number of windows per epoch (the remainder is dropped). With several
sources, each sample's source is drawn with `probs` from a generator seeded with
(seed, rank, block of 1024 samples). All of this is a function of a few counters, so the state
is those counters: the epoch and position of each source and the number of samples drawn.

Validation reads each source's windows once, in order, the final batch possibly short; every
`iter()` starts from the beginning.

Streamed sources (flame.data.streaming) plug in with the same window interface.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flame.data.errors import DataError

MIX_BLOCK = 1024
STATE_VERSION = 1


class WindowSource:
    """One token stream cut into windows of `length + 1` tokens, read in a per-rank order."""

    def __init__(self, stream: np.ndarray, length: int, description: str, *, index: int,
                 seed: int, rank: int, world: int, shuffle: bool):
        self.stream = stream
        self.length = length
        self.description = description
        self.num_windows = (len(stream) - 1) // length
        self.per_rank = self.num_windows // world
        if self.per_rank == 0:
            raise DataError(
                f"{description} has {len(stream)} tokens: fewer than one window of {length + 1} "
                f"tokens per data-parallel rank ({world} ranks); use a shorter seq_len, fewer "
                "ranks or more data"
            )
        self.index, self.seed, self.rank, self.world, self.shuffle = index, seed, rank, world, shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = None
        self._order = None

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_windows)
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, self.index, epoch])
            self._order, self._order_epoch = rng.permutation(self.num_windows), epoch
        return self._order

    def exhausted(self) -> bool:
        return not self.shuffle and self.position >= self.per_rank

    def next_window(self) -> np.ndarray:
        if self.position >= self.per_rank:
            if not self.shuffle:
                raise StopIteration
            self.epoch, self.position = self.epoch + 1, 0
        start = int(self.order(self.epoch)[self.rank + self.world * self.position]) * self.length
        self.position += 1
        return self.stream[start:start + self.length + 1]

    def reset(self) -> None:
        self.epoch, self.position = 0, 0

    def state_dict(self) -> dict:
        return {"description": self.description, "num_windows": self.num_windows,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict, old_world: int) -> None:
        position = state["position"]
        if old_world != self.world:  # re-split: the same fraction of the epoch
            position = min(self.per_rank, math.ceil(position * old_world / self.world))
        self.epoch, self.position = state["epoch"], position


class DataLoader:
    """Iterable of batches `{"input_ids": [B, T] long, "labels": [B, T] long}`; in varlen mode
    B == 1 and the batch also has `cu_seqlens` (int32) and `position_ids` ([1, T] long)."""

    def __init__(self, streams: list[tuple[np.ndarray, str]], *, eod_id: int, batch_size: int,
                 seq_len: int, split: str, seed: int, dp_rank: int, dp_world_size: int,
                 probs: list[float] | None = None, varlen: bool = False, context_len: int = 0,
                 allow_dp_resplit: bool = False):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if not 0 <= dp_rank < dp_world_size:
            raise DataError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        if context_len < 0:
            raise DataError(f"context_len must be >= 0, got {context_len}")
        self.eod_id, self.batch_size, self.seq_len, self.split = eod_id, batch_size, seq_len, split
        self.seed, self.dp_rank, self.dp_world_size = seed, dp_rank, dp_world_size
        self.varlen, self.context_len = varlen, context_len or seq_len
        self.allow_dp_resplit = allow_dp_resplit
        self.training = split == "train"
        length = batch_size * seq_len if varlen else seq_len
        self.sources = []
        for i, item in enumerate(streams):
            if isinstance(item, tuple):  # (token stream, description)
                self.sources.append(WindowSource(item[0], length, item[1], index=i, seed=seed,
                                                 rank=dp_rank, world=dp_world_size,
                                                 shuffle=self.training))
            else:  # a streamed dataset (flame.data.streaming.StreamedDataset)
                self.sources.append(item.open(length, index=i, seed=seed, rank=dp_rank,
                                              world=dp_world_size, split=split))
        self.probs = normalized_probs(probs, len(self.sources))
        self.samples = 0
        self._mix_block, self._mix = None, None

    # --- sampling -----------------------------------------------------------------------------

    def _source_of_sample(self, k: int) -> WindowSource:
        if len(self.sources) == 1:
            return self.sources[0]
        if not self.training:  # validation: every source once, in order
            return next((s for s in self.sources if not s.exhausted()), self.sources[-1])
        block = k // MIX_BLOCK
        if self._mix_block != block:
            rng = np.random.default_rng([self.seed, self.dp_rank, block])
            self._mix = rng.choice(len(self.sources), size=MIX_BLOCK, p=self.probs)
            self._mix_block = block
        return self.sources[int(self._mix[k % MIX_BLOCK])]

    def _next_window(self) -> np.ndarray:
        window = self._source_of_sample(self.samples).next_window()
        self.samples += 1
        return window

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch; StopIteration at the end of a validation pass."""
        if self.varlen:
            return self._varlen_batch(self._next_window())
        rows = []
        for _ in range(self.batch_size):
            try:
                rows.append(self._next_window())
            except StopIteration:
                break
        if not rows:
            raise StopIteration
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        # separate contiguous tensors: a consumer that masks labels in place leaves inputs intact
        return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}

    def _varlen_batch(self, window: np.ndarray) -> dict[str, torch.Tensor]:
        inputs = window[:-1]
        starts = np.flatnonzero(inputs == self.eod_id)
        cu = segment_bounds(starts, len(inputs), self.context_len)
        positions = np.arange(len(inputs)) - np.repeat(cu[:-1], np.diff(cu))
        window = torch.from_numpy(window.astype(np.int64))
        return {"input_ids": window[None, :-1].contiguous(), "labels": window[None, 1:].contiguous(),
                "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
                "position_ids": torch.from_numpy(positions)[None]}

    def __iter__(self):
        if not self.training:
            self.samples = 0
            for source in self.sources:
                source.reset()
        while True:
            try:
                batch = self.next_batch()
            except StopIteration:
                return
            yield batch

    def __len__(self) -> int:
        """Batches in one validation pass (training loaders are infinite)."""
        if self.training:
            raise TypeError("a training DataLoader is infinite and has no len()")
        if any(not hasattr(s, "per_rank") for s in self.sources):
            raise TypeError("a streamed validation split has no len()")
        samples = sum(s.per_rank for s in self.sources)
        return samples if self.varlen else math.ceil(samples / self.batch_size)

    # --- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "split": self.split, "seed": self.seed,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "varlen": self.varlen,
                "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size,
                "samples": self.samples, "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; refuses a state of another data layout.

        A state saved with a different number of data-parallel ranks is refused unless
        allow_dp_resplit is set. The re-split then keeps each source's epoch and moves its
        position to the same fraction of the epoch under the new rank count
        (ceil(position * old_ranks / new_ranks)): with one source, no window of the current epoch
        is repeated and fewer than new_ranks windows are skipped; with a mixture the ranks' positions
        differ and the continuation is approximate.
        """
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data loader state version {state.get('version')} is not {STATE_VERSION}")
        for key in ("split", "seed", "batch_size", "seq_len", "varlen"):
            if state[key] != getattr(self, key):
                raise DataError(f"data loader state has {key} = {state[key]!r}, this run has "
                                 f"{getattr(self, key)!r}; cannot resume exactly")
        saved = [(s["description"], s["num_windows"]) for s in state["sources"]]
        mine = [(s.description, s.num_windows) for s in self.sources]
        if saved != mine:
            raise DataError(f"data loader state is for sources {saved}, this run reads {mine}")
        old_world = state["dp_world_size"]
        if old_world != self.dp_world_size and not self.allow_dp_resplit:
            raise DataError(
                f"the checkpoint's data loader ran on {old_world} data-parallel ranks, this run has "
                f"{self.dp_world_size}; resuming would change which data each rank reads. Resume "
                "with the same number of ranks, or set data.allow_dp_resplit = true to re-split "
                "(see flame.data.loader.DataLoader.load_state_dict)"
            )
        for source, saved_source in zip(self.sources, state["sources"]):
            source.load_state_dict(saved_source, old_world)
        self.samples = state["samples"]


def normalized_probs(probs, num_sources: int) -> np.ndarray:
    if not probs:
        return np.full(num_sources, 1.0 / num_sources)
    probs = np.asarray(probs, dtype=np.float64)
    if len(probs) != num_sources:
        raise DataError(f"data.probs has {len(probs)} entries for {num_sources} sources")
    if (probs < 0).any() or probs.sum() <= 0 or not np.isfinite(probs).all():
        raise DataError(f"data.probs must be non-negative with a positive sum, got {probs.tolist()}")
    return probs / probs.sum()


def segment_bounds(doc_starts: np.ndarray, length: int, context_len: int) -> np.ndarray:
    """cu_seqlens of a varlen row: a segment starts at 0 and at every document start, and
    segments longer than context_len are cut into pieces of at most context_len tokens."""
    starts = np.union1d(doc_starts, [0])
    ends = np.append(starts[1:], length)
    pieces = [np.arange(s, e, context_len) for s, e in zip(starts, ends)]
    return np.append(np.concatenate(pieces), length).astype(np.int64)
