"""flame.export.writer's outputs: an existing output is replaced only with --overwrite, a failed
export leaves nothing behind and keeps the old output, a format that cannot hold the model
refuses it in one line, the model's config is the one its checkpoint was trained with and must
fit its tensors, and every file is readable by all."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tomllib
from pathlib import Path

import pytest

from flame.config import config_from_dict, to_toml
from flame.export import writer
from flame.weights import CONFIG_FILE
from tests.export.helpers import STEPS, export, leftovers, run_export


def test_existing_output_needs_overwrite(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_export(capsys, runs["root"] / "gsa", out)
    assert code == 1 and "already exists" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    assert export(runs["root"] / "gsa", out, "--overwrite") == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert leftovers(tmp_path) == []


def test_gsa_has_no_rwkv_lm_format(runs, tmp_path, capsys):
    code, err = run_export(capsys, runs["root"] / "gsa", tmp_path / "gsa.pth", "--format", "rwkv")
    assert code == 1 and "RWKV6 and RWKV7 models only" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing_and_keeps_the_old_output(runs, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert export(runs["root"] / "rwkv7", out) == 0
    before = (out / "model.safetensors").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_safetensors", disk_full)
    assert export(runs["root"] / "gsa", out, "--overwrite") == 1
    assert (out / "model.safetensors").read_bytes() == before and leftovers(tmp_path) == []


def test_every_exported_file_is_readable_by_all(runs, tmp_path):
    """model.safetensors gets the mode of the other files (0644 under umask 022); safetensors
    itself creates it 0600."""
    umask = os.umask(0o022)
    try:
        assert export(runs["root"] / "rwkv7", tmp_path / "out") == 0
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def edit_model(config: Path, **fields) -> None:
    data = tomllib.loads(config.read_text())
    data["model"].update(fields)
    config.write_text(to_toml(config_from_dict(data)))


def test_export_reads_the_config_the_checkpoint_was_trained_with(runs, tmp_path):
    """The run's config.toml may have changed since the save (a later start with other settings):
    the step folder's own config.toml describes its weights."""
    dump = tmp_path / "dump"
    shutil.copytree(runs["root"] / "rwkv7", dump)
    step_dir = dump / "checkpoint" / f"step-{STEPS}"
    assert (step_dir / CONFIG_FILE).read_text() == (dump / CONFIG_FILE).read_text()
    edit_model(dump / CONFIG_FILE, hidden_size=128)
    assert export(dump, tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == 64


def test_a_config_that_does_not_fit_the_tensors_is_refused(runs, tmp_path, capsys):
    """A checkpoint saved without its own config.toml is read with the run's (so older runs still
    export); when that config does not describe the tensors, the export names the tensor and both
    shapes, exits 1 and writes nothing."""
    dump = tmp_path / "dump"
    shutil.copytree(runs["root"] / "rwkv7", dump)
    (dump / "checkpoint" / f"step-{STEPS}" / CONFIG_FILE).unlink()
    assert export(dump, tmp_path / "old") == 0
    edit_model(dump / CONFIG_FILE, hidden_size=128)
    code, err = run_export(capsys, dump, tmp_path / "new" / "out")
    assert code == 1 and "\n" not in err, err
    assert "embeddings.weight" in err and "(256, 64)" in err and "(256, 128)" in err, err
    assert str(dump / CONFIG_FILE) in err
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


def test_modeling_file_names_what_to_install_when_flame_is_missing(tmp_path, monkeypatch):
    """The hf folder's modeling_flame.py, run where `flame.export.hf` cannot be imported (flame not
    installed, or fla-org/flame in its place), says how to install this project; transformers'
    own check of the file's imports does not ask for `pip install flame` first."""
    get_imports = pytest.importorskip("transformers.dynamic_module_utils").get_imports
    path = tmp_path / "modeling_flame.py"
    path.write_text(writer.MODELING_SOURCE)
    assert "flame" not in get_imports(path)
    namespace = {}
    exec(compile(writer.MODELING_SOURCE, str(path), "exec"), namespace)  # flame installed: it loads
    assert namespace["FlameForCausalLM"].__module__ == "flame.export.hf"
    monkeypatch.setitem(sys.modules, "flame.export.hf", None)  # as if flame were not installed
    with pytest.raises(ModuleNotFoundError) as info:
        exec(compile(writer.MODELING_SOURCE, str(path), "exec"), {})
    message = str(info.value)
    assert "pip install -e ." in message and "pip install flame-lm" in message
    assert "`pip install flame` installs an unrelated package" in message
