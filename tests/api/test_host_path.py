"""The host path of a request: cached chunks are tokenized and hashed once (``inputs.encodings``), and
``ttft_s`` counts from the call (tokenizing included) while ``engine_ttft_s`` is the engine's part."""
from __future__ import annotations

import time

import pytest

from lazyllm import Chunk
from lazyllm.cache.store import segment_keys
from lazyllm.config import EngineConfig
from lazyllm.inputs import InputProcessor, PromptBuilder
from lazyllm.inputs.chat import build_conversation
from lazyllm.inputs.encodings import ChunkEncodings

DOCS = ["Paris is the capital of France. " * 20, "Berlin is the capital of Germany. " * 20,
        "Rome is the capital of Italy. " * 20]
FP = "test-fingerprint"


class CountingTokenizer:
    """A tokenizer that counts the texts it encodes (everything else is the real one's)."""

    def __init__(self, tok):
        self._tok = tok
        self.texts: list[str] = []

    def __call__(self, text, **kw):
        self.texts.extend(text if isinstance(text, list) else [text])  # a batch: each of its texts
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def chunk_calls(self) -> int:
        return sum(any(d.strip() in t for d in DOCS) for t in self.texts)


def _door(tok, packet_ids=None, encodings=None, chunk_context="isolated", max_context=4096):
    prompts = PromptBuilder(tok, packet_ids, encodings if encodings is not None else ChunkEncodings())
    config = EngineConfig.resolve(chunk_context=chunk_context)
    return InputProcessor(tok, prompts, max_context=max_context, vocab_size=len(tok), config=config, fingerprint=FP)


def _keys(r, chunk_context="isolated", memos=True):
    segs = r.segments
    return segment_keys(FP, chunk_context, segs[0].ids, [s.ids for s in segs[1:-1]],
                        [s.memo for s in segs[:-1]] if memos else None)


def test_a_second_request_over_the_same_chunks_does_not_tokenize_them(tokenizer):
    tok = CountingTokenizer(tokenizer)
    door = _door(tok)
    first = door.generation("Which capital?", DOCS, streaming=False)
    assert tok.chunk_calls() == len(DOCS)
    second = door.generation("Another question?", list(reversed(DOCS)), streaming=False)
    assert tok.chunk_calls() == len(DOCS)  # the question was tokenized, no chunk text was
    assert [s.ids for s in second.segments[1:-1]] == [s.ids for s in reversed(first.segments[1:-1])]
    assert door.prompts.encodings.hits >= len(DOCS)


def _texts(n: int, words: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(['alpha', 'beta', 'gamma'])}{rng.randint(0, 999)}" for _ in range(words))
            for _ in range(n)]


def test_new_chunks_are_tokenized_once_each(tokenizer):
    """A request's new chunks, a repeated one among them: each distinct text tokenized once
    (in batched calls), none again in the next request, which tokenizes only its new one."""
    tok = CountingTokenizer(tokenizer)
    door = _door(tok, max_context=1 << 16)
    docs = _texts(8, 400, seed=1)
    r = door.generation("Which?", docs + docs[:1], streaming=False)
    chunk_texts = [t for t in tok.texts if any(d in t for d in docs)]
    assert sorted(chunk_texts) == sorted(f"{d}\n\n" for d in docs)
    plain = PromptBuilder(tokenizer)  # no cache: one text at a time, the reference
    assert [s.ids for s in r.segments[1:-1]] == [plain.encode(f"{d}\n\n") for d in docs + docs[:1]]
    new = _texts(1, 400, seed=2)
    tok.texts.clear()
    door.generation("Again?", docs[::-1] + new, streaming=False)
    assert [t for t in tok.texts if any(d in t for d in docs + new)] == [f"{new[0]}\n\n"]


def _lines_run(fn) -> int:
    """Python lines executed by ``fn()`` in lazyllm's and transformers' code, on every thread
    (the tokenizing threads included)."""
    import sys
    import threading

    from lazyllm.inputs import prompt

    count = [0]

    def tracer(frame, event, arg):
        f = frame.f_code.co_filename
        if "lazyllm" not in f and "transformers" not in f:
            return None
        if event == "line":
            count[0] += 1
        return tracer

    old_pool, prompt._POOL = prompt._POOL, None  # a pool whose threads start traced
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        threading.settrace(None)
        if prompt._POOL is not None:
            prompt._POOL.shutdown()
        prompt._POOL = old_pool
    return count[0]


def test_new_chunks_cost_no_python_work_per_token(tokenizer):
    """Building a request over 8 new chunks runs as many Python lines for chunks of 400 words as
    for chunks of 1,200 (both long enough to be tokenized on threads): the host path grows with
    the chunks, not with their tokens."""
    door = _door(tokenizer, max_context=1 << 16)
    door.generation("Warm?", _texts(8, 400, seed=3), streaming=False)  # first-use work out of the way
    n = {w: _lines_run(lambda w=w: door.generation("Which?", _texts(8, w, seed=w), streaming=False))
         for w in (400, 1200)}
    assert n[1200] <= n[400] + 8, n


def test_a_changed_text_id_or_packet_is_tokenized_again(tokenizer):
    tok = CountingTokenizer(tokenizer)
    cache = ChunkEncodings()
    door = _door(tok, encodings=cache)
    door.generation("q?", DOCS[:1], streaming=False)
    door.generation("q?", [DOCS[0] + " Also Lyon."], streaming=False)
    assert tok.chunk_calls() == 2
    door.generation("q?", [Chunk(DOCS[0], id="doc-0")], streaming=False)
    assert tok.chunk_calls() == 3
    packed = _door(tok, packet_ids=([1, 2], [3]), encodings=cache)
    r = packed.generation("q?", DOCS[:1], streaming=False)
    assert tok.chunk_calls() == 4
    assert r.segments[1].ids[:2] == [1, 2] and r.segments[1].ids[-1] == 3


def test_the_conversation_path_shares_the_cache(tokenizer):
    tok = CountingTokenizer(tokenizer)
    door = _door(tok)
    msgs = [{"role": "user", "content": "Which capital?"}]
    a = build_conversation(door.prompts, msgs, [Chunk(d) for d in DOCS], None, [])
    b = build_conversation(door.prompts, msgs, [Chunk(d) for d in DOCS], None, [])
    assert tok.chunk_calls() == len(DOCS)
    assert [s.ids for s in a] == [s.ids for s in b]
    plain = PromptBuilder(tokenizer)
    assert [s.ids for s in a] == [s.ids for s in build_conversation(plain, msgs, [Chunk(d) for d in DOCS], None, [])]


@pytest.mark.parametrize("chunk_context", ["isolated", "prefix"])
def test_cached_ids_and_keys_equal_the_uncached_path(tokenizer, chunk_context):
    cached = _door(tokenizer, chunk_context=chunk_context)
    plain = InputProcessor(tokenizer, PromptBuilder(tokenizer), max_context=4096, vocab_size=len(tokenizer))
    for system in (None, "Be brief."):
        for _ in range(2):  # filled, then served from the cache and the key memos
            r = cached.generation("Which capital?", DOCS, system, streaming=False)
            ref = plain.generation("Which capital?", DOCS, system, streaming=False)
            assert [s.ids for s in r.segments] == [s.ids for s in ref.segments]
            assert _keys(r, chunk_context) == _keys(ref, chunk_context, memos=False)
            assert all(s.memo for s in r.segments[:-1])  # hashed by the front door


def test_the_lru_bound_holds(tokenizer):
    texts = [f"Document number {i}: " + "words " * 30 for i in range(12)]
    cache = ChunkEncodings(max_tokens=150, max_entries=100)
    door = _door(tokenizer, encodings=cache)
    for t in texts:
        door.generation("q?", [t], streaming=False)
        assert cache.tokens <= 150
    assert 0 < len(cache) < len(texts)
    small = ChunkEncodings(max_tokens=1 << 20, max_entries=3)
    door = _door(tokenizer, encodings=small)
    for t in texts:
        door.generation("q?", [t], streaming=False)
    assert len(small) == 3  # the prefix and the two latest chunks
    first = small.misses
    door.generation("q?", [texts[-1]], streaming=False)
    assert small.misses == first  # the most recent stayed
    door.generation("q?", [texts[0]], streaming=False)
    assert small.misses == first + 1  # the oldest was dropped


def test_a_chunk_over_the_whole_bound_is_encoded_but_not_kept(tokenizer):
    cache = ChunkEncodings(max_tokens=10)
    door = _door(tokenizer, encodings=cache)
    r = door.generation("q?", DOCS[:1], streaming=False)
    assert len(r.segments[1].ids) > 10 and cache.tokens <= 10


class SlowTokenizer(CountingTokenizer):
    """A tokenizer that takes ``delay`` seconds per text it encodes."""

    delay = 0.0

    def __call__(self, text, **kw):
        time.sleep(self.delay)
        return super().__call__(text, **kw)


@pytest.fixture(scope="module")
def slow_llm(default_llm_parts):
    from lazyllm import LazyLLM

    hf, tok = default_llm_parts
    slow = SlowTokenizer(tok)
    llm = LazyLLM(model=hf, tokenizer=slow, packets=None, warmup=False, progress=False, quality="isolated")
    yield llm, slow
    llm.close()


def test_ttft_counts_from_the_call_tokenizing_included(slow_llm):
    llm, tok = slow_llm
    tok.delay = 0.0
    fast = llm.generate("Which capital?", ["Madrid is in Spain."], max_new_tokens=1)
    assert fast.ttft_s >= fast.engine_ttft_s > 0
    tok.delay = 0.05
    try:  # new chunk texts: each one is tokenized (slowly) before the engine sees the request
        slow = llm.generate("Which capital?", ["Lisbon is in Portugal.", "Oslo is in Norway."], max_new_tokens=1)
        batch = llm.generate_batch([{"question": "Where?", "chunks": ["Vienna is in Austria."]},
                                    {"question": "Where else?", "chunks": ["Prague is in Czechia."]}],
                                   max_new_tokens=1)
    finally:
        tok.delay = 0.0
    # the two new chunks (one batched call) and the suffix: 2 slow encodes (the prefix is cached)
    assert slow.ttft_s >= slow.engine_ttft_s + 0.1
    assert slow.total_s >= slow.ttft_s
    assert all(o.ttft_s >= o.engine_ttft_s for o in batch)
    assert batch[1].ttft_s >= 0.2  # the batch's second request counts from the call, before the first was built


def test_received_at_sets_where_ttft_counts_from(slow_llm):
    llm, _ = slow_llm
    earlier = time.perf_counter() - 60.0  # far enough back for any machine's load
    out = llm.generate("Which capital?", ["Madrid is in Spain."], max_new_tokens=1, received_at=earlier)
    assert out.ttft_s >= 60.0 and out.ttft_s - out.engine_ttft_s >= 60.0


def test_a_large_batch_is_built_in_order_and_a_bad_item_runs_nothing(slow_llm):
    from lazyllm import InvalidRequestError

    llm, _ = slow_llm
    items = [{"question": f"Question {i}?", "chunks": ["Madrid is in Spain."]} for i in range(10)]
    before = llm.engine.metrics["requests"]
    with pytest.raises(InvalidRequestError):
        llm.generate_batch(items[:7] + [{"question": ""}] + items[7:], max_new_tokens=1)
    assert llm.engine.metrics["requests"] == before
    outs = llm.generate_batch(items, max_new_tokens=1)
    assert all(f"Question {i}?" in llm.tokenizer.decode(o.prompt_segments[-1][1]) for i, o in enumerate(outs))


def test_the_floor_of_a_loop():
    from tests.conftest import load_benchmark

    fl = load_benchmark("_common")
    rates = fl.Rates(prefill_token_s=1e-4, step_s=0.01)
    m0 = dict(prefill_tokens=100, decode_steps=10, prefill_s=1.0, decode_s=1.0)
    m1 = dict(prefill_tokens=1100, decode_steps=30, prefill_s=1.5, decode_s=1.6, selection_s=0.1)
    f = fl.floor(rates, m0, m1, wall_s=1.0)
    assert f["floor_s"] == pytest.approx(1000 * 1e-4 + 20 * 0.01)
    assert f["of_floor"] == pytest.approx(0.3) and f["host_s"] == pytest.approx(1.0 - 0.5 - 0.6)
    assert f["selection_s"] == pytest.approx(0.1) and "30%" in fl.floor_line(f)
