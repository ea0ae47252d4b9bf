"""Chunk store: keys, pinning, LRU eviction, accounting."""
import pytest
import torch

from lazyllm.cache.store import ChunkStore, PagePool, chunk_key


def _store(pages=10, ps=4):
    return ChunkStore(PagePool(1, 1, 4, page_size=ps, num_pages=pages, dtype=torch.float32, device="cpu"))


def test_keys_depend_on_everything_that_changes_kv():
    base = chunk_key("m1", "isolated", [1, 2, 3])
    assert base == chunk_key("m1", "isolated", [1, 2, 3])
    assert base != chunk_key("m2", "isolated", [1, 2, 3])
    assert base != chunk_key("m1", "prefix", [1, 2, 3])
    assert base != chunk_key("m1", "isolated", [1, 2, 4])
    assert base != chunk_key("m1", "isolated", [1, 2, 3], prefix_key=b"p")
    assert chunk_key("m1", "prefix", [1], b"p") != chunk_key("m1", "prefix", [1], b"q")


def test_lru_eviction_skips_pinned_and_frees_pages():
    s = _store(pages=6, ps=4)
    a = s.create(b"a", 8, 0, "chunk")  # 2 pages
    b = s.create(b"b", 8, 0, "chunk")
    c = s.create(b"c", 8, 0, "chunk")  # pool now full
    for e in (a, b, c):
        e.ready = True
    s.unpin(a)
    s.unpin(c)  # b stays pinned
    assert s.get(b"a") is a  # touch a: c becomes least recently used
    d = s.create(b"d", 4, 0, "chunk")  # needs 1 page: evicts c
    assert d is not None and b"c" not in s.entries and b"a" in s.entries
    e = s.create(b"e", 16, 0, "chunk")  # needs 4: 1 free + a's 2 evictable is not enough
    assert e is None and b"a" in s.entries  # nothing evicted when it cannot succeed
    s.unpin(d)
    e = s.create(b"e", 16, 0, "chunk")
    assert e is not None and b"b" in s.entries
    owned = [p for ent in s.entries.values() for p in ent.pages]
    assert len(owned) == len(set(owned)) and len(owned) + s.pool.num_free == 6
    assert s.stats()["evictions"] == 3


def test_unpin_below_zero_is_an_error():
    s = _store()
    e = s.create(b"x", 3, 0, "chunk")
    s.unpin(e)
    with pytest.raises(RuntimeError):
        s.unpin(e)


def test_get_ignores_entries_not_yet_written():
    s = _store()
    e = s.create(b"x", 3, 0, "chunk")
    assert s.get(b"x") is None
    e.ready = True
    assert s.get(b"x") is e


def test_double_free_and_key_overwrite_are_refused():
    s = _store(pages=4)
    pages = s.pool.alloc(2)
    s.pool.free(pages)
    with pytest.raises(RuntimeError, match="twice"):
        s.pool.free(pages[:1])
    s.create(b"x", 4, 0, "chunk")
    with pytest.raises(ValueError):
        s.create(b"x", 4, 0, "chunk")
    with pytest.raises(ValueError):
        s.adopt(b"x", [3], 4, 0, "page")
