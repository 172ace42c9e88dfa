"""CPU tests of bench/dp_proofs.py: preempt_fsdp and kill_rank on 2 processes (gloo) of a 1-layer,
hidden-32 RWKV7, with a real SIGUSR1 to torchrun and a real SIGKILL of a rank; and on hand-made
inputs hsdp_nodes' step comparison, the match of flame's failure lines, finding a rank's process
and the refusals of a bad plan. hsdp_nodes itself needs 4 processes: `python -m bench.dp_proofs
--device cpu --nproc 4 --checks hsdp_nodes` (about 25 s on 2 cores)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import dp_proofs, launcher

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["--model.hidden_size", "32", "--model.num_layers", "1", "--model.head_dim", "16",
         "--training.seq_len", "32", "--training.batch_size", "2"]


@pytest.mark.slow
def test_preempt_fsdp_and_a_killed_rank_on_two_cpu_processes(tmp_path):
    out = tmp_path / "proofs"
    argv = ["--checks", "preempt_fsdp,kill_rank", "--config", TINY, "--nproc", "2", "--device", "cpu",
            "--steps", "8", "--out", str(out), "--timeout", "240", *SMALL]
    assert dp_proofs.main(argv) == 0

    results = json.loads((out / "proofs.json").read_text())["results"]
    preempt = results["preempt_fsdp"]
    assert preempt["data_parallel"].startswith("FSDP over 2 ranks")
    assert preempt["passed"] and preempt["max_abs_loss_diff"] == 0.0 and not preempt["problems"]
    step = preempt["stopped_at_step"]
    assert 4 <= step < 8 and preempt["rank_stop_steps"] == {"0": step, "1": step}
    assert preempt["checkpoint_ranks"] == [0, 1] and preempt["compared_steps"] == 8

    killed = results["kill_rank"]
    assert killed["passed"] and not killed["problems"], killed
    assert killed["killed_rank"] == 1 and killed["launcher_named_the_rank"]
    assert killed["exit_codes"][0] == 1 and killed["stop_seconds"][0] < 60 * 0.5 + dp_proofs.STOP_GRACE_S
    checkpoint = killed["last_complete_checkpoint"]
    assert killed["steps_named"]["0"] and min(killed["steps_named"]["0"]) >= checkpoint
    assert killed["resumed_from"] == [checkpoint] and killed["steps_compared"]

    report = (out / "proofs.md").read_text()
    assert "| preempt_fsdp | PASS |" in report and "| kill_rank | PASS |" in report
    assert (out / "shards" / "manifest.json").is_file()  # tokenized once, for every run


def test_hsdp_comparison_allows_reduction_order_and_refuses_other_samples():
    bounds = dp_proofs.FP32_BOUNDS
    reference = [{"step": s, "loss": 9.0 - 0.1 * s, "grad_norm": 2.0 + s, "tokens": 512 * s} for s in (1, 2, 3)]

    def drifted(step1: float, later: float, norm_factor: float = 100) -> list[dict]:
        """The reference with relative differences: `step1` at step 1, `later` after it."""
        d = {1: step1, 2: later, 3: later / 2}
        return [dict(r, loss=r["loss"] * (1 + d[r["step"]]),
                     grad_norm=r["grad_norm"] * (1 - norm_factor * d[r["step"]])) for r in reference]

    same = dp_proofs.compare_steps(reference, drifted(3e-7, 2e-5, norm_factor=1), bounds)
    assert same["passed"] and same["steps"] == 3, same["problems"]
    assert same["loss"]["max_rel_diff"] == pytest.approx(2e-5) and same["loss"]["at_step"] == 2
    assert same["loss"]["first_step_rel_diff"] == pytest.approx(3e-7)
    # AdamW's drift shows in the norm after step 1, not at step 1
    assert dp_proofs.compare_steps(reference, drifted(0.0, 5e-5, norm_factor=50), bounds)["passed"]
    first = dp_proofs.compare_steps(reference, drifted(1e-5, 1e-5, norm_factor=1), bounds)
    assert not first["passed"] and "loss differs by 1e-05 (relative) at step 1, more than 1e-06" in first["problems"]

    other_sample = [dict(r, loss=r["loss"] + 0.01 * (r["step"] == 2)) for r in reference]
    wrong = dp_proofs.compare_steps(reference, other_sample, bounds)
    assert not wrong["passed"] and wrong["loss"]["at_step"] == 2
    other_batch = [dict(r, tokens=r["tokens"] - 1) for r in reference]
    problems = dp_proofs.compare_steps(reference, other_batch, bounds)["problems"]
    assert "token counts differ at steps [1, 2, 3]" in problems[0]
    assert not dp_proofs.compare_steps(reference, reference[:2], bounds)["passed"]


def test_failure_lines_match_what_flame_writes():
    from flame.train.parallel import ParallelState, collective_failure
    from flame.train.preemption import StallWarning

    state = ParallelState(device=torch.device("cpu"), rank=1, world_size=2, parallel_dims=object())
    limits = SimpleNamespace(init_timeout_minutes=20.0, collective_timeout_minutes=0.5)
    error = collective_failure(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:5"), state, 5, limits)
    assert dp_proofs.FAILURE_LINE.findall(str(error)) == [("1", "5")]

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("flame.train").addHandler(handler)
    watch = StallWarning(rank=1, timeout_minutes=0.005, poll_seconds=0.02)  # warns after 0.27 s
    try:
        watch.step_done(41)
        deadline = time.monotonic() + 10
        while not messages and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.close()
        logging.getLogger("flame.train").removeHandler(handler)
    assert messages and dp_proofs.FAILURE_LINE.findall(messages[0]) == [("1", "41")], messages


def test_rank_pid_finds_the_process_of_a_rank():
    # The child says "ready" only once it runs with its own environment: /proc shows the parent's
    # environment until the child's exec, so asking before that races.
    child = subprocess.Popen(["sh", "-c", "echo ready; exec sleep 30"], env={**os.environ, "RANK": "3"},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert launcher.rank_pid(os.getpid(), 3) == child.pid
        assert launcher.rank_pid(os.getpid(), 2) is None
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_refuses_bad_plans(capsys):
    with pytest.raises(SystemExit):
        dp_proofs.parse_args(["--checks", "hsdp_nodes,bogus", "--nproc", "2", "--steps", "4"])
    err = capsys.readouterr().err
    assert "unknown ['bogus']" in err and "hsdp_nodes needs --nproc >= 4" in err and "--steps must be >= 8" in err
    with pytest.raises(SystemExit):
        dp_proofs.parse_args(["--nproc", "3"])
    assert "--nproc must be even" in capsys.readouterr().err
