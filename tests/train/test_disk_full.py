"""A full or unwritable disk during a save: the run stops and loses nothing (or goes on and retries the
next save, when asked), and a failed COMPLETE-marker write leaves no half checkpoint behind."""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager

import pytest
import torch

from flame.train.checkpoint import CheckpointError
from flame.train.trainer import Trainer
from tests.train.faults import complete_steps
from tests.train.helpers import params, tiny_config

# DCP's writer threads raise the injected error, and pytest reports each thread's exception as a warning;
# what these tests check is that it reaches the trainer through DCP's save
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@contextmanager
def failing_writes(monkeypatch, step: int, error: int):
    """DCP's file writes into step-N fail with `error` after a few bytes (a disk filling up)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            if f"step-{step}" in str(path) and "w" in mode:
                stream.write(b"\0" * 16)
                raise OSError(error, os.strerror(error), str(path))
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    yield
    monkeypatch.setattr(FileSystem, "create_stream", real)


def disk_config(dump, **checkpoint):
    return tiny_config(dump, training={"steps": 6}, checkpoint={
        "enable": True, "interval": 2, "keep_latest_k": 1, **checkpoint})


@pytest.fixture(scope="module")
def straight_disk_run(tmp_path_factory):
    trainer = Trainer(disk_config(tmp_path_factory.mktemp("disk") / "straight"))
    trainer.train()
    return params(trainer.model)


def test_a_full_disk_stops_the_run_and_loses_nothing(tmp_path, monkeypatch, straight_disk_run):
    trainer = Trainer(disk_config(tmp_path))
    with failing_writes(monkeypatch, 4, errno.ENOSPC):
        with pytest.raises(CheckpointError, match=r"saving step 4 to .*step-4 failed: .*OSError: "
                           r"\[Errno 28\] No space left on device.*partial folder was removed.*"
                           r"step-2, is intact"):
            trainer.train()
    assert complete_steps(tmp_path) == [2] and not (tmp_path / "checkpoint" / "step-4").exists()
    resumed = Trainer(disk_config(tmp_path))  # keep_latest_k pruned nothing on the failed save
    assert resumed.state.step == 2
    resumed.train()
    for name, value in straight_disk_run.items():
        assert torch.equal(params(resumed.model)[name], value), name


def test_with_continue_training_goes_on_and_the_next_save_retries(tmp_path, monkeypatch, flame_log,
                                                                  straight_disk_run):
    trainer = Trainer(disk_config(tmp_path, on_save_error="continue", keep_latest_k=0))
    with failing_writes(monkeypatch, 4, errno.EROFS):
        trainer.train()
    warning = next(m for m in flame_log if "saving step 4" in m and "failed" in m)
    assert "Read-only file system" in warning and "the next save tries again" in warning
    assert complete_steps(tmp_path) == [2, 6]
    assert not (tmp_path / "checkpoint" / "step-4").exists()
    for name, value in straight_disk_run.items():
        assert torch.equal(params(trainer.model)[name], value), name


def test_a_failed_marker_write_removes_the_folder_and_the_final_save_must_succeed(tmp_path,
                                                                                  monkeypatch):
    import flame.train.checkpoint as checkpoint

    def full_for_markers(path, *args, **kwargs):
        if str(path).endswith("COMPLETE"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return open(path, *args, **kwargs)

    trainer = Trainer(disk_config(tmp_path, on_save_error="continue"))
    trainer.train(stop_at_step=2)
    monkeypatch.setattr(checkpoint, "open", full_for_markers, raising=False)
    with pytest.raises(CheckpointError, match=r"step 6 .* failed: writing .*step-6/COMPLETE: no space "
                       r"left on device \(OSError.*the final or a stop signal's save"):
        trainer.train()
    monkeypatch.undo()
    assert complete_steps(tmp_path) == [2]  # 4 and 6 failed; 2 was never pruned


def test_flame_train_names_a_full_disk_and_the_folder_in_one_line(tmp_path, monkeypatch, capsys):
    """torch.save reports a full disk as "[enforce fail at inline_container.cc] unexpected pos", with
    the file system's OSError only in its context: the message names the OSError."""
    from pathlib import Path

    from torch.distributed.checkpoint.filesystem import FileSystem

    from flame.train.__main__ import main

    def create_stream(self, path, mode):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    dump = tmp_path / "run"
    assert main(["--config", str(tiny), "--job.dump_folder", str(dump), "--training.device", "cpu",
                 "--model.hidden_size", "32", "--model.num_layers", "1", "--model.head_dim", "16",
                 "--training.steps", "1", "--training.seq_len", "16", "--metrics.val_freq", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"flame-train: CheckpointError: checkpoint: saving step 1 to {dump / 'checkpoint' / 'step-1'} failed: "
        f"on rank 0: no space left on device (OSError: [Errno 28] No space left on device)"), err
    assert not (dump / "checkpoint" / "step-1").exists()
