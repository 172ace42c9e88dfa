"""wandb: offline automatically without an API key; a resumed run continues the same wandb run."""

import os

import pytest

from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config

pytest.importorskip("wandb")


def test_wandb_goes_offline_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    monkeypatch.setenv("WANDB_SILENT", "true")
    had_mode = "WANDB_MODE" in os.environ
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = tiny_config(tmp_path / "run", training={"steps": 4},
                      checkpoint={"enable": True, "interval": 2},
                      metrics={"enable_wandb": True, "wandb_project": "flame-test"})
    try:
        first = Trainer(cfg)
        assert os.environ["WANDB_MODE"] == "offline"
        run_id = first.state.wandb_run_id
        assert run_id
        first.train(stop_at_step=2)

        resumed = Trainer(cfg)
        assert resumed.state.step == 2
        assert resumed.state.wandb_run_id == run_id
        resumed.train()
    finally:
        if not had_mode:
            os.environ.pop("WANDB_MODE", None)
    runs = list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2  # the first run and its resumption, one wandb run id
