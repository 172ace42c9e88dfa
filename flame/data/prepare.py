"""Tokenize a job's data once into memory-mappable shards.

    python -m flame.data.prepare --config configs/tiny.toml --out data/shards [--data.key value ...]

Reads the [data] section (dataset or sources, data_files, name, split, text_field, tokenizer,
val_fraction, num_workers) and writes the shard folder described in flame.data.shards. Train
from it with `--data.shard_dir data/shards`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from flame.config import ConfigError, load_config
    from flame.data.shards import write_shards
    from flame.data.errors import DataError
    from flame.data.tokenizer import load_tokenizer

    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
            del argv[i:i + 2]
            break
        if arg.startswith("--out="):
            out = arg.split("=", 1)[1]
            del argv[i]
            break
    if not out:
        raise SystemExit("usage: python -m flame.data.prepare --config FILE --out DIR "
                         "[--data.key value ...]")
    try:
        cfg = load_config(argv)
        data = cfg.data
        tokenizer = load_tokenizer(data.tokenizer)
        tokenizer.check_vocab_size(cfg.model.vocab_size)
        manifest = write_shards(out, list(data.sources) or [data.dataset], tokenizer,
                                val_fraction=data.val_fraction, data_files=data.data_files,
                                name=data.name, dataset_split=data.split,
                                text_field=data.text_field, num_workers=data.num_workers)
    except (ConfigError, DataError) as err:
        raise SystemExit(f"error: {err}") from None
    total = sum(sum(s["tokens"].values()) for s in manifest["sources"])
    print(f"wrote {len(manifest['sources'])} source(s), {total} tokens ({manifest['dtype']}) to {out}")


if __name__ == "__main__":
    main()
