"""When the first token reaches the caller, and what the GPU still has to do when the next
request arrives, under overlapped decode (fake model, CPU: the order of the engine's calls is
what is checked, not time).

A request's first token is handed out (stamped, its text on the event queue) as soon as its
prefill's pick is read, before any decode step is launched; and a request that ends at its
length limit leaves no decode step behind it, so the next request's prefill is the next
forward on the device (a step of dropped tokens in flight would run first and delay it)."""
import pytest

from tests.engine.fakes import make_engine, make_request, reference_generate, run_to_end

PREFIX = [3, 4, 5]
DOCS = [list(range(10, 18)), list(range(20, 27))]


def _watch_launches(engine, req):
    """Record, at each decode launch, the events already on ``req``'s queue and whether its
    first token was stamped."""
    seen = []
    launch = engine.runner.launch_decode

    def spy(batch):
        seen.append((list(req.events.queue), req.state.first_token_time))
        return launch(batch)

    engine.runner.launch_decode = spy
    return seen


@pytest.mark.parametrize("overlap", [False, True])
def test_first_token_is_handed_out_before_the_first_decode_step(overlap):
    engine = make_engine("lazy", overlap_decode=overlap)
    req = make_request(PREFIX, DOCS, [60, 61], max_new_tokens=4)
    seen = _watch_launches(engine, req)
    (out,) = run_to_end(engine, [req])
    first = reference_generate([t for s in req.segments for t in s.ids], 1)[0]
    assert out.token_ids[0] == first
    events, stamped = seen[0]
    assert ("delta", f"<{first}>") in events and stamped > 0


@pytest.mark.parametrize("n", [1, 2, 4, 9])
def test_a_request_at_its_length_limit_leaves_no_step_in_flight(n):
    engine = make_engine("lazy", overlap_decode=True)
    model = engine.model
    req = make_request(PREFIX, DOCS, [60, 61], max_new_tokens=n)
    (out,) = run_to_end(engine, [req])
    assert len(out.token_ids) == n
    # one prefill, then one decode step per token after the first, none of dropped tokens
    assert engine.metrics["decode_steps"] == n - 1
    assert engine._inflight is None
    before = len(model.forwards)
    nxt = make_request(PREFIX, DOCS[::-1], [70], max_new_tokens=3)
    (out2,) = run_to_end(engine, [nxt])
    assert out2.token_ids == reference_generate([t for s in nxt.segments for t in s.ids], 3)
    # the next request's prefill is the first forward after the first request's end
    suffix = nxt.segments[-1].ids
    assert model.forwards[before]["ids"][-len(suffix):] == suffix


def test_a_batch_with_one_row_at_its_limit_still_decodes_the_others():
    engine = make_engine("lazy", overlap_decode=True)
    reqs = [make_request(PREFIX, DOCS, [60 + i], max_new_tokens=n) for i, n in enumerate((2, 6))]
    outs = run_to_end(engine, reqs)
    for r, o in zip(reqs, outs):
        assert o.token_ids == reference_generate([t for s in r.segments for t in s.ids], r.params.max_new_tokens)
    assert engine.metrics["decode_steps"] == 5 and engine._inflight is None
