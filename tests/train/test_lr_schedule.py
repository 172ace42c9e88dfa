import math

import pytest
import torch

from flame.config import LRScheduler
from flame.train.lr_schedule import build_lr_scheduler, lr_multiplier


def multipliers(total, **kw):
    args = dict(warmup_steps=2, total_steps=total, decay_type="cosine", decay_ratio=0.1,
                min_ratio=0.0)
    args.update(kw)
    return [lr_multiplier(s, **args) for s in range(total)]


def test_warmup_is_linear_and_reaches_peak():
    m = multipliers(10, warmup_steps=4)
    assert m[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_cosine_values_and_final_lr_min():
    m = multipliers(6, warmup_steps=2, min_ratio=0.1)
    # updates 3..6 decay over 4 steps: progress 1/4, 2/4, 3/4, 1
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.5, 0.75, 1.0)]
    assert m[2:] == pytest.approx(expected)
    assert m[-1] == pytest.approx(0.1)


def test_linear_values():
    m = multipliers(6, warmup_steps=2, decay_type="linear")
    assert m[2:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_wsd_is_stable_then_decays_over_the_last_ratio():
    m = multipliers(20, warmup_steps=2, decay_type="wsd", decay_ratio=0.2, min_ratio=0.0)
    assert m[1:16] == pytest.approx([1.0] * 15)  # stable until update 16
    assert m[16:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_scheduler_keeps_group_multipliers_and_lr_min_is_absolute():
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [p1], "lr": 1e-3}, {"params": [p2], "lr": 2e-3}], lr=1e-3)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=1, decay_type="linear", lr_min=1e-4),
                               total_steps=3, peak_lr=1e-3)
    lrs = []
    for _ in range(3):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx([1e-3, 2e-3])
    assert lrs[1] == pytest.approx([5.5e-4, 1.1e-3])
    assert lrs[2] == pytest.approx([1e-4, 2e-4])


def test_a_warmup_longer_than_the_run_is_clamped_and_logged(flame_log):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=15, lr_min=1e-4), total_steps=4, peak_lr=1e-3)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert flame_log == ["lr_scheduler.warmup_steps = 15 is longer than the run (training.steps = 4): the "
                         "warmup is clamped to 4 steps, the LR reaches its peak at the last step and does "
                         "not decay"]
    flame_log.clear()
    build_lr_scheduler(opt, LRScheduler(warmup_steps=4), total_steps=4, peak_lr=1e-3)
    assert flame_log == []


def test_warmup_start_gives_rwkv_lms_warmup():
    """RWKV-LM's warmup of w updates multiplies update s (0-based) by 0.01 + 0.99 s / w for s < w;
    flame's warmup_steps = w + 1 with warmup_start = 0.01 is the same ramp, reaching 1 at s = w."""
    w, total = 10, 100
    flame = multipliers(total, warmup_steps=w + 1, warmup_start=0.01, min_ratio=0.1)
    for s in range(w):
        assert flame[s] == pytest.approx(0.01 + 0.99 * s / w)
    assert flame[w] == pytest.approx(1.0)
    assert flame[w + 1] < 1.0 and flame[-1] == pytest.approx(0.1)
    assert multipliers(10, warmup_steps=4, warmup_start=0.0)[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
