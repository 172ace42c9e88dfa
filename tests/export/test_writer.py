"""flame.export.writer's outputs: an existing output is replaced only with --overwrite, a failed
export leaves nothing behind and keeps the old output, and a format that cannot hold the model
refuses it in one line."""

from __future__ import annotations

import sys

import pytest

from flame.export import writer
from tests.export.helpers import export, leftovers, run_export


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
