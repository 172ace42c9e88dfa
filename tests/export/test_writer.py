"""flame.export.writer's outputs: an existing output is replaced only with --overwrite, a failed
export leaves nothing behind and keeps the old output, and a format that cannot hold the model
refuses it in one line."""

from __future__ import annotations

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
