"""Chunk cache keys outside the engine: what a router needs to find the replica that holds a
request's documents.

A chunk's key is ``lazyllm.cache.store.segment_keys`` over the token ids of its segment, as
the engine's prompt builder makes them (the packet's virtual ids around the text, the prompt
layout's own chunk text). ``key_identity`` is what an engine reports so that a ``ChunkKeyer``
elsewhere, with the same tokenizer, builds the same segments and computes the same keys.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from ..cache.store import segment_keys
from ..types import Chunk
from .prompt import PromptBuilder
from .prompt_blockft import prompt_builder


def key_identity(fingerprint: str, chunk_context: str, prompts: PromptBuilder) -> dict:
    """What, besides the tokenizer, a chunk's key depends on: the model fingerprint, the chunk
    context, the packet's virtual ids (``[header ids, trailer ids]`` or ``None``) and the
    Block-Attention layout (``None``: the chat template's)."""
    return {"fingerprint": fingerprint, "chunk_context": chunk_context,
            "packet_ids": prompts.packet_ids, "layout": getattr(prompts, "layout", None)}


class ChunkKeyer:
    """The engine's cache keys of a request's chunks, computed without a model from the
    tokenizer and an engine's ``key_identity``. Keys and token counts are cached per chunk
    text (bounded LRU), so a popular document is tokenized once per router, not once per
    request."""

    def __init__(self, tokenizer, fingerprint: str, chunk_context: str = "isolated", cache_size: int = 65536,
                 *, packet_ids: tuple[list[int], list[int]] | None = None, layout: str | None = None):
        self.prompts = prompt_builder(tokenizer, layout, packet_ids)
        self.fingerprint, self.chunk_context = fingerprint, chunk_context
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, tuple[bytes, int]] = OrderedDict()
        self._prefix: dict[str | None, list[int]] = {}

    @classmethod
    def from_identity(cls, tokenizer, identity: Mapping, cache_size: int = 65536) -> ChunkKeyer:
        """The keyer of an engine whose ``key_identity`` is ``identity`` (a replica's stats
        carry it)."""
        packet_ids = identity.get("packet_ids")
        return cls(tokenizer, identity["fingerprint"], identity["chunk_context"], cache_size,
                   packet_ids=tuple(map(list, packet_ids)) if packet_ids else None, layout=identity.get("layout"))

    def _prefix_ids(self, system: str | None) -> list[int]:
        if system not in self._prefix:
            if len(self._prefix) > 1024:
                self._prefix.clear()
            self._prefix[system] = self.prompts.build("q", [Chunk("x")], system)[0].ids
        return self._prefix[system]

    def keys(self, chunks: Iterable[Chunk], system: str | None = None) -> list[tuple[bytes, int]]:
        """``(key, tokens)`` of each chunk, in order."""
        chunks = list(chunks)
        # an isolated chunk's key does not depend on the prefix, so its cache entry need not either
        by_prefix = self.chunk_context == "prefix"
        prefix = self._prefix_ids(system) if by_prefix else []
        texts = [(self.prompts.chunk_text(c), system if by_prefix else None) for c in chunks]
        misses = {t: c for t, c in zip(texts, chunks) if t not in self._cache}
        if misses:
            ids = [self.prompts.chunk_ids(c) for c in misses.values()]
            _, keys = segment_keys(self.fingerprint, self.chunk_context, prefix, ids)
            for t, k, i in zip(misses, keys, ids):
                self._cache[t] = (k, len(i))
        out = []
        for t in texts:
            self._cache.move_to_end(t)
            out.append(self._cache[t])
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out


__all__ = ["ChunkKeyer", "key_identity"]
