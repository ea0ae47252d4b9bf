"""The output processor: tokens to text, when a request ends, and the result it hands out;
no model (logits are made up, the tokenizer is a fake)."""
import pytest
import torch

from lazyllm.engine.metrics import EngineMetrics
from lazyllm.engine.output import OutputProcessor
from lazyllm.engine.request import PrefillPlan, Scoring
from lazyllm.errors import LazyLLMError, RequestCancelled
from tests.engine.fakes import EOS, VOCAB, FakeTokenizer, make_request


def _out(max_context=100):
    return OutputProcessor(FakeTokenizer(), {EOS}, max_context, EngineMetrics())


def _events(r):
    out = []
    while not r.events.empty():
        out.append(r.events.get())
    return out


def test_greedy_tokens_stream_as_text_until_the_length_limit():
    op = _out()
    r = make_request([2], [], [3], max_new_tokens=3)
    r.state.next_pos = 2
    done = [op.emit(r, t) for t in (7, 8, 9)]
    assert done == [False, False, True] and r.state.finish_reason == "length"
    assert r.state.generated == [7, 8, 9] and r.state.first_token_time > 0
    assert "".join(v for k, v in _events(r) if k == "delta") == "<7><8><9>"


class _Grammar:
    """A token constraint that accepts ``allowed`` tokens and is complete after ``n`` of them."""

    def __init__(self, allowed, n):
        self.allowed, self.n, self.seen = set(allowed), n, 0

    def fill_bitmask(self, bitmask, row):
        raise AssertionError("the output processor never fills masks")

    def accept(self, token):
        self.seen += token in self.allowed
        return token in self.allowed

    def is_terminated(self):
        return self.seen >= self.n


def test_a_complete_grammar_stops_the_request():
    op = _out()
    r = make_request([2], [], [3], max_new_tokens=9)
    r.constraint = _Grammar({7, 8}, 2)
    assert [op.emit(r, t) for t in (7, 8)] == [False, True] and r.state.finish_reason == "stop"
    assert r.constraint.seen == 2


def test_a_token_the_constraint_rejects_is_an_error():
    op = _out()
    r = make_request([2], [], [3], max_new_tokens=9)
    r.constraint = _Grammar({7}, 5)
    with pytest.raises(LazyLLMError):
        op.emit(r, 8)
    assert r.state.generated == []


def test_eos_stops_and_is_not_text():
    op = _out()
    r = make_request([2], [], [3], max_new_tokens=5)
    assert not op.emit(r, 7)
    assert op.emit(r, EOS)
    assert r.state.finish_reason == "stop" and r.state.generated == [7, EOS]
    assert "".join(v for k, v in _events(r) if k == "delta") == "<7>"


def test_a_stop_string_ends_the_request_and_is_cut_from_the_text():
    op = _out()
    r = make_request([2], [], [3], max_new_tokens=9, stop=("<9>",))
    ends = [op.emit(r, t) for t in (7, 8, 9)]
    assert ends == [False, False, True] and r.state.finish_reason == "stop"
    assert r.detok.text == "<7><8>"


def test_the_model_context_ends_a_request():
    op = _out(max_context=10)
    r = make_request([2], [], [3], max_new_tokens=50)
    r.state.next_pos = 10
    assert op.emit(r, 7) and r.state.finish_reason == "length"


def test_a_non_streaming_request_gets_its_text_once_at_the_end():
    op = _out()
    r = make_request([2], [], [3], max_new_tokens=2)
    r.streaming = False
    op.emit(r, 7)
    assert _events(r) == []
    op.emit(r, 8)
    assert r.detok.text == "<7><8>"


def test_done_hands_out_the_result_with_usage():
    op = _out()
    r = make_request([2, 2], [[5, 6, 7]], [3], max_new_tokens=2)
    r.plan = PrefillPlan(cached_tokens=5, cached_chunk_tokens=3)
    for t in (7, 8):
        op.emit(r, t)
    _events(r)
    op.done(r)
    (kind, res), = _events(r)
    assert kind == "done" and res.token_ids == [7, 8] and res.text == "<7><8>" and res.finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.cached_tokens, res.usage.completion_tokens) == (6, 5, 2)
    assert res.usage.cached_chunk_tokens == 3 and res.chunk_ids == ["5"]
    assert [k for k, _ in res.prompt_segments] == ["prefix", "chunk", "suffix"]
    assert op.metrics["requests"] == 1


def test_fail_hands_out_the_error_and_counts_it():
    op = _out()
    r, c = make_request([2], [], [3]), make_request([2], [], [3])
    op.fail(r, ValueError("bad"))
    op.fail(c, RequestCancelled("cancelled"))
    assert isinstance(_events(r)[0][1], ValueError) and isinstance(_events(c)[0][1], RequestCancelled)
    assert op.metrics["failed"] == 1 and op.metrics["cancelled"] == 1


def test_score_gives_the_log_probabilities_of_the_continuation():
    op = _out()
    r = make_request([2], [], [3, 4], max_new_tokens=1)
    r.score = Scoring([4, 9], list(r.segments))
    r.plan = PrefillPlan(computed_tokens=3)
    logits = torch.randn(2, VOCAB)
    res = op.score(r, logits)
    want = torch.log_softmax(logits, -1)[[0, 1], [4, 9]]
    assert res.token_ids == [4, 9]
    assert torch.allclose(torch.tensor(res.logprobs), want)
    assert res.logits is None and res.prefilled_tokens == 3
