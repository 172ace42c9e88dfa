"""wandb: offline at once without an API key, offline after a bounded wait when the server cannot be
reached (the run trains on), and a resumed run continues the same wandb run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config

pytest.importorskip("wandb")
REPO = Path(__file__).resolve().parents[2]
UNREACHABLE = "http://127.0.0.1:9"
"""A wandb server address on this machine where nothing listens (the discard port)."""


def test_wandb_goes_offline_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config(tmp_path / "run", training={"steps": 4},
                      checkpoint={"enable": True, "interval": 2},
                      metrics={"enable_wandb": True, "wandb_project": "flame-test"})
    first = Trainer(cfg)
    assert first.metrics.wandb_run.settings.mode == "offline"
    assert "WANDB_MODE" not in os.environ  # the mode went to wandb.init, not to the environment
    run_id = first.state.wandb_run_id
    assert run_id
    first.train(stop_at_step=2)

    resumed = Trainer(cfg)
    assert resumed.state.step == 2
    assert resumed.state.wandb_run_id == run_id
    resumed.train()
    runs = list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2  # the first run and its resumption, one wandb run id


@pytest.mark.slow
def test_an_unreachable_wandb_server_falls_back_to_offline_and_the_run_trains_on(tmp_path):
    """An API key but no server (a cluster node without internet): the online start gives up after
    metrics.wandb_init_timeout_seconds, the run logs offline, says how to sync, and finishes. A
    process of its own: wandb reads its environment once per process."""
    dump = tmp_path / "run"
    env = {**os.environ, "WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": UNREACHABLE,
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),  # wandb saves the server address there
           "WANDB_ERROR_REPORTING": "false", "PYTHONPATH": str(REPO)}
    env.pop("WANDB_MODE", None)
    argv = [sys.executable, "-m", "flame.train", "--config", str(REPO / "configs" / "tiny.toml"),
            "--job.dump_folder", str(dump), "--model.hidden_size", "32", "--model.num_layers", "1",
            "--model.head_dim", "16", "--training.steps", "2", "--training.seq_len", "16",
            "--training.device", "cpu", "--metrics.val_freq", "0", "--metrics.log_freq", "1",
            "--checkpoint.enable", "false", "--metrics.enable_wandb",
            "--metrics.wandb_init_timeout_seconds", "1"]
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wandb: the online start failed" in result.stdout
    assert "logging offline instead" in result.stdout
    offline = list((dump / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    assert f"upload it later with `wandb sync {offline[0]}`" in result.stdout
    assert list(offline[0].glob("*.wandb"))  # the offline run holds its records
    assert "training: done at step 2" in result.stdout
