"""`flame-train` end to end on a very small RWKV7: metrics.jsonl, config.toml, a checkpoint."""

import io
import json
import logging
import sys
import tomllib
from pathlib import Path

from flame.train.__main__ import main


def test_tiny_run_writes_metrics_config_and_checkpoint(tmp_path, monkeypatch):
    dump = tmp_path / "run"
    argv = [
        "--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"),
        "--job.dump_folder", str(dump),
        "--model.hidden_size", "32", "--model.num_layers", "2", "--model.head_dim", "16",
        "--model.backend", "torch",
        "--training.steps", "4", "--training.batch_size", "2", "--training.seq_len", "32",
        "--training.gradient_accumulation_steps", "2", "--training.device", "cpu",
        "--lr_scheduler.warmup_steps", "1",
        "--metrics.log_freq", "2", "--metrics.enable_wandb", "false",
        "--metrics.enable_tensorboard", "true",
        "--checkpoint.enable", "true", "--checkpoint.interval", "100",
        "--metrics.val_freq", "0",
    ]
    assert main(argv) == 0

    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= r.keys()
        assert r["loss"] > 0 and r["tokens_per_s"] > 0
    assert records[-1]["tokens"] == 4 * 2 * 2 * 32  # every label is valid in packed data

    config = tomllib.loads((dump / "config.toml").read_text())
    assert config["training"]["steps"] == 4 and config["model"]["hidden_size"] == 32

    assert list((dump / "tensorboard").glob("events.out.tfevents.*"))

    step_dir = dump / "checkpoint" / "step-4"
    assert (step_dir / "COMPLETE").is_file() and (step_dir / ".metadata").is_file()


def test_bad_checkpoint_and_bad_config_exit_with_a_message(tmp_path, capsys):
    assert main(["--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"),
                 "--training.stepz", "3"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err

    dump = tmp_path / "run"
    (dump / "checkpoint" / "step-3").mkdir(parents=True)
    (dump / "checkpoint" / "step-3" / "COMPLETE").write_text("3\n")  # marked, but empty
    argv = ["--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"),
            "--job.dump_folder", str(dump), "--model.hidden_size", "32",
            "--model.num_layers", "1", "--model.head_dim", "16", "--training.device", "cpu"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "WeightsError" in err and "step-3 is incomplete" in err


def test_vocab_mismatch_and_missing_tokenizer_exit_with_a_message(tmp_path, capsys):
    base = ["--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"),
            "--job.dump_folder", str(tmp_path / "run"), "--training.device", "cpu"]
    assert main(base + ["--model.vocab_size", "8000"]) == 1
    err = capsys.readouterr().err
    assert "DataError" in err and "set model.vocab_size >= 8192" in err and "Traceback" not in err

    assert main(base + ["--data.tokenizer", str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err
    assert "DataError" in err and "missing.json does not exist" in err


def test_console_logging_follows_a_replaced_stdout(capsys):
    """The log handler writes to sys.stdout as it is at each record: a stream that was current when
    logging was set up and has since been closed (a test's capture, a notebook cell) is not used."""
    from flame.train.metrics import setup_logging

    flame_logger = logging.getLogger("flame")
    saved = flame_logger.handlers[:]
    flame_logger.handlers.clear()
    real, early = sys.stdout, io.StringIO()
    try:
        sys.stdout = early
        setup_logging()
        sys.stdout = real
        early.close()
        flame_logger.info("logged after the first stream closed")
    finally:
        sys.stdout = real
        flame_logger.handlers[:] = saved
    out = capsys.readouterr()
    assert "logged after the first stream closed" in out.out and "Logging error" not in out.err


def test_the_progress_line_names_the_reserved_memory_beside_the_allocated():
    from flame.train.metrics import progress_line

    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1e5, "tokens": 4096,
              "eta_s": 10.0, "memory_gib": 42.1, "memory_reserved_gib": 53.54}
    assert "| mem 42.1GiB (reserved 53.5) |" in progress_line(record)
    del record["memory_reserved_gib"], record["memory_gib"]
    assert "mem" not in progress_line(record)
