"""The logged MFU is tokens_per_s_per_device x the model's `num_flops_per_token()` / the device's peak
(docs/architecture.md, "FLOPs per token and MFU"); a device without a known peak logs none."""

import json

import pytest
import torch

from flame.models import build_model
from flame.train import metrics, readback
from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config

PEAK = 3e12  # FLOP/s, a peak given to the CPU so that it logs an MFU


def run_records(tmp_path, monkeypatch) -> list[dict]:
    """The training records of a 3-step tiny run whose every step takes one second of the clock."""
    clock = [0.0]
    monkeypatch.setattr(readback, "host_clock", lambda: clock[0])
    trainer = Trainer(tiny_config(tmp_path, training={"steps": 3}, optimizer={"implementation": "fused"}))

    def one_second_per_forward(module, args):
        clock[0] += 1.0

    trainer.model.register_forward_pre_hook(one_second_per_forward)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def test_logged_mfu_is_throughput_times_the_models_flops_over_the_peak(tmp_path, monkeypatch, flame_log):
    monkeypatch.setattr(metrics, "device_peak_flops", lambda device: PEAK)
    cfg = tiny_config(tmp_path)
    with torch.device("meta"):
        flops = build_model(cfg.model).num_flops_per_token()
    records = run_records(tmp_path, monkeypatch)
    assert [r["step"] for r in records] == [1, 2, 3]
    tokens_per_s = cfg.training.batch_size * cfg.training.seq_len  # one step per second, one device
    for record in records:
        assert record["tokens_per_s_per_device"] == tokens_per_s
        assert record["mfu"] == pytest.approx(tokens_per_s * flops / PEAK, rel=1e-12)
    assert f"MFU: {flops:,d} FLOPs per token over cpu's peak of 3 TFLOP/s" in flame_log


def test_cpu_has_no_peak_and_logs_no_mfu(tmp_path, monkeypatch):
    assert metrics.device_peak_flops(torch.device("cpu")) == 0.0
    records = run_records(tmp_path, monkeypatch)
    assert records and all("mfu" not in r for r in records)
