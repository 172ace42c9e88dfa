"""Tiny trained runs to export: a 256-token tokenizer, one small model per family, a few steps."""

from __future__ import annotations

import gzip
import json
import shutil
import tomllib
from pathlib import Path

import torch

from flame.config import config_from_dict, to_toml
from flame.data.tokenizer import EMBEDDED_DIR

VOCAB = 256
FAMILIES = ("rwkv6", "rwkv7", "gsa")
MODEL = {
    "rwkv6": {"head_dim": 32, "mix_low_rank_dim": 8, "decay_low_rank_dim": 16},
    "rwkv7": {"head_dim": 32},
    "gsa": {"num_heads": 2, "num_slots": 16},
}
SEQ, BATCH, STEPS = 32, 2, 3


def make_tokenizer(path: Path) -> Path:
    """A BPE tokenizer of VOCAB tokens (end-of-document included) trained on the embedded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lines = gzip.decompress((EMBEDDED_DIR / "shakespeare.jsonl.gz").read_bytes()).decode().splitlines()[:2]
    text = [json.loads(line)["text"][:20000] for line in lines]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(text, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(path))
    return path


def run_config(family: str, dump, tokenizer: Path, **sections):
    data = {
        "job": {"dump_folder": str(dump), "seed": 3},
        "model": {"family": family, "vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2,
                  "backend": "torch", **MODEL[family]},
        "data": {"tokenizer": str(tokenizer), "val_fraction": 0.0},
        "training": {"batch_size": BATCH, "seq_len": SEQ, "steps": STEPS, "device": "cpu"},
        "optimizer": {"lr": 2e-2, "implementation": "for-loop"},
        "lr_scheduler": {"warmup_steps": 0},
        "checkpoint": {"enable": True, "interval": STEPS, "keep_latest_k": 0},
        "metrics": {"log_freq": 1},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data)


def batches(rows: slice = slice(None), seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """STEPS batches of random tokens; `rows` picks one rank's share of each."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        out.append({"input_ids": tokens[rows, :-1].clone(), "labels": tokens[rows, 1:].clone()})
    return out


def train_run(family: str, dump, tokenizer: Path, **sections):
    from flame.train.trainer import Trainer

    trainer = Trainer(run_config(family, dump, tokenizer, **sections), dataloader=batches())
    trainer.train()
    return trainer


def with_model_fields(dump: Path, copy: Path, **fields) -> Path:
    """A copy of the run folder `dump` whose config.toml changes these `model` fields (the same
    weights): a model that computes with another eps, for the formats that need it."""
    shutil.copytree(dump, copy)
    data = tomllib.loads((copy / "config.toml").read_text())
    data["model"].update(fields)
    (copy / "config.toml").write_text(to_toml(config_from_dict(data)))
    return copy
