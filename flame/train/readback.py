"""Read a few device scalars on the host without waiting for the work queued after them.

`tensor.tolist()` waits for everything queued on the stream so far. The trainer reads step N's
loss and gradient norm after step N+1's forward and backward are queued, so a plain read would wait
for step N+1's backward too, and the device would then idle while the host queues step N+1's update
and step N+2. `DeviceScalars` copies the values into pinned host memory as soon as they exist and
records an event behind the copy; `values()` waits for that event alone.
"""

from __future__ import annotations

import torch


class DeviceScalars:
    """A snapshot of one-element tensors, taken where they are queued, read later by `values()`."""

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

    def values(self) -> list[float]:
        """The values, waiting only for the work queued before the snapshot."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
