"""The engine: one worker thread that owns the model and the KV pool.

Callers on any thread (or event loop) submit requests and read events from a per-request
queue. Each loop of the worker:

1. admits waiting requests: looks their segments up in the chunk store, pins hits,
   reserves entries for misses and private pages for the rest;
2. prefills, batched across the admitted requests: stage 1 shared prefixes, stage 2
   missing chunks (each distinct chunk once), stage 3 suffixes (or the whole prompt in the
   full-attention modes), and samples each request's first token;
3. decodes one token for every running request, together;
4. retires finished or cancelled requests, unpinning their entries and freeing their
   private pages.

Reuse modes change only step 1/2 bookkeeping, never the semantics:
``lazy`` references chunk pages with a rotation delta (zero copy); ``block`` copies them
into private pages re-rotated; ``prefix`` reuses hash-chained full pages of an identical
token prefix under full attention; ``none`` computes everything.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache.store import ChunkStore, Entry, chunk_key
from ..errors import CacheCapacityError, ContextLengthError, LazyLLMError, RequestCancelled
from ..model.llama import AttentionMetadata
from lazyllm.kernels.reference import rotate_by_delta
from ..types import GenerationOutput, SamplingParams, ScoreOutput, Usage
from .decode import DecodeState, GraphRunner, PinnedTurns, PrefillGraphs
from .prompt import Segment
from .sampler import Detokenizer, sample_token

log = logging.getLogger("lazyllm")

REUSE_MODES = ("lazy", "block", "prefix", "none")
CHUNK_CONTEXTS = ("isolated", "prefix")


@dataclass
class _TableEntry:
    page: int
    pos: int  # position of slot 0 in the request's frame
    delta: int  # rotation added to stored keys
    length: int  # valid slots


@dataclass
class _Job:
    """One sequence of new tokens in a prefill forward."""

    ids: list[int]
    start_pos: int
    own_pages: list[int]
    context: list[_TableEntry]  # cached pages it attends to besides its own
    logit_rows: int = 0  # how many of its last tokens need logits (1 to sample, more to score)
    # explicit per-token positions and KV slots (tokens scattered over pages, as in
    # recomputation); then ``context`` lists every page attended to, its own included
    positions: list[int] | None = None
    slots: list[int] | None = None


@dataclass
class _Step:
    """A launched decode step: its requests in row order, logits, argmax on its way to the
    host (``(buffer, event)``), and when it was staged."""

    reqs: list
    logits: torch.Tensor
    picks: tuple
    t_launch: float
    overlapped: bool = False  # launched while the step before it was still unread


class _Call:
    def __init__(self, fn):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None

    def run(self):
        try:
            self.result = self.fn()
        except Exception as e:  # handed back to the caller
            self.error = e
        self.done.set()

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@dataclass
class Request:
    segments: list[Segment]
    params: SamplingParams
    events: "queue.Queue"
    submit_time: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None
    # filled by the engine
    table: list[_TableEntry] = field(default_factory=list)
    private_pages: list[int] = field(default_factory=list)
    pinned: list[Entry] = field(default_factory=list)
    cached_tokens: int = 0
    cached_chunk_tokens: int = 0
    computed_tokens: int = 0  # tokens this request ran through the model in prefill
    lookups: list = field(default_factory=list)  # (hit, tokens) of the plan being made
    recomputed_tokens: int = 0  # chunk tokens recomputed with full context
    next_pos: int = 0
    generated: list[int] = field(default_factory=list)
    detok: Detokenizer | None = None
    gen: torch.Generator | None = None
    admit_time: float = 0.0
    first_token_time: float = 0.0
    finish_reason: str | None = None
    warm_only: bool = False  # compute prefix and chunk KV, generate nothing
    row: int | None = None  # row in the decode state while decoding
    keys: tuple | None = None  # (prefix key, chunk keys), see Engine._segment_keys
    logit_rows: int = 1  # >1: a scoring request (teacher forcing), finished after prefill
    return_logits: bool = False
    score_only: bool = False
    score_ids: list | None = None
    orig_segments: list | None = None  # the segments as submitted, if preemption changed them
    preempted: bool = False
    solo: bool = False  # prefill alone (a batched prefill with it failed)
    streaming: bool = True  # emit text deltas as tokens come (False: decode the text once at the end)

    @property
    def prompt_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]


class Engine:
    def __init__(self, model, tokenizer, store: ChunkStore, *, reuse: str, chunk_context: str,
                 fingerprint: str, eos_ids: set[int], max_batch_tokens: int = 8192,
                 max_batch_size: int = 256, cuda_graphs: bool = True, rerotate=None,
                 recompute_first_tokens: int = 0, recompute_ratio: float = 0.0, probe_layer: int = 1,
                 recompute_selection: str = "deviation", disk=None, async_decode: bool | None = None):
        self.model = model
        self.tok = tokenizer
        self.store = store
        self.pool = store.pool
        self.reuse = reuse
        self.chunk_context = chunk_context
        self.fingerprint = fingerprint
        self.eos_ids = eos_ids
        self.max_batch_tokens = max_batch_tokens
        self.rerotate = rerotate
        self.device = model.device
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stop = False
        # prefill work gathered while admitting one round: key -> (entry, job)
        self._round1: dict[bytes, tuple[Entry, _Job]] = {}
        self._round2: dict[bytes, tuple[Entry, _Job]] = {}
        self.max_batch_size = max_batch_size
        self.recompute_first_tokens = recompute_first_tokens
        self.disk = disk  # optional DiskKVStore: chunk KV that survives restarts
        if disk is not None:
            self._disk_queue: queue.Queue = queue.Queue()
            threading.Thread(target=self._disk_writer, name="lazyllm-disk", daemon=True).start()
        self.recompute_ratio = recompute_ratio
        self.recompute_selection = recompute_selection
        self.probe_layer = min(probe_layer, model.spec.num_layers - 1)
        max_entries = -(-model.spec.max_context // self.pool.page_size) + 2
        self.decode_state = DecodeState(max_batch_size, max_entries, self.device)
        # no CUDA graphs where a layer's attention reads the batch layout on the host (the
        # torch reference: the torch backend, Gemma 3's sliding-window layers)
        graphs = cuda_graphs and getattr(model, "graph_capturable", True)
        self.graphs = GraphRunner(model, self.decode_state, self.pool.k, self.pool.v, enabled=graphs)
        self.prefill_graphs = PrefillGraphs(model, self.pool.k, self.pool.v, max_entries, self.device,
                                            self.pool.scratch_page * self.pool.page_size, enabled=graphs)
        self.metrics = {"requests": 0, "failed": 0, "cancelled": 0, "preemptions": 0, "prefill_retries": 0, "recovery_skipped": 0, "disk_hits": 0, "prefill_tokens": 0,
                        "decode_steps": 0, "decode_tokens": 0, "peak_pages": 0,
                        "copied_pages": 0, "overlapped_steps": 0}  # pages copied re-rotated (block copies, recovery)
        # (batch, seconds) of the most recent decode steps, the host's wall time from the step's
        # inputs to its sampled tokens: the time per output token at each batch size, free of
        # the prefills that interleave with decoding while requests arrive
        self.decode_step_log: collections.deque = collections.deque(maxlen=4096)
        # Overlapped decode (see _decode): on by default where decode runs from CUDA graphs
        # (there the host's per-step work is what it hides); elsewhere a step is synchronous
        # anyway. Token for token the same as one step at a time (tests/test_async_decode.py).
        self.async_decode = self.graphs.enabled if async_decode is None else bool(async_decode)
        self._inflight: _Step | None = None
        self._last_read: tuple[float, int] | None = None
        self._picks = PinnedTurns(max_batch_size, self.device)  # each step's argmax, on its way to the host

    # -- public, any thread ----------------------------------------------------------
    def submit(self, req: Request) -> Request:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="lazyllm-engine", daemon=True)
                self._thread.start()
        self.inbox.put(req)
        return req

    def call(self, fn):
        """Run ``fn()`` on the engine thread between steps and return its result."""
        c = _Call(fn)
        self.submit(c)  # type: ignore[arg-type]
        return c.wait()

    def graph_stats(self) -> dict:
        """CUDA graphs captured so far (decode and short prefills) and the host seconds spent
        capturing them: a request that meets a new batch or width bucket waits for one."""
        d, p = self.graphs, self.prefill_graphs
        return {"decode_graphs": len(d.graphs), "prefill_graphs": len(p.graphs),
                "capture_s": d.capture_s + p.capture_s}

    def clear_cache(self) -> int:
        """Evict every unpinned cached entry; returns how many were evicted."""
        def clear():
            keys = [k for k, e in self.store.entries.items() if e.pins == 0]
            for k in keys:
                self.store._evict(k)
            return len(keys)
        return self.call(clear)

    def close(self) -> None:
        self.flush_disk()
        self._stop = True
        self.inbox.put(None)  # type: ignore[arg-type]
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- worker ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            idle = not self.running and not self.waiting
            try:
                item = self.inbox.get() if idle else self.inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if isinstance(item, _Call):
                    item.run()
                else:
                    self.waiting.append(item)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self._stop:
                break
            try:
                self._step()
            except Exception as e:  # never let one bad step kill the engine
                log.exception("engine step failed")
                for r in list(self.running):
                    self._finish(r, error=e)
        for r in self.running + self.waiting:
            self._finish(r, error=LazyLLMError("engine closed"))

    def _step(self) -> None:
        self._drop_cancelled()
        admitted = self._admit()
        used = self.pool.num_pages - self.pool.num_free
        if used > self.metrics["peak_pages"]:
            self.metrics["peak_pages"] = used
        if admitted:
            try:
                self._prefill(admitted)
            except Exception as e:
                log.exception("prefill failed")
                if self.device.type == "cuda" and isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                for r in admitted:
                    if r.row is not None or r.finish_reason is not None or r not in self.running:
                        continue  # already prefilled and decoding, or finished
                    if len(admitted) > 1:
                        self._requeue_solo(r)  # retry alone: a bad request fails only itself
                    else:
                        self._finish(r, error=e)
        decoding = list(self.decode_state.rows)
        if decoding:
            try:
                self._decode()
            except Exception as e:
                log.exception("decode failed")
                for r in decoding:
                    self._finish(r, error=e)
        used = self.pool.num_pages - self.pool.num_free
        if used > self.metrics["peak_pages"]:
            self.metrics["peak_pages"] = used

    def _drop_cancelled(self) -> None:
        now = time.perf_counter()
        for r in list(self.waiting) + list(self.running):
            if r.deadline is not None and now > r.deadline and not r.cancelled.is_set():
                r.cancelled.set()
                r.finish_reason = "timeout"
            if r.cancelled.is_set():
                self._finish(r, error=RequestCancelled("timed out" if r.finish_reason == "timeout" else "cancelled"))

    # -- admission ----------------------------------------------------------------
    def _pages_for(self, n: int) -> int:
        return -(-n // self.pool.page_size)

    def _admit(self) -> list[Request]:
        admitted = []
        budget = self.max_batch_tokens
        for r in list(self.waiting):
            n_prompt = sum(len(s.ids) for s in r.segments)
            cost = self._prefill_cost(r)
            if admitted and cost > budget:
                break
            if len(self.running) >= self.max_batch_size:
                break
            if r.solo and admitted:
                break
            try:
                ok = self._plan(r)
            except LazyLLMError as e:
                self.waiting.remove(r)
                self._finish(r, error=e)
                continue
            if not ok:
                if not self.running and not admitted:
                    self.waiting.remove(r)
                    self._finish(r, error=CacheCapacityError(
                        f"the KV pool ({self.pool.num_pages} pages of {self.pool.page_size} tokens) "
                        f"cannot hold this request ({n_prompt} prompt tokens + {r.params.max_new_tokens} new); "
                        "raise kv_cache_bytes"))
                    continue
                break  # wait for running requests to free pages
            self.waiting.remove(r)
            self.running.append(r)
            admitted.append(r)
            budget -= cost
            if r.solo:
                break
            r.admit_time = time.perf_counter()
        return admitted

    def _release(self, r: Request) -> None:
        for e in r.pinned:
            if e.ready:
                self.store.unpin(e)
            else:
                e.pins -= 1
                if e.pins <= 0:  # nobody else waits for it: drop the reservation
                    self.store.discard(e)
                    self._round1.pop(e.key, None)
                    self._round2.pop(e.key, None)
        r.pinned = []
        self.pool.free(r.private_pages)
        r.private_pages = []

    def _alloc_private(self, r: Request, n_pages: int) -> list[int] | None:
        pages = self.store.alloc_pages(n_pages)
        if pages is not None:
            r.private_pages.extend(pages)
        return pages

    def _plan(self, r: Request) -> bool:
        """Reserve everything request ``r`` needs; on failure undo and return False."""
        total_new = self._pages_for(r.params.max_new_tokens + 1)
        r.lookups = []
        ok = (self._plan_chunked if self.reuse in ("lazy", "block") else self._plan_full)(r, total_new)
        if not ok:
            self._unplan(r)
        else:
            # a request waiting for pages is planned again every step: its lookups count
            # once, when it is admitted, or cache_stats' hit rate would count the waiting
            for hit, n in r.lookups:
                self.store.record(hit, n)
        r.lookups = []
        return ok

    def _unplan(self, r: Request) -> None:
        """Give back what planning reserved and forget what it counted, so the request
        can be planned again from scratch."""
        self.decode_state.detach(r)
        self._release(r)
        r.table, r._jobs, r._copies, r._recovery = [], None, None, None  # type: ignore[attr-defined]
        r.cached_tokens = r.cached_chunk_tokens = r.computed_tokens = r.recomputed_tokens = 0

    def _requeue(self, r: Request) -> None:
        """Back to the front of the queue, holding nothing."""
        self._unplan(r)
        if r in self.running:
            self.running.remove(r)
        self.waiting.insert(0, r)

    def _lookup_or_create(self, r: Request, key: bytes, n: int, stored_pos: int, kind: str):
        """Pinned entry for ``key`` and whether it still needs computing."""
        e = self.store.entries.get(key)
        if e is not None:
            self.store.pin(e)
            self.store.entries.move_to_end(key)
            r.pinned.append(e)
            r.lookups.append((True, n))
            e.hits += 1
            return e, False  # ready, or computed once in this round for whoever created it
        e = self.store.create(key, n, stored_pos, kind)
        if e is None:
            return None, False
        r.pinned.append(e)
        if self.disk is not None and self._load_from_disk(e):
            r.lookups.append((True, n))
            self.metrics["disk_hits"] += 1
            return e, False
        r.computed_tokens += n
        r.lookups.append((False, n))
        return e, True

    # -- persistent tier --------------------------------------------------------------
    def _load_from_disk(self, e: Entry) -> bool:
        """Fill a fresh entry's pages from the disk tier; False if it has no valid file."""
        got = self.disk.get(e.key)
        if got is None:
            return False
        k, v, n, stored = got
        if n != e.num_tokens or stored != e.stored_pos or k.dtype != self.pool.k.dtype:
            return False
        L, _, ps, h, d = self.pool.k.shape
        idx = torch.tensor(e.pages, device=self.device)
        for cache, t in ((self.pool.k, k), (self.pool.v, v)):
            buf = torch.zeros((L, len(e.pages) * ps, h, d), dtype=cache.dtype)
            buf[:, :n] = t
            cache[:, idx] = buf.view(L, len(e.pages), ps, h, d).to(self.device)
        e.ready = True
        return True

    def _save_to_disk(self, entries: list[Entry]) -> None:
        """Queue freshly computed segments for the disk tier's writer thread (the copy to
        host happens here; the file write, fsync included, off the engine thread)."""
        for e in entries:
            if e.kind not in ("chunk", "prefix") or e.key in self.disk:
                continue
            idx = torch.tensor(e.pages, device=self.device)
            L, _, ps, h, d = self.pool.k.shape
            k = self.pool.k[:, idx].reshape(L, -1, h, d)[:, : e.num_tokens].to("cpu", copy=True)
            v = self.pool.v[:, idx].reshape(L, -1, h, d)[:, : e.num_tokens].to("cpu", copy=True)
            self._disk_queue.put((e.key, k, v, e.num_tokens, e.stored_pos))

    def _disk_writer(self) -> None:
        while True:
            item = self._disk_queue.get()
            try:
                if item is None:
                    return
                key, k, v, n, stored = item
                self.disk.put(key, k, v, num_tokens=n, stored_pos=stored)
            except Exception:  # a failed write only loses a cache file
                log.exception("disk tier write failed")
            finally:
                self._disk_queue.task_done()

    def flush_disk(self) -> None:
        """Wait until every queued disk write has finished."""
        if self.disk is not None:
            self._disk_queue.join()

    def _segment_keys(self, r: Request) -> tuple[bytes, list[bytes]]:
        """Cache keys of the request's prefix and chunks (computed once per request)."""
        if r.keys is None or r.keys[0] is None:
            prefix = r.segments[0]
            pkey = chunk_key(self.fingerprint, f"prefix-segment:{self.chunk_context}", prefix.ids)
            if self.chunk_context == "prefix":
                ck = [chunk_key(self.fingerprint, "prefix", c.ids, pkey) for c in r.segments[1:-1]]
            else:
                ck = [chunk_key(self.fingerprint, "isolated", c.ids) for c in r.segments[1:-1]]
            r.keys = (pkey, ck)
        return r.keys

    def _prefill_cost(self, r: Request) -> int:
        """Tokens admitting ``r`` would prefill now (cached segments cost nothing)."""
        if self.reuse not in ("lazy", "block"):
            return sum(len(s.ids) for s in r.segments)
        pkey, ck = self._segment_keys(r)
        segs = r.segments
        cost = len(segs[-1].ids)
        for key, seg in zip([pkey] + ck, segs[:-1]):
            if key not in self.store.entries:
                cost += len(seg.ids)
        return cost

    def _plan_chunked(self, r: Request, decode_pages: int) -> bool:
        segs = r.segments
        prefix, chunks, suffix = segs[0], segs[1:-1], segs[-1]
        P = len(prefix.ids)
        table: list[_TableEntry] = []
        # stage 1: the shared prefix (system prompt and template header), positions 0..P-1
        pkey, chunk_keys = self._segment_keys(r)
        pe, need = self._lookup_or_create(r, pkey, P, 0, "prefix")
        if pe is None:
            return False
        if need:
            self._round1[pkey] = (pe, _Job(prefix.ids, 0, pe.pages, []))
        else:
            r.cached_tokens += P
        prefix_entries = self._entry_table(pe, pos=0, delta=0)
        table += prefix_entries
        # stage 2: chunks, each encoded alone (isolated) or after the prefix
        pos = P
        spans = []  # (logical start, ids, first table index, computed now) per chunk
        for c, key in zip(chunks, chunk_keys):
            n = len(c.ids)
            stored = P if self.chunk_context == "prefix" else 0
            ce, need = self._lookup_or_create(r, key, n, stored, "chunk")
            if ce is None:
                return False
            if need:
                ctx = prefix_entries if self.chunk_context == "prefix" else []
                self._round2[key] = (ce, _Job(c.ids, stored, ce.pages, ctx))
            else:
                r.cached_tokens += n
                r.cached_chunk_tokens += n
            entries = self._entry_table(ce, pos=pos, delta=pos - stored)
            spans.append((pos, c.ids, len(table), need, entries))
            table += entries
            pos += n
        if r.warm_only:
            r._jobs = None  # type: ignore[attr-defined]
            return True
        # stage 3: the suffix in private pages
        S = len(suffix.ids)
        own = self._alloc_private(r, self._pages_for(S))
        if own is None:
            return False
        if self.reuse == "block":
            # Block-Attention baseline: a private re-rotated copy of every shifted chunk page
            copies = []
            new_table = []
            shifted = [e for e in table if e.delta != 0]
            dst = self._alloc_private(r, len(shifted))
            if dst is None:
                return False
            it = iter(dst)
            for e in table:
                if e.delta != 0:
                    d = next(it)
                    copies.append((e.page, d, e.delta))
                    new_table.append(_TableEntry(d, e.pos, 0, e.length))
                else:
                    new_table.append(e)
            table = new_table
            r._copies = copies  # type: ignore[attr-defined]
        if self.pool.num_free + self._evictable() < decode_pages:
            return False
        r._jobs = _Job(suffix.ids, pos, own, list(table), logit_rows=r.logit_rows)  # type: ignore[attr-defined]
        r._recovery = (spans, table, own, suffix.ids, pos)  # type: ignore[attr-defined]
        r.computed_tokens += S
        r.table = table + self._own_table(own, pos, S)
        r.next_pos = pos + S
        return True

    def _apply_recovery(self, r: Request) -> None:
        """Quality recovery, once the request's chunk KV is in the pool: recompute with
        full context the first ``recompute_first_tokens`` tokens of each chunk and the
        ``recompute_ratio`` fraction of chunk tokens chosen by ``recompute_selection``:
        ``"deviation"``, those whose layer-``probe_layer`` keys deviate most from full
        attention (CacheBlend-style); ``"attention"``, those the question's queries attend
        to most in a first pass over the cached KV (all layers and heads); then in the
        suffix's forward.
        Pages holding recomputed tokens are replaced, for this request only, by private
        copies re-rotated to their logical positions (one delta per page: 0); the
        recomputed K/V overwrite their slots; the shared cache is never written. If the
        pool cannot give the copies, the request goes ahead without recovery."""
        spans, table, own, suffix_ids, suffix_pos = r._recovery  # type: ignore[attr-defined]
        k, ratio = self.recompute_first_tokens, self.recompute_ratio
        if not spans or (k <= 0 and ratio <= 0):
            return
        sel = [set(range(min(k, len(cids)))) for _, cids, _, _, _ in spans]
        if ratio > 0:
            if self.recompute_selection == "attention":
                dev = self._question_attention(r, spans, table, own, suffix_ids, suffix_pos)
            else:
                dev = self._key_deviation(r, spans)
            total = sum(len(cids) for _, cids, _, _, _ in spans)
            n_pick = min(total, int(math.ceil(ratio * total)))
            flat = [(ci, i) for ci, (_, cids, _, _, _) in enumerate(spans) for i in range(len(cids))]
            for j in torch.topk(dev, n_pick).indices.tolist():
                ci, i = flat[j]
                sel[ci].add(i)
        ps = self.pool.page_size
        copies = list(getattr(r, "_copies", None) or [])
        table = list(table)
        for (start, cids, t0, _, _), chosen in zip(spans, sel):
            for j in sorted({i // ps for i in chosen}):
                e = table[t0 + j]
                if e.page not in r.private_pages:  # lazy: shared page -> private copy
                    dst = self._alloc_private(r, 1)
                    if dst is None:
                        self.metrics["recovery_skipped"] += 1
                        return
                    copies.append((e.page, dst[0], e.delta))
                    table[t0 + j] = _TableEntry(dst[0], e.pos, 0, e.length)
        ids, positions, slots = [], [], []
        for (start, cids, t0, computed_now, _), chosen in zip(spans, sel):
            for i in sorted(chosen):
                ids.append(cids[i])
                positions.append(start + i)
                slots.append(table[t0 + i // ps].page * ps + i % ps)
            r.recomputed_tokens += len(chosen)
            if not computed_now:  # these tokens were counted as reused: they are not
                r.cached_tokens -= len(chosen)
                r.cached_chunk_tokens -= len(chosen)
        r.computed_tokens += len(ids)
        S = len(suffix_ids)
        ids += suffix_ids
        positions += range(suffix_pos, suffix_pos + S)
        slots += [own[i // ps] * ps + i % ps for i in range(S)]
        r._copies = copies  # type: ignore[attr-defined]
        own_table = self._own_table(own, suffix_pos, S)
        r._jobs = _Job(ids, suffix_pos, [], table + own_table, logit_rows=r.logit_rows,  # type: ignore[attr-defined]
                       positions=positions, slots=slots)
        r.table = table + own_table

    def _question_attention(self, r: Request, spans, table, own, suffix_ids, suffix_pos) -> torch.Tensor:
        """Per chunk token (in chunk order), the attention mass the question's queries give
        it (summed over layers, heads and queries) in a forward of the suffix over the
        cached prefix and chunk KV as they are (nothing recomputed yet). The suffix's K/V
        go to its own pages and are overwritten by the real pass."""
        t_first = spans[0][2]
        probe = list(table[:t_first])  # the prefix (never shifted, never copied)
        offsets = []
        for _, _, _, _, entries in spans:  # the shared chunk pages with their rotations
            offsets.append(len(probe))
            probe += entries
        S = len(suffix_ids)
        ps = self.pool.page_size
        slots = [own[i // ps] * ps + i % ps for i in range(S)]
        tables = [probe + self._own_table(own, suffix_pos, S)]
        ids_t, _, meta = self._metadata(list(suffix_ids), list(range(suffix_pos, suffix_pos + S)), slots, [0, S],
                                        tables, S, [])
        self.metrics["prefill_tokens"] += S
        mass = self.model.attention_mass(ids_t, meta, self.pool.k, self.pool.v)[0].reshape(-1)
        idx = [(off + i // ps) * ps + i % ps for off, (_, cids, _, _, _) in zip(offsets, spans)
               for i in range(len(cids))]
        return mass[torch.tensor(idx, device=mass.device)].float()

    def _key_deviation(self, r: Request, spans) -> torch.Tensor:
        """Per chunk token (in chunk order), the distance between its cached keys at layer
        ``probe_layer`` and the keys full attention gives it there."""
        layer = self.probe_layer
        n_head = spans[-1][0] + len(spans[-1][1])  # prefix + chunks: the suffix is not needed
        ids = torch.tensor(r.prompt_ids[:n_head], dtype=torch.long, device=self.device)
        full = self.model.probe_keys(ids, layer)
        ps = self.pool.page_size
        pages, slot_idx, deltas, rows = [], [], [], []
        for start, cids, _, _, entries in spans:
            for i in range(len(cids)):
                e = entries[i // ps]
                pages.append(e.page)
                slot_idx.append(i % ps)
                deltas.append(e.delta)
                rows.append(start + i)
        dev = self.device
        cached = self.pool.k[layer][torch.tensor(pages, device=dev), torch.tensor(slot_idx, device=dev)]
        inv = self.model.inv_freqs[self.model.freq_index[layer]]
        cached = rotate_by_delta(cached, torch.tensor(deltas, device=dev), inv)
        diff = full[torch.tensor(rows, device=dev)].float() - cached.float()
        return diff.pow(2).sum(dim=(-1, -2)).sqrt()

    def _plan_full(self, r: Request, decode_pages: int) -> bool:
        ids = r.prompt_ids
        N = len(ids)
        ps = self.pool.page_size
        table: list[_TableEntry] = []
        m = 0
        keys = []
        if self.reuse == "prefix":
            prev = self.fingerprint.encode()
            for j in range(N // ps):
                h = hashlib.blake2b(prev + str(ids[j * ps:(j + 1) * ps]).encode(), digest_size=20).digest()
                keys.append(h)
                prev = h
            while m < len(keys) and m < (N - 1) // ps:
                e = self.store.get(keys[m])
                if e is None:
                    break
                self.store.pin(e)
                r.pinned.append(e)
                e.hits += 1
                table.append(_TableEntry(e.pages[0], m * ps, 0, ps))
                m += 1
            if m:
                r.lookups.append((True, m * ps))
            r.cached_tokens = m * ps
        rest = ids[m * ps:]
        if self.reuse == "prefix":
            r.lookups.append((False, len(rest)))
        own = self._alloc_private(r, self._pages_for(len(rest)))
        if own is None:
            return False
        if self.pool.num_free + self._evictable() < decode_pages:
            return False
        r._jobs = _Job(rest, m * ps, own, list(table), logit_rows=r.logit_rows)  # type: ignore[attr-defined]
        r.computed_tokens = len(rest)
        r._chain = (keys, m)  # type: ignore[attr-defined]
        r.table = table + self._own_table(own, m * ps, len(rest))
        r.next_pos = N
        return True

    def _evictable(self) -> int:
        return sum(len(e.pages) for e in self.store.entries.values() if e.pins == 0)

    def _entry_table(self, e: Entry, pos: int, delta: int) -> list[_TableEntry]:
        ps = self.pool.page_size
        out = []
        for i, p in enumerate(e.pages):
            n = min(ps, e.num_tokens - i * ps)
            out.append(_TableEntry(p, pos + i * ps, delta, n))
        return out

    def _own_table(self, pages: list[int], pos: int, n: int) -> list[_TableEntry]:
        ps = self.pool.page_size
        return [_TableEntry(p, pos + i * ps, 0, min(ps, n - i * ps)) for i, p in enumerate(pages)]

    # -- prefill ---------------------------------------------------------------------
    def _prefill(self, reqs: list[Request]) -> None:
        self._last_read = None  # the next decode interval includes this prefill: not a step time
        for rnd in (self._round1, self._round2):
            stage = list(rnd.values())
            rnd.clear()
            if stage:
                # On failure the entries stay not-ready and are discarded when the
                # failed requests release them, so no half-written KV is ever found.
                self._run_jobs([j for _, j in stage])
                for e, _ in stage:
                    e.ready = True
                if self.disk is not None:
                    self._save_to_disk([e for e, _ in stage])
        for r in reqs:
            if getattr(r, "_recovery", None) is not None and not r.warm_only:
                self._apply_recovery(r)
                r._recovery = None  # type: ignore[attr-defined]
        stage3 = [(r, r._jobs) for r in reqs if not r.warm_only]  # type: ignore[attr-defined]
        for r in reqs:
            copies = getattr(r, "_copies", None)
            if copies:
                src, dst, delta = zip(*copies)
                t = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
                self._rerotate(t(src), t(dst), t(delta))
                self.metrics["copied_pages"] += len(copies)
        for r in reqs:
            if r.warm_only:
                r.first_token_time = time.perf_counter()
                r.detok = r.detok or Detokenizer(self.tok, ())
                r.finish_reason = "warm"
                self._finish(r)
        logits = self._run_jobs([j for _, j in stage3]) if stage3 else []
        for (r, _), lg in zip(stage3, logits):
            r._jobs = None  # type: ignore[attr-defined]
            if self.reuse == "prefix":
                self._adopt_chain(r)
            if r.logit_rows > 1 or r.score_only:
                self._finish_score(r, lg)
                continue
            r.preempted = False
            self._emit(r, lg[-1])
            if r.finish_reason is None and r in self.running:
                self.decode_state.attach(r, r.table)

    def _rerotate(self, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor) -> None:
        """Copy pages ``src -> dst`` with keys rotated by ``delta``, every layer with its
        own RoPE frequencies (one launch when all layers share them)."""
        m = self.model
        if len(m.inv_freqs) == 1:
            self.rerotate(self.pool.k, self.pool.v, src, dst, delta, m.inv_freqs[0])
            return
        for li, fi in enumerate(m.freq_index):
            self.rerotate(self.pool.k[li:li + 1], self.pool.v[li:li + 1], src, dst, delta, m.inv_freqs[fi])

    def _adopt_chain(self, r: Request) -> None:
        """Identical-prefix mode: hand the request's full prompt pages to the store."""
        keys, m = r._chain  # type: ignore[attr-defined]
        ps = self.pool.page_size
        for j in range(m, len(keys)):
            page = r.table[j].page
            if keys[j] in self.store.entries or page not in r.private_pages:
                continue
            r.private_pages.remove(page)
            r.pinned.append(self.store.adopt(keys[j], [page], ps, j * ps, "page"))

    def _run_jobs(self, jobs: list[_Job]) -> list[torch.Tensor]:
        """One forward (or a few, capped by ``max_batch_tokens``) over prefill jobs."""
        out: list[torch.Tensor] = []
        group: list[_Job] = []
        n = 0
        for j in jobs:
            if group and n + len(j.ids) > self.max_batch_tokens:
                out += self._forward_jobs(group)
                group, n = [], 0
            group.append(j)
            n += len(j.ids)
        if group:
            out += self._forward_jobs(group)
        return out

    def _forward_jobs(self, jobs: list[_Job]) -> list[torch.Tensor]:
        ps = self.pool.page_size
        ids, pos, slots, cu, tables, logit_rows = [], [], [], [0], [], []
        for j in jobs:
            n = len(j.ids)
            ids += j.ids
            if j.positions is not None:
                pos += j.positions
                slots += j.slots
                tables.append(j.context)
            else:
                pos += range(j.start_pos, j.start_pos + n)
                slots += [j.own_pages[i // ps] * ps + i % ps for i in range(n)]
                tables.append(j.context + self._own_table(j.own_pages, j.start_pos, n))
            cu.append(cu[-1] + n)
            logit_rows += range(cu[-1] - j.logit_rows, cu[-1])
        self.metrics["prefill_tokens"] += len(ids)
        if len(jobs) == 1 and self.prefill_graphs.accepts(len(ids), len(tables[0]), jobs[0].logit_rows):
            # a short single-sequence prefill (a question over cached chunks): one graph replay
            table = [(e.page, e.pos, e.delta, e.length) for e in tables[0]]
            out = self.prefill_graphs.run(ids, pos, slots, table)
            if out is not None:  # None: the capture failed and graphs are off; run eagerly
                return [out]
        ids_t, rows, meta = self._metadata(ids, pos, slots, cu, tables, max(len(j.ids) for j in jobs), logit_rows)
        logits = self.model.forward(ids_t, meta, self.pool.k, self.pool.v, logits_index=rows)
        out, i = [], 0
        for j in jobs:
            out.append(logits[i:i + j.logit_rows] if j.logit_rows else None)
            i += j.logit_rows
        return out  # type: ignore[return-value]

    def _metadata(self, ids, pos, slots, cu, tables, max_q, logit_rows):
        """Token ids, logit rows and attention metadata of a prefill step, sent to the
        device in one copy."""
        B = len(tables)
        W = max(1, max(len(t) for t in tables))
        tab = np.zeros((4, B, W), dtype=np.int64)
        for b, t in enumerate(tables):
            if t:
                tab[:, b, : len(t)] = np.array([(e.page, e.pos, e.delta, e.length) for e in t], dtype=np.int64).T
        n, nr = len(ids), len(logit_rows)
        host = torch.from_numpy(np.concatenate([
            np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64), np.asarray(slots, dtype=np.int64),
            np.asarray(cu, dtype=np.int64), np.asarray(logit_rows, dtype=np.int64), tab.ravel()]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        o = 0

        def take(k):
            nonlocal o
            o += k
            return dev[o - k:o]

        ids_t, pos_t, slots_t, cu_t, rows_t = take(n), take(n), take(n), take(B + 1), take(nr)
        tab_t = take(4 * B * W).view(4, B, W).to(torch.int32)
        meta = AttentionMetadata(
            positions=pos_t.to(torch.int32), cu_seqlens_q=cu_t.to(torch.int32), slot_mapping=slots_t,
            block_table=tab_t[0], block_pos=tab_t[1], block_delta=tab_t[2], block_len=tab_t[3], max_seqlen_q=max_q,
        )
        return ids_t, rows_t, meta

    # -- decode ----------------------------------------------------------------------
    def _decode(self) -> None:
        """One token for every decoding request. Host work is O(batch): each request
        changes one table entry; the tables themselves stay on the device.

        Overlapped (``async_decode``, greedy batches): while step ``n`` runs on the GPU, the
        host stages and launches step ``n + 1``, whose token ids come from step ``n``'s argmax
        on the device, and only then reads step ``n``'s tokens and hands them out; the GPU
        never waits for the host's bookkeeping. A request that stops at step ``n`` (EOS, a
        stop string, cancellation, its length limit) has one wasted token computed in step
        ``n + 1``, which is dropped (at its length limit into the scratch slot). Batches with a
        sampled request run one step at a time (the host draws their tokens)."""
        inflight = self._inflight
        if inflight is not None and not self._can_overlap():
            self._read_step(inflight)
            inflight = self._inflight = None
        # requests whose latest token is still in the unread step: row -> its row there
        pending = {} if inflight is None else {id(r): i for i, r in enumerate(inflight.reqs)}
        # of those, the ones that reach their length or context limit with that token: they
        # ride along in this step as dead rows (no page, K/V to the scratch slot, dropped)
        limit = self.model.spec.max_context
        dead = {id(r) for r in self.decode_state.rows if id(r) in pending and (
            len(r.generated) + 1 >= r.params.max_new_tokens or r.next_pos + 1 >= limit)}
        ps = self.pool.page_size
        # pages first: a request whose last page is full needs a new one; if the pool is
        # exhausted, preempt the most recently started requests (they are recomputed later)
        for r in list(self.decode_state.rows):
            if r.row is None or id(r) in dead:
                continue
            last = r.table[-1]
            if last.length < ps and last.page in r.private_pages:
                continue
            while True:
                pages = self._alloc_private(r, 1)
                if pages is not None:
                    r.table.append(_TableEntry(pages[0], r.next_pos + (id(r) in pending), 0, 0))
                    break
                victim = self.decode_state.rows[-1]
                self._preempt(victim)
                if victim is r:
                    break
        reqs = list(self.decode_state.rows)  # rows 0..B-1, compact
        if not reqs:
            if inflight is not None:
                self._read_step(inflight)
                self._inflight = None
            return
        updates, ids, src, pos, slots = [], [], [], [], []
        W = 0
        scratch = self.pool.scratch_page * ps
        for r in reqs:
            last = r.table[-1]
            col = len(r.table) - 1
            if id(r) in dead:
                slots.append(scratch)
                updates.append((self.decode_state.max_batch, 0, 0, 0, 0, 0))  # the dump row
            else:
                slots.append(last.page * ps + last.length)
                last.length += 1
                updates.append((r.row, col, last.page, last.pos, last.delta, last.length))
            i = pending.get(id(r), -1)
            src.append(i)  # its token: step n's argmax of that row, still on the device
            ids.append(r.generated[-1] if i < 0 else 0)
            pos.append(r.next_pos + (i >= 0))
            W = max(W, len(r.table))
        B = len(reqs)
        t_step = time.perf_counter()
        Bp, Wp = self.graphs.batch_bucket(B), self.graphs.width_bucket(W)
        # the graph loads the staged inputs, runs the forward and the argmax
        self.decode_state.stage(updates, ids, pos, slots, Bp, scratch, src=src if inflight is not None else None)
        logits, argmax = self.graphs.run(Bp, Wp)
        step = _Step(reqs, logits[:B], self._picks_to_host(argmax, B), t_step, overlapped=inflight is not None)
        self.metrics["decode_steps"] += 1
        self.metrics["decode_tokens"] += B
        if inflight is not None:
            self.metrics["overlapped_steps"] += 1
            self._read_step(inflight)  # step n's tokens, while step n + 1 runs
        if self.async_decode and all(r.params.greedy for r in reqs):
            self._inflight = step
        else:
            self._inflight = None
            self._read_step(step)

    def _picks_to_host(self, argmax: torch.Tensor, B: int):
        """Start copying a step's argmax to the host (the graph overwrites ``argmax`` at the
        next step of its bucket); returns ``(buffer, event)`` for ``_read_step``."""
        k = self._picks.take()
        buf = self._picks.bufs[k][:B]
        buf.copy_(argmax[:B], non_blocking=True)
        self._picks.record(k)
        return buf, self._picks.events[k]

    def _can_overlap(self) -> bool:
        """Whether the next step may be launched before the step in flight is read: every
        decoding row greedy (its next token is the device argmax)."""
        return self.async_decode and all(r.params.greedy for r in self.decode_state.rows)

    def _read_step(self, step: "_Step") -> None:
        """Hand out a launched step's tokens (waits for it on the GPU)."""
        buf, ev = step.picks
        if ev is not None:
            ev.synchronize()
        picks = buf.tolist()
        now = time.perf_counter()
        B = len(step.reqs)
        if step.overlapped and self._last_read is not None and self._last_read[1] == B:
            # back-to-back overlapped steps: the interval between their results is the step
            self.decode_step_log.append((B, now - self._last_read[0]))
        elif not step.overlapped:
            self.decode_step_log.append((B, now - step.t_launch))
        self._last_read = (now, B)
        for r, lg, g in zip(step.reqs, step.logits, picks):
            if r.row is None:
                continue  # finished, cancelled or preempted after the step was launched
            r.next_pos += 1
            self._emit(r, lg, g if r.params.greedy else None)  # a sampled request samples

    def _requeue_solo(self, r: Request) -> None:
        self._requeue(r)
        r.solo = True
        self.metrics["prefill_retries"] += 1

    def _preempt(self, r: Request) -> None:
        """Give back everything ``r`` holds and queue it again; when readmitted, its
        generated tokens are prefilled as part of its suffix (same semantics: they attend
        to everything before them), and decoding continues where it stopped."""
        self._requeue(r)
        if r.orig_segments is None:
            r.orig_segments = list(r.segments)
        base = r.orig_segments
        r.segments = base[:-1] + [Segment("suffix", base[-1].ids + r.generated)]
        r.preempted = True
        self.metrics["preemptions"] += 1

    # -- output ----------------------------------------------------------------------
    def _emit(self, r: Request, logits: torch.Tensor, greedy_pick: int | None = None) -> None:
        if r.cancelled.is_set():
            self._finish(r, error=RequestCancelled("cancelled"))
            return
        tok = greedy_pick if greedy_pick is not None else sample_token(logits, r.params, r.gen)
        if not r.generated and not r.first_token_time:
            # the first token exists once it is sampled (the forward before it may still have
            # been running on the GPU when the host got here); a recomputed request keeps its own
            r.first_token_time = time.perf_counter()
        r.generated.append(tok)
        is_eos = tok in self.eos_ids
        if r.streaming or r.params.stop:  # text is needed now: for the caller, or to stop
            delta = r.detok.add(tok) if not is_eos else r.detok.finish()
            if delta:
                r.events.put(("delta", delta))
        if is_eos or r.detok.stopped:
            r.finish_reason = "stop"
        elif len(r.generated) >= r.params.max_new_tokens or r.next_pos >= self.model.spec.max_context:
            r.finish_reason = "length"
        if r.finish_reason:
            if not (r.streaming or r.params.stop):  # detokenize once, at the end
                for t in (r.generated[:-1] if is_eos else r.generated):
                    r.detok.ids.append(t)
                r.detok.text = self.tok.decode(r.detok.ids, skip_special_tokens=True)
            tail = r.detok.finish()
            if tail:
                r.events.put(("delta", tail))
            self._finish(r)

    def _finish_score(self, r: Request, logits: torch.Tensor) -> None:
        """Teacher-forced log-probabilities of the continuation (the last ``logit_rows``
        tokens of the suffix are the continuation shifted by one)."""
        cont = r.score_ids
        logp = torch.log_softmax(logits.float(), dim=-1)
        idx = torch.tensor(cont, device=logp.device)
        token_logp = logp.gather(1, idx[:, None])[:, 0]
        r.first_token_time = time.perf_counter()
        self._release(r)
        if r in self.running:
            self.running.remove(r)
        self.metrics["requests"] += 1
        segs = r.orig_segments or r.segments
        r.events.put(("done", ScoreOutput(
            token_ids=list(cont), logprobs=token_logp.tolist(),
            logits=logits.float().cpu() if r.return_logits else None,
            prompt_segments=[(sg.kind, list(sg.ids)) for sg in segs],
            usage=Usage(prompt_tokens=sum(len(sg.ids) for sg in segs), cached_tokens=r.cached_tokens,
                        completion_tokens=0, cached_chunk_tokens=r.cached_chunk_tokens),
            prefilled_tokens=r.computed_tokens,
            ttft_s=r.first_token_time - r.submit_time)))

    def _finish(self, r: Request, error: Exception | None = None) -> None:
        self.decode_state.detach(r)
        self._release(r)
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        if error is not None:
            self.metrics["cancelled" if isinstance(error, RequestCancelled) else "failed"] += 1
            r.events.put(("error", error))
            return
        self.metrics["requests"] += 1
        now = time.perf_counter()
        out = GenerationOutput(
            text=r.detok.text,
            token_ids=list(r.generated),
            prompt_segments=[(s.kind, list(s.ids)) for s in (r.orig_segments or r.segments)],
            usage=Usage(prompt_tokens=sum(len(s.ids) for s in (r.orig_segments or r.segments)),
                        cached_tokens=r.cached_tokens,
                        completion_tokens=len(r.generated), cached_chunk_tokens=r.cached_chunk_tokens),
            finish_reason=r.finish_reason or "stop",
            ttft_s=r.first_token_time - r.submit_time,
            total_s=now - r.submit_time,
            queue_s=r.admit_time - r.submit_time,
            chunk_ids=[s.chunk.id for s in r.segments if s.kind == "chunk"],
        )
        r.events.put(("done", out))


def check_fits(n_prompt: int, params: SamplingParams, max_context: int) -> None:
    if n_prompt >= max_context:
        raise ContextLengthError(
            f"the request has {n_prompt} prompt tokens; the model's context is {max_context} tokens")
