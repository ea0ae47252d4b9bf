"""Ray Serve's side of document-affinity routing: the requests replicas and routers pass
(``ServeRequest``, ``WarmRequest``), what a replica reports (``replica_stats``: a Bloom filter
of its resident chunk keys and the ``key_identity`` a router keys chunks with), and
``DocumentAffinityRouter``, which applies ``integrations.routing``'s policy inside Ray Serve.
``ray_serve`` builds deployments with it and re-exports it.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lazyllm import Chunk, InvalidRequestError
from lazyllm.inputs.keys import key_identity
from lazyllm.types import as_chunk

from .routing import BloomFilter, ChunkKeyer, rank_replicas, request_keys

# -- requests ------------------------------------------------------------------------

@dataclass
class ServeRequest:
    """One generation request as replicas and routers see it. ``prompt`` (the documents
    in order, between the system prompt and the question) is what Ray's
    ``PrefixCacheAffinityRouter`` matches on, so the baseline routes the same object."""

    question: str | None  # None: the conversation is in sampling["messages"]
    chunks: list[Chunk] = field(default_factory=list)
    system: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.chunks, (str, Chunk)):
            raise InvalidRequestError("chunks must be a list of str or Chunk, not a single one")
        self.chunks = [as_chunk(c, i) for i, c in enumerate(self.chunks)]

    @property
    def prompt(self) -> str:
        return "\n\n".join([self.system or ""] + [c.text for c in self.chunks] + [self.question or ""])


@dataclass
class WarmRequest:
    """Precompute ``chunks`` (routed like a request, but never to a fallback replica)."""

    chunks: list[Chunk]
    system: str | None = None

    def __post_init__(self):
        self.chunks = [as_chunk(c, i) for i, c in enumerate(self.chunks)]

    @property
    def prompt(self) -> str:
        return "\n\n".join([self.system or ""] + [c.text for c in self.chunks])


# -- what a replica reports ------------------------------------------------------------

def replica_stats(llm, limit: int = 4096) -> dict:
    """The routing statistics of a replica serving ``llm``: a Bloom filter of (at most
    ``limit``, most recently used first) resident chunk keys, and what a router needs to
    compute keys itself (fingerprint, chunk context, tokenizer path)."""
    keys = llm.resident_chunk_keys(limit)
    engine = getattr(getattr(llm, "engine", None), "metrics", None) or {}
    return {
        "lazyllm": 1,
        **key_identity(llm.fingerprint, llm.chunk_context, llm.prompts),
        "caches_chunks": bool(llm.engine.planner.caches_chunks),
        "tokenizer": getattr(llm.tokenizer, "name_or_path", None),
        "chunks": len(keys),
        "bloom": BloomFilter.for_keys(keys).to_stats(),
        "time": time.time(),
        # for the HTTP front end's /metrics (summed over replicas there)
        "cache": {k: v for k, v in llm.cache_stats().items() if isinstance(v, (int, float))},
        "engine": {k: engine[k] for k in ("requests", "failed", "cancelled", "preemptions")
                   if isinstance(engine.get(k), (int, float))},
    }


# -- the router -------------------------------------------------------------------------

try:  # Ray Serve is an optional dependency (the `ray` extra)
    from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter
    _ROUTER_BASES: tuple[type, ...] = (LocalityMixin, MultiplexMixin, RequestRouter)
except ImportError:  # without ray the module still imports; serving needs it (ray_serve requires it)
    _ROUTER_BASES = ()


class DocumentAffinityRouter(*_ROUTER_BASES):
    """Ray Serve request router: sends a request to the replica holding most of its chunk
    tokens (see ``rank_replicas``). Configure with
    ``RequestRouterConfig(request_router_class=DocumentAffinityRouter, request_router_kwargs={...})``;
    the keyword arguments are those of ``initialize_state``."""

    def initialize_state(self, tokenizer: str | None = None, imbalanced_threshold: float = 4,
                         overlay_ttl_s: float = 30.0, key_cache_size: int = 65536, seed: int | None = None,
                         load_slack: float | None = 1, queue_len_deadline_s: float | None = None):
        """``tokenizer``: path of the tokenizer (default: the one replicas report);
        ``imbalanced_threshold``: queue-length spread above which to fall back to power of
        two choices; ``load_slack``: queued requests above the shortest queue beyond which
        a replica is passed over for affinity (``rank_replicas``; None: never);
        ``overlay_ttl_s``: how long keys this router sent to a replica count as held there
        without the replica's stats showing them; ``queue_len_deadline_s``: how long Ray's
        queue-length probe of the chosen replica may take before Ray moves to the next-ranked
        one (Ray's default, 0.1 s, can send a request away from the replica holding its
        documents on a loaded host)."""
        if queue_len_deadline_s is not None:
            self.queue_len_response_deadline_s = queue_len_deadline_s
            self.max_queue_len_response_deadline_s = max(self.max_queue_len_response_deadline_s,
                                                          queue_len_deadline_s)
        self._tokenizer_path = tokenizer
        self._imbalanced_threshold = imbalanced_threshold
        self._load_slack = load_slack
        self._overlay_ttl_s = overlay_ttl_s
        self._key_cache_size = key_cache_size
        self._rng = random.Random(seed)
        self._keyer: ChunkKeyer | None = None
        self._keyer_id: str | None = None
        self._blooms: dict[str, tuple[float, BloomFilter]] = {}
        self._overlay: dict[str, dict[bytes, float]] = {}
        self.decisions: dict[str, int] = {}  # reason -> count, for tests and benchmarks

    # -- keys
    def _stats(self, replica) -> dict:
        s = replica.routing_stats or {}
        return s if s.get("lazyllm") else {}

    def _get_keyer(self, candidates) -> ChunkKeyer | None:
        for r in candidates:
            s = self._stats(r)
            if s.get("fingerprint") and s.get("caches_chunks", True):
                ident = repr([s.get(k) for k in ("fingerprint", "chunk_context", "packet_ids", "layout")])
                if self._keyer is None or self._keyer_id != ident:
                    from transformers import AutoTokenizer

                    path = self._tokenizer_path or s.get("tokenizer")
                    if not path:
                        return None
                    self._keyer = ChunkKeyer.from_identity(AutoTokenizer.from_pretrained(path), s,
                                                           cache_size=self._key_cache_size)
                    self._keyer_id = ident
                return self._keyer
        return None

    def _holds(self, replica) -> Callable[[bytes], bool]:
        rid = replica.replica_id.unique_id
        s = self._stats(replica)
        bloom = None
        if s.get("bloom"):
            cached = self._blooms.get(rid)
            if cached is None or cached[0] != s.get("time"):
                cached = (s.get("time"), BloomFilter.from_stats(s["bloom"]))
                self._blooms[rid] = cached
            bloom = cached[1]
        overlay = self._overlay.get(rid, {})
        now = time.time()

        def holds(key: bytes) -> bool:
            t = overlay.get(key)
            return (t is not None and now - t < self._overlay_ttl_s) or (bloom is not None and key in bloom)
        return holds

    @staticmethod
    def _request_of(pending_request):
        for a in (pending_request.args if pending_request is not None else ()) or ():
            if isinstance(a, (ServeRequest, WarmRequest)):
                return a
        return None

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            ids = self.apply_locality_routing(pending_request=pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        replicas = [by_id[i] for i in ids if i in by_id] or list(candidate_replicas)
        if not replicas:
            return []
        req = self._request_of(pending_request)
        keyer = self._get_keyer(replicas) if req is not None else None
        chunks, owners = [], []
        if req is not None and req.chunks:
            chunks, owners = request_keys(req.chunks, req.system, keyer)
        queue_lens = await self._queue_lens(replicas)
        rid = {r.replica_id.unique_id: r for r in replicas}
        d = rank_replicas(chunks, {k: self._holds(r) for k, r in rid.items()}, queue_lens,
                          imbalanced_threshold=self._imbalanced_threshold, rng=self._rng,
                          allow_fallback=not isinstance(req, WarmRequest), load_slack=self._load_slack,
                          owner_keys=owners)
        if keyer is None and req is not None and req.chunks:
            d.reason = "no-stats"
        self.decisions[d.reason] = self.decisions.get(d.reason, 0) + 1
        if pending_request is not None and chunks and keyer is not None:
            pending_request.routing_context.lazyllm_chunk_keys = [k for k, _ in chunks]
        return [[rid[i] for i in rank] for rank in d.ranks]

    async def _queue_lens(self, replicas) -> dict[str, int | None]:
        cache = self.replica_queue_len_cache
        out, missing = {}, []
        for r in replicas:
            q = cache.get(r.replica_id)
            out[r.replica_id.unique_id] = q
            if q is None:
                missing.append(r)
        if missing and len(replicas) > 1:
            for r, q in await self._probe_queue_lens(missing, 0):
                out[r.replica_id.unique_id] = q
        return out

    def on_request_routed(self, pending_request, replica_id, result):
        keys = getattr(pending_request.routing_context, "lazyllm_chunk_keys", None) if pending_request else None
        if keys:
            ov = self._overlay.setdefault(replica_id.unique_id, {})
            now = time.time()
            for k in keys:
                ov[k] = now
            if len(ov) > 4 * self._key_cache_size:  # drop the expired ones
                for k in [k for k, t in ov.items() if now - t >= self._overlay_ttl_s]:
                    del ov[k]

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self._overlay.pop(replica_id.unique_id, None)
        self._blooms.pop(replica_id.unique_id, None)


__all__ = ["DocumentAffinityRouter", "ServeRequest", "WarmRequest", "replica_stats"]
