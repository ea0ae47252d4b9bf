"""Where admission happens: which waiting requests run next, and what they hold.

Each step the scheduler admits waiting requests in arrival order while the step's prefill
token budget and the batch size allow, planning each one's pages through the ``KVPlanner``
(a request the pool cannot hold yet waits; one it can never hold fails). While requests
decode it gives each a new page when its last one fills up and claims the slot of its next
token (both through the request's ``Allocation``), preempting the most recently
started requests when the pool is exhausted (they are queued again and recomputed later,
their generated tokens prefilled as part of their suffix). Adaptive recompute's escalations,
of a first answer token or a later one, go through it too (``escalate``).
"""
from __future__ import annotations

import time

from ...errors import CacheCapacityError, LazyLLMError
from ..kv.planner import KVPlanner
from ..metrics import EngineMetrics
from ..request import Request, Segment
from ..running.decode_state import DecodeState
from ..step import Admission, DecodeBatch


class Scheduler:
    """Waiting and running requests and the pages they hold (engine thread only)."""

    def __init__(self, planner: KVPlanner, decode_state: DecodeState, *, max_batch_tokens: int,
                 max_batch_size: int, metrics: EngineMetrics):
        self.planner, self.pool = planner, planner.pool
        self.decode_state = decode_state
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.metrics = metrics
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def admit(self) -> Admission:
        """Admit what fits this step: ``Admission(admitted, failed)``; failed requests are
        out of the queue and their errors are for the caller."""
        admitted: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        budget = self.max_batch_tokens
        for r in list(self.waiting):
            cost = self.planner.prefill_cost(r)
            if admitted and cost > budget:
                break
            if len(self.running) >= self.max_batch_size:
                break
            if r.state.solo and admitted:
                break
            try:
                ok = self.planner.plan(r)
            except LazyLLMError as e:
                self.waiting.remove(r)
                failed.append((r, e))
                continue
            if not ok:
                if not self.running and not admitted:
                    self.waiting.remove(r)
                    failed.append((r, CacheCapacityError(
                        f"the KV pool ({self.pool.num_pages} pages of {self.pool.page_size} tokens) "
                        f"cannot hold this request ({r.num_prompt_tokens} prompt tokens + "
                        f"{r.params.max_new_tokens} new); raise kv_cache_bytes")))
                    continue
                break  # wait for running requests to free pages
            self.waiting.remove(r)
            self.running.append(r)
            admitted.append(r)
            budget -= cost
            r.state.admit_time = time.perf_counter()  # a solo request too: its queue_s counts from here
            if r.state.solo:
                break
        return Admission(admitted, failed)

    def retire(self, r: Request) -> None:
        """``r`` is over: it leaves the queues and gives back everything it holds."""
        self.decode_state.detach(r)
        self.planner.release(r)
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)

    def requeue(self, r: Request, *, solo: bool = False) -> None:
        """Back to the front of the queue, holding nothing. ``solo``: its next prefill runs
        alone (a batched prefill with it failed; a bad request then fails only itself)."""
        self.decode_state.detach(r)
        self.planner.unplan(r)
        if r in self.running:
            self.running.remove(r)
        self.waiting.insert(0, r)
        if solo:
            r.state.solo = True
            self.metrics.prefill_retries += 1

    def preempt(self, r: Request) -> None:
        """Give back everything ``r`` holds, for room, and queue it again; when readmitted,
        its generated tokens are prefilled as part of its suffix (same semantics: they
        attend to everything before them), and decoding continues where it stopped."""
        self._resume_later(r)
        self.metrics.preemptions += 1

    def escalate(self, r: Request) -> None:
        """Adaptive recompute (``escalate_below``): the reuse pass left ``r``'s latest token
        undecided, so the token is dropped and ``r`` gives back everything it holds and is
        queued to be prefilled again with every chunk token recomputed (``state.escalated``):
        full attention's answer. Its first answer token (not decoding yet): queued as it
        came; a later one (``escalate_tokens``): as a preempted request, its tokens so far
        joining its suffix, and it decodes on as full attention. No longer watched."""
        if r.state.row is not None:
            self._resume_later(r)
        else:
            self.requeue(r)
        r.state.escalated, r.state.watched = True, False
        self.metrics.escalations += 1

    def _resume_later(self, r: Request) -> None:
        self.requeue(r)
        base = r.segments
        r.state.resumed = base[:-1] + [Segment("suffix", base[-1].ids + r.state.generated)]
        r.state.preempted = True

    def decode_batch(self, pending: dict[int, int], dead: set[int]) -> DecodeBatch:
        """The next decode step: every decoding request's room for its next token claimed
        (``grow_decode_pages``), then the rows that step runs. ``pending``/``dead`` as in
        ``DecodeBatch``."""
        self.grow_decode_pages(pending, dead)
        return DecodeBatch.of(self.decode_state.rows, pending, dead)

    def grow_decode_pages(self, pending: dict[int, int], dead: set[int]) -> None:
        """Give every decoding request room for its next token and claim that token's slot
        (``Allocation.advance``): a new page when its last one is full (or shared),
        preempting the most recently started requests when the pool is exhausted.
        ``pending``/``dead`` as in ``DecodeBatch``: a dead row gets nothing."""
        rows = self.decode_state.rows
        for r in list(rows):
            state = r.state
            if state.row is None or r.id in dead:
                continue
            alloc = r.alloc
            while not alloc.advance():
                # a new page, starting at the token being decoded now (one later when the
                # latest token is still in the unread step in flight); the loop claims its slot
                if alloc.append_page(state.next_pos + (r.id in pending)):
                    continue
                victim = rows[-1]
                self.preempt(victim)
                if victim is r:
                    break
