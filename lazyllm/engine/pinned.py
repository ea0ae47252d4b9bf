"""Host buffers for asynchronous copies between host and device, used in turn."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a pinned, asynchronous copy on CUDA (a copy from pageable memory
    waits for the stream to drain)."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PinnedTurns:
    """Two host buffers (pinned where CUDA is used) used in turn for asynchronous copies,
    each with an event recorded after the copy that uses it.

    ``take(n)`` hands out the next buffer's index ``k`` once its previous copy is done (two
    copies ago: normally long done), grown to at least ``n`` elements, so the host never
    rewrites or reads a buffer that a pending copy still uses; fill ``bufs[k]`` (or its numpy
    view ``arrays[k]``), enqueue the copy, then ``record(k)`` (or ``send(k, host)``, which does
    both for a copy to the device). On a CPU device, or where CUDA is absent, the buffers are
    ordinary memory and nothing waits."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype = torch.long, n: int = 0):
        self.device = torch.device(device)
        self.dtype = dtype
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.bufs = [self._alloc(n) for _ in range(2)]
        self.arrays = [b.numpy() for b in self.bufs]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]
        self.turn = 0

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.dtype, pin_memory=self.cuda)

    def take(self, n: int = 0) -> int:
        """Index of the buffer to use now (``bufs[k]``, ``arrays[k]``, ``events[k]``), with
        room for at least ``n`` elements (a buffer too small is replaced by one of
        ``max(n, 2 * its size)``, zeroed)."""
        k = self.turn
        self.turn ^= 1
        if self.events[k] is not None:
            self.events[k].synchronize()
        if self.bufs[k].numel() < n:
            self.bufs[k] = self._alloc(max(n, 2 * self.bufs[k].numel()))
            self.arrays[k] = self.bufs[k].numpy()
        return k

    def record(self, k: int) -> None:
        """Mark the end of the copy just enqueued with buffer ``k``."""
        if self.events[k] is not None:
            self.events[k].record()

    def send(self, k: int, host: torch.Tensor) -> torch.Tensor:
        """Copy ``host`` (a view of ``bufs[k]``) to the device without waiting, and record the
        copy's end; returns the device tensor."""
        dev = host.to(self.device, non_blocking=True)
        self.record(k)
        return dev


__all__ = ["PinnedTurns", "to_device"]
