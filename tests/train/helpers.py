"""Small configs and hand-made batches for the trainer tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from flame.config import config_from_dict

TINY_VOCAB = 8192  # the embedded tokenizer's vocabulary

TEST_COMPILE_CACHE = Path(tempfile.gettempdir()) / "flame-tests-compile-cache"
"""training.compile_cache_dir of the tests' runs: one folder for them all, as torch's default
folder on the machine would be, so that a compiling test does not start cold in its own dump
folder (flame.train.compile_cache)."""


def tiny_config(dump_folder, **sections):
    """A JobConfig for a very small RWKV7 on CPU; `sections` = {section: {key: value}} overrides."""
    data = {
        "job": {"dump_folder": str(dump_folder), "seed": 7},
        "model": {"family": "rwkv7", "vocab_size": TINY_VOCAB, "hidden_size": 32,
                  "num_layers": 2, "head_dim": 16, "backend": "torch"},
        "training": {"batch_size": 2, "seq_len": 16, "gradient_accumulation_steps": 1,
                     "steps": 4, "max_norm": 1.0, "device": "cpu",
                     "compile_cache_dir": str(TEST_COMPILE_CACHE)},
        "optimizer": {"lr": 3e-3, "implementation": "for-loop"},
        "lr_scheduler": {"warmup_steps": 2, "decay_type": "cosine"},
        "checkpoint": {"enable": False},
        "metrics": {"log_freq": 1},
        "data": {"val_fraction": 0.0},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data)


def random_batches(num_rows: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_rows` sequences of random token ids and their next-token labels."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY_VOCAB, (num_rows, seq_len + 1), generator=generator)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def split_rows(input_ids: torch.Tensor, labels: torch.Tensor, micro_batch: int):
    """The rows cut into micro-batches of `micro_batch` rows, in order."""
    return [
        {"input_ids": input_ids[i:i + micro_batch], "labels": labels[i:i + micro_batch]}
        for i in range(0, input_ids.shape[0], micro_batch)
    ]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
