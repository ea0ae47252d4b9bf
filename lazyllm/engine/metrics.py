"""``EngineMetrics``: the engine's counters, one typed field each.

The engine's parts (scheduler, KV planner, model runner, recovery, output) count into the one
``EngineMetrics`` the engine owns, by attribute (``metrics.decode_steps += 1``). Readers
(benchmarks, the server's ``/metrics``, tests) may also read it as a read-only mapping,
``metrics["prefill_s"]``, ``dict(metrics)``, as when the counters were a dict of strings.
Written on the engine thread only; a reader elsewhere sees each field's latest value.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(eq=False)
class EngineMetrics(Mapping):
    """The engine's counters since it started (the warm-up's scratch work excluded)."""

    requests: int = 0  # requests finished with a result
    failed: int = 0  # requests that ended with an error
    cancelled: int = 0  # requests cancelled (by the caller or their timeout)
    preemptions: int = 0  # running requests pushed back to make room
    prefill_retries: int = 0  # batched prefills that failed and were retried one request at a time
    escalations: int = 0  # requests prefilled again with full context (escalate_below)
    recovery_skipped: int = 0  # recomputations skipped (nothing to recompute, or no room)
    disk_hits: int = 0  # entries loaded from the disk tier
    prefill_tokens: int = 0  # tokens run through the model in prefill (chunks, prefixes, suffixes, recompute)
    decode_steps: int = 0  # decode forwards
    decode_tokens: int = 0  # tokens decoded (the sum of the steps' batch sizes)
    peak_pages: int = 0  # the most KV pages in use at once
    copied_pages: int = 0  # pages copied re-rotated (block copies, recovery)
    overlapped_steps: int = 0  # decode steps launched before the previous one's tokens were read
    prefill_s: float = 0.0  # engine-thread seconds in steps that prefilled
    decode_s: float = 0.0  # engine-thread seconds in decode steps
    shared_decode_steps: int = 0  # decode steps that read shared pages once (grouped)
    shared_plans: int = 0  # decode batches found sharing pages (a plan made when the rows changed)
    selection_s: float = 0.0  # engine-thread seconds choosing the tokens to recompute (within prefill_s)
    mixed_steps: int = 0  # forwards of mixed steps: prefill pieces, with the decode rows if any

    # -- the read-only mapping view ------------------------------------------------------
    def __getitem__(self, name: str):
        if name not in _FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def snapshot(self) -> EngineMetrics:
        """A copy of the counters now."""
        return EngineMetrics(**{name: getattr(self, name) for name in _FIELDS})

    def restore(self, saved: EngineMetrics) -> None:
        """Set every counter back to ``saved``'s (``snapshot``)."""
        for name in _FIELDS:
            setattr(self, name, getattr(saved, name))


_FIELDS = tuple(f.name for f in dataclasses.fields(EngineMetrics))

__all__ = ["EngineMetrics"]
