"""Pre-tokenized shards: token streams written once, memory-mapped for training.

A shard folder holds, for each source i and split ("train", "validation"):
- `source{i}-{split}.bin`: the token stream `EOD d0 EOD d1 EOD ...` as raw little-endian
  uint16 (vocabularies up to 65536 tokens) or uint32;
- `source{i}-{split}.idx.npy`: int64 start position of every document in that stream;
and `manifest.json`: format, tokenizer (path, sha256 fingerprint, vocab size, EOD id), dtype,
val_fraction, and per source its spec, description and document/token counts per split. The
manifest is written last, so a folder with a manifest is complete.

The streams are exactly those the raw-text path builds in memory (same documents, same split),
so training from shards yields the same batches as training from the text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from flame.data.errors import DataError
from flame.data.sources import load_documents
from flame.data.tokens import SPLITS, ids_to_numpy, split_indices, token_dtype, tokenize_dataset

FORMAT = "flame-shards-1"
MANIFEST = "manifest.json"
WRITE_BATCH_DOCS = 4096


def shard_paths(folder: Path, source_index: int, split: str) -> tuple[Path, Path]:
    stem = f"source{source_index}-{split}"
    return folder / f"{stem}.bin", folder / f"{stem}.idx.npy"


def write_shards(out: str | os.PathLike, specs: list[str], tokenizer, *, val_fraction: float,
                 data_files=(), name: str = "", dataset_split: str = "train",
                 text_field: str = "text", num_workers: int = 0, log=print) -> dict:
    """Tokenize every source once and write its train/validation streams; returns the manifest."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).unlink(missing_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    splits = SPLITS if val_fraction > 0 else ("train",)
    sources = []
    for i, spec in enumerate(specs):
        ds, field, description = load_documents(spec, data_files=data_files, name=name,
                                                split=dataset_split, text_field=text_field)
        ids = tokenize_dataset(ds, field, tokenizer, num_workers).data
        entry = {"spec": spec, "description": description, "documents": {}, "tokens": {}}
        for split in splits:
            keep = np.zeros(ids.num_rows, dtype=bool)
            keep[split_indices(ids.num_rows, val_fraction, split)] = True
            bin_path, idx_path = shard_paths(folder, i, split)
            tokens, starts = write_stream(bin_path, ids, keep, dtype, tokenizer.eod_id)
            np.save(idx_path, starts)
            entry["documents"][split], entry["tokens"][split] = len(starts), tokens
            log(f"{description} [{split}]: {len(starts)} documents, {tokens} tokens -> {bin_path}")
        sources.append(entry)
    manifest = {"format": FORMAT, "dtype": dtype.name, "val_fraction": val_fraction,
                "tokenizer": {"source": tokenizer.source, "fingerprint": tokenizer.fingerprint,
                              "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id},
                "sources": sources}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(folder / MANIFEST)
    return manifest


def write_stream(path: Path, ids, keep: np.ndarray, dtype, eod_id: int) -> tuple[int, np.ndarray]:
    """Write `EOD` then the kept documents of the arrow table `ids` (EOD already appended to
    each), batch by batch; returns (tokens written, document start positions)."""
    starts, position, row = [], 1, 0
    with open(path, "wb") as f:
        f.write(np.array([eod_id], dtype=dtype).tobytes())
        for batch in ids.to_batches(max_chunksize=WRITE_BATCH_DOCS):
            tokens, offsets = ids_to_numpy(batch.column(0), dtype)
            mask = keep[row:row + batch.num_rows]
            row += batch.num_rows
            lengths = np.diff(offsets)[mask]
            starts.append(position + np.cumsum(lengths) - lengths)
            kept = tokens[np.repeat(mask, np.diff(offsets))]
            f.write(kept.tobytes())
            position += len(kept)
    return position, np.concatenate(starts).astype(np.int64) if starts else np.zeros(0, np.int64)


def read_manifest(shard_dir: str | os.PathLike) -> dict:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"no shard manifest {path}: create the shards first with "
                        f"`python -m flame.data.prepare --config <job.toml> --out {shard_dir}`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def open_shards(shard_dir: str | os.PathLike, tokenizer, split: str,
                val_fraction: float | None = None) -> list[tuple[np.ndarray, str]]:
    """The memory-mapped streams of `split`, one per source, as (tokens, description); refuses
    shards made with another tokenizer or another val_fraction."""
    folder = Path(shard_dir)
    manifest = read_manifest(folder)
    made_with = manifest["tokenizer"]
    if made_with["fingerprint"] != tokenizer.fingerprint:
        raise DataError(
            f"the shards in {folder} were made with the tokenizer {made_with['source']} "
            f"(sha256 {made_with['fingerprint'][:12]}..., {made_with['vocab_size']} tokens); this "
            f"run uses {tokenizer.source} (sha256 {tokenizer.fingerprint[:12]}..., "
            f"{tokenizer.vocab_size} tokens). Re-create them with `python -m flame.data.prepare`"
        )
    if val_fraction is not None and val_fraction != manifest["val_fraction"]:
        raise DataError(f"the shards in {folder} hold out val_fraction = "
                        f"{manifest['val_fraction']}, this run asks for {val_fraction}")
    streams = []
    for i, source in enumerate(manifest["sources"]):
        if split not in source["tokens"]:
            raise DataError(f"the shards in {folder} have no {split} split (val_fraction = 0)")
        bin_path, _ = shard_paths(folder, i, split)
        expected = source["tokens"][split]
        if not bin_path.is_file() or bin_path.stat().st_size != expected * np.dtype(manifest["dtype"]).itemsize:
            raise DataError(f"shard {bin_path} is missing or does not hold the {expected} tokens "
                            "its manifest records")
        tokens = np.memmap(bin_path, dtype=manifest["dtype"], mode="r")
        streams.append((tokens, f"{source['description']}/{split}"))
    return streams
