"""From documents to a token stream: tokenize once, hold out a validation split by document.

A token stream is a 1-D integer array that starts with the end-of-document token (EOD) and has
one EOD after every document: `EOD d0 EOD d1 EOD ...`. The EOD in front of a document is its
first input, so the first real token is predicted from the EOD, and the last real token
predicts the EOD.
"""

from __future__ import annotations

import numpy as np

from flame.data.errors import DataError

# Fixed seed of the train/validation split: the split depends on the documents only, so runs
# with different job seeds evaluate on the same held-out documents.
SPLIT_SEED = 0x5EED
SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def split_indices(num_docs: int, val_fraction: float, split: str) -> np.ndarray:
    """Sorted indices of the documents of `split`; at least one document is held out when
    val_fraction > 0."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    num_val = 0 if val_fraction == 0 else max(1, round(num_docs * val_fraction))
    if split == "validation" and num_val == 0:
        raise DataError("the validation split is empty: data.val_fraction is 0")
    if num_val >= num_docs:
        raise DataError(f"data.val_fraction = {val_fraction} holds out all {num_docs} documents")
    is_val = np.zeros(num_docs, dtype=bool)
    is_val[np.random.default_rng(SPLIT_SEED).permutation(num_docs)[:num_val]] = True
    return np.flatnonzero(is_val if split == "validation" else ~is_val)


def tokenize_dataset(ds, text_field: str, tokenizer, num_workers: int = 0):
    """A `datasets.Dataset` with one column "ids": each document's tokens, EOD appended.

    With num_workers > 1 the tokenization runs in that many worker processes (datasets.map);
    `datasets` caches the result on disk, keyed by the data and the tokenizer.
    """
    eod = tokenizer.eod_id

    def encode(batch):
        return {"ids": [ids + [eod] for ids in tokenizer.encode_batch(batch[text_field])]}

    return ds.map(encode, batched=True, batch_size=256, remove_columns=ds.column_names,
                  num_proc=num_workers if num_workers > 1 else None, desc="tokenizing")


def ids_to_numpy(ids_column, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets) of an arrow list column: document i is tokens[offsets[i]:offsets[i+1]]."""
    column = ids_column.combine_chunks() if hasattr(ids_column, "combine_chunks") else ids_column
    tokens = column.flatten().to_numpy(zero_copy_only=False).astype(dtype)
    offsets = column.offsets.to_numpy().astype(np.int64)
    return tokens, offsets - offsets[0]


_TOKENIZED: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def tokenize_documents(ds, text_field: str, tokenizer, num_workers: int = 0):
    """(tokens, offsets) of every document of `ds`, EOD appended to each; document i is
    tokens[offsets[i]:offsets[i+1]]. Cached in memory for this process."""
    key = (getattr(ds, "_fingerprint", None) or id(ds), text_field, tokenizer.fingerprint)
    if key not in _TOKENIZED:
        tokenized = tokenize_dataset(ds, text_field, tokenizer, num_workers)
        _TOKENIZED[key] = ids_to_numpy(tokenized.data.column("ids"),
                                       token_dtype(tokenizer.vocab_size))
    return _TOKENIZED[key]


def build_stream(tokens: np.ndarray, offsets: np.ndarray, docs: np.ndarray, eod_id: int) -> np.ndarray:
    """The token stream `EOD d EOD d ...` of the documents `docs` (their order kept)."""
    lengths = np.diff(offsets)
    keep = np.zeros(len(lengths), dtype=bool)
    keep[docs] = True
    body = tokens[np.repeat(keep, lengths)]
    return np.concatenate([np.array([eod_id], dtype=tokens.dtype), body])
