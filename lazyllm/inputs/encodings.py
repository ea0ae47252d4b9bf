"""Chunk encodings kept between requests: a hot chunk is tokenized and hashed once.

A RAG request names its documents by text; without a cache every request re-tokenizes every
chunk and the planner re-hashes its token ids into a cache key, host work that grows with the
chunk's length although its KV is already cached. ``ChunkEncodings`` is a bounded LRU of
``Encoding`` values keyed by what the segment's ids depend on: the chunk's segment text (as
the prompt builder lays it out), its id, the tokenizer and the packet's virtual ids. Each
entry carries the token ids (the very list the request's ``Segment`` holds: segments are
never mutated) and a memo of the segment's cache keys (``Segment.memo``, read by
``lazyllm.cache.store.segment_keys``), so a request over cached chunks costs a dictionary
lookup per chunk.

The bound is in tokens and in entries (``max_tokens``, ``max_entries``): at the defaults, about
2 million cached token ids, some 70 MB of Python lists at most.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 1 << 21
DEFAULT_MAX_ENTRIES = 16384


@dataclass
class Encoding:
    """One cached segment encoding: its token ids and the memo of its cache keys (by
    fingerprint, chunk context and, under ``chunk_context="prefix"``, the prefix key)."""

    ids: list[int]
    memo: dict = field(default_factory=dict)


def tokenizer_identity(tokenizer) -> tuple:
    """What tells two tokenizers apart in one process: the object itself (its ``id``, held
    alive by the prompt builder that owns the cache), its name and its vocabulary size."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    return (id(tokenizer), type(tokenizer).__name__, getattr(tokenizer, "name_or_path", None), size)


class ChunkEncodings:
    """A thread-safe LRU of segment encodings, bounded by ``max_tokens`` token ids in all
    and ``max_entries`` entries (the least recently used go first). ``hits``, ``misses``:
    lookups served from the cache and tokenizations done."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_tokens < 0 or max_entries < 0:
            raise ValueError("max_tokens and max_entries must be >= 0")
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self._entries: OrderedDict[tuple, Encoding] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Token ids held now (at most ``max_tokens``)."""
        return self._tokens

    def get(self, key: tuple, encode) -> Encoding:
        """The encoding cached under ``key``, else ``encode()`` (a list of token ids) cached
        and returned. ``encode`` runs outside the lock: tokenizers release the GIL, so
        threads tokenize in parallel (two racing on one key both tokenize, one entry stays)."""
        with self._lock:
            enc = self._entries.get(key)
            if enc is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return enc
        return self._put(key, Encoding(encode()))

    def get_many(self, keys: list[tuple], encode_many) -> list[Encoding]:
        """The encodings of ``keys``, in order: the cached ones looked up, the others (each
        distinct key once) from one ``encode_many(missing_keys)`` call (a list of token id
        lists, in that order), run outside the lock and then cached."""
        found: dict[tuple, Encoding] = {}
        with self._lock:
            for key in keys:
                enc = self._entries.get(key)
                if enc is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    found[key] = enc
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        if missing:
            for key, ids in zip(missing, encode_many(missing)):
                found[key] = self._put(key, Encoding(ids))
        return [found[k] for k in keys]

    def _put(self, key: tuple, enc: Encoding) -> Encoding:
        with self._lock:
            self.misses += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old.ids)
            if len(enc.ids) <= self.max_tokens and self.max_entries > 0:
                self._entries[key] = enc
                self._tokens += len(enc.ids)
            while self._tokens > self.max_tokens or len(self._entries) > self.max_entries:
                _, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped.ids)
        return enc

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0


__all__ = ["ChunkEncodings", "DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_TOKENS", "Encoding", "tokenizer_identity"]
