"""Replicas of ``LazyLLM`` on Ray Serve, routed by the documents each replica holds.

A chunk's KV is cached under a key that does not depend on where the chunk sits in the
prompt (``lazyllm.cache.store.chunk_key``: model, chunk context, prefix when it matters,
tokens). So a router can score a replica by how many of *this request's* chunk tokens it
already holds, one set lookup per chunk, whatever the order of the documents, where a
prefix-affinity router only sees the longest shared prefix.

Pieces:

* ``LazyLLMDeployment``: the replica. Wraps a ``LazyLLM`` (built in the replica from a model
  path, keyword arguments or a factory) and reports, through Ray Serve's routing
  statistics (``record_routing_stats``), a Bloom filter of its resident chunk keys, the
  model fingerprint and the chunk context.
* ``DocumentAffinityRouter``: a Ray Serve ``RequestRouter``. It computes the request's chunk
  keys (tokenizer in the router's process, a bounded cache per document text), ranks the
  replicas by the chunk tokens each holds (Bloom filter from the stats, plus the keys it
  routed there itself since, which the stats cannot show yet), breaks ties by the cold
  chunks each replica owns under rendezvous hashing (so every router agrees where a new
  document goes), and falls back to the less loaded of two random replicas when the queues
  are unbalanced.
* ``build_app``: the application (deployment options passed through), ``warm``: precompute
  documents on the replicas that will own them.
* ``RayBackend``: the ``integrations.server.Backend`` of a deployment handle, so the HTTP
  front end of the replicas is the single-process server's app,
  ``create_app(RayBackend(handle))`` (``build_http_app``: every endpoint, ``/v1/models`` and
  ``/metrics`` included, the metrics summed over the replicas).

The policy itself (``BloomFilter``, ``ChunkKeyer``, ``rank_replicas``, ``rendezvous_owner``)
lives in ``integrations.routing``, pure and tested without a Ray cluster; this module
re-exports it.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lazyllm import Chunk, InvalidRequestError
from lazyllm.config import EngineConfig
from lazyllm.extras import require
from lazyllm.types import as_chunk

from ._common import engine_settings
from .routing import (
    BloomFilter,
    ChunkKeyer,
    Decision,
    rank_replicas,
    rendezvous_owner,
    replica_identity,
    text_keys,
)

ROUTERS = ("documents", "default", "prefix")
# Ray's prefix-affinity router. ``ray.serve.llm.request_router.PrefixCacheAffinityRouter`` is
# an empty public subclass of this class, but importing ``ray.serve.llm`` needs the `ray[llm]`
# dependencies (pyarrow...), which a CPU replica does not: the same class from where it lives.
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"


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
        **replica_identity(llm),
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
    _HAVE_RAY = True
except ImportError:  # pragma: no cover - exercised only without ray
    _HAVE_RAY = False
    RequestRouter = LocalityMixin = MultiplexMixin = object


class DocumentAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
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
        chunks = []
        if req is not None and req.chunks:
            chunks = keyer.keys(req.chunks, req.system) if keyer is not None else text_keys(req.chunks)
        queue_lens = await self._queue_lens(replicas)
        rid = {r.replica_id.unique_id: r for r in replicas}
        d = rank_replicas(chunks, {k: self._holds(r) for k, r in rid.items()}, queue_lens,
                          imbalanced_threshold=self._imbalanced_threshold, rng=self._rng,
                          allow_fallback=not isinstance(req, WarmRequest), load_slack=self._load_slack)
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


# -- the replica --------------------------------------------------------------------------

class LazyLLMDeployment:
    """A Ray Serve replica serving one ``LazyLLM``: ``generate`` (a ``ServeRequest`` ->
    dict), ``stream`` (text deltas, then a final dict with usage), ``warm``,
    ``cache_stats``, and ``record_routing_stats`` for the router.

    The engine is built inside the replica: from ``llm_factory()`` when given (any
    picklable callable returning a ``LazyLLM``), else ``LazyLLM(model, **llm_kwargs)``.
    ``torch_threads`` caps the intra-op threads (several CPU replicas on one host).

    Ray Serve routes to a replica once its constructor returned and ``check_health`` passes:
    the constructor runs the engine's warm-up (``LazyLLM.warmup``, unless the engine was made
    with ``warmup=False``), so a replica is ready only when its kernels are compiled and its
    CUDA graphs captured, and ``check_health`` fails while it is not."""

    def __init__(self, model: str | None = None, llm_factory: Callable[[], Any] | None = None,
                 report_limit: int = 4096, torch_threads: int | None = None, **llm_kwargs):
        import torch

        from lazyllm import LazyLLM

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.llm = llm_factory() if llm_factory is not None else LazyLLM(model, **llm_kwargs)
        if self.llm.config.warmup:
            self.llm.warmup()  # a no-op where the constructor ran it
        self.report_limit = report_limit
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Ray Serve (unit use)
            self.replica_id = "local"

    def check_health(self) -> None:
        """Ray Serve's health probe: raises while the engine is not ready."""
        if not self.llm.ready:
            raise RuntimeError("the engine is not ready (warming up or closed)")

    def _result(self, out) -> dict:
        return {"text": out.text, "finish_reason": getattr(out, "finish_reason", None),
                "prompt_tokens": out.usage.prompt_tokens, "cached_tokens": out.usage.cached_tokens,
                "cached_chunk_tokens": out.usage.cached_chunk_tokens,
                "completion_tokens": out.usage.completion_tokens, "ttft_s": out.ttft_s,
                "chunk_tokens": sum(len(ids) for kind, ids in out.prompt_segments if kind == "chunk"),
                "tpot_s": getattr(out, "tpot_s", None), "replica": self.replica_id}

    async def generate(self, request: ServeRequest) -> dict:
        out = await self.llm.agenerate(request.question, request.chunks, request.system, **request.sampling)
        return self._result(out)

    async def stream_output(self, request: ServeRequest):
        """Text deltas (str), then the ``GenerationOutput``."""
        s = self.llm.astream(request.question, request.chunks, request.system, **request.sampling)
        async for delta in s:
            yield delta
        yield s.output

    async def stream(self, request: ServeRequest):
        s = self.llm.astream(request.question, request.chunks, request.system, **request.sampling)
        async for delta in s:
            yield {"delta": delta}
        yield {"done": self._result(s.output)}

    async def warm(self, request: WarmRequest) -> dict:
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(None, lambda: self.llm.warm(request.chunks, request.system,
                                                                     progress=False))
        return {**out, "replica": self.replica_id}

    def cache_stats(self) -> dict:
        return {**self.llm.cache_stats(), "replica": self.replica_id}

    def model_info(self) -> dict:
        """The ``/v1/models`` card's fields (``integrations.server.Backend.model_info``)."""
        return {"model_name": str(self.llm.model_name), "max_context": self.llm.model.spec.max_context,
                **engine_settings(self.llm)}

    def record_routing_stats(self) -> dict:
        return replica_stats(self.llm, self.report_limit)

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()


def router_config(router: str = "documents", *, stats_period_s: float = 2.0, imbalanced_threshold: float = 4,
                  tokenizer: str | None = None, **router_kwargs):
    """The ``RequestRouterConfig`` of ``router``: ``"documents"`` (``DocumentAffinityRouter``),
    ``"default"`` (Ray's power of two choices) or ``"prefix"`` (Ray's
    ``PrefixCacheAffinityRouter``, with the same imbalance threshold)."""
    require("ray", "ray.serve")
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    common = dict(request_routing_stats_period_s=stats_period_s)
    if router == "documents":
        kw = dict(imbalanced_threshold=imbalanced_threshold, **router_kwargs)
        if tokenizer:
            kw["tokenizer"] = tokenizer
        return RequestRouterConfig(request_router_class=DocumentAffinityRouter, request_router_kwargs=kw, **common)
    if router == "prefix":
        return RequestRouterConfig(request_router_class=PREFIX_ROUTER,
                                   request_router_kwargs=dict(imbalanced_threshold=imbalanced_threshold,
                                                              **router_kwargs), **common)
    return RequestRouterConfig(**common)


def build_app(model: str | None = None, *, num_replicas: int | str | None = 2, num_gpus: float = 0,
              num_cpus: float | None = None, autoscaling_config: dict | None = None, router: str = "documents",
              max_ongoing_requests: int = 16, stats_period_s: float = 2.0, imbalanced_threshold: float = 4,
              router_kwargs: dict | None = None, name: str = "LazyLLM", ray_actor_options: dict | None = None,
              llm_factory: Callable[[], Any] | None = None, report_limit: int = 4096,
              torch_threads: int | None = None, **llm_kwargs):
    """A Ray Serve application of ``LazyLLMDeployment`` replicas behind ``router``.

    ``num_gpus`` / ``num_cpus`` go to ``ray_actor_options`` (one GPU per replica is the usual
    setting); ``autoscaling_config`` is passed to Ray as is (then ``num_replicas`` is
    ignored); ``llm_kwargs`` (``quality``, ``reuse``, ``kv_cache_bytes``, ``device``: the fields
    of ``lazyllm.config.EngineConfig``, the options ``lazyllm serve`` takes as flags) go to
    ``LazyLLM`` and are validated here first.
    Run it with ``serve.run(build_app(...))``, which returns the handle to send
    ``ServeRequest``s to (``handle.generate.remote(req)``)."""
    require("ray", "ray.serve")
    from ray import serve

    if llm_factory is None:  # the replicas' options checked here, before any replica starts
        EngineConfig.resolve(**llm_kwargs)
    opts = dict(ray_actor_options or {})
    opts.setdefault("num_gpus", num_gpus)
    if num_cpus is not None:
        opts.setdefault("num_cpus", num_cpus)
    dep_kw: dict[str, Any] = dict(name=name, ray_actor_options=opts, max_ongoing_requests=max_ongoing_requests,
                                  request_router_config=router_config(router, stats_period_s=stats_period_s,
                                                                      imbalanced_threshold=imbalanced_threshold,
                                                                      **(router_kwargs or {})))
    if autoscaling_config is not None:
        dep_kw["autoscaling_config"] = autoscaling_config
    else:
        dep_kw["num_replicas"] = num_replicas
    dep = serve.deployment(LazyLLMDeployment).options(**dep_kw)
    return dep.bind(model, llm_factory=llm_factory, report_limit=report_limit, torch_threads=torch_threads,
                    **llm_kwargs)


# -- the HTTP front end -------------------------------------------------------------------

def _cause(e: BaseException) -> BaseException:
    """The replica's own exception of a Ray error (``RayTaskError.cause``), for the HTTP
    status (``server.error_from_exception``)."""
    return getattr(e, "cause", None) or e


class RayStream:
    """The stream across the boundary between a Ray replica and the HTTP ingress: one
    streaming call of ``LazyLLMDeployment.stream_output`` as a ``server.GenerationStream``
    (text deltas, then ``output``). ``cancel()`` cancels the call, and the replica's stream,
    so its engine drops the request and releases its pages."""

    def __init__(self, handle, request: ServeRequest):
        self.handle, self.request = handle, request
        self.gen = None
        self.output = None
        self.cancelled = self.finished = False

    async def __aiter__(self):
        from lazyllm.errors import RequestCancelled

        if self.cancelled:
            raise RequestCancelled("cancelled before it started")
        self.gen = self.handle.options(stream=True).stream_output.remote(self.request)
        try:
            async for part in self.gen:
                if isinstance(part, str):
                    yield part
                else:
                    self.finished = True
                    self.output = part
        except Exception as e:
            self.finished = True
            raise _cause(e) from None
        finally:
            if not self.finished:
                self.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        if self.gen is not None and not self.finished:
            self.gen.cancel()


def _handle_replicas(handle) -> list:
    """The running replicas the handle's router knows (Ray internals: best effort, [] when
    the router is not there yet, e.g. before the handle's first request)."""
    try:
        return list(handle._router._asyncio_router.request_router.curr_replicas.values())
    except AttributeError:
        return []


class RayBackend:
    """The ``integrations.server.Backend`` of a handle to ``LazyLLMDeployment`` replicas:
    ``create_app(RayBackend(handle))`` serves them over the OpenAI-compatible API, each
    request routed by the handle's router (``DocumentAffinityRouter`` by default).

    ``cache_stats()`` sums the replicas' cache counters from the routing statistics they
    report (``replica_stats``; as fresh as ``stats_period_s``), ``replicas`` counting them;
    ``model_info()`` asks one replica once. Bad input is found in the replica, so a stream
    reports it as an error event (a non-streaming request as its HTTP status)."""

    def __init__(self, handle, model_name: str = "lazyllm"):
        self.handle = handle
        self.model_name = model_name
        self._info: dict | None = None

    @staticmethod
    def _request(question, chunks, system, sampling) -> ServeRequest:
        return ServeRequest(question, chunks, system, {k: v for k, v in sampling.items() if v is not None})

    def stream(self, question: str | None, chunks, system: str | None, **sampling) -> RayStream:
        return RayStream(self.handle, self._request(question, chunks, system, sampling))

    async def model_info(self) -> dict:
        if self._info is None:
            info = dict(await self.handle.model_info.remote())
            info.pop("model_name", None)
            self._info = info
        return dict(self._info)

    def _replica_stats(self) -> list[dict]:
        return [s for s in ((getattr(r, "routing_stats", None) or {}) for r in _handle_replicas(self.handle))
                if s.get("lazyllm")]

    def cache_stats(self) -> dict:
        stats = self._replica_stats()
        total: dict = {}
        for s in stats:
            for k, v in (s.get("cache") or {}).items():
                total[k] = total.get(k, 0) + v
        if not stats:
            return {}
        total.pop("hit_rate", None)
        lookups = total.get("hits", 0) + total.get("misses", 0)
        if lookups:
            total["hit_rate"] = total["hits"] / lookups
        total["replicas"] = len(stats)
        return total

    def engine_stats(self) -> dict:
        total: dict = {}
        for s in self._replica_stats():
            for k, v in (s.get("engine") or {}).items():
                total[k] = total.get(k, 0) + v
        return total


class LazyLLMIngress:
    """The HTTP ingress: ``integrations.server.create_app(RayBackend(llm_handle), **app_kwargs)``,
    built in the ingress replica (``serve.ingress`` late-bound app), whose handle routes each
    request to a ``LazyLLMDeployment`` replica."""

    def __init__(self, llm_handle, model_name: str = "lazyllm", **app_kwargs):
        self.llm_handle, self.model_name, self.app_kwargs = llm_handle, model_name, app_kwargs

    def __serve_build_asgi_app__(self):
        from .server import create_app

        return create_app(RayBackend(self.llm_handle, self.model_name), **self.app_kwargs)


def build_http_app(model: str | None = None, *, model_name: str = "lazyllm", ingress_kwargs: dict | None = None,
                   **kwargs):
    """``build_app(model, **kwargs)`` behind the OpenAI-compatible HTTP API (one ingress
    replica serving ``create_app(RayBackend(handle), **ingress_kwargs)``, the single-process
    server's app: ``ingress_kwargs`` are ``create_app``'s, ``api_key``, ``max_new_tokens_limit``...;
    its handle routes each request to a ``LazyLLMDeployment`` replica):
    ``serve.run(build_http_app(...), route_prefix="/")``, then ``POST /v1/chat/completions``
    with ``documents``, ``GET /v1/models``, ``/health``, ``/metrics`` as in the single-process
    server."""
    from ray import serve

    llm_app = build_app(model, **kwargs)
    ingress = serve.deployment(serve.ingress()(LazyLLMIngress)).options(
        name=f"{kwargs.get('name', 'LazyLLM')}Ingress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(llm_app, model_name=model_name, **(ingress_kwargs or {}))


def warm(handle, documents: Sequence[str | Chunk], system: str | None = None, *, timeout_s: float = 600) -> list:
    """Precompute ``documents`` on the replicas that will own them: one ``WarmRequest`` per
    document, which ``DocumentAffinityRouter`` sends to the replica already holding it or,
    for a cold document, to its rendezvous owner (never to a fallback replica). Returns
    each replica's ``warm`` result."""
    responses = [handle.warm.remote(WarmRequest([d], system)) for d in documents]
    return [r.result(timeout_s=timeout_s) for r in responses]


__all__ = ["BloomFilter", "ChunkKeyer", "Decision", "DocumentAffinityRouter", "LazyLLMDeployment", "LazyLLMIngress",
           "RayBackend", "RayStream", "ServeRequest",
           "WarmRequest", "build_app", "build_http_app", "rank_replicas", "rendezvous_owner", "replica_stats",
           "router_config", "warm"]
