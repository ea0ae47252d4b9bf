"""The chunk token index of a request, as quality recovery reads it: per chunk token (chunk
order: by chunk, then by token), where it is cached and where it sits in the prompt. One
layout, read by the per-request selection (``recompute``) and the round's
(``rounds``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..pinned import to_device

# rows of the index: its page, its slot in the page, the entry's delta, its position in the
# prompt, its slot in the question pass's table, its token id, its chunk and its index there;
# the first ``DEVICE_ROWS`` also on the device
PAGE, SLOT, DELTA, ROW, PROBE, TOKEN, SPAN, TOK = range(8)
DEVICE_ROWS = 6


@dataclass
class ChunkIndex:
    host: np.ndarray  # (8, chunk tokens) int64
    device: torch.device
    _dev: torch.Tensor | None = None

    @property
    def dev(self) -> torch.Tensor:
        """``(DEVICE_ROWS, chunk tokens)`` int64: the first rows of ``host`` on the pool's
        device (one pinned, asynchronous copy, made when first asked for)."""
        if self._dev is None:
            self._dev = to_device(torch.from_numpy(self.host[:DEVICE_ROWS]), self.device)
        return self._dev


__all__ = ["ChunkIndex", "DELTA", "DEVICE_ROWS", "PAGE", "PROBE", "ROW", "SLOT", "SPAN", "TOK", "TOKEN"]
