"""CPU smoke test of bench/scale.py: replicas on 2 processes (gloo) and a preempt-and-resume on 2
processes, on a 1-layer, hidden-32 RWKV7, with a real SIGUSR1 to torchrun.
It checks the procedure (runs, table, the resumed losses), not the numbers; and the trace reading
and the cluster model on hand-made inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scale

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


@pytest.mark.slow
def test_baseline_replicas_and_a_preempted_run_on_two_cpu_processes(tmp_path):
    from flame.data.prepare import main as prepare

    shards = tmp_path / "shards"  # tokenized once, instead of once per rank and run
    prepare(["--config", TINY, "--out", str(shards)])
    out = tmp_path / "scale"
    argv = ["--configs", TINY, "--nproc", "2", "--device", "cpu", "--steps", "8", "--warmup", "2",
            "--runs", "replicate,preempt", "--out", str(out), "--timeout", "240",
            "--model.hidden_size", "32", "--model.num_layers", "1", "--model.head_dim", "16",
            "--training.seq_len", "32", "--training.batch_size", "2", "--data.shard_dir", str(shards)]
    assert scale.main(argv) == 0

    runs = json.loads((out / "summary.json").read_text())["tiny"]
    assert runs["replicate"]["gpus"] == 2
    assert runs["replicate"]["data_parallel"].startswith("replicated over 2 ranks")
    assert runs["replicate"]["tokens_per_s_per_gpu"] > 0 and runs["replicate"]["peak_memory_gib"] is None  # CPU
    preempt = runs["preempt"]
    assert preempt["passed"] and preempt["max_abs_loss_diff"] == 0.0
    assert 4 <= preempt["stopped_at_step"] < 8 and preempt["compared_steps"] == 8
    report = (out / "scale.md").read_text()
    assert "| tiny | replicate | 2 | replicated over 2 ranks" in report
    assert "bitwise" in report


def test_trace_breakdown_counts_exposed_communication(tmp_path):
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [kernel("gemm", 0, 100), kernel("ncclDevKernel_AllReduce", 50, 100), kernel("triton_add", 120, 30),
              {"ph": "X", "name": "record_param_comms", "ts": 40, "dur": 1,
               "args": {"Collective name": "allreduce", "In msg nelems": 1000, "dtype": "Float"}}]
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = scale.trace_breakdown(trace, step_time_s=300e-6)  # the 150 us window is half a step
    assert got["gpu_busy_ms"] == pytest.approx(0.300)   # 0-150 us, twice
    assert got["compute_ms"] == pytest.approx(0.260)    # 0-100 and 120-150
    assert got["comm_ms"] == pytest.approx(0.200)
    assert got["exposed_comm_ms"] == pytest.approx(0.040)  # 100-120: the collective alone
    assert got["all_reduce_bytes"] == 8000


def test_cluster_model_hides_what_fits_in_the_last_backward():
    fits = scale.cluster_model(compute_ms=300, grad_bytes=10**9, busbw_gbs=100, gpus=2, backward_fraction=2 / 3, ga=2)
    assert fits["all_reduce_ms"] == pytest.approx(10.0) and fits["efficiency"] == 1.0
    slow = scale.cluster_model(compute_ms=300, grad_bytes=10**10, busbw_gbs=50, gpus=64, backward_fraction=2 / 3, ga=2)
    assert slow["exposed_ms"] == pytest.approx(2 * 63 / 64 * 200 - 100)
    assert slow["efficiency"] == pytest.approx(300 / (300 + slow["exposed_ms"]))


def test_refuses_bad_plans(capsys):
    with pytest.raises(SystemExit):
        scale.parse_args(["--configs", TINY, "--nproc", "3", "--runs", "single,bogus"])
    err = capsys.readouterr().err
    assert "--nproc must be even" in err and "unknown ['bogus']" in err
