"""Property-based test of the chunk store (lazyllm/cache/store.py): random warm, use, evict,
pin and unpin sequences, driven the way the engine drives the store, keep its invariants.

The machine keeps its own model of the store (which keys exist, their pins, readiness and
LRU order, the outstanding request-private allocations) and predicts, before every
allocation, whether it can succeed and exactly which entries it must evict. After every
step it checks: no page owned twice (entries, private allocations, free list), every page
accounted for, pinned or not-ready entries never evicted, pins never negative, the
eviction counters equal the entries that disappeared without a discard, and ``stats()``
agrees with the contents.
"""
import sys
import threading
import time

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lazyllm.cache.store import ChunkStore, PagePool

NUM_KEYS = 10  # a small key space, so keys are re-warmed after eviction and hit while present
KEYS = [b"key-%02d" % i for i in range(NUM_KEYS)]


class ChunkStoreMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(8, 24), page_size=st.sampled_from([1, 4]))
    def init(self, num_pages, page_size):
        self.pool = PagePool(1, 1, 4, page_size=page_size, num_pages=num_pages, dtype=torch.float32, device="cpu")
        self.store = ChunkStore(self.pool)
        self.ps, self.n = page_size, num_pages
        self.entries = {}  # key -> Entry object handed out by the store
        self.pins = {}  # key -> pins the model expects
        self.ready = {}  # key -> ready flag the model expects
        self.lru = []  # keys, least recently used first (mirror of store.entries order)
        self.private = []  # outstanding request-private allocations (lists of pages)
        self.evictions = self.evicted_tokens = 0
        self.adopted = 0

    # -- model helpers ---------------------------------------------------------------
    def _touch(self, key):
        self.lru.remove(key)
        self.lru.append(key)

    def _predict(self, n):
        """(can succeed, keys that must be evicted, LRU first) for ``alloc_pages(n)``."""
        free = self.pool.num_free
        if n == 0 or n <= free:
            return True, []
        evictable = sum(len(self.entries[k].pages) for k in self.lru if self.pins[k] == 0)
        if free + evictable < n:
            return False, []
        victims = []
        for k in self.lru:
            if free >= n:
                break
            if self.pins[k] == 0:
                victims.append(k)
                free += len(self.entries[k].pages)
        return True, victims

    def _forget(self, key):
        del self.entries[key], self.pins[key], self.ready[key]
        self.lru.remove(key)

    def _apply_evictions(self, victims):
        for k in victims:
            assert self.pins[k] == 0 and self.ready[k], "would evict a pinned or unwritten entry"
            self.evictions += 1
            self.evicted_tokens += self.entries[k].num_tokens
            self._forget(k)

    def _alloc_checked(self, n, call):
        """Run an allocating ``call`` and check it did exactly what the model predicts."""
        ok, victims = self._predict(n)
        before = dict(self.store.entries)
        result = call()
        assert (result is not None) == ok, (n, ok, victims)
        event("allocation refused" if not ok else "allocation evicted" if victims else "allocation from free pages")
        if ok:
            self._apply_evictions(victims)
        else:  # nothing is evicted when the allocation cannot succeed
            assert dict(self.store.entries) == before
        return result

    # -- rules: what the engine does --------------------------------------------------
    def _tokens(self, pages, short):
        return max(0, pages * self.ps - short % self.ps)  # the last page partly filled

    @rule(key=st.sampled_from(KEYS), pages=st.integers(0, 6), short=st.integers(0, 3))
    def warm(self, key, pages, short):
        """Engine._lookup_or_create: pin a present entry (ready or being computed in this
        round), or reserve a new pinned, not-ready one."""
        self._warm(key, self._tokens(pages, short))

    @rule(key=st.sampled_from(KEYS), pages=st.integers(0, 6), short=st.integers(0, 3))
    def ingest(self, key, pages, short):
        """A warm-only request (``LazyLLM.warm``): reserve or join, compute, release; the
        entry ends up ready and unpinned (evictable), unless others still hold it."""
        if not self._warm(key, self._tokens(pages, short)):
            return
        e = self.entries[key]
        if not e.ready:
            e.ready = self.ready[key] = True
        self.store.unpin(e)
        self.pins[key] -= 1

    def _warm(self, key, tokens) -> bool:
        if key in self.entries:
            e = self.store.entries[key]
            assert e is self.entries[key]
            self.store.pin(e)
            self.store.entries.move_to_end(key)
            self.pins[key] += 1
            self._touch(key)
            event("warm: hit" if self.ready[key] else "warm: joins an entry being computed")
            return True
        need = -(-tokens // self.ps)
        e = self._alloc_checked(need, lambda: self.store.create(key, tokens, 0, "chunk"))
        if e is None:
            assert key not in self.store.entries
            return False
        assert e.pins == 1 and not e.ready and len(e.pages) == need and e.num_tokens == tokens
        self.entries[key], self.pins[key], self.ready[key] = e, 1, False
        self.lru.append(key)
        return True

    @precondition(lambda self: any(not r for r in self.ready.values()))
    @rule(data=st.data())
    def prefill_done(self, data):
        """The prefill that fills a reserved entry succeeded: mark it ready."""
        key = data.draw(st.sampled_from(sorted(k for k, r in self.ready.items() if not r)))
        self.entries[key].ready = True
        self.ready[key] = True

    @precondition(lambda self: any(not r for r in self.ready.values()))
    @rule(data=st.data())
    def release_unready(self, data):
        """Engine._release of a not-ready entry (its prefill failed or was never run): drop
        one pin, and discard the reservation when nobody else waits for it."""
        key = data.draw(st.sampled_from(sorted(k for k, r in self.ready.items() if not r)))
        e = self.entries[key]
        e.pins -= 1
        self.pins[key] -= 1
        if e.pins <= 0:
            self.store.discard(e)
            self._forget(key)

    @rule(key=st.sampled_from(KEYS))
    def use(self, key):
        """A lookup: ``get`` returns only ready entries (and refreshes them); pin what it returns."""
        e = self.store.get(key)
        if key in self.entries and self.ready[key]:
            assert e is self.entries[key]
            self._touch(key)
            self.store.pin(e)
            self.pins[key] += 1
        else:
            assert e is None

    @precondition(lambda self: any(p > 0 and self.ready[k] for k, p in self.pins.items()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, p in self.pins.items() if p > 0 and self.ready[k])))
        self.store.unpin(self.entries[key])
        self.pins[key] -= 1

    @precondition(lambda self: any(p == 0 for p in self.pins.values()))
    @rule(data=st.data())
    def unpin_unpinned_is_refused(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, p in self.pins.items() if p == 0)))
        try:
            self.store.unpin(self.entries[key])
        except RuntimeError:
            pass
        else:
            raise AssertionError("unpin of an unpinned entry was accepted")
        assert self.entries[key].pins == 0

    @rule(n=st.integers(0, 12))
    def alloc_private(self, n):
        """A request's private pages (suffix, decode, block copies): may evict."""
        pages = self._alloc_checked(n, lambda: self.store.alloc_pages(n))
        if pages is not None:
            assert len(pages) == n
            self.private.append(pages)

    @precondition(lambda self: self.private)
    @rule(data=st.data())
    def free_private(self, data):
        i = data.draw(st.integers(0, len(self.private) - 1))
        self.pool.free(self.private.pop(i))

    @precondition(lambda self: any(self.private))
    @rule(data=st.data())
    def adopt_page(self, data):
        """Engine._adopt_chain: a full private page becomes a ready cached entry, pinned once."""
        i = data.draw(st.sampled_from([j for j, p in enumerate(self.private) if p]))
        key = b"adopted-%d" % self.adopted
        self.adopted += 1
        page = self.private[i].pop()
        e = self.store.adopt(key, [page], self.ps, 0, "page")
        assert e.pins == 1 and e.ready
        self.entries[key], self.pins[key], self.ready[key] = e, 1, True
        self.lru.append(key)

    @rule()
    def clear_cache(self):
        """Engine.clear_cache: evict every unpinned entry."""
        victims = [k for k in self.lru if self.pins[k] == 0]
        for k in victims:
            self.store._evict(k)
        self._apply_evictions(victims)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def pages_are_owned_once(self):
        owned = [p for e in self.store.entries.values() for p in e.pages]
        private = [p for pages in self.private for p in pages]
        free = list(self.pool._free)
        every = owned + private + free
        assert len(every) == len(set(every)), "a page is owned twice"
        assert set(every) == set(range(self.n)), "a page leaked or an invalid page was handed out"
        assert len(owned) + len(private) + self.pool.num_free == self.pool.num_pages == self.n
        assert self.pool.scratch_page not in every

    @invariant()
    def store_matches_model(self):
        assert list(self.store.entries) == self.lru
        for key, e in self.store.entries.items():
            assert e is self.entries[key] and e.key == key
            assert e.pins == self.pins[key] >= 0
            assert e.ready == self.ready[key]
            assert e.ready or e.pins > 0, "an unwritten entry nobody waits for"
            assert len(e.pages) == -(-e.num_tokens // self.ps)

    @invariant()
    def pinned_entries_are_never_evicted(self):
        for key, p in self.pins.items():
            if p > 0:
                assert self.store.entries.get(key) is self.entries[key]

    @invariant()
    def counters_and_stats_are_consistent(self):
        s = self.store.stats()
        assert s["evictions"] == self.evictions and s["evicted_tokens"] == self.evicted_tokens
        es = list(self.store.entries.values())
        assert s["entries"] == len(es)
        assert s["pinned_entries"] == sum(1 for e in es if e.pins > 0)
        assert s["resident_tokens"] == sum(e.num_tokens for e in es)
        assert s["free_pages"] == self.pool.num_free and s["pool_pages"] == self.n
        page_bytes = 2 * self.ps * 4 * 4  # k and v, 1 layer, 1 head, head_dim 4, fp32
        assert s["resident_bytes"] == sum(len(e.pages) for e in es) * page_bytes
        assert s["pool_bytes"] == self.n * page_bytes

    def teardown(self):
        if not hasattr(self, "store"):
            return
        # what the engine does when every request is done: everything unpinnable comes back
        for key in list(self.lru):
            e = self.entries[key]
            if not e.ready:
                e.pins = 0
                self.store.discard(e)
            else:
                while e.pins > 0:
                    self.store.unpin(e)
        for pages in self.private:
            self.pool.free(pages)
        for key in list(self.store.entries):
            self.store._evict(key)
        assert self.pool.num_free == self.n and not self.store.entries


ChunkStoreMachine.TestCase.settings = settings(
    max_examples=1500, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestChunkStoreStateful = ChunkStoreMachine.TestCase


def test_stats_while_the_engine_thread_mutates_the_store():
    """``stats()`` is documented as callable from any thread (``LazyLLM.cache_stats``), while
    the engine thread creates and evicts entries without taking the store's lock."""
    store = ChunkStore(PagePool(1, 1, 4, page_size=4, num_pages=4000, dtype=torch.float32, device="cpu"))
    stop, errors = threading.Event(), []

    def engine():
        i = 0
        while not stop.is_set():
            e = store.create(i.to_bytes(8, "little"), 4, 0, "chunk")
            e.ready = True
            store.unpin(e)
            if len(store.entries) > 2000:
                for k in list(store.entries)[:500]:
                    store._evict(k)
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to provoke the race
    t = threading.Thread(target=engine)
    t.start()
    try:
        end = time.monotonic() + 1.0  # a second of tries: an unsafe stats() fails well within it
        while time.monotonic() < end:
            try:
                store.stats()
            except RuntimeError as e:  # "OrderedDict mutated during iteration"
                errors.append(e)
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert errors == []
