"""DeviceScalars: the trainer reads step N's loss and norm without waiting for step N+1's work."""

import math
import time

import pytest
import torch

from flame.train.readback import DeviceScalars


def test_values_are_the_snapshot_not_later_writes():
    loss, norm = torch.tensor(2.5), torch.tensor([float("inf")])
    numbers = DeviceScalars(loss, norm)
    loss.fill_(7.0)  # work queued after the snapshot does not change what it reads
    assert numbers.values() == [2.5, math.inf]


def test_needs_a_tensor():
    with pytest.raises(ValueError, match="at least one"):
        DeviceScalars()


@pytest.mark.gpu
def test_reading_does_not_wait_for_work_queued_after_the_snapshot():
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    numbers = DeviceScalars(x[0, 0] * 0 + 3.0, torch.tensor(4.0, device=device))
    torch.cuda._sleep(2_000_000_000)  # about a second of device time queued behind the snapshot
    start = time.perf_counter()
    values = numbers.values()
    waited = time.perf_counter() - start
    later_done = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert values == [3.0, 4.0]
    assert not later_done and waited < 0.5
