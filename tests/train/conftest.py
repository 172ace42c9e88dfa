"""Fixtures of the fault-injection tests (tests/train/faults.py launches and reads their runs)."""

import logging

import pytest

from tests.train import faults
from tests.train.faults import STEPS, checkpoint_tensors, losses, run


@pytest.fixture
def flame_log():
    """The messages of the "flame.train" logger (it does not propagate to pytest's caplog)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("flame.train").addHandler(handler)
    yield messages
    logging.getLogger("flame.train").removeHandler(handler)


@pytest.fixture(scope="session")
def config(tmp_path_factory):
    return faults.write_config(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="session")
def reference(config):
    """The uninterrupted one-process run: its losses and the tensors of its final checkpoint."""
    dump = config.parent / "reference"
    done = run(config, dump)
    assert done.returncode == 0, done.output
    return losses(dump), checkpoint_tensors(dump / "checkpoint" / f"step-{STEPS}")
