"""build_dataloader: from data settings to a resumable iterable of batches."""

from __future__ import annotations

from flame.data.loader import DataLoader
from flame.data.shards import open_shards
from flame.data.errors import DataError
from flame.data.sources import load_documents, local_files
from flame.data.streaming import StreamedDataset
from flame.data.tokens import build_stream, split_indices, tokenize_documents


def build_dataloader(*, dataset: str = "embedded", data_files=(), text_field: str = "text",
                     tokenizer, batch_size: int, seq_len: int, split: str = "train",
                     seed: int = 0, dp_rank: int = 0, dp_world_size: int = 1,
                     name: str = "", dataset_split: str = "train", streaming: bool = False,
                     val_fraction: float = 0.01, sources=(), probs=(), varlen: bool = False,
                     context_len: int = 0, num_workers: int = 0, shard_dir: str = "",
                     allow_dp_resplit: bool = False) -> DataLoader:
    """A DataLoader over one source (`dataset`, with `data_files`) or a mixture (`sources`,
    sampled with `probs`).

    split: "train" (infinite, reshuffled every epoch) or "validation" (one pass over the
    held-out documents, `val_fraction` of each source). dataset_split is the HF split to read.
    varlen: one row of batch_size * seq_len tokens per batch with `cu_seqlens` at document
    starts, documents cut into pieces of at most context_len (0: seq_len) tokens.
    num_workers > 1 tokenizes in that many worker processes.
    streaming: read the documents in order as they arrive (flame.data.streaming), tokenized
    on the fly, shuffled in a window buffer; otherwise a source is tokenized once, whole.
    shard_dir: read the pre-tokenized shards of that folder (flame.data.prepare) instead of text;
    their sources replace `dataset`/`sources` (probs still apply).
    """
    if shard_dir:
        streams = open_shards(shard_dir, tokenizer, split, val_fraction)
        return make_loader(streams, tokenizer.eod_id, batch_size=batch_size, seq_len=seq_len,
                           split=split, seed=seed, dp_rank=dp_rank, dp_world_size=dp_world_size,
                           probs=probs, varlen=varlen, context_len=context_len,
                           allow_dp_resplit=allow_dp_resplit)
    specs = list(sources) or [dataset]
    streams = []
    for spec in specs:
        ds, field, description = load_documents(spec, data_files=data_files, name=name,
                                                split=dataset_split, streaming=streaming,
                                                text_field=text_field)
        if streaming:
            streams.append(StreamedDataset(ds, field, tokenizer, description, val_fraction,
                                           files=local_files(spec, data_files)))
            continue
        tokens, offsets = tokenize_documents(ds, field, tokenizer, num_workers)
        docs = split_indices(len(offsets) - 1, val_fraction, split)
        streams.append((build_stream(tokens, offsets, docs, tokenizer.eod_id),
                        f"{description}/{split}"))
    return make_loader(streams, tokenizer.eod_id, batch_size=batch_size, seq_len=seq_len,
                       split=split, seed=seed, dp_rank=dp_rank, dp_world_size=dp_world_size,
                       probs=probs, varlen=varlen, context_len=context_len,
                       allow_dp_resplit=allow_dp_resplit)


def build_job_dataloader(data, training, *, tokenizer, split: str, job_seed: int,
                         dp_rank: int = 0, dp_world_size: int = 1) -> DataLoader:
    """`build_dataloader` from a job's [data] and [training] sections (flame.config): the data
    order's seed is data.seed, or job.seed when data.seed is -1."""
    return build_dataloader(
        dataset=data.dataset, data_files=data.data_files, text_field=data.text_field,
        name=data.name, dataset_split=data.split, streaming=data.streaming,
        val_fraction=data.val_fraction, num_workers=data.num_workers, sources=data.sources,
        probs=data.probs, context_len=data.context_len, shard_dir=data.shard_dir,
        allow_dp_resplit=data.allow_dp_resplit, varlen=training.varlen, tokenizer=tokenizer,
        batch_size=training.batch_size, seq_len=training.seq_len, split=split,
        seed=job_seed if data.seed < 0 else data.seed, dp_rank=dp_rank, dp_world_size=dp_world_size,
    )


def make_loader(streams, eod_id: int, *, probs, **kwargs) -> DataLoader:
    if probs and len(probs) != len(streams):
        raise DataError(f"data.probs has {len(probs)} entries for {len(streams)} sources")
    return DataLoader(streams, eod_id=eod_id, probs=list(probs) or None, **kwargs)
