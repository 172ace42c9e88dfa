"""Read a few device scalars on the host without waiting for the work queued after them, and time
the device's steps.

`tensor.tolist()` waits for everything queued on the stream so far. The trainer reads step N's
loss and gradient norm after step N+1's forward and backward are queued, so a plain read would wait
for step N+1's backward too, and the device would then idle while the host queues step N+1's update
and step N+2. `DeviceScalars` copies the values into pinned host memory as soon as they exist and
records an event behind the copy; `values()` waits for that event alone.

`DeviceClock` marks a point of the device's work: a timing event on CUDA, where the host runs
ahead and its own clock says nothing of when the device got there; the host clock on a CPU, whose
work is done when it is queued. The time between two steps' marks is the device time of the
later step, so the steps' times add up to the run's time on the device, whatever the host's lead.
"""

from __future__ import annotations

import time

import torch


host_clock = time.perf_counter
"""The host's clock, which `DeviceClock` reads on a CPU."""


class DeviceClock:
    """A point of the device stream's work, taken where it is queued."""

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record(torch.cuda.current_stream(device))
            self._host = None
        else:
            self._event, self._host = None, host_clock()

    def seconds_since(self, earlier: "DeviceClock") -> float:
        """Seconds of device time from `earlier` to this mark (waits for this mark)."""
        if self._event is not None:
            self._event.synchronize()
            return earlier._event.elapsed_time(self._event) / 1e3
        return self._host - earlier._host


class DeviceScalars:
    """A snapshot of one-element tensors, taken where they are queued, read later by `values()`;
    `clock` marks the device's work at the snapshot."""

    def __init__(self, *scalars: torch.Tensor):
        if not scalars:
            raise ValueError("DeviceScalars needs at least one tensor")
        device = scalars[0].device
        stacked = torch.stack([s.reshape(()).to(device=device, dtype=torch.float64) for s in scalars])
        if device.type == "cuda":
            self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))
        else:
            self._host, self._ready = stacked, None
        self.clock = DeviceClock(device)

    def values(self) -> list[float]:
        """The values, waiting only for the work queued before the snapshot."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
