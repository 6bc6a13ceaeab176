"""Moving a step's plan arrays to the device without a device sync.

Every backend's `plan` needs a few int32 arrays (indptr, page indices, last-page lengths, ...) on
the device, and FlashInfer also reads some of them on the host. `PlanStaging` packs them into one
pinned host buffer and uploads it with one asynchronous copy. Two buffers are used in turn: step
N writes the pair step N-2 used, after waiting on the event recorded at the end of step N-1's
plan. The GPU is past that event only once step N-2's work (enqueued before step N-1's plan) is
done, so the host blocks only when it runs more than one step ahead of the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.attention._plan import IntArray


class PlanStaging:
    """Two pinned host buffers and two device buffers for plan arrays, used in turn."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._host = [self._on_host(capacity), self._on_host(capacity)]
        self._dev = [self._on_device(capacity), self._on_device(capacity)]
        self._turn = 0
        self._fence: torch.cuda.Event | None = None

    def _on_host(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, pin_memory=self._cuda)

    def _on_device(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device=self._device)

    def stage(self, arrays: Sequence[IntArray]) -> list[torch.Tensor]:
        """Copy `arrays` into the next pinned buffer; return its host views, one per array.

        Waits for the fence of the previous `finish` first (see the module docstring).
        """
        if self._fence is not None:
            self._fence.synchronize()
        self._turn ^= 1
        t = self._turn
        total = sum(int(a.shape[0]) for a in arrays)
        if total > self._host[t].shape[0]:
            size = max(total, 2 * self._host[t].shape[0])
            self._host[t], self._dev[t] = self._on_host(size), self._on_device(size)
        views, offset = [], 0
        for a in arrays:
            n = int(a.shape[0])
            view = self._host[t][offset : offset + n]
            np.copyto(view.numpy(), a)
            views.append(view)
            offset += n
        self._staged = offset
        return views

    def upload(self, host_views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device views of the arrays just staged, uploaded with one asynchronous copy."""
        t, n = self._turn, self._staged
        self._dev[t][:n].copy_(self._host[t][:n], non_blocking=True)
        views, offset = [], 0
        for h in host_views:
            k = int(h.shape[0])
            views.append(self._dev[t][offset : offset + k])
            offset += k
        return views

    def finish(self) -> None:
        """Record the fence after every copy that reads the staged host buffer was enqueued."""
        if self._cuda:
            self._fence = torch.cuda.current_stream(self._device).record_event()
