"""Two GPUs under torchrun (NCCL) train step by step like one GPU on the same global batch
(tests/train/step_check.py: losses, gradient norms, gradients, updates; tests/train/trace_run.py
runs the steps): replicas (each rank the one-GPU step with compiled blocks replayed as CUDA
graphs, the gradients all-reduced in fp32, and in bf16), and FSDP with bf16 parameters (the
gathered weights held over the step with CUDA graphs, and freed after use).

The one-GPU reference runs the same bf16 path with twice the micro-batches. Replicas with an
fp32 all-reduce compute every micro-batch exactly as one GPU does and differ only in the order in
which the fp32 gradients are summed: FIRST_GRADIENT on the first step, REPLICA_TOLERANCES after
it. A bf16 all-reduce rounds each rank's gradient to bf16, and FSDP gathers every parameter in bf16
(vectors included, which stay fp32 on one GPU): GPU_TOLERANCES, as bf16 against fp32.
"""

from __future__ import annotations

import pytest
import torch

from flame.config import to_toml
from tests.train import faults
from tests.train.step_check import GPU_TOLERANCES, MIN_FALL, assert_same_steps, relative_error
from tests.train.test_compile import gpu_config
from tests.train.trace_run import TRACE_FILE, read_trace

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

REPLICA_TOLERANCES = {"loss": 1e-3, "grad_norm": 1e-3, "gradient": 5e-2, "update": 5e-2, "loss_fall": 1e-3}
"""Replicas with an fp32 all-reduce against one GPU: the first step's gradients differ only in the
order of their fp32 sums (FIRST_GRADIENT). From the second step on, the weights differ by AdamW's
response to that difference (a whole step of the other sign for a component whose gradient is
that close to zero), and a weight whose two values round to different bf16 compute copies moves
every gradient after it: measured on 2 H100s over 6 steps, 1.2e-4 in the losses, 1.5e-4 in the
gradient norms, 1.3e-2 in the gradients, 6.9e-3 in the updates. A broken step misses these by far
(tests/train/step_check.py)."""

FIRST_GRADIENT = 1e-5
"""The first step's gradient, from the same weights on the same micro-batches: only the order of
the fp32 sums differs (about 1e-7)."""

VARIANTS = {  # name: (overrides, FSDP, CUDA graphs, tolerances, the first step's gradient or None)
    "replicas": (("--parallel.data_parallel_shard_degree", "1"), False, True, REPLICA_TOLERANCES, FIRST_GRADIENT),
    "replicas-bf16-all-reduce": (
        ("--parallel.data_parallel_shard_degree", "1", "--training.mixed_precision_reduce", "bfloat16"),
        False, True, GPU_TOLERANCES, None),
    "fsdp-held-weights": (
        ("--parallel.data_parallel_shard_degree", "2", "--parallel.fsdp_hold_weights", "true"),
        True, True, GPU_TOLERANCES, None),
    "fsdp-freed-weights": (
        ("--parallel.data_parallel_shard_degree", "2", "--parallel.fsdp_hold_weights", "false"),
        True, False, GPU_TOLERANCES, None),
}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """A 4-layer, hidden-128 RWKV7 (the traces hold every parameter's gradient and update of every
    step), compiled; one row per micro-batch, four per step on one GPU."""
    folder = tmp_path_factory.mktemp("two-gpus")
    cfg = gpu_config(folder / "unused", "rwkv7", compile=True)
    cfg.model.hidden_size, cfg.model.num_layers = 128, 4
    path = folder / "two_gpus.toml"
    path.write_text(to_toml(cfg))
    return path


@pytest.fixture(scope="module")
def one_gpu(config):
    dump = config.parent / "one-gpu"
    done = faults.torchrun(config, dump, "--training.gradient_accumulation_steps", "4", nproc=1,
                           module="tests.train.trace_run", timeout=600)
    assert done.returncode == 0, done.output[-5000:]
    trace, run = read_trace(dump)
    assert (run["world_size"], run["fsdp"], run["cuda_graphs"]) == (1, False, True), run
    return trace


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_gpus_train_like_one(config, one_gpu, variant):
    overrides, fsdp, cuda_graphs, tolerances, first_gradient = VARIANTS[variant]
    dump = config.parent / variant
    done = faults.torchrun(config, dump, "--training.gradient_accumulation_steps", "2", *overrides, nproc=2,
                           module="tests.train.trace_run", timeout=600)
    assert done.returncode == 0, done.output[-5000:]
    trace, run = read_trace(dump)
    (dump / TRACE_FILE).unlink()  # the traces are large
    assert (run["world_size"], run["fsdp"], run["cuda_graphs"]) == (2, fsdp, cuda_graphs), run
    assert_same_steps(trace, one_gpu, tolerances, MIN_FALL)
    if first_gradient is not None:
        first = relative_error(trace.gradients[0], one_gpu.gradients[0])
        assert first <= first_gradient, f"the first step's gradient differs by {first:.2e} (relative)"
