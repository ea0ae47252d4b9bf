"""The scheduler: admission under the token budget and batch size, waiting and failing for
pages, decode pages and slots, preemption; on a CPU page pool with no model."""
import dataclasses

import pytest

from lazyllm.engine.kv.planner import KVPlanner
from lazyllm.engine.metrics import EngineMetrics
from lazyllm.engine.request import pack_tables
from lazyllm.engine.running.decode_state import DecodeState
from lazyllm.engine.scheduling.scheduler import Scheduler
from lazyllm.engine.step import PrefillBatch, Recomputation
from lazyllm.errors import CacheCapacityError
from tests.engine.fakes import make_request, make_store

PS = 4


def _scheduler(num_pages=64, max_batch_tokens=64, max_batch_size=8, reuse="none"):
    planner = KVPlanner(make_store(num_pages, PS), reuse, "isolated", "fp")
    metrics = EngineMetrics()
    state = DecodeState(max_batch_size, 32, planner.pool.k.device)
    return Scheduler(planner, state, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size,
                     metrics=metrics)


def _req(n_prompt, max_new_tokens=4):
    return make_request([2] * (n_prompt - 1), [], [3], max_new_tokens=max_new_tokens)


def _last_slot(r):
    """Pool slot of the request's last claimed token."""
    _, page, _, _, n = r.alloc.tail()
    return page * PS + n - 1


def _start_decoding(s, reqs):
    """What the engine does after a prefill: each request decodes from its own row, from
    where its plan's prompt ends."""
    for r in reqs:
        r.state.generated.append(5)
        r.state.next_pos = r.plan.next_pos
        s.decode_state.attach(r)


def test_admits_in_order_up_to_the_token_budget():
    s = _scheduler(max_batch_tokens=20)
    reqs = [_req(8), _req(8), _req(8)]
    s.waiting.extend(reqs)
    admitted, failed = s.admit()
    assert admitted == reqs[:2] and failed == [] and s.waiting == reqs[2:]
    assert s.running == reqs[:2] and all(r.state.admit_time > 0 for r in admitted)
    admitted, _ = s.admit()
    assert admitted == reqs[2:]


def test_the_first_request_is_admitted_even_over_the_budget():
    s = _scheduler(max_batch_tokens=4)
    big = _req(30)
    s.waiting.append(big)
    assert s.admit()[0] == [big]


def test_admission_stops_at_the_batch_size():
    s = _scheduler(max_batch_size=2)
    s.waiting.extend([_req(4) for _ in range(3)])
    assert len(s.admit()[0]) == 2
    assert s.admit()[0] == []  # two running already
    s.retire(s.running[0])
    assert len(s.admit()[0]) == 1


def test_a_request_waits_for_pages_held_by_running_ones():
    s = _scheduler(num_pages=6)
    first, second = _req(12, 4), _req(12, 4)  # 3 prompt pages + 2 decode pages each
    s.waiting.extend([first, second])
    admitted, failed = s.admit()
    assert admitted == [first] and failed == [] and s.waiting == [second]
    assert second.alloc.table == ()  # its failed plan took nothing
    s.retire(first)
    assert s.admit()[0] == [second]


def test_a_request_no_pool_can_hold_fails_clearly():
    s = _scheduler(num_pages=4)
    r = _req(30)
    s.waiting.append(r)
    admitted, failed = s.admit()
    assert admitted == [] and [x for x, _ in failed] == [r] and isinstance(failed[0][1], CacheCapacityError)
    assert s.waiting == [] and s.planner.pool.num_free == 4


def test_a_solo_request_is_admitted_alone():
    s = _scheduler()
    a, b, c = _req(4), _req(4), _req(4)
    b.state.solo = True
    s.waiting.extend([a, b, c])
    assert s.admit()[0] == [a]  # b waits: it runs alone
    assert s.admit()[0] == [b]
    assert s.admit()[0] == [c]
    for r in (a, b, c):  # each admission is stamped, the solo one too (its queue_s was negative)
        assert r.state.admit_time >= r.submit_time > 0


def test_decode_claims_one_slot_per_step_and_a_new_page_when_full():
    s = _scheduler()
    r = _req(6, max_new_tokens=8)  # 6 prompt tokens: the second page holds 2
    s.waiting.append(r)
    s.admit()
    _start_decoding(s, [r])
    widths, slots = [], []
    for _ in range(4):
        s.grow_decode_pages({}, set())
        widths.append(r.alloc.width)
        slots.append(_last_slot(r))
        r.state.next_pos += 1
    assert widths == [2, 2, 3, 3]
    own = r.alloc.table[1].page
    new = r.alloc.table[2]
    assert slots == [own * PS + 2, own * PS + 3, new.page * PS, new.page * PS + 1]
    assert new.pos == 8 and new.delta == 0 and new.length == 2


def test_a_dead_row_gets_no_slot_and_a_pending_one_starts_its_page_a_token_later():
    s = _scheduler()
    a, b = _req(8), _req(8)  # both with a full last page
    s.waiting.extend([a, b])
    s.admit()
    _start_decoding(s, [a, b])
    s.grow_decode_pages({a.id: 0, b.id: 1}, {b.id})
    assert a.alloc.width == 3 and a.alloc.last.pos == a.state.next_pos + 1 and a.alloc.last.length == 1
    assert b.alloc.width == 2  # dead: it rides along with no page


def test_an_exhausted_pool_preempts_the_most_recently_started():
    s = _scheduler(num_pages=8)
    reqs = [_req(8, max_new_tokens=1) for _ in range(3)]  # 2 pages + 1 decode page each
    s.waiting.extend(reqs)
    assert s.admit()[0] == reqs
    _start_decoding(s, reqs)
    s.grow_decode_pages({}, set())  # 6 pages held, 2 free: the third request is preempted
    assert s.metrics["preemptions"] == 1
    assert reqs[2].state.preempted and s.waiting == [reqs[2]] and reqs[2].state.row is None
    assert reqs[2].alloc.table == () and reqs[2].alloc.private_pages == ()
    # its generated token is prefilled with its suffix when it comes back
    assert reqs[2].prefill_segments[-1].ids == [3, 5] and reqs[2].segments[-1].ids == [3]
    assert [r.alloc.width for r in reqs[:2]] == [3, 3]


def test_the_last_row_that_cannot_grow_preempts_itself():
    s = _scheduler(num_pages=5)
    a, b = _req(8, max_new_tokens=1), _req(8, max_new_tokens=1)  # each fits alone with its decode page
    s.waiting.extend([a, b])
    assert s.admit()[0] == [a, b]
    _start_decoding(s, [a, b])
    s.grow_decode_pages({}, set())  # a takes the last free page; b, the last row, gives way
    assert a.alloc.width == 3 and a.alloc.last.length == 1 and not a.state.preempted
    assert b.state.preempted and b.state.row is None and s.waiting == [b] and s.decode_state.rows == [a]


@pytest.mark.parametrize("steps", [1, 5, 11])
def test_the_device_mirror_follows_the_allocation(steps):
    """The decode state's rows equal the requests' tables after each step's updates (rows
    moved by retirement included)."""
    s = _scheduler()
    reqs = [_req(n, max_new_tokens=16) for n in (5, 8, 11)]
    s.waiting.extend(reqs)
    s.admit()
    _start_decoding(s, reqs)
    st = s.decode_state
    for i in range(steps):
        if i == 3:
            s.retire(reqs[0])  # the last row moves into its place
        s.grow_decode_pages({}, set())
        live = list(st.rows)
        updates = [st.row_update(r) for r in live]
        st.stage(updates, [5] * len(live), [r.state.next_pos for r in live], [_last_slot(r) for r in live],
                 len(live), 0)
        st.load(len(live))
        for r in live:
            r.state.next_pos += 1
            w = r.alloc.width
            want = pack_tables([r.alloc.table], w)[:, 0]
            assert st.tables[:, r.state.row, :w].tolist() == want.tolist()


def test_the_mirror_refuses_a_table_rebuilt_behind_its_back():
    s = _scheduler()
    r = _req(5)
    s.waiting.append(r)
    s.admit()
    _start_decoding(s, [r])
    r.alloc.set_table(r.alloc.table)  # a new epoch the device copy never saw
    with pytest.raises(RuntimeError):
        s.decode_state.row_update(r)


def test_a_prefill_batch_runs_recoverys_jobs_after_every_copy():
    """A round's ``PrefillBatch``: the page copies of every planned request in order (a
    warm-only one's too), the planner's then recovery's; the jobs of the requests that run
    one, recovery's where it recomputes, the planner's elsewhere; the plans untouched."""
    s = _scheduler(reuse="lazy")
    warm, a, b = _req(6), _req(7), _req(9)
    warm.warm_only = True
    s.waiting.extend([warm, a, b])
    s.admit()
    a.plan.copies = [(1, 2, 3)]  # as a block copy of the planner's
    job = a.plan.job
    rc = Recomputation(job=dataclasses.replace(job), copies=((4, 5, 6),), reused=2, computed=3)
    batch = PrefillBatch.of([warm, a, b], {a.id: rc})
    assert batch.reqs == (a, b) and batch.jobs[0] is rc.job and batch.jobs[1] is b.plan.job
    assert batch.copies == ((), ((1, 2, 3), (4, 5, 6)), ())
    assert a.plan.job is job and a.plan.copies == [(1, 2, 3)]
    counts = (a.plan.cached_tokens, a.plan.cached_chunk_tokens, a.plan.computed_tokens)
    a.plan.recomputed(rc)
    assert (a.plan.cached_tokens, a.plan.cached_chunk_tokens, a.plan.computed_tokens) == \
        (counts[0] - 2, counts[1] - 2, counts[2] + 3)
