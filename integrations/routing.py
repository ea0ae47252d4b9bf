"""The routing policy of the Ray Serve deployment, as pure functions and plain classes,
tested without a Ray cluster: the Bloom filter a replica reports its resident chunk keys in,
the chunk keys a router computes for a request (``ChunkKeyer``, or ``text_keys`` before any
replica has reported), rendezvous ownership of cold chunks, and the ranking of replicas
(``rank_replicas``). ``ray_serve.DocumentAffinityRouter`` applies it inside Ray Serve."""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lazyllm import Chunk
from lazyllm.intmath import next_pow2


class BloomFilter:
    """A Bloom filter over chunk keys (20-byte blake2b digests, so their bytes are already
    uniform: the ``k`` bit positions are read from the key, nothing is hashed again).

    ``bits`` is a power of two; with 16 bits per key and 4 positions the false-positive
    rate is about 0.24% (a false positive only costs a less good routing choice)."""

    def __init__(self, bits: int, hashes: int = 4, data: bytes | bytearray | None = None):
        if bits < 8 or bits & (bits - 1):
            raise ValueError("bits must be a power of two >= 8")
        if not 1 <= hashes <= 5:
            raise ValueError("hashes must be 1..5 (a 20-byte key has five 32-bit words)")
        self.bits, self.hashes = bits, hashes
        self.data = bytearray(data) if data is not None else bytearray(bits // 8)
        if len(self.data) != bits // 8:
            raise ValueError("data does not match bits")

    @classmethod
    def for_keys(cls, keys: Sequence[bytes], bits_per_key: int = 16, hashes: int = 4) -> BloomFilter:
        bits = next_pow2(max(1, len(keys)) * bits_per_key, 1024)
        f = cls(bits, hashes)
        for k in keys:
            f.add(k)
        return f

    def _positions(self, key: bytes):
        if len(key) < 4 * self.hashes:
            key = hashlib.blake2b(key, digest_size=20).digest()
        mask = self.bits - 1
        for i in range(self.hashes):
            yield int.from_bytes(key[4 * i:4 * i + 4], "little") & mask

    def add(self, key: bytes) -> None:
        for p in self._positions(key):
            self.data[p >> 3] |= 1 << (p & 7)

    def __contains__(self, key: bytes) -> bool:
        return all(self.data[p >> 3] >> (p & 7) & 1 for p in self._positions(key))

    def to_stats(self) -> dict:
        return {"bits": self.bits, "hashes": self.hashes, "data": bytes(self.data)}

    @classmethod
    def from_stats(cls, d: Mapping) -> BloomFilter:
        return cls(d["bits"], d["hashes"], d["data"])


# -- chunk keys in the router ---------------------------------------------------------

class ChunkKeyer:
    """The engine's cache keys of a request's chunks, computed without a model: the
    tokenizer and what a replica reports (``replica_identity``: the model fingerprint, the
    chunk context, the packet's virtual ids, the prompt layout) are enough. The segments
    come from the engine's own prompt builder and the keys from the planner's own function
    (``lazyllm.cache.store.segment_keys``). Keys and token counts are cached per chunk text
    (bounded LRU), so a popular document is tokenized once per router, not once per request."""

    def __init__(self, tokenizer, fingerprint: str, chunk_context: str = "isolated", cache_size: int = 65536,
                 *, packet_ids: tuple[list[int], list[int]] | None = None, layout: str | None = None):
        from lazyllm.cache.store import segment_keys
        from lazyllm.engine.prompt import PromptBuilder

        self._segment_keys = segment_keys
        if layout is None:
            self.prompts = PromptBuilder(tokenizer, packet_ids)
        else:
            from lazyllm.engine.prompt_blockft import BlockFTPromptBuilder

            self.prompts = BlockFTPromptBuilder(tokenizer, layout)
        self.fingerprint, self.chunk_context = fingerprint, chunk_context
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, tuple[bytes, int]] = OrderedDict()
        self._prefix: dict[str | None, list[int]] = {}

    @classmethod
    def from_identity(cls, tokenizer, identity: Mapping, cache_size: int = 65536) -> ChunkKeyer:
        """The keyer of a replica that reported ``identity`` (``replica_identity``)."""
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
        # an isolated chunk's key does not depend on the prefix, so the cache need not either
        by_prefix = self.chunk_context == "prefix"
        prefix = self._prefix_ids(system) if by_prefix else []
        texts = [(self.prompts.chunk_text(c), system if by_prefix else None) for c in chunks]
        misses = {t: c for t, c in zip(texts, chunks) if t not in self._cache}
        if misses:
            ids = [self.prompts.chunk_ids(c) for c in misses.values()]
            _, keys = self._segment_keys(self.fingerprint, self.chunk_context, prefix, ids)
            for t, k, i in zip(misses, keys, ids):
                self._cache[t] = (k, len(i))
        out = []
        for t in texts:
            self._cache.move_to_end(t)
            out.append(self._cache[t])
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out


def replica_identity(llm) -> dict:
    """What a router needs, with the tokenizer, to compute ``llm``'s chunk keys itself."""
    return {"fingerprint": llm.fingerprint, "chunk_context": llm.chunk_context,
            "packet_ids": getattr(llm.prompts, "packet_ids", None), "layout": getattr(llm.prompts, "layout", None)}


def text_keys(chunks: Iterable[Chunk]) -> list[tuple[bytes, int]]:
    """Keys of chunks from their text alone, for a router that has no replica stats yet (so
    no tokenizer or model fingerprint): no replica's cache holds them, but they give each
    document the same rendezvous owner on every router and every request, so until stats
    arrive the same documents still meet on one replica. Weights are the texts' lengths."""
    return [(hashlib.blake2b(c.text.encode(), digest_size=20).digest(), max(1, len(c.text)))
            for c in chunks]


# -- the policy (pure) -----------------------------------------------------------------

def rendezvous_owner(key: bytes, replica_ids: Sequence[str]) -> str | None:
    """The replica that owns ``key`` under rendezvous (highest random weight) hashing:
    every router computes the same owner, and adding or removing a replica moves only
    the keys it owns."""
    best, best_w = None, b""
    for rid in replica_ids:
        w = hashlib.blake2b(key + rid.encode(), digest_size=8).digest()
        if best is None or w > best_w:
            best, best_w = rid, w
    return best


@dataclass
class Decision:
    """Replica ranks (most preferred first; the framework sends the request to the least
    loaded replica of the first rank that has room) and why."""

    ranks: list[list[str]]
    reason: str  # "affinity", "owner", "imbalanced", "no-chunks", "no-stats"
    held_tokens: dict[str, int] = field(default_factory=dict)


def rank_replicas(chunks: Sequence[tuple[bytes, int]], holds: Mapping[str, Callable[[bytes], bool]],
                  queue_lens: Mapping[str, int | None], *, imbalanced_threshold: float = 4,
                  rng: random.Random | None = None, allow_fallback: bool = True,
                  load_slack: float | None = None) -> Decision:
    """Rank the replicas ``holds`` (id -> membership test of chunk keys) for a request
    whose chunks are ``(key, tokens)``.

    * Queues unbalanced (longest minus shortest known queue above ``imbalanced_threshold``)
      and ``allow_fallback``: power of two choices, two random replicas in one rank.
    * Otherwise by the chunk tokens each replica holds, most first; ties (and a request
      whose chunks nobody holds) by the tokens of cold chunks it owns under rendezvous
      hashing, then by queue length. Every replica is ranked, so a full first choice
      spills to the next best one rather than waiting.
    * ``load_slack``: when set (and ``allow_fallback``), replicas whose known queue is more
      than ``load_slack`` above the shortest come after all the others, whatever they hold:
      without it, the replica holding the popular documents attracts every request that
      names one of them (and then computes and holds their other documents too), so a few
      clients below the imbalance threshold all queue on one replica.
    """
    rng = rng or random
    ids = list(holds)
    if not ids:
        return Decision([], "no-replicas")
    known = [q for q in (queue_lens.get(r) for r in ids) if q is not None]
    if allow_fallback and len(known) >= 2 and max(known) - min(known) > imbalanced_threshold:
        return Decision([rng.sample(ids, min(2, len(ids)))], "imbalanced")
    if not chunks:
        return Decision([rng.sample(ids, min(2, len(ids)))], "no-chunks")
    held = {r: 0 for r in ids}
    owned = {r: 0 for r in ids}
    for key, n in chunks:
        holders = [r for r in ids if holds[r](key)]
        for r in holders:
            held[r] += n
        if not holders:
            owned[rendezvous_owner(key, ids)] += n
    tie = {r: rng.random() for r in ids}
    busy = {r: False for r in ids}
    if load_slack is not None and allow_fallback and known:
        shortest = min(known)
        busy = {r: queue_lens.get(r) is not None and queue_lens[r] > shortest + load_slack for r in ids}
    order = sorted(ids, key=lambda r: (busy[r], -held[r], -owned[r], queue_lens.get(r) or 0, tie[r]))
    reason = "affinity" if held[order[0]] > 0 else "owner"
    return Decision([[r] for r in order], reason, held)


__all__ = ["BloomFilter", "ChunkKeyer", "Decision", "rank_replicas", "rendezvous_owner", "replica_identity",
           "text_keys"]
