"""The run's record: `<dump>/config.toml` is written only once a start is accepted (data, model
and checkpoint checked), so a refused start leaves it byte-identical; each checkpoint holds the
config it was trained with, which generate and eval read; fewer steps than the checkpoint has is
refused, naming both numbers."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest

from flame.train.__main__ import main
from flame.weights import CONFIG_FILE, load_model

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


SETTINGS = {"model.hidden_size": "32", "model.num_layers": "1", "model.head_dim": "16",
            "model.backend": "torch", "training.steps": "2", "training.batch_size": "2",
            "training.seq_len": "16", "training.device": "cpu", "lr_scheduler.warmup_steps": "1",
            "checkpoint.interval": "2", "metrics.val_freq": "0"}


def argv(dump: Path, *overrides: str) -> list[str]:
    """The command line of a very small run in `dump`; `overrides`: "--key", "value" pairs."""
    settings = {**SETTINGS, **{k.removeprefix("--"): v for k, v in zip(overrides[::2], overrides[1::2])}}
    return ["--config", str(TINY), "--job.dump_folder", str(dump),
            *[word for key, value in settings.items() for word in (f"--{key}", value)]]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run trained to step 2, with its checkpoint."""
    dump = tmp_path_factory.mktemp("record") / "run"
    assert main(argv(dump)) == 0
    return dump


def test_a_checkpoint_holds_the_config_it_was_trained_with(finished_run):
    step_config = finished_run / "checkpoint" / "step-2" / CONFIG_FILE
    assert step_config.read_bytes() == (finished_run / CONFIG_FILE).read_bytes()
    assert tomllib.loads(step_config.read_text())["model"]["hidden_size"] == 32
    assert not list(finished_run.rglob(f".{CONFIG_FILE}.tmp-*"))


@pytest.mark.parametrize("overrides, message", [
    (("--model.hidden_size", "64"), r"embeddings.weight"),
    (("--training.batch_size", "3"), r"batch_size = 2, this run has 3"),
    (("--data.dataset", "missing/*.jsonl"), r"no files match 'missing/\*.jsonl'"),
    (("--training.steps", "1"), r"step-2 is at step 2, past training.steps = 1"),
], ids=["model", "batch", "data", "steps"])
def test_a_refused_resume_leaves_the_runs_record_as_it_was(finished_run, capsys, overrides, message):
    record = {p: p.read_bytes() for p in finished_run.rglob(CONFIG_FILE)}
    assert main(argv(finished_run, *overrides)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("flame-train: ") and "\n" not in err and "Traceback" not in err, err
    assert re.search(message, err), err
    assert {p: p.read_bytes() for p in finished_run.rglob(CONFIG_FILE)} == record


def test_generate_and_eval_read_the_checkpoints_config(finished_run, tmp_path):
    """An accepted later start (more steps, another LR) rewrites the run's config.toml and saves
    its own with its checkpoints; the loader of flame.generate and flame.eval reads a checkpoint's
    own config, and the run's for a checkpoint saved without one."""
    dump = tmp_path / "run"
    shutil.copytree(finished_run, dump)
    assert main(argv(dump, "--training.steps", "4", "--optimizer.lr", "1e-3")) == 0
    assert tomllib.loads((dump / CONFIG_FILE).read_text())["optimizer"]["lr"] == 1e-3
    assert tomllib.loads((dump / "checkpoint" / "step-2" / CONFIG_FILE).read_text())["optimizer"]["lr"] == 2e-3
    assert tomllib.loads((dump / "checkpoint" / "step-4" / CONFIG_FILE).read_text())["optimizer"]["lr"] == 1e-3

    text = (dump / CONFIG_FILE).read_text()
    (dump / CONFIG_FILE).write_text(text.replace("hidden_size = 32", "hidden_size = 64"))
    model, args, _ = load_model(dump)  # what flame.generate and flame.eval call
    assert args.hidden_size == 32 and model.embeddings.weight.shape[1] == 32

    (dump / "checkpoint" / "step-4" / CONFIG_FILE).unlink()  # a checkpoint saved without one
    (dump / CONFIG_FILE).write_text(text)
    _, args, _ = load_model(dump)
    assert args.hidden_size == 32
