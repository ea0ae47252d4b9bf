"""The persistent tier between the page pool and a ``DiskKVStore``.

Reads happen on the engine thread while a request is planned (a fresh entry is filled from
its file instead of being prefilled); writes are queued by the engine thread right after a
prefill (the device-to-host copy happens there, so the pages may be reused at once) and
written, fsync included, by a writer thread of this tier.
"""
from __future__ import annotations

import logging
import queue
import threading

import torch

from .disk import DiskKVStore
from .store import Entry, PagePool

log = logging.getLogger("lazyllm")

# entry kinds worth keeping across restarts: a chunk, a shared prefix (not identical-prefix
# chain pages, which are only worth anything behind the same prefix)
_PERSISTED_KINDS = ("chunk", "prefix")


class DiskTier:
    """Load entries from, and save entries to, ``disk`` through pool ``pool``."""

    def __init__(self, disk: DiskKVStore, pool: PagePool):
        self.disk, self.pool = disk, pool
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="lazyllm-disk", daemon=True)
        self._writer.start()

    def load(self, e: Entry) -> bool:
        """Fill fresh entry ``e``'s pages from its file; False if there is no valid file for
        it (then it must be computed)."""
        got = self.disk.get(e.key)
        if got is None:
            return False
        k, v, n, stored = got
        pool = self.pool
        if n != e.num_tokens or stored != e.stored_pos or k.dtype != pool.k.dtype:
            return False
        L, _, ps, h, d = pool.k.shape
        idx = torch.tensor(e.pages, device=pool.k.device)
        for cache, t in ((pool.k, k), (pool.v, v)):
            buf = torch.zeros((L, len(e.pages) * ps, h, d), dtype=cache.dtype)
            buf[:, :n] = t
            cache[:, idx] = buf.view(L, len(e.pages), ps, h, d).to(cache.device)
        return True

    def save(self, entries: list[Entry]) -> None:
        """Queue freshly computed entries for the writer (copied to the host here)."""
        pool = self.pool
        L, _, _, h, d = pool.k.shape
        for e in entries:
            if e.kind not in _PERSISTED_KINDS or e.key in self.disk:
                continue
            idx = torch.tensor(e.pages, device=pool.k.device)
            k = pool.k[:, idx].reshape(L, -1, h, d)[:, : e.num_tokens].to("cpu", copy=True)
            v = pool.v[:, idx].reshape(L, -1, h, d)[:, : e.num_tokens].to("cpu", copy=True)
            self._queue.put((e.key, k, v, e.num_tokens, e.stored_pos))

    def flush(self) -> None:
        """Wait until every queued write has finished."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, k, v, n, stored = item
                self.disk.put(key, k, v, num_tokens=n, stored_pos=stored)
            except Exception:  # a failed write only loses a cache file
                log.exception("disk tier write failed")
            finally:
                self._queue.task_done()
