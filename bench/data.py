"""Data-pipeline throughput on the CPU, per rank (a benchmark, not a test).

    python -m bench.data [--workers 2] [--batch-size 8] [--seq-len 2048] [--seconds 3]

Measures, for one data-parallel rank:
- online tokenization of the embedded corpus: `tokenizers` batch encoding in this process
  (Rust threads), and `datasets.map` in --workers worker processes (the loader's path, caching off);
- batch production from pre-tokenized shards (memory-mapped) and from the in-memory stream of
  tokenized text, packed and varlen.
Targets: shards >= 20M tokens/s per rank, online tokenization >= 0.5M tokens/s per rank
on 2 cores.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time


def tokens_per_second(loader, seconds: float) -> float:
    it = iter(loader)
    next(it)  # warm up: first epoch permutation, page cache
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += next(it)["input_ids"].numel()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    import datasets

    from flame.data import build_dataloader, load_tokenizer
    from flame.data.shards import write_shards
    from flame.data.sources import EMBEDDED_CORPUS, load_documents
    from flame.data.tokens import tokenize_dataset

    datasets.disable_progress_bars()
    tokenizer = load_tokenizer()
    with gzip.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as corpus:
        texts = [json.loads(line)["text"] for line in corpus]
    results = {}

    start, cpu_start = time.perf_counter(), time.process_time()
    n = sum(len(ids) + 1 for ids in tokenizer.encode_batch(texts))
    results["tokenize: tokenizers encode_batch, 1 process"] = n / (time.perf_counter() - start)
    # CPU time of all this process's threads: the rate one fully available core would reach
    results["tokenize: per CPU-second (one core's rate)"] = n / (time.process_time() - cpu_start)

    ds, field, _ = load_documents("embedded")
    datasets.disable_caching()
    try:
        start = time.perf_counter()
        out = tokenize_dataset(ds, field, tokenizer, num_workers=args.workers)
        n = out.data.column("ids").combine_chunks().flatten().__len__()
        results[f"tokenize: datasets.map, {args.workers} workers"] = n / (time.perf_counter() - start)
    finally:
        datasets.enable_caching()

    common = dict(tokenizer=tokenizer, batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
    with tempfile.TemporaryDirectory() as shard_dir:
        write_shards(shard_dir, ["embedded"], tokenizer, val_fraction=0.01, log=lambda *_: None)
        results["batches: shards, packed"] = tokens_per_second(
            build_dataloader(shard_dir=shard_dir, **common), args.seconds)
        results["batches: shards, varlen"] = tokens_per_second(
            build_dataloader(shard_dir=shard_dir, varlen=True, **common), args.seconds)
    results["batches: tokenized text in memory, packed"] = tokens_per_second(
        build_dataloader(dataset="embedded", **common), args.seconds)

    print(f"batch {args.batch_size} x seq_len {args.seq_len}, one rank")
    for name, value in results.items():
        print(f"{name:50s} {value / 1e6:8.2f} M tokens/s")


if __name__ == "__main__":
    main()
