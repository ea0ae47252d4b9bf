"""Adaptive recompute (``escalate_below``): a request whose reuse pass leaves its first answer
token undecided is answered by full attention; every other request keeps the reuse answer.
With ``escalate_tokens``, a later answer token left undecided while decoding makes the
request go on as full attention from that token."""
import random

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.errors import InvalidRequestError
from lazyllm.quality.metrics import answer_margins
from tests.conftest import make_tiny
from tests.hf_reference import hf_generate

DOCS = [f"Record {i}: " + " ".join(f"item{i}_{j}" for j in range(9 + 5 * i)) for i in range(6)]
QUESTIONS = ["Which item is first?", "Name the record with most items.", "What comes after item2_3?",
             "List two records.", "Is item4_1 in the documents?", "Say one word."]


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", seed=5)


def _llm(model, tokenizer, **kw):
    return LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=32 << 20, progress=False, **kw)


def _prompts(seed):
    rng = random.Random(seed)
    return [(q, rng.sample(DOCS, 4)) for q in QUESTIONS]


@pytest.mark.parametrize("kw", [dict(quality="fast"), dict(quality="balanced"),
                                dict(chunk_context="isolated", recompute_ratio=0.0, recompute_first_tokens=0,
                                     packets=None),
                                dict(reuse="block", recompute_ratio=0.0, recompute_first_tokens=0, packets=None)])
def test_escalating_every_request_answers_as_full_attention(model, tokenizer, kw):
    """A margin is below 1 unless one token has all the probability: every request over
    documents in another order than they were cached escalates, and its greedy answer is
    full attention's token for token."""
    llm = _llm(model, tokenizer, escalate_below=1.0, **kw)
    llm.warm(DOCS, progress=False)
    n = 0
    for q, docs in _prompts(1):
        out = llm.generate(q, chunks=docs, max_new_tokens=8)
        assert out.token_ids == hf_generate(model, out.prompt_token_ids, 8, llm.eos_token_ids)
        n += 1
    assert llm.engine.metrics.escalations == n
    llm.close()


def test_scores_escalate_too_and_equal_full_attention(model, tokenizer):
    exact = _llm(model, tokenizer, quality="exact")
    esc = _llm(model, tokenizer, quality="fast", escalate_below=1.0)
    esc.warm(DOCS, progress=False)
    for q, docs in _prompts(2)[:3]:
        cont = list(exact.generate(q, chunks=docs, max_new_tokens=6).token_ids)
        a = exact.score(q, chunks=docs, continuation=cont, return_logits=True)
        b = esc.score(q, chunks=docs, continuation=cont, return_logits=True)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
        assert b.usage.cached_chunk_tokens < a.usage.prompt_tokens  # every chunk token away from home recomputed
    exact.close()
    esc.close()


def test_only_the_requests_below_the_threshold_escalate(model, tokenizer):
    """The margin the engine reads is the reuse pass's: requests whose ``fast`` first-token
    margin (measured by a score over the same cache) is below the threshold are full
    attention's, the others keep ``fast``'s answer."""
    fast = _llm(model, tokenizer, quality="fast")
    fast.warm(DOCS, progress=False)
    prompts = _prompts(3)
    margins, answers = [], []
    for q, docs in prompts:
        out = fast.generate(q, chunks=docs, max_new_tokens=6)
        sc = fast.score(q, chunks=docs, continuation=list(out.token_ids), return_logits=True)
        margins.append(answer_margins(sc.logits)[0])
        answers.append(list(out.token_ids))
    fast.close()
    ms = sorted(margins)
    tau = (ms[2] + ms[3]) / 2  # half of them below
    assert ms[2] < tau < ms[3]
    esc = _llm(model, tokenizer, quality="fast", escalate_below=tau, escalate_tokens=1)
    esc.warm(DOCS, progress=False)
    for (q, docs), m, ans in zip(prompts, margins, answers):
        before = esc.engine.metrics.escalations
        out = esc.generate(q, chunks=docs, max_new_tokens=6)
        escalated = esc.engine.metrics.escalations - before
        assert escalated == (m < tau)
        if m < tau:
            assert out.token_ids == hf_generate(model, out.prompt_token_ids, 6, esc.eos_token_ids)
        else:
            assert list(out.token_ids) == ans
    esc.close()


def test_batched_requests_escalate_alone_and_finish(model, tokenizer):
    llm = _llm(model, tokenizer, quality="balanced", escalate_below=1.0)
    llm.warm(DOCS, progress=False)
    outs = llm.generate_batch([dict(question=q, chunks=d, max_new_tokens=5) for q, d in _prompts(4)])
    for o in outs:
        assert o.token_ids == hf_generate(model, o.prompt_token_ids, 5, llm.eos_token_ids)
    assert llm.engine.metrics.escalations == len(outs)
    llm.close()


def _window_threshold(margins: list[list[float]], window: int) -> float:
    """A threshold in a clear gap between the measured margins under which some request keeps
    its first token and escalates at a later one, and another never escalates."""
    values = sorted({m for ms in margins for m in ms[:window]})
    for lo, hi in zip(values, values[1:]):
        tau = (lo + hi) / 2
        later = any(ms[0] > tau and min(ms[:window]) < tau for ms in margins)
        never = any(min(ms[:window]) > tau for ms in margins)
        if later and never and hi - lo > max(1e-6, 0.05 * hi):
            return tau
    raise AssertionError(f"no threshold separates these margins: {margins}")


@pytest.mark.parametrize("kw", [dict(overlap_decode=True), dict(overlap_decode=False), dict(mixed_steps=True)])
def test_a_later_undecided_token_goes_on_as_full_attention(model, tokenizer, kw):
    """``escalate_tokens=4``: the reuse setting's own margins over its first 4 answer tokens
    (a score of its answer over the same cache); a request whose margin falls below the
    threshold at token ``p`` keeps its first ``p`` tokens and continues as full attention
    after them (transformers' greedy continuation of the prompt and those tokens); the
    others keep the reuse answer."""
    n, window = 8, 4
    fast = _llm(model, tokenizer, quality="fast")
    fast.warm(DOCS, progress=False)
    prompts = _prompts(5) + _prompts(6)
    answers, margins = [], []
    for q, docs in prompts:
        out = fast.generate(q, chunks=docs, max_new_tokens=n)
        sc = fast.score(q, chunks=docs, continuation=list(out.token_ids), return_logits=True)
        answers.append(list(out.token_ids))
        margins.append(answer_margins(sc.logits))
    fast.close()
    tau = _window_threshold(margins, window)
    esc = _llm(model, tokenizer, quality="fast", escalate_below=tau, escalate_tokens=window, **kw)
    esc.warm(DOCS, progress=False)
    later = 0
    for (q, docs), ans, ms in zip(prompts, answers, margins):
        before = esc.engine.metrics.escalations
        out = esc.generate(q, chunks=docs, max_new_tokens=n)
        p = next((i for i, m in enumerate(ms[:min(window, len(ans))]) if m < tau), None)
        assert esc.engine.metrics.escalations - before == (p is not None)
        if p is None:
            assert list(out.token_ids) == ans
        else:
            later += p > 0
            head = ans[:p]
            tail = hf_generate(model, list(out.prompt_token_ids) + head, n - p, esc.eos_token_ids)
            assert list(out.token_ids) == head + tail, p
            assert len(out.token_ids) == len(head + tail)
    assert later > 0
    assert esc.engine.metrics.preemptions == 0  # escalations are not counted as preemptions
    esc.close()


@pytest.mark.parametrize("bad", [-0.1, 1.5, "x", float("nan")])
def test_bad_thresholds_are_refused(model, tokenizer, bad):
    with pytest.raises(InvalidRequestError, match="escalate_below"):
        _llm(model, tokenizer, escalate_below=bad)


@pytest.mark.parametrize("bad", [0, 65, 2.0, "4", True])
def test_bad_windows_are_refused(model, tokenizer, bad):
    with pytest.raises(InvalidRequestError, match="escalate_tokens"):
        _llm(model, tokenizer, escalate_below=0.1, escalate_tokens=bad)


def test_escalation_needs_cached_chunks(model, tokenizer):
    with pytest.raises(InvalidRequestError, match="escalate_below needs"):
        _llm(model, tokenizer, quality="exact", escalate_below=0.2)
    assert _llm(model, tokenizer, escalate_below=0.25).config.escalate_below == 0.25


def test_escalation_takes_no_packet(default_llm_parts):
    """Full attention's prompt has no packet tokens, so an engine that escalates carries none:
    the shipped packet is not taken, and an explicit one is refused."""
    model, tok = default_llm_parts
    kw = dict(model=model, tokenizer=tok, chunk_context="isolated", recompute_ratio=0.0, recompute_first_tokens=0,
              kv_cache_bytes=32 << 20, progress=False)
    with_packet = LazyLLM(**kw)
    assert with_packet.packets is not None  # the shipped packet, where nothing escalates
    with_packet.close()
    esc = LazyLLM(escalate_below=0.2, **kw)
    assert esc.packets is None
    esc.close()
    with pytest.raises(InvalidRequestError, match="packets are not supported with escalate_below"):
        LazyLLM(escalate_below=0.2, packets="some_packet.safetensors", **kw)
