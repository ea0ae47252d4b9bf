"""Where each reuse mode decides a request's pages.

``KVPlanner.plan`` reserves everything a request needs before it is admitted: cached
entries it reads (pinned), entries it must compute (reserved, filled by this round's
prefill), private pages for its own tokens, and room for its decode. One policy object per
reuse mode holds that mode's behaviour:

* ``LazyPolicy``: chunk pages are referenced where they lie, with a rotation delta that the
  attention kernel applies (zero copy).
* ``BlockPolicy``: the same lookup, then a private re-rotated copy of every shifted chunk
  page (the Block-Attention baseline).
* ``PrefixPolicy``: full attention; reuses hash-chained full pages of an identical token
  prefix (as vLLM), and hands the prompt's full pages to the store after the prefill.
* ``NonePolicy``: full attention, nothing reused.

A policy writes no planner state: its ``plan`` returns a ``Reservation`` (what it found
cached and what the request must compute), and the planner applies it. Work for entries that
several requests of one admission round need is gathered once per key (``pending_prefixes``
then ``pending_chunks``: a chunk encoded after the prefix needs the prefix's KV first) and run
by the engine's prefill.

A request's pages and page table live in its ``Allocation`` (``page_table.py``), the one object that edits
table entries: the policies build the table, the scheduler asks it for a new page
(``append_page``) and for the slot of the next decoded token (``advance``), recovery asks
it for private copies (``privatize``), and the decode state's device mirror only copies it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ...cache.disk_tier import DiskTier
from ...cache.store import ChunkStore, Entry, segment_keys
from ...intmath import cdiv
from ...reuse_modes import MODES, ReuseMode
from ..metrics import EngineMetrics
from ..request import ChunkSpan, Job, PrefillPlan, Request, TableEntry, entry_table
from .page_table import Allocation


@dataclass
class PendingEntry:
    """A cache entry being computed in this round and the prefill job that computes it."""

    entry: Entry
    job: Job


@dataclass
class Reservation:
    """What a policy's ``plan`` found and reserved for one request, for the planner to apply.

    ok : whether everything the request needs was reserved (else the planner undoes it).
    lookups : ``(hit, tokens)`` of each cache lookup, counted once the request is admitted.
    prefixes, chunks : entries this request created and must compute, by key.
    disk_hits : entries found in the disk tier (loaded, counted whether or not ``ok``).
    """

    ok: bool = True
    lookups: list[tuple[bool, int]] = field(default_factory=list)
    prefixes: dict[bytes, PendingEntry] = field(default_factory=dict)
    chunks: dict[bytes, PendingEntry] = field(default_factory=dict)
    disk_hits: int = 0

    def failed(self) -> Reservation:
        """This reservation, marked as not enough (the pool could not hold the request)."""
        self.ok = False
        return self


class KVPlanner:
    """Reserves pages for requests under one reuse policy (engine thread only). ``reuse`` and
    ``chunk_context`` come validated (``lazyllm.config.EngineConfig``)."""

    def __init__(self, store: ChunkStore, reuse: str, chunk_context: str, fingerprint: str,
                 disk: DiskTier | None = None, metrics: EngineMetrics | None = None):
        self.store, self.pool = store, store.pool
        self.page_size = self.pool.page_size
        self.policy: ReusePolicy = _POLICIES[reuse]()
        self.chunk_context = chunk_context
        self.fingerprint = fingerprint
        self.disk = disk
        self.metrics = metrics if metrics is not None else EngineMetrics()
        # prefill work gathered while admitting one round: key -> pending entry
        self.pending_prefixes: dict[bytes, PendingEntry] = {}
        self.pending_chunks: dict[bytes, PendingEntry] = {}

    # -- planning ---------------------------------------------------------------------
    def plan(self, r: Request) -> bool:
        """Reserve everything request ``r`` needs; on failure undo and return False."""
        decode_pages = cdiv(r.params.max_new_tokens + 1, self.page_size)
        self.allocation(r)
        r.plan = PrefillPlan()
        found = self.policy.plan(self, r, decode_pages)
        if found.disk_hits:
            self.metrics.disk_hits += found.disk_hits
        if not found.ok:
            self.unplan(r)
            return False
        self.pending_prefixes.update(found.prefixes)
        self.pending_chunks.update(found.chunks)
        # a request waiting for pages is planned again every step: its lookups count
        # once, when it is admitted, or cache_stats' hit rate would count the waiting
        for hit, n in found.lookups:
            self.store.record(hit, n)
        return True

    def unplan(self, r: Request) -> None:
        """Give back what planning reserved and forget what it counted, so the request can
        be planned again from scratch (the caller detaches it from decoding first)."""
        self.release(r)
        r.plan = None

    def release(self, r: Request) -> None:
        """Unpin what ``r`` reads, drop reservations nobody else waits for, free its pages."""
        if r.alloc is None:
            return
        for e in r.alloc.release():
            self.pending_prefixes.pop(e.key, None)
            self.pending_chunks.pop(e.key, None)

    def prefill_cost(self, r: Request) -> int:
        """Tokens admitting ``r`` would prefill now (cached segments cost nothing)."""
        return self.policy.prefill_cost(self, r)

    def take_pending(self) -> list[list[PendingEntry]]:
        """The round's entry prefills in dependency order (prefixes, then chunks)."""
        rounds = [list(self.pending_prefixes.values()), list(self.pending_chunks.values())]
        self.pending_prefixes.clear()
        self.pending_chunks.clear()
        return rounds

    def after_prefill(self, r: Request) -> None:
        """Called once the request's own prefill has written its KV."""
        self.policy.after_prefill(self, r)

    @property
    def caches_chunks(self) -> bool:
        return self.policy.caches_chunks

    @property
    def exact_at_home(self) -> bool:
        """A chunk read where it was encoded needs no recompute (``ReuseMode.exact_at_home``)."""
        return self.policy.mode.exact_at_home(self.chunk_context)

    # -- shared steps of the policies ----------------------------------------------------
    def allocation(self, r: Request) -> Allocation:
        """The request's allocation, made on first use (it lives as long as the request)."""
        if r.alloc is None:
            r.alloc = Allocation(self.store)
        return r.alloc

    def own_table(self, pages: list[int], pos: int, n: int) -> list[TableEntry]:
        return entry_table(pages, n, pos, 0, self.page_size)

    def has_decode_room(self, decode_pages: int) -> bool:
        return self.pool.num_free + self.store.evictable_pages() >= decode_pages

    def segment_keys(self, r: Request) -> tuple[bytes, list[bytes]]:
        """Cache keys of the request's prefix and chunks (computed once per request)."""
        if self.allocation(r).keys is None:
            segs = r.prefill_segments
            r.alloc.keys = segment_keys(self.fingerprint, self.chunk_context, segs[0].ids,
                                        [c.ids for c in segs[1:-1]], [s.memo for s in segs[:-1]])
        return r.alloc.keys

    def lookup_or_create(self, r: Request, key: bytes, n: int, stored_pos: int, kind: str, found: Reservation):
        """Pinned entry for ``key`` and whether ``r`` must compute it; ``(None, False)`` when
        the pool cannot hold it. The lookup is noted in ``found``, not in the planner."""
        e = self.store.acquire(key, pending_ok=True)
        if e is not None:
            r.alloc.hold(e)
            found.lookups.append((True, n))
            return e, False  # ready, or computed once in this round for whoever created it
        e = self.store.create(key, n, stored_pos, kind)
        if e is None:
            return None, False
        r.alloc.hold(e)
        if self.disk is not None and self.disk.load(e):
            self.store.mark_ready(e)
            found.lookups.append((True, n))
            found.disk_hits += 1
            return e, False
        r.plan.computed_tokens += n
        found.lookups.append((False, n))
        return e, True


class ReusePolicy:
    """How one reuse mode plans a request's KV; what the mode is (``mode``,
    ``lazyllm.reuse_modes``) answers every other question about it."""

    mode: ReuseMode

    @property
    def name(self) -> str:
        return self.mode.name

    @property
    def caches_chunks(self) -> bool:
        return self.mode.caches_chunks

    def prefill_cost(self, planner: KVPlanner, r: Request) -> int:
        return r.num_prompt_tokens

    def plan(self, planner: KVPlanner, r: Request, decode_pages: int) -> Reservation:
        """Reserve what ``r`` needs (in ``r.alloc`` and ``r.plan``) and return what was found
        and reserved; the planner applies it (policies write no planner state)."""
        raise NotImplementedError

    def after_prefill(self, planner: KVPlanner, r: Request) -> None:
        pass


class LazyPolicy(ReusePolicy):
    """Chunk pages referenced in place, positions applied in the kernel (zero copy)."""

    mode = MODES["lazy"]

    def prefill_cost(self, planner: KVPlanner, r: Request) -> int:
        pkey, ck = planner.segment_keys(r)
        segs = r.prefill_segments
        cost = len(segs[-1].ids)
        for key, seg in zip([pkey] + ck, segs[:-1]):
            if key not in planner.store:
                cost += len(seg.ids)
        return cost

    def plan(self, planner: KVPlanner, r: Request, decode_pages: int) -> Reservation:
        ps = planner.page_size
        segs = r.prefill_segments
        prefix, chunks, suffix = segs[0], segs[1:-1], segs[-1]
        P = len(prefix.ids)
        table: list[TableEntry] = []
        found = Reservation()
        # the shared prefix (system prompt and template header), positions 0..P-1
        pkey, chunk_keys = planner.segment_keys(r)
        pe, need = planner.lookup_or_create(r, pkey, P, 0, "prefix", found)
        if pe is None:
            return found.failed()
        if need:
            found.prefixes[pkey] = PendingEntry(pe, Job(prefix.ids, 0, pe.pages, []))
        else:
            r.plan.cached_tokens += P
        prefix_entries = entry_table(pe.pages, pe.num_tokens, 0, 0, ps)
        table += prefix_entries
        # chunks, each encoded alone (isolated) or after the prefix
        pos = P
        spans = []
        after_prefix = planner.chunk_context == "prefix"
        for c, key in zip(chunks, chunk_keys):
            n = len(c.ids)
            stored = P if after_prefix else 0
            ce, need = planner.lookup_or_create(r, key, n, stored, "chunk", found)
            if ce is None:
                return found.failed()
            if need:
                ctx = prefix_entries if after_prefix else []
                found.chunks[key] = PendingEntry(ce, Job(c.ids, stored, ce.pages, ctx))
            else:
                r.plan.cached_tokens += n
                r.plan.cached_chunk_tokens += n
            entries = entry_table(ce.pages, ce.num_tokens, pos, pos - stored, ps)
            spans.append(ChunkSpan(pos, c.ids, len(table), need, entries))
            table += entries
            pos += n
        if r.warm_only:
            return found
        # the suffix in private pages
        S = len(suffix.ids)
        own = r.alloc.take_private(cdiv(S, ps))
        if own is None:
            return found.failed()
        plan = r.plan
        plan.spans, plan.own, plan.suffix_ids, plan.suffix_pos = spans, own, list(suffix.ids), pos
        r.alloc.set_table(table)
        if not self.place(r, plan) or not planner.has_decode_room(decode_pages):
            return found.failed()
        table = list(r.alloc.table)
        plan.ctx_range = (spans[0].start, pos) if spans else None
        plan.job = Job(suffix.ids, pos, own, list(table), logit_rows=r.logit_rows, ctx=plan.ctx_range)
        plan.context = table
        plan.computed_tokens += S
        r.alloc.extend_table(planner.own_table(own, pos, S))
        plan.next_pos = pos + S
        return found

    def place(self, r: Request, plan: PrefillPlan) -> bool:
        """Make the cached part of the request's table (``r.alloc``) what its attention
        reads; False when the pool cannot hold it."""
        return True


class BlockPolicy(LazyPolicy):
    """The Block-Attention baseline: a private re-rotated copy of every shifted chunk page."""

    mode = MODES["block"]

    def place(self, r: Request, plan: PrefillPlan) -> bool:
        copies = r.alloc.privatize([c for c, e in enumerate(r.alloc.table) if e.delta != 0])
        if copies is None:
            return False
        plan.copies += copies
        return True


class FullPromptPolicy(ReusePolicy):
    """Full attention: the request computes its whole prompt, less what ``reuse_prefix``
    finds cached (the base of ``NonePolicy`` and ``PrefixPolicy``)."""

    def reuse_prefix(self, planner: KVPlanner, r: Request, ids: list[int], found: Reservation):
        """``(table of reused pages, tokens reused, chain keys)``; lookups noted in ``found``."""
        raise NotImplementedError

    def plan(self, planner: KVPlanner, r: Request, decode_pages: int) -> Reservation:
        ids = r.prompt_ids
        N = len(ids)
        found = Reservation()
        table, m, keys = self.reuse_prefix(planner, r, ids, found)
        rest = ids[m:]
        own = r.alloc.take_private(cdiv(len(rest), planner.page_size))
        if own is None or not planner.has_decode_room(decode_pages):
            return found.failed()
        r.plan.job = Job(rest, m, own, list(table), logit_rows=r.logit_rows)
        r.plan.chain = (keys, m // planner.page_size)
        r.plan.computed_tokens = len(rest)
        r.alloc.set_table(table + planner.own_table(own, m, len(rest)))
        r.plan.next_pos = N
        return found


class NonePolicy(FullPromptPolicy):
    """Full attention over the whole prompt, nothing reused."""

    mode = MODES["none"]

    def reuse_prefix(self, planner: KVPlanner, r: Request, ids: list[int], found: Reservation):
        return [], 0, []


class PrefixPolicy(FullPromptPolicy):
    """Full attention reusing the full pages of an identical token prefix (as vLLM)."""

    mode = MODES["prefix"]

    def reuse_prefix(self, planner: KVPlanner, r: Request, ids: list[int], found: Reservation):
        ps = planner.page_size
        N = len(ids)
        keys = []
        prev = planner.fingerprint.encode()
        for j in range(N // ps):
            h = hashlib.blake2b(prev + str(ids[j * ps:(j + 1) * ps]).encode(), digest_size=20).digest()
            keys.append(h)
            prev = h
        table: list[TableEntry] = []
        m = 0
        # the last ``logit_rows`` tokens are computed whatever is cached: their logits are the
        # result (one to sample from; a whole continuation when scoring)
        while m < len(keys) and m < (N - r.logit_rows) // ps:
            e = planner.store.acquire(keys[m])
            if e is None:
                break
            r.alloc.hold(e)
            table.append(TableEntry(e.pages[0], m * ps, 0, ps))
            m += 1
        if m:
            found.lookups.append((True, m * ps))
        found.lookups.append((False, N - m * ps))
        r.plan.cached_tokens = m * ps
        return table, m * ps, keys

    def after_prefill(self, planner: KVPlanner, r: Request) -> None:
        """Hand the request's full prompt pages to the store, for later identical prefixes."""
        keys, m = r.plan.chain
        ps = planner.page_size
        table = r.alloc.table
        for j in range(m, len(keys)):
            if keys[j] in planner.store or not r.alloc.owns(table[j].page):
                continue
            r.alloc.publish(j, keys[j], j * ps)


_POLICIES = {p.mode.name: p for p in (LazyPolicy, BlockPolicy, PrefixPolicy, NonePolicy)}
