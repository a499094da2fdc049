"""A device tensor's values read on the host without draining the device.

``tensor.tolist()`` waits for every kernel queued before it, so the device idles from then until the host has
queued the next work. ``HostReadback(values)`` queues the copy (into pinned memory, non-blocking) and marks it
with an event; ``get()`` waits for that copy alone. Work queued between the two keeps the device busy while the
host waits and while it queues what follows (the expert dispatch's splits: the count exchanges start before the
MoE's latent projection is queued, the hierarchical dispatch's node level before its shared experts, and each is
read after).
"""

from __future__ import annotations

import torch


class HostReadback:
    def __init__(self, values: torch.Tensor) -> None:
        if values.is_cuda:
            self._host = values.to("cpu", non_blocking=True)  # a pinned buffer: the copy is asynchronous
            self._done: torch.cuda.Event | None = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = values, None

    def get(self) -> list | int | float:
        """The values (``tolist()``), once their copy has finished."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
