"""Clipping by the global gradient norm: the pipelined step with fused AdamW clips inside the optimizer
(its `grad_scale`, flame.train.step_pipeline), the other implementations multiply the gradients first
(flame.train.gradients); both must give the same steps.

AdamW divides each gradient by its own running size, which hides a clip by one constant factor. Here
the limit is far below the gradient norm, so the factor changes from step to step, and the optimizer's
eps is large against the clipped gradients: a clip that is not applied changes the updates by far more
than the tolerance (checked below)."""

import math

import pytest
import torch

from flame.train.gradients import clip_grad_norm
from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config
from tests.train.step_check import CPU_TOLERANCES, MIN_FALL, assert_same_steps, learnable_steps, step_differences, \
    trace_steps

MAX_NORM = 0.05
EPS = 1e-3


def trace(dump, implementation: str, max_norm: float):
    cfg = tiny_config(dump, training={"steps": 100, "batch_size": 2, "gradient_accumulation_steps": 2,
                                      "max_norm": max_norm},
                      optimizer={"implementation": implementation, "eps": EPS, "lr": 3e-2})
    return trace_steps(Trainer(cfg, dataloader=()), learnable_steps(4, rows=4, seq_len=16, micro_batch=2))


def test_fused_adamw_applies_the_clip_as_the_other_implementations(tmp_path):
    loop = trace(tmp_path / "loop", "for-loop", MAX_NORM)
    fused = trace(tmp_path / "fused", "fused", MAX_NORM)
    assert min(loop.grad_norms) > 10 * MAX_NORM, loop.grad_norms  # every step is clipped
    assert_same_steps(fused, loop, CPU_TOLERANCES, MIN_FALL / 4)
    unclipped = trace(tmp_path / "unclipped", "fused", 0.0)  # max_norm 0: no clipping
    assert step_differences(unclipped, loop)["update"] > 0.5


def test_clip_grad_norm_scales_or_only_reports_the_factor():
    grads = [torch.full((3,), 4.0), torch.full((4,), -2.0)]
    total = math.sqrt(3 * 16 + 4 * 4)
    for scale in (True, False):
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norms = clip_grad_norm([(str(i), p) for i, p in enumerate(params)], 1.0, scale=scale)
        assert norms.total.item() == torch.tensor(total).float().item()
        factor = norms.coefficient.item()
        assert factor == pytest.approx(1.0 / total, rel=1e-5) and factor < 1
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad, g * factor if scale else g)
    unlimited = clip_grad_norm([("p", params[0])], math.inf)
    assert unlimited.coefficient is None
