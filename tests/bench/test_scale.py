"""CPU smoke test of bench/scale.py: every run of the scaling script at world size 2 (gloo) on a
1-layer, hidden-32 RWKV7, with a real SIGKILL in the resume run. It checks the procedure (runs,
table rows, resume comparison, model-only load), not the numbers; it takes about a minute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")

from bench import scale, scale_runs


def table(text: str) -> dict[tuple[str, str], list[str]]:
    """{(config, run): cells} of the rows between the scale.py markers."""
    body = text.split("<!-- scale.py rows -->", 1)[1].split("<!-- /scale.py rows -->", 1)[0]
    rows = {}
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[(cells[0], cells[1])] = cells
    return rows


@pytest.mark.slow
def test_every_run_on_two_cpu_processes(tmp_path):
    from flame.data.prepare import main as prepare

    shards = tmp_path / "shards"  # tokenized once, instead of once per rank and run
    prepare(["--config", TINY, "--out", str(shards)])
    results = tmp_path / "RESULTS.md"
    original = (ROOT / "bench" / "RESULTS.md").read_text()
    results.write_text(original)
    out = tmp_path / "scale"
    argv = [
        "--config", TINY, "--nproc", "2", "--device", "cpu", "--steps", "16",
        "--warmup-steps", "2", "--global-batch-tokens", "128", "--out", str(out),
        "--results", str(results), "--timeout", "120",
        "--model.hidden_size", "32", "--model.num_layers", "1", "--model.head_dim", "16",
        "--training.seq_len", "32", "--training.batch_size", "2", "--data.shard_dir", str(shards),
    ]
    assert scale.main(argv) == 0

    summary = json.loads((out / "summary.json").read_text())
    plan = summary["plan"]
    assert plan["grad_accum"] == 1 and plan["global_batch_tokens"] == 2 * 32 * 1 * 2
    for run in ("fsdp", "single", "hsdp"):
        assert summary[run]["tokens_per_s_per_gpu"] > 0
        assert summary[run]["timed_steps"] >= 16 - 2 - 1
        assert summary[run]["mfu"] is None and summary[run]["peak_memory_gib"] is None  # CPU
    assert summary["fsdp"]["world"] == 2 and summary["single"]["world"] == 1
    resume = summary["resume"]
    assert resume["passed"] and resume["bitwise"] and resume["compared_steps"] == 8
    assert resume["resumed_from"] == 8 and 8 <= resume["killed_at_step"] < 16
    model_only = summary["model_only"]
    assert model_only["passed"] and model_only["untrained_on"] == "same batch"
    assert model_only["loaded_first_loss"] < model_only["untrained_loss"] - 0.1
    assert model_only["checkpoint"].endswith("fsdp/checkpoint/step-8")

    rows = table(results.read_text())
    labels = ["FSDP 2", "1 process (baseline)", "HSDP 2x1", "resume after SIGKILL at world 2",
              "model-only load 2 -> 1"]
    for label in labels:
        cells = rows[("tiny", label)]
        assert len(cells) == 10 and "CPU" in cells[9], cells
    assert rows[("tiny", "FSDP 2")][7].endswith("%")  # scaling efficiency against the baseline
    assert rows[("tiny", "resume after SIGKILL at world 2")][8].startswith("PASS")
    assert rows[("tiny", "model-only load 2 -> 1")][8].startswith("PASS")
    # the GPU rows already in the file are kept as they were
    assert rows[("rwkv7_1B", "FSDP 2")] == table(original)[("rwkv7_1B", "FSDP 2")]
    assert "- **tiny · FSDP 2**: `python bench/scale.py --config" in results.read_text()


def test_refuses_overrides_of_its_own_keys_and_bad_plans(tmp_path, capsys):
    with pytest.raises(SystemExit):
        scale.parse_args(["--config", TINY, "--nproc", "2", "--training.steps", "5"])
    assert "--training.steps is set by bench/scale.py" in capsys.readouterr().err
    args, extra = scale.parse_args(["--config", TINY, "--nproc", "3", "--steps", "7"])
    with pytest.raises(scale_runs.ScaleError, match=r"--nproc must be even.*--steps must be even"):
        scale_runs.make_plan(args, extra)


def test_throughput_leaves_out_warmup_and_the_step_after_a_save():
    args, extra = scale.parse_args(["--config", TINY, "--nproc", "2", "--steps", "6",
                                    "--warmup-steps", "2", "--device", "cpu"])
    plan = scale_runs.make_plan(args, extra)
    records = [{"step": s, "loss": 9.0 - s, "tokens_per_s_per_device": speed}
               for s, speed in zip(range(1, 7), [1.0, 1.0, 10.0, 1.0, 12.0, 11.0])]
    result = scale_runs.throughput(records, plan, checkpoint_steps=(3,))  # step 4 holds the save
    assert result["tokens_per_s_per_gpu"] == 11.0 and result["timed_steps"] == 3
    assert result["first_loss"] == 8.0 and result["last_loss"] == 3.0
