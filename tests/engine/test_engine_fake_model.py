"""The engine's parts together (scheduler, planner, model runner, decode state, output) over a
fake model that checks every key's position through the page tables: each reuse mode, with
room to spare and with a pool so small that requests are preempted, must give the tokens the
plain prompt gives."""
import random

import pytest

from tests.engine.fakes import make_engine, make_request, reference_generate, run_to_end

PREFIX = [3, 4, 5, 6, 7]
DOCS = [list(range(10 + 10 * i, 10 + 10 * i + 4 + 3 * i)) for i in range(5)]  # 4..16 tokens


def _requests(seed, n=6):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        docs = rng.sample(DOCS, rng.randint(1, 3))
        out.append(make_request(PREFIX, docs, [60 + i, 61], max_new_tokens=rng.randint(1, 9)))
    return out


def _check(engine, reqs, outs):
    for r, o in zip(reqs, outs):
        assert not isinstance(o, Exception), o
        prompt = [t for s in r.segments for t in s.ids]  # as submitted, whatever preemption did
        assert o.token_ids == reference_generate(prompt, r.params.max_new_tokens)
    assert not engine.decode_state.rows and not engine.scheduler.running and not engine.scheduler.waiting
    store = engine.store
    assert all(e.pins == 0 for e in store.entries.values())
    assert engine.pool.num_free + store.evictable_pages() == engine.pool.num_pages


@pytest.mark.parametrize("reuse", ["lazy", "block", "prefix", "none"])
@pytest.mark.parametrize("async_decode", [False, True])
def test_every_mode_gives_the_plain_prompts_tokens(reuse, async_decode):
    engine = make_engine(reuse, num_pages=96, overlap_decode=async_decode)
    first = _requests(0)
    _check(engine, first, run_to_end(engine, first))
    again = _requests(1)  # the same documents in other orders: cached pages reused
    outs = run_to_end(engine, again)
    _check(engine, again, outs)
    if reuse in ("lazy", "block"):
        assert sum(o.usage.cached_chunk_tokens for o in outs) > 0


@pytest.mark.parametrize("reuse", ["lazy", "block", "prefix", "none"])
def test_preempted_requests_resume_with_the_same_tokens(reuse):
    # a pool that holds a few requests' prompts but not all of their decode pages at once
    engine = make_engine(reuse, num_pages=40, max_batch_size=8)
    reqs = [make_request(PREFIX, [DOCS[i % 5], DOCS[(i + 2) % 5]], [60 + i], max_new_tokens=16) for i in range(8)]
    _check(engine, reqs, run_to_end(engine, reqs))
    assert engine.metrics["preemptions"] > 0


def test_recovery_recomputes_into_private_copies_and_keeps_the_tokens():
    engine = make_engine("lazy", num_pages=96, recompute_first_tokens=3)
    warm = _requests(2)
    _check(engine, warm, run_to_end(engine, warm))
    reqs = _requests(3)
    outs = run_to_end(engine, reqs)
    _check(engine, reqs, outs)
    assert engine.metrics["copied_pages"] > 0 and engine.metrics["recovery_skipped"] == 0
