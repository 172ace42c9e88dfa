"""The step comparison of tests/train/step_check.py can fail: a trainer whose optimizer does
nothing, or whose optimizer sees zero or stale gradients, differs from the working one beyond the
CPU tolerances (tests/train/test_compile.py's GPU version checks the GPU tolerances the same way);
the same working run twice passes with no difference at all."""

import pytest

from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config
from tests.train.step_check import CPU_TOLERANCES, MIN_FALL, SABOTAGES, assert_same_steps, learnable_steps, \
    step_differences, trace_steps

STEPS = 4
pytestmark = pytest.mark.filterwarnings(  # the no-op optimizer replaces the step the LR schedule wraps
    "ignore:Seems like `optimizer.step\\(\\)` has been overridden:UserWarning")


def trace(dump, broken=None):
    cfg = tiny_config(dump, training={"steps": 100, "batch_size": 2, "gradient_accumulation_steps": 2})
    return trace_steps(Trainer(cfg, dataloader=()), learnable_steps(STEPS, rows=4, seq_len=16, micro_batch=2),
                       broken)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return trace(tmp_path_factory.mktemp("step-check") / "reference")


def test_the_same_step_twice_passes_without_a_difference(tmp_path, reference):
    again = trace(tmp_path / "again")
    assert step_differences(again, reference) == dict.fromkeys(CPU_TOLERANCES, 0.0)
    assert_same_steps(again, reference, CPU_TOLERANCES, MIN_FALL)


@pytest.mark.parametrize("sabotage", list(SABOTAGES))
def test_a_broken_step_fails_the_comparison(tmp_path, reference, sabotage):
    broken = trace(tmp_path / "broken", SABOTAGES[sabotage])
    with pytest.raises(AssertionError, match="steps differ beyond tolerance"):
        assert_same_steps(broken, reference, CPU_TOLERANCES, MIN_FALL)
    differences = step_differences(broken, reference)
    # not by a hair: every way of breaking the step shows in the losses and the updates
    assert differences["loss"] > 0.1 and differences["update"] > 0.9, differences


def test_a_reference_that_learns_nothing_is_refused(tmp_path, reference):
    idle = trace(tmp_path / "idle", SABOTAGES["no-op optimizer"])
    with pytest.raises(AssertionError, match="the reference run learned too little"):
        assert_same_steps(reference, idle, CPU_TOLERANCES, MIN_FALL)
