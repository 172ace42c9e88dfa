"""Tiny trained runs to export: a 256-token tokenizer, one small model per family, a few steps;
where conftest.py's `runs` puts their exports, and what the tests compare them with."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import tomllib
from pathlib import Path

import torch

from flame.config import config_from_dict, to_toml
from flame.data.tokenizer import EMBEDDED_DIR
from flame.export.__main__ import main as export_main
from flame.weights import CONFIG_FILE
from flame.weights.fla_names import fla_group_norm_eps

VOCAB = 256
FAMILIES = ("rwkv6", "rwkv7", "gsa")
MODEL = {
    "rwkv6": {"head_dim": 32, "mix_low_rank_dim": 8, "decay_low_rank_dim": 16},
    "rwkv7": {"head_dim": 32},
    "gsa": {"num_heads": 2, "num_slots": 16},
}
SEQ, BATCH, STEPS = 32, 2, 3
FORMATS = {"rwkv6": ("hf", "fla", "rwkv"), "rwkv7": ("hf", "fla", "rwkv"), "gsa": ("hf", "fla")}
FLA_EPS = {family: fla_group_norm_eps(family, MODEL[family]["head_dim"], 1e-5) for family in ("rwkv6", "rwkv7")}
"""The GroupNorm eps of fla's RWKV models at the test's head size: an fla export needs it."""


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


def with_model_fields(dump: Path, to: Path, **fields) -> Path:
    """A copy `to` of the run folder `dump` whose config.toml files (the run's and each
    checkpoint's) change these `model` fields (the same weights): a model that computes with
    another eps, for the formats that need it."""
    shutil.copytree(dump, to)
    for path in to.rglob(CONFIG_FILE):
        data = tomllib.loads(path.read_text())
        data["model"].update(fields)
        path.write_text(to_toml(config_from_dict(data)))
    return to


def out_path(root: Path, family: str, fmt: str) -> Path:
    return root / "exports" / (f"{family}.pth" if fmt == "rwkv" else f"{family}-{fmt}")


def export(checkpoint, out, *args) -> int:
    return export_main(["--checkpoint", str(checkpoint), "--out", str(out), *args])


def reference(runs, family, fmt="hf"):
    """The trained model, in eval mode; for an RWKV family's fla export, a copy that computes with
    fla's GroupNorm eps, as that export does."""
    model = runs[family].model
    model.eval()
    if fmt == "fla" and family in FLA_EPS:
        model = copy.deepcopy(model)
        for layer in model.layers:
            layer.attn.ln_x.eps = FLA_EPS[family]
    return model


def sample_ids(rows=2, length=24, seed=5):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def assert_same_weights(expected: dict, actual: dict, label: str) -> None:
    assert expected.keys() == actual.keys(), f"{label}: names differ: {set(expected) ^ set(actual)}"
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype and torch.equal(actual[name], value), f"{label}: {name}"


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def run_export(capsys, *args) -> tuple[int, str]:
    code = export(*args)
    err = capsys.readouterr().err.strip()
    return code, err
