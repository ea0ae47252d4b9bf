"""The server's Prometheus metrics: request counts by status, latency histograms, tokens,
and the backend's cache and engine counters read at scrape time."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lazyllm import GenerationOutput

if TYPE_CHECKING:
    from .backends import Backend


class _CacheCollector:
    """Reads the backend's ``cache_stats()`` (and ``engine_stats()`` when it has one) at
    scrape time."""

    COUNTERS = {"hits": "chunk lookups found in the cache", "misses": "chunk lookups not found",
                "reused_tokens": "prompt tokens whose KV was reused", "computed_tokens": "chunk tokens computed",
                "evictions": "cached chunks evicted", "evicted_tokens": "tokens of evicted chunks"}
    GAUGES = {"resident_bytes": "bytes of KV held by cached chunks", "resident_tokens": "tokens of cached chunks",
              "entries": "cached chunks", "pinned_entries": "cached chunks in use by a running request",
              "free_pages": "free pages of the KV pool", "pool_pages": "pages of the KV pool",
              "pool_bytes": "bytes of the KV pool", "hit_rate": "hits / lookups"}

    def __init__(self, backend: Backend):
        self.backend = backend

    def collect(self):
        s = self.backend.cache_stats()
        for k, doc in self.COUNTERS.items():
            if k in s:
                yield CounterMetricFamily(f"lazyllm_cache_{k}", doc, value=s[k])
        for k, doc in self.GAUGES.items():
            if k in s:
                yield GaugeMetricFamily(f"lazyllm_cache_{k}", doc, value=s[k])
        late = s.get("kernels_compiled_after_ready")
        if isinstance(late, (int, float)):
            yield CounterMetricFamily("lazyllm_kernels_compiled_after_ready",
                                      "Triton kernels compiled after the warm-up (requests waited for them)",
                                      value=late)
        settings = getattr(self.backend, "engine_settings", None)
        if settings is not None:  # the options the engine runs with, as labels of a constant 1
            values = {k: str(v) for k, v in settings().items()}
            info = GaugeMetricFamily("lazyllm_engine_info", "the engine options served (quality preset...)",
                                     labels=sorted(values))
            info.add_metric([values[k] for k in sorted(values)], 1)
            yield info
        engine_stats = getattr(self.backend, "engine_stats", None)
        engine_metrics = (engine_stats() if engine_stats is not None else None) or {}
        for k in ("requests", "failed", "cancelled", "preemptions"):
            if isinstance(engine_metrics.get(k), (int, float)):
                yield CounterMetricFamily(f"lazyllm_engine_{k}", f"engine {k}", value=engine_metrics[k])


_LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of their own (one per app), over a
    ``Backend``."""

    def __init__(self, backend: Backend):
        self.registry = CollectorRegistry()
        self.registry.register(_CacheCollector(backend))
        self.ttft = Histogram("lazyllm_ttft_seconds", "time from the server's receipt of the request to the first "
                              "token (reading, tokenizing and queueing included)", buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.engine_ttft = Histogram("lazyllm_engine_ttft_seconds", "time from the engine's receipt of the "
                                     "tokenized request to the first token", buckets=_LATENCY_BUCKETS,
                                     registry=self.registry)
        self.queue = Histogram("lazyllm_queue_seconds", "time the engine held a request before scheduling it",
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.duration = Histogram("lazyllm_request_duration_seconds", "time from the server's receipt of a "
                                  "request to its last token",
                                  buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("lazyllm_http_requests", "chat completion requests by status and mode",
                                ["status", "stream"], registry=self.registry)
        self.tokens = Counter("lazyllm_tokens", "tokens by kind", ["kind"], registry=self.registry)
        self.in_flight = Gauge("lazyllm_requests_in_flight", "chat completions being served",
                               registry=self.registry)
        self.disconnects = Counter("lazyllm_client_disconnects", "streams whose client left before the end",
                                   registry=self.registry)

    def observe(self, out: GenerationOutput) -> None:
        self.ttft.observe(out.ttft_s)
        if out.engine_ttft_s > 0:  # a backend that reports it
            self.engine_ttft.observe(out.engine_ttft_s)
        self.queue.observe(out.queue_s)
        self.duration.observe(out.total_s)
        self.tokens.labels("prompt").inc(out.usage.prompt_tokens)
        self.tokens.labels("cached").inc(out.usage.cached_tokens)
        self.tokens.labels("completion").inc(out.usage.completion_tokens)
