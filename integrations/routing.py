"""The routing policy of the Ray Serve deployment, as pure functions and plain classes,
tested without a Ray cluster: the Bloom filter a replica reports its resident chunk keys in,
the chunk keys a router computes for a request (``ChunkKeyer``, or ``text_keys`` before any
replica has reported), rendezvous ownership of cold chunks, and the ranking of replicas
(``rank_replicas``). ``ray_serve.DocumentAffinityRouter`` applies it inside Ray Serve."""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lazyllm import Chunk
from lazyllm.inputs.keys import ChunkKeyer
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

def text_keys(chunks: Iterable[Chunk]) -> list[tuple[bytes, int]]:
    """Keys of chunks from their text alone, for a router that has no replica stats yet (so
    no tokenizer or model fingerprint): no replica's cache holds them, but they give each
    document the same rendezvous owner on every router and every request, so until stats
    arrive the same documents still meet on one replica. Weights are the texts' lengths."""
    return [(hashlib.blake2b(c.text.encode(), digest_size=20).digest(), max(1, len(c.text)))
            for c in chunks]


def request_keys(chunks: Sequence[Chunk], system: str | None,
                 keyer: ChunkKeyer | None) -> tuple[list[tuple[bytes, int]], list[bytes]]:
    """What a router ranks replicas by for a request's ``chunks``: their ``(key, tokens)``
    (the engine's keys through ``keyer``; ``text_keys`` without one) and, per chunk, the key
    its rendezvous owner is drawn from, always its text's: a document nobody holds has the
    same owner before and after replica stats reach the router, so a document precomputed
    before them is looked for where it went, not where its engine key would hash."""
    by_text = text_keys(chunks)
    return (keyer.keys(chunks, system) if keyer is not None else by_text), [k for k, _ in by_text]


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
                  load_slack: float | None = None, owner_keys: Sequence[bytes] | None = None) -> Decision:
    """Rank the replicas ``holds`` (id -> membership test of chunk keys) for a request
    whose chunks are ``(key, tokens)``.

    * Queues unbalanced (longest minus shortest known queue above ``imbalanced_threshold``)
      and ``allow_fallback``: power of two choices, two random replicas in one rank.
    * Otherwise by the chunk tokens each replica holds, most first; ties (and a request
      whose chunks nobody holds) by the tokens of cold chunks it owns under rendezvous
      hashing (of ``owner_keys[i]`` for chunk ``i``, default its key: see ``request_keys``),
      then by queue length. Every replica is ranked, so a full first choice spills to the
      next best one rather than waiting.
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
    if owner_keys is not None and len(owner_keys) != len(chunks):
        raise ValueError(f"{len(owner_keys)} owner keys for {len(chunks)} chunks")
    for i, (key, n) in enumerate(chunks):
        holders = [r for r in ids if holds[r](key)]
        for r in holders:
            held[r] += n
        if not holders:
            owned[rendezvous_owner(key if owner_keys is None else owner_keys[i], ids)] += n
    tie = {r: rng.random() for r in ids}
    busy = {r: False for r in ids}
    if load_slack is not None and allow_fallback and known:
        shortest = min(known)
        busy = {r: queue_lens.get(r) is not None and queue_lens[r] > shortest + load_slack for r in ids}
    order = sorted(ids, key=lambda r: (busy[r], -held[r], -owned[r], queue_lens.get(r) or 0, tie[r]))
    reason = "affinity" if held[order[0]] > 0 else "owner"
    return Decision([[r] for r in order], reason, held)


__all__ = ["BloomFilter", "ChunkKeyer", "Decision", "rank_replicas", "rendezvous_owner", "request_keys", "text_keys"]
