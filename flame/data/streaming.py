"""A streamed source (`data.streaming = true`): documents read in order from a
`datasets.IterableDataset`, tokenized on the fly, packed into windows, shuffled in a buffer.

Document k of the stream (counted from 0 in every epoch) is held out for validation when
frac(k * golden ratio) < val_fraction (an evenly spread, fixed selection), and belongs to rank
k mod W. Each rank packs its own documents (`EOD d EOD d ...`) into windows of `length + 1`
tokens; in training a buffer of `shuffle_buffer` windows is sampled by a generator seeded with
(seed, source, rank, draw number). At the end of the stream training starts the next epoch
(the window order changes with the draws); validation stops.

The state is the epoch, the number of documents read, the tokens read but not yet in a window,
the shuffle buffer and the draw count. Resuming re-reads (skips) the documents already read.
"""

from __future__ import annotations

import numpy as np

from flame.data.errors import DataError
from flame.data.records import first_bad_record
from flame.data.tokens import token_dtype

GOLDEN = 0x9E3779B97F4A7C15
READ_BATCH = 64


def is_validation(k: int, val_fraction: float) -> bool:
    return ((k * GOLDEN) % 2**64) / 2**64 < val_fraction


class StreamedDataset:
    """A streamed `datasets.IterableDataset` waiting for the loader's layout (`open`)."""

    def __init__(self, ds, text_field: str, tokenizer, description: str, val_fraction: float,
                 shuffle_buffer: int = 64, files: tuple[str | None, list[str]] = (None, [])):
        """`files`: (file type, files) of a local source, read again to name the file and line of
        a record that cannot be used (`flame.data.records`)."""
        self.ds, self.text_field, self.tokenizer = ds, text_field, tokenizer
        self.description, self.val_fraction, self.shuffle_buffer = description, val_fraction, shuffle_buffer
        self.files = files

    def open(self, length: int, *, index: int, seed: int, rank: int, world: int, split: str):
        return StreamSource(self.ds, self.text_field, self.tokenizer, length,
                            f"{self.description}/{split}", index=index, seed=seed, rank=rank,
                            world=world, split=split, val_fraction=self.val_fraction,
                            shuffle_buffer=self.shuffle_buffer, files=self.files)


class StreamSource:
    """Windows of a streamed dataset; the same interface as loader.WindowSource."""

    def __init__(self, ds, text_field: str, tokenizer, length: int, description: str, *,
                 index: int, seed: int, rank: int, world: int, split: str, val_fraction: float,
                 shuffle_buffer: int = 64, files: tuple[str | None, list[str]] = (None, [])):
        if split == "validation" and val_fraction == 0:
            raise DataError("the validation split is empty: data.val_fraction is 0")
        self.ds, self.text_field, self.tokenizer, self.files = ds, text_field, tokenizer, files
        self.length, self.description = length, description
        self.index, self.seed, self.rank, self.world = index, seed, rank, world
        self.split, self.val_fraction = split, val_fraction
        self.shuffle = split == "train"
        self.buffer_size = shuffle_buffer if self.shuffle else 0
        self.num_windows = None  # unknown for a stream
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.reset()

    def reset(self) -> None:
        self.epoch, self.docs_read, self.draws = 0, 0, 0
        self.pending = np.array([self.tokenizer.eod_id], dtype=self.dtype)
        self.buffer: list[np.ndarray] = []
        self.finished = False
        self._docs = None
        self._mine_this_epoch = 0

    def _mine(self, k: int) -> bool:
        held_out = is_validation(k, self.val_fraction)
        return k % self.world == self.rank and held_out == (self.split == "validation")

    def _read_documents(self) -> bool:
        """Tokenize the next batch of this rank's documents into `pending`; False at the end
        of the stream (training then starts the next epoch)."""
        if self._docs is None:
            ds = self.ds.skip(self.docs_read) if self.docs_read else self.ds
            self._docs = iter(ds)
        texts = []
        try:
            for row in self._docs:
                k = self.docs_read
                self.docs_read += 1
                if self._mine(k):
                    if self.text_field not in row:
                        raise DataError(f"field {self.text_field!r} not found in {self.description}; "
                                        f"fields are {sorted(row)}")
                    if not isinstance(row[self.text_field], str):
                        raise DataError(f"document {k + 1} of {self.description}: field "
                                        f"{self.text_field!r} is {row[self.text_field]!r:.80}, not text")
                    texts.append(row[self.text_field])
                    if len(texts) == READ_BATCH:
                        break
        except Exception as err:  # datasets raises many types; name the file and line when local
            problem = first_bad_record(*self.files, self.text_field) if self.files[0] else None
            if problem is None and isinstance(err, DataError):
                raise
            raise DataError(problem or f"cannot read {self.description} after {self.docs_read} "
                                       f"documents: {type(err).__name__}: {err}") from err
        if texts:
            self._mine_this_epoch += len(texts)
            eod = self.tokenizer.eod_id
            ids = [np.asarray(d + [eod], dtype=self.dtype) for d in self.tokenizer.encode_batch(texts)]
            self.pending = np.concatenate([self.pending, *ids])
            return True
        if not self.shuffle:
            return False
        if self._mine_this_epoch == 0:
            if self.docs_read == 0:
                raise DataError(f"dataset {self.description} is empty")
            raise DataError(f"{self.description} has no {self.split} documents for data-parallel "
                            f"rank {self.rank} of {self.world} ({self.docs_read} documents)")
        self.epoch, self.docs_read, self._docs, self._mine_this_epoch = self.epoch + 1, 0, None, 0
        return True

    def _pack(self) -> np.ndarray | None:
        while len(self.pending) < self.length + 1:
            if not self._read_documents():
                return None
        window = self.pending[:self.length + 1]
        self.pending = self.pending[self.length:]
        return window

    def exhausted(self) -> bool:
        if self.finished or self.buffer:
            return self.finished
        if self.shuffle:
            return False
        window = self._pack()
        if window is None:
            self.finished = True
        else:
            self.buffer.append(window)
        return self.finished

    def next_window(self) -> np.ndarray:
        if not self.shuffle:
            if self.exhausted():
                raise StopIteration
            return self.buffer.pop()
        while len(self.buffer) < self.buffer_size + 1:
            self.buffer.append(self._pack())
        rng = np.random.default_rng([self.seed, self.index, self.rank, self.draws])
        j = int(rng.integers(len(self.buffer)))
        self.draws += 1
        self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
        return self.buffer.pop()

    def state_dict(self) -> dict:
        return {"description": self.description, "num_windows": None, "epoch": self.epoch,
                "docs_read": self.docs_read, "draws": self.draws,
                "mine_this_epoch": self._mine_this_epoch, "finished": self.finished,
                "pending": self.pending.tolist(), "buffer": [w.tolist() for w in self.buffer]}

    def load_state_dict(self, state: dict, old_world: int) -> None:
        if old_world != self.world:
            raise DataError("a streamed source cannot be re-split over another number of "
                             f"data-parallel ranks ({old_world} -> {self.world})")
        self.epoch, self.docs_read, self.draws = state["epoch"], state["docs_read"], state["draws"]
        self._mine_this_epoch, self.finished = state["mine_this_epoch"], state["finished"]
        self.pending = np.asarray(state["pending"], dtype=self.dtype)
        self.buffer = [np.asarray(w, dtype=self.dtype) for w in state["buffer"]]
        self._docs = None
