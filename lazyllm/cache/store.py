"""Paged KV pool and the chunk store that lives in it.

The pool is one preallocated pair of tensors ``(num_layers, num_pages, page_size,
num_kv_heads, head_dim)`` sized by a byte budget. A page belongs either to one cached
entry (a chunk, a shared prefix, or one page of an identical-prefix chain) or to one
request's private tokens, so each page has exactly one rotation delta per request.

Cached entries are keyed by a strong hash (see ``chunk_key``). An entry in use by a
running request is pinned (reference-counted) and never evicted; unpinned entries are
evicted least-recently-used first when the pool needs pages.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..errors import CacheCapacityError
from ..intmath import cdiv


def chunk_key(fingerprint: str, context: str, tokens: list[int], prefix_key: bytes | None = None) -> bytes:
    """Strong key of a cached KV segment: blake2b over the model fingerprint, the
    chunk-context setting, the key of the prefix it was encoded after (if any) and its
    token ids."""
    h = hashlib.blake2b(digest_size=20)
    h.update(fingerprint.encode())
    h.update(b"\0" + context.encode() + b"\0")
    h.update(prefix_key or b"-")
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()


def segment_keys(fingerprint: str, chunk_context: str, prefix_ids: list[int],
                 chunk_ids: Sequence[list[int]], memos: Sequence[dict | None] | None = None
                 ) -> tuple[bytes, list[bytes]]:
    """Cache keys of a prompt's prefix segment and of each of its chunk segments (token ids
    as prefilled, packet ids included): the planner's keys and the router's are this one
    function, so a router finds the chunks a replica holds. Under ``chunk_context="prefix"``
    a chunk's key includes its prefix's key (its KV was computed after that prefix).

    ``memos``: one per segment (the prefix's first) or ``None``, each a dict kept with a cached
    encoding of those ids (``Segment.memo``): a key found there is not hashed again, and one
    hashed here is stored there."""
    memos = memos or [None] * (1 + len(chunk_ids))
    pkey = _memo_key(memos[0], (fingerprint, "prefix-segment", chunk_context),
                     lambda: chunk_key(fingerprint, f"prefix-segment:{chunk_context}", prefix_ids))
    ctx = "prefix" if chunk_context == "prefix" else "isolated"
    after = pkey if ctx == "prefix" else None
    return pkey, [_memo_key(m, (fingerprint, ctx, after), lambda ids=ids: chunk_key(fingerprint, ctx, ids, after))
                  for m, ids in zip(memos[1:], chunk_ids)]


_MEMO_SIZE = 8  # keys kept per encoding (one per fingerprint, context and, for "prefix", prefix)


def _memo_key(memo: dict | None, what: tuple, compute) -> bytes:
    if memo is None:
        return compute()
    key = memo.get(what)
    if key is None:
        key = compute()
        if len(memo) >= _MEMO_SIZE:
            memo.clear()
        memo[what] = key
    return key


@dataclass
class Entry:
    """A cached KV segment: its pages hold ``num_tokens`` tokens computed at positions
    ``stored_pos .. stored_pos + num_tokens - 1``."""

    key: bytes
    pages: list[int]
    num_tokens: int
    stored_pos: int
    kind: str  # "chunk", "prefix" or "page" (identical-prefix chain)
    pins: int = 0
    hits: int = 0
    ready: bool = False  # KV written (set by the engine after the prefill that fills it)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    extra: dict = field(default_factory=dict)


class PagePool:
    """Fixed pool of KV pages on one device with a free list."""

    def __init__(self, num_layers, num_kv_heads, head_dim, *, page_size, num_pages, dtype, device):
        if num_pages < 1:
            raise CacheCapacityError("KV budget is smaller than one page")
        self.page_size = page_size
        self.num_pages = num_pages
        # one extra page, never handed out: padded rows of a CUDA-graph batch write there
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scratch_page = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages  # catches a double free at once

    @staticmethod
    def page_bytes(num_layers, num_kv_heads, head_dim, page_size, dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._is_free[p] = 0
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = 1
        self._free.extend(pages)


@dataclass(frozen=True)
class StoreMark:
    """What ``ChunkStore.mark`` saw: the keys cached then, and a copy of the counters."""

    keys: frozenset
    counters: CacheStats


class ChunkStore:
    """Keyed, pinned, LRU-evicted KV segments inside a ``PagePool``.

    The engine uses it only through these methods: ``acquire`` (look up and pin),
    ``release`` (unpin, or drop a reservation nobody else waits for), ``create`` /
    ``adopt`` / ``mark_ready`` (new entries), ``alloc_pages`` (pages for private tokens,
    evicting LRU-first), ``evictable_pages``, ``clear_unpinned``, ``mark`` / ``rollback`` /
    ``drop_except`` (the warm-up's scratch work) and ``stats``; ``key in
    store`` says whether an entry (ready or still being computed) exists. ``entries`` is
    the store's own LRU order, read by tests.

    All methods are called from the engine thread; ``stats()`` may be called from any
    thread.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.counters = CacheStats()
        self._lock = threading.Lock()

    # -- lookup ---------------------------------------------------------------
    def get(self, key: bytes) -> Entry | None:
        e = self.entries.get(key)
        if e is not None and e.ready:
            self.entries.move_to_end(key)
            return e
        return None

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def acquire(self, key: bytes, *, pending_ok: bool = False) -> Entry | None:
        """Look ``key`` up and pin it for the caller (most recently used now, one more hit).
        ``pending_ok``: also an entry still being computed (reserved this round by another
        request, ready by the time the round's prefill ends)."""
        e = self.entries.get(key)
        if e is None or not (e.ready or pending_ok):
            return None
        e.pins += 1
        e.hits += 1
        self.entries.move_to_end(key)
        return e

    def release(self, e: Entry) -> bool:
        """Give back one pin of ``e``. An entry that is not ready (its prefill has not run,
        or failed) and that nobody else holds is dropped with its pages; returns True then,
        so the caller forgets the work it had planned for it."""
        if e.ready:
            self.unpin(e)
            return False
        e.pins -= 1
        if e.pins <= 0:
            self.discard(e)
            return True
        return False

    def mark_ready(self, e: Entry) -> None:
        """The entry's KV is written: later lookups may use it."""
        e.ready = True

    def evictable_pages(self) -> int:
        """Pages that eviction could free now (entries nobody pins)."""
        return sum(len(e.pages) for e in self.entries.values() if e.pins == 0)

    def clear_unpinned(self) -> int:
        """Evict every entry nobody pins; returns how many."""
        keys = [k for k, e in self.entries.items() if e.pins == 0]
        for k in keys:
            self._evict(k)
        return len(keys)

    def drop_except(self, keep) -> int:
        """Evict every unpinned entry whose key is not in ``keep``; returns how many."""
        keys = [k for k, e in self.entries.items() if e.pins == 0 and k not in keep]
        for k in keys:
            self._evict(k)
        return len(keys)

    def mark(self) -> StoreMark:
        """The cached keys and the counters now, for ``rollback`` (work that leaves no trace)."""
        with self._lock:
            counters = replace(self.counters)
        return StoreMark(frozenset(self.entries), counters)

    def rollback(self, mark: StoreMark) -> None:
        """Evict every unpinned entry cached since ``mark`` and put the counters back to it."""
        self.drop_except(mark.keys)
        self.reset_counters(mark.counters)

    def reset_counters(self, counters: CacheStats) -> None:
        """Put the hit, miss and eviction counters back to ``counters`` (a copy is kept)."""
        with self._lock:
            self.counters = replace(counters)

    def record(self, hit: bool, tokens: int) -> None:
        with self._lock:
            if hit:
                self.counters.hits += 1
                self.counters.reused_tokens += tokens
            else:
                self.counters.misses += 1
                self.counters.computed_tokens += tokens

    # -- allocation -------------------------------------------------------------
    def alloc_pages(self, n: int) -> list[int] | None:
        """Take ``n`` pages, evicting unpinned entries LRU-first if needed; ``None`` if
        even full eviction cannot free enough."""
        if n == 0:
            return []
        pages = self.pool.alloc(n)
        if pages is not None:
            return pages
        if self.pool.num_free + self.evictable_pages() < n:
            return None
        for key in list(self.entries.keys()):
            if self.pool.num_free >= n:
                break
            e = self.entries[key]
            if e.pins == 0:
                self._evict(key)
        return self.pool.alloc(n)

    def _evict(self, key: bytes) -> None:
        e = self.entries.pop(key)
        self.pool.free(e.pages)
        with self._lock:
            self.counters.evictions += 1
            self.counters.evicted_tokens += e.num_tokens

    def create(self, key: bytes, num_tokens: int, stored_pos: int, kind: str) -> Entry | None:
        """Allocate a new (not yet ready) pinned entry; ``None`` if the pool is full."""
        if key in self.entries:  # replacing it would leak the old entry's pages
            raise ValueError("a cache entry with this key exists")
        ps = self.pool.page_size
        pages = self.alloc_pages(cdiv(num_tokens, ps))
        if pages is None:
            return None
        e = Entry(key=key, pages=pages, num_tokens=num_tokens, stored_pos=stored_pos, kind=kind, pins=1)
        self.entries[key] = e
        return e

    def adopt(self, key: bytes, pages: list[int], num_tokens: int, stored_pos: int, kind: str) -> Entry:
        """Register already-written pages (e.g. a full page of a request's prompt) as a
        cached entry, pinned once for the caller."""
        if key in self.entries:
            raise ValueError("a cache entry with this key exists")
        e = Entry(key=key, pages=pages, num_tokens=num_tokens, stored_pos=stored_pos, kind=kind, pins=1, ready=True)
        self.entries[key] = e
        return e

    def discard(self, e: Entry) -> None:
        """Drop an entry whose prefill failed."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
            self.pool.free(e.pages)

    # -- pinning ---------------------------------------------------------------
    def pin(self, e: Entry) -> None:
        e.pins += 1

    def unpin(self, e: Entry) -> None:
        if e.pins <= 0:
            raise RuntimeError("unpin of an unpinned cache entry")
        e.pins -= 1

    # -- reporting -------------------------------------------------------------
    def keys(self, kind: str = "chunk", limit: int | None = None) -> list[bytes]:
        """Keys of the ready entries of ``kind`` (``"chunk"``, ``"prefix"`` or ``"page"``),
        most recently used first, at most ``limit`` of them; for replicas that report what
        they hold to a router. Safe from any thread (one snapshot, as in ``stats``)."""
        entries = list(self.entries.values())
        out: list[bytes] = []
        for e in reversed(entries):
            if e.kind == kind and e.ready:
                out.append(e.key)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def stats(self) -> dict:
        with self._lock:
            c = self.counters
            lookups = c.hits + c.misses
            # one snapshot, taken by C code without releasing the GIL: the engine thread
            # mutates ``entries`` without this lock, and iterating it live from another
            # thread raises "OrderedDict mutated during iteration"
            entries = list(self.entries.values())
            resident_pages = sum(len(e.pages) for e in entries)
            page_bytes = self.pool.k[0, 0].numel() * self.pool.k.element_size() * 2 * self.pool.k.shape[0]
            return {
                "hits": c.hits,
                "misses": c.misses,
                "hit_rate": (c.hits / lookups) if lookups else 0.0,
                "reused_tokens": c.reused_tokens,
                "computed_tokens": c.computed_tokens,
                "evictions": c.evictions,
                "evicted_tokens": c.evicted_tokens,
                "entries": len(entries),
                "pinned_entries": sum(1 for e in entries if e.pins > 0),
                "resident_tokens": sum(e.num_tokens for e in entries),
                "resident_bytes": resident_pages * page_bytes,
                "pool_pages": self.pool.num_pages,
                "free_pages": self.pool.num_free,
                "page_size": self.pool.page_size,
                "pool_bytes": self.pool.num_pages * page_bytes,
            }
