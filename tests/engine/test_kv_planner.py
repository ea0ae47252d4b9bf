"""The KV planner's policies (lazy, block, prefix, none) and the allocation that owns a
request's page table, on a CPU page pool with no model."""
import ast
from pathlib import Path

import pytest

from lazyllm.config import EngineConfig
from lazyllm.engine.kv.page_table import Allocation
from lazyllm.engine.kv.planner import KVPlanner, NonePolicy, PrefixPolicy, Reservation
from lazyllm.engine.request import TableEntry, entry_table
from lazyllm.reuse_modes import MODES
from tests.engine.fakes import make_request, make_store

PS = 4
P = [3, 4, 5, 6, 7]  # prefix: 5 tokens (two pages, the second one short)
A, B = list(range(10, 19)), list(range(20, 26))  # chunks of 9 and 6 tokens


def _planner(reuse, num_pages=64, chunk_context="isolated"):
    return KVPlanner(make_store(num_pages, PS), reuse, chunk_context, "fp")


def _covers(table, n):
    """The table's entries hold logical positions 0..n-1, each once, in order."""
    pos = [e.pos + i for e in table for i in range(e.length)]
    return pos == list(range(n))


def _finish_prefill(planner, r):
    """What the engine does after the round's prefill: entries ready, the policy's hand-off."""
    for stage in planner.take_pending():
        for p in stage:
            planner.store.mark_ready(p.entry)
    planner.after_prefill(r)


@pytest.mark.parametrize("reuse", ["lazy", "block", "prefix", "none"])
def test_every_policy_lays_out_the_whole_prompt(reuse):
    planner = _planner(reuse)
    r = make_request(P, [A, B], [40, 41], max_new_tokens=3)
    assert planner.plan(r)
    n = r.num_prompt_tokens
    assert _covers(r.alloc.table, n) and r.plan.next_pos == n
    assert r.state.next_pos == 0  # where it decodes from is the engine's to set
    assert r.plan.job.logit_rows == 1
    # the request's own job ends at the prompt's last token
    assert r.plan.job.start_pos + len(r.plan.job.ids) == n


def test_lazy_references_cached_chunks_in_place_with_a_delta():
    planner = _planner("lazy")
    first = make_request(P, [A, B], [40], max_new_tokens=2)
    assert planner.plan(first)
    assert first.plan.computed_tokens == len(P) + len(A) + len(B) + 1
    _finish_prefill(planner, first)
    second = make_request(P, [B, A], [41], max_new_tokens=2)  # same chunks, other order
    assert planner.prefill_cost(second) == 1  # only the suffix
    assert planner.plan(second)
    assert second.plan.cached_tokens == len(P) + len(A) + len(B) and second.plan.copies == []
    shared = {e.page for e in first.alloc.table} & {e.page for e in second.alloc.table}
    assert len(shared) == 2 + 3 + 2  # the prefix's, A's and B's pages: no copy
    # B now sits first (after the prefix), A after it: each entry's delta moves the chunk
    # from where it was encoded (position 0, isolated) to where it sits now
    deltas = {e.page: e.delta for e in second.alloc.table}
    span_a, span_b = first.plan.spans
    assert {deltas[e.page] for e in span_b.entries} == {len(P)}
    assert {deltas[e.page] for e in span_a.entries} == {len(P) + len(B)}
    assert _covers(second.alloc.table, second.num_prompt_tokens)


def test_block_copies_every_shifted_chunk_page_and_only_those():
    planner = _planner("block")
    first = make_request(P, [A], [40])
    assert planner.plan(first)
    # A encoded alone at position 0 sits at position 5: every page of it is shifted
    assert len(first.plan.copies) == 3
    assert all(e.delta == 0 for e in first.alloc.table)
    copied = {dst for _, dst, _ in first.plan.copies}
    assert copied <= set(first.alloc.private_pages)
    assert {d for _, _, d in first.plan.copies} == {len(P)}
    _finish_prefill(planner, first)
    # in "prefix" context a chunk is encoded after the prefix: at home, nothing to copy
    planner = _planner("block", chunk_context="prefix")
    r = make_request(P, [A], [40])
    assert planner.plan(r) and r.plan.copies == []


def test_prefix_reuses_full_pages_of_an_identical_prefix_only():
    planner = _planner("prefix")
    first = make_request(P, [A, B], [40, 41])
    assert planner.plan(first) and first.plan.cached_tokens == 0
    _finish_prefill(planner, first)
    n_full = first.num_prompt_tokens // PS
    assert len(first.alloc.pinned) == n_full  # its full pages were handed to the store
    same_start = make_request(P, [A, B], [42, 43])  # differs only in its last page
    assert planner.plan(same_start)
    assert same_start.plan.cached_tokens == (first.num_prompt_tokens - 2) // PS * PS
    assert same_start.plan.job.start_pos == same_start.plan.cached_tokens
    assert _covers(same_start.alloc.table, same_start.num_prompt_tokens)
    reordered = make_request(P, [B, A], [40, 41])  # the same chunks in another order
    assert planner.plan(reordered)
    assert reordered.plan.cached_tokens == len(P) // PS * PS  # only the prefix's one full page


def test_none_reuses_and_caches_nothing():
    planner = _planner("none")
    for _ in range(2):
        r = make_request(P, [A, B], [40])
        assert planner.plan(r)
        assert r.plan.cached_tokens == 0 and r.plan.computed_tokens == r.num_prompt_tokens
        _finish_prefill(planner, r)
        assert r.alloc.pinned == () and len(planner.store.entries) == 0


def test_prefix_and_none_policies_are_siblings():
    assert not issubclass(PrefixPolicy, NonePolicy) and not issubclass(NonePolicy, PrefixPolicy)


@pytest.mark.parametrize("reuse", list(MODES))  # a mode declared without a policy fails here
def test_each_policy_answers_from_its_mode_what_it_does(reuse):
    """What a mode is (``lazyllm.reuse_modes``) is what its policy does: one that caches
    chunks creates chunk entries, one that makes copies holds private chunk pages, and the
    configuration's mode is the policy's."""
    planner = _planner(reuse, chunk_context="prefix")
    mode = planner.policy.mode
    assert mode is MODES[reuse] is EngineConfig(reuse=reuse).mode and planner.policy.name == reuse
    r = make_request(P, [A, B], [40])
    assert planner.plan(r)
    assert bool(planner.pending_chunks) == mode.caches_chunks == planner.caches_chunks
    shifted = [e for e in r.alloc.table if e.delta != 0]
    assert bool(shifted) == (mode.caches_chunks and not mode.makes_copies)
    assert planner.exact_at_home == (reuse == "lazy")
    assert not _planner(reuse, chunk_context="isolated").exact_at_home


@pytest.mark.parametrize("reuse", ["lazy", "block", "prefix", "none"])
def test_a_request_the_pool_cannot_hold_takes_nothing(reuse):
    planner = _planner(reuse, num_pages=6)
    free = planner.pool.num_free
    r = make_request(P, [A, B], [40], max_new_tokens=4)
    assert not planner.plan(r)
    assert planner.pool.num_free + planner.store.evictable_pages() == free
    assert r.alloc.table == () and r.alloc.pinned == () and r.alloc.private_pages == ()
    assert r.plan is None


@pytest.mark.parametrize("reuse", ["lazy", "block", "prefix", "none"])
def test_release_gives_every_page_back(reuse):
    planner = _planner(reuse)
    r = make_request(P, [A, B], [40], max_new_tokens=9)
    assert planner.plan(r)
    _finish_prefill(planner, r)
    planner.release(r)
    assert r.alloc.table == () and r.alloc.private_pages == ()
    assert all(e.pins == 0 for e in planner.store.entries.values())
    assert planner.pool.num_free + planner.store.evictable_pages() == planner.pool.num_pages


def test_unfinished_reservations_are_dropped_with_their_last_holder():
    planner = _planner("lazy")
    a, b = make_request(P, [A], [40]), make_request(P, [A], [41])
    assert planner.plan(a) and planner.plan(b)  # b waits for a's reservation of A
    planner.release(a)
    assert planner.pending_chunks  # b still waits for it
    planner.release(b)
    assert not planner.pending_chunks and not planner.pending_prefixes and not planner.store.entries


@pytest.mark.parametrize("reuse", ["lazy", "block", "prefix", "none"])
def test_a_policy_returns_what_it_found_and_writes_no_planner_state(reuse):
    planner = _planner(reuse)
    first = make_request(P, [A, B], [40], max_new_tokens=2)
    assert planner.plan(first)
    _finish_prefill(planner, first)
    r = make_request(P, [B, A], [41], max_new_tokens=2)  # the prefix and chunks now cached
    before = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(planner).items()}
    planner.allocation(r)
    r.plan = type(first.plan)()
    found = planner.policy.plan(planner, r, decode_pages=1)
    after = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(planner).items()}
    assert after == before  # nothing of the planner's written: the policy only returned
    assert isinstance(found, Reservation) and found.ok and found.disk_hits == 0
    if planner.caches_chunks:  # prefix, B, A: every lookup a hit, nothing to compute
        assert found.lookups == [(True, len(P)), (True, len(B)), (True, len(A))]
        assert not found.prefixes and not found.chunks
    elif reuse == "prefix":  # the first full page of the identical prefix is reused
        assert found.lookups[0] == (True, PS) and found.lookups[-1][0] is False
    else:
        assert found.lookups == []
    # a request with new chunks: what it must compute comes back, for the planner to gather
    fresh = make_request(P, [list(range(50, 57))], [42], max_new_tokens=2)
    planner.allocation(fresh)
    fresh.plan = type(first.plan)()
    got = planner.policy.plan(planner, fresh, decode_pages=1)
    assert got.ok and not planner.pending_chunks and not planner.pending_prefixes
    assert list(got.chunks) == ([planner.segment_keys(fresh)[1][0]] if planner.caches_chunks else [])


# -- the allocation: the one writer of a request's table -----------------------------------
def test_allocation_grows_only_through_append_page_and_advance():
    store = make_store(8, PS)
    alloc = Allocation(store)
    alloc.set_table([TableEntry(0, 0, 0, 3)])
    epoch, version = alloc.epoch, alloc.version
    assert not alloc.advance()  # page 0 is not its own
    assert alloc.table == (TableEntry(0, 0, 0, 3),) and alloc.version == version
    assert alloc.append_page(3)
    assert alloc.last.length == 0 and alloc.last.pos == 3 and alloc.owns(alloc.last.page)
    lengths = []
    for _ in range(PS):
        assert alloc.advance()
        lengths.append(alloc.tail()[4])
    assert lengths == list(range(1, PS + 1)) and alloc.tail()[:4] == (1, alloc.last.page, 3, 0)
    assert not alloc.advance()  # no slot past the page
    assert alloc.last.length == PS
    assert alloc.epoch == epoch  # grown at its end only: a mirror copies the last entry
    alloc.release()
    assert alloc.epoch != epoch and alloc.table == () and store.pool.num_free == 8


def test_append_page_on_an_exhausted_pool_changes_nothing():
    store = make_store(1, PS)
    alloc = Allocation(store)
    assert alloc.append_page(0)
    v = alloc.version
    assert not alloc.append_page(PS)
    assert alloc.width == 1 and alloc.version == v


def test_privatize_is_all_or_nothing():
    store = make_store(3, PS)
    alloc = Allocation(store)
    alloc.set_table([TableEntry(0, 5, 5, 4), TableEntry(1, 9, 5, 2)])
    store.pool.alloc(2)  # pages 0 and 1 are someone else's (a cache entry)
    before, epoch = alloc.table, alloc.epoch
    assert alloc.privatize([0, 1]) is None  # one free page for two copies
    assert alloc.table == before and alloc.private_pages == () and alloc.epoch == epoch
    copies = alloc.privatize([1])
    assert copies == [(1, alloc.table[1].page, 5)] and alloc.table[1] == TableEntry(copies[0][1], 9, 0, 2)
    assert alloc.epoch != epoch


def test_entry_table_rows_cover_the_tokens_page_by_page():
    import random

    gen = random.Random(0)
    for _ in range(3000):
        ps = gen.choice([1, 2, 16, 64])
        k = gen.randint(0, 12)
        n = gen.randint(max(0, (k - 2) * ps), k * ps)  # pages full but the last, and over-allocated ones
        pages, pos, delta = gen.sample(range(1000), k), gen.randint(0, 5000), gen.randint(-99, 99)
        rows = entry_table(pages, n, pos, delta, ps)
        assert all(type(e) is TableEntry for e in rows)
        assert [e.page for e in rows] == pages and {e.delta for e in rows} <= {delta}
        assert [e.pos for e in rows] == [pos + i * ps for i in range(k)]
        assert [e.length for e in rows] == [min(ps, n - i * ps) for i in range(k)]


def test_table_entries_cannot_be_edited_in_place():
    alloc = Allocation(make_store(4, PS))
    alloc.set_table([TableEntry(0, 0, 0, 1)])
    with pytest.raises(AttributeError):
        alloc.table[0].length = 2
    with pytest.raises((TypeError, AttributeError)):
        alloc.table.append(TableEntry(1, 1, 0, 1))
    assert alloc.table == (TableEntry(0, 0, 0, 1),)


_PACKAGE = Path(__file__).resolve().parents[2]
_SOURCES = sorted(p for d in ("lazyllm", "kernels", "integrations") for p in (_PACKAGE / d).rglob("*.py"))
# who may call which edit of an allocation (module path suffix -> allowed methods)
_EDITS = {"set_table", "extend_table", "privatize", "publish", "hold", "take_private", "append_page", "advance"}
_ENGINE = "lazyllm/engine/"
_ENTRY_FIELDS = ("page", "pos", "delta", "length")
_TABLE_LISTS = ("table", "private_pages", "pinned")
_LIST_EDITS = ("append", "extend", "insert", "remove", "pop", "clear", "__setitem__")
_ALLOWED = {
    "lazyllm/engine/kv/page_table.py": _EDITS,
    "lazyllm/engine/kv/planner.py": _EDITS,
    "lazyllm/engine/scheduling/scheduler.py": {"append_page", "advance"},  # decode pages and slots
    "lazyllm/engine/recovery/recompute.py": {"privatize"},  # private copies of recomputed pages
}


def _table_writes(rel: str, tree: ast.AST) -> list[tuple[str, int, str]]:
    """Where module ``rel`` writes page-table state other than through the calls its role
    may make (``_ALLOWED``)."""
    planner = rel == "lazyllm/engine/kv/page_table.py"
    allowed = _ALLOWED.get(rel, set())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not planner:
            if node.attr in ("_table", "_private", "_pinned"):  # the allocation's storage
                found.append((rel, node.lineno, node.attr))
            makes_it = node.attr == "alloc" and rel == "lazyllm/engine/kv/planner.py"  # the planner makes it
            if isinstance(node.ctx, ast.Store) and node.attr in ("table", "alloc", *_TABLE_LISTS) and not makes_it:
                found.append((rel, node.lineno, f"assigns .{node.attr}"))
            own = isinstance(node.value, ast.Name) and node.value.id == "self"  # an object's own field
            if isinstance(node.ctx, ast.Store) and node.attr in _ENTRY_FIELDS and rel.startswith(_ENGINE) and not own:
                found.append((rel, node.lineno, f"assigns .{node.attr}"))  # a table entry's field
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Attribute) and node.value.attr in _TABLE_LISTS:
            found.append((rel, node.lineno, f"item of .{node.value.attr}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f, recv = node.func.attr, node.func.value
            if isinstance(recv, ast.Attribute) and recv.attr in _TABLE_LISTS and f in _LIST_EDITS:
                found.append((rel, node.lineno, f".{recv.attr}.{f}"))
            if f in _EDITS - allowed:
                found.append((rel, node.lineno, f))
            if rel.startswith(_ENGINE) and (f == "__setattr__" or (f == "replace" and isinstance(recv, ast.Name)
                                                                    and recv.id == "dataclasses")):
                found.append((rel, node.lineno, f))  # around a frozen entry
    return found


def test_only_the_planner_edits_page_tables():
    """No module outside the planner reaches into an allocation's storage or edits a table
    any other way than the calls its role needs (the scheduler grows decode pages, recovery
    makes private copies)."""
    assert len(_SOURCES) > 20
    found = []
    for path in _SOURCES:
        rel = path.relative_to(_PACKAGE).as_posix()
        found += _table_writes(rel, ast.parse(path.read_text(), filename=rel))
    assert found == [], found
