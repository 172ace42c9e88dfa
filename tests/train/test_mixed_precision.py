"""One-rank mixed precision (`flame.train.mixed_precision`): compute copies of the matrices, put in
place for model calls and refreshed from the fp32 weights, and gradients summed in fp32."""

import copy
import dataclasses
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from flame.config import Training
from flame.train.accumulation import add_gradients
from flame.train.mixed_precision import ComputeWeights, Precision
from flame.train.trainer import Trainer
from tests.train.helpers import random_batches, split_rows, tiny_config


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight
        self.mu = nn.Parameter(torch.randn(4))


@pytest.mark.parametrize("device, fsdp, param, reduce, want", [
    ("cuda", False, "bfloat16", "float32", (torch.bfloat16, torch.float32, torch.bfloat16)),  # one GPU, replicas
    ("cuda", True, "bfloat16", "bfloat16", (torch.bfloat16, torch.bfloat16, None)),  # FSDP casts itself
    ("cuda", False, "float32", "bfloat16", (torch.float32, torch.bfloat16, None)),  # nothing to cast
    ("cpu", False, "bfloat16", "bfloat16", (torch.float32, torch.float32, None)),  # CPUs: fp32 throughout
])
def test_precision_follows_the_config_the_device_and_the_data_parallel_kind(device, fsdp, param, reduce, want):
    training = Training(mixed_precision_param=param, mixed_precision_reduce=reduce)
    precision = Precision.resolve(training, torch.device(device), fsdp=fsdp)
    assert (precision.param, precision.reduce, precision.compute_weights) == want
    assert precision.autocast == precision.compute_weights


def test_the_autocast_context_is_autocast_to_its_dtype_or_nothing():
    cpu = torch.device("cpu")
    assert isinstance(Precision(cpu, torch.float32, torch.float32, None, None).autocast_context(), nullcontext)
    context = Precision(cpu, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16).autocast_context()
    with context:
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_copies_replace_the_matrices_inside_active_only():
    torch.manual_seed(0)
    model = Tied()
    masters = dict(model.named_parameters())
    weights = ComputeWeights(model, torch.bfloat16)
    assert [id(p) for p in weights.masters] == [id(model.embedding.weight), id(model.proj.weight)]
    with weights.active():
        assert model.head.weight is model.embedding.weight  # a tied weight has one copy
        assert model.proj.weight.dtype == torch.bfloat16 and model.proj.weight.requires_grad
        torch.testing.assert_close(model.proj.weight, masters["proj.weight"].to(torch.bfloat16), rtol=0, atol=0)
        assert model.proj.bias is masters["proj.bias"] and model.mu is masters["mu"]  # vectors stay fp32
    assert dict(model.named_parameters()).keys() == masters.keys()
    for name, param in model.named_parameters():
        assert param is masters[name]
    assert model.head.weight is model.embedding.weight
    targets = weights.grad_targets([masters["proj.weight"], masters["mu"]])
    assert targets[0] is weights.copies[1] and targets[1] is masters["mu"]


def test_the_outermost_entry_refreshes_the_copies_and_an_error_restores_the_masters():
    model = Tied()
    weights = ComputeWeights(model, torch.bfloat16)
    with torch.no_grad():
        model.proj.weight.fill_(1.0)
    with weights.active():
        assert bool((model.proj.weight == 1).all())
        with torch.no_grad():
            weights.masters[1].fill_(2.0)
        with weights.active():  # nested: no refresh in the middle of a step's model calls
            assert bool((model.proj.weight == 1).all())
    with weights.active():
        assert bool((model.proj.weight == 2).all())
    master = model.proj.weight
    with pytest.raises(RuntimeError, match="inside"):
        with weights.active():
            raise RuntimeError("inside")
    assert model.proj.weight is master and weights.depth == 0


def test_no_dtype_no_copies():
    model = Tied()
    weights = ComputeWeights(model, None)
    before = dict(model.named_parameters())
    with weights.active():
        assert all(p is before[n] for n, p in model.named_parameters())
    params = list(before.values())
    assert weights.grad_targets(params) == params


def test_add_gradients_copies_then_adds_in_fp32_whatever_the_source_dtype():
    torch.manual_seed(1)
    buffers = [torch.full((5,), 7.0), torch.full((3, 2), 7.0), torch.full((4,), 7.0)]
    first = [torch.randn(5).bfloat16(), torch.randn(3, 2), None]
    second = [torch.randn(5).bfloat16(), torch.randn(3, 2), None]
    add_gradients(buffers, first, first=True)
    add_gradients(buffers, second, first=False)
    assert all(b.dtype == torch.float32 for b in buffers)
    torch.testing.assert_close(buffers[0], first[0].float() + second[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(buffers[1], first[1] + second[1], rtol=0, atol=0)
    assert bool((buffers[2] == 0).all())  # unreached: zero, not the previous step's


def test_trainer_runs_on_compute_copies_and_sums_their_gradients_in_fp32(tmp_path, monkeypatch):
    """With compute copies on (as on one GPU; here bf16 under CPU autocast), a step's fp32 gradient
    buffers hold the fp32 sum of the micro-batches' gradients of the bf16 copies, the optimizer
    updates the fp32 parameters, and the next step's model calls see the updated weights."""
    one_gpu_on_cpu = Precision(torch.device("cpu"), param=torch.float32, reduce=torch.float32,
                               compute_weights=torch.bfloat16, autocast=torch.bfloat16)
    monkeypatch.setattr(Precision, "resolve", classmethod(lambda cls, training, device, fsdp: one_gpu_on_cpu))
    cfg = tiny_config(tmp_path / "run", training={"batch_size": 2, "gradient_accumulation_steps": 2,
                                                   "max_norm": 0.0})
    trainer = Trainer(cfg, dataloader=())
    input_ids, labels = random_batches(4, cfg.training.seq_len, seed=3)
    micro_batches = split_rows(input_ids, labels, 2)

    # the reference: a copy of the model with bf16 matrices, each micro-batch's gradients in fp32
    reference = copy.deepcopy(trainer.model)
    matrices = [p for p in reference.parameters() if p.dim() >= 2]
    for p in matrices:
        p.data = p.data.to(torch.bfloat16)
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in reference.parameters()]
    for batch in micro_batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(batch["input_ids"], labels=batch["labels"], loss_scale=1.0 / labels.numel())
        for total, grad in zip(expected, torch.autograd.grad(loss, list(reference.parameters()))):
            total += grad.float()

    masters = [p for p in trainer.model.parameters()]
    trainer.pipeline.gradients(micro_batches)
    assert [p for p in trainer.model.parameters()] == masters and all(p.dtype == torch.float32 for p in masters)
    for (name, param), want in zip(trainer.model.named_parameters(), expected):
        assert param.grad.dtype == torch.float32
        torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")

    trainer.pipeline.zero_grad()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step(micro_batches)
    proj = trainer.model.layers[0].attn.receptance
    master = proj.weight
    assert not torch.equal(master, before["layers.0.attn.receptance.weight"])  # the fp32 weight moved
    with trainer.pipeline.compute_weights.active():
        assert proj.weight is not master
        torch.testing.assert_close(proj.weight, master.detach().to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.gpu
def test_compute_copies_train_like_autocast_alone_and_like_fp32_on_the_gpu(tmp_path, monkeypatch):
    """Eight compiled bf16 steps (CUDA graphs, "elementwise" recomputation) on the compute copies,
    and with autocast casting the fp32 weights in every model call: each step by step like the
    eager fp32 step (tests/train/step_check.py), and like each other (the forward's bf16 weights
    are the same roundings of the same fp32 weights)."""
    from tests.train.step_check import GPU_TOLERANCES, MIN_FALL, assert_same_steps
    from tests.train.test_compile import gpu_trace

    reference = gpu_trace(tmp_path, "eager-fp32", "rwkv7", compile=False, mixed_precision_param="float32")
    copies = gpu_trace(tmp_path, "copies", "rwkv7", compile=True, activation_checkpoint="elementwise")
    resolve = Precision.resolve
    monkeypatch.setattr(Precision, "resolve", classmethod(
        lambda cls, *args, **kwargs: dataclasses.replace(resolve(*args, **kwargs), compute_weights=None)))
    autocast_alone = gpu_trace(tmp_path, "autocast", "rwkv7", compile=True, activation_checkpoint="elementwise")
    assert_same_steps(copies, reference, GPU_TOLERANCES, MIN_FALL)
    assert_same_steps(autocast_alone, reference, GPU_TOLERANCES, MIN_FALL)
    assert_same_steps(copies, autocast_alone, GPU_TOLERANCES, MIN_FALL)
