"""The host path of a request: cached chunks are tokenized and hashed once (``inputs.encodings``)."""
from __future__ import annotations

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
        self.texts.append(text)
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def chunk_calls(self) -> int:
        return sum(any(d.strip() in t for d in DOCS) for t in self.texts)


def _door(tok, packet_ids=None, encodings=None, chunk_context="isolated"):
    prompts = PromptBuilder(tok, packet_ids, encodings if encodings is not None else ChunkEncodings())
    config = EngineConfig.resolve(chunk_context=chunk_context)
    return InputProcessor(tok, prompts, max_context=4096, vocab_size=len(tok), config=config, fingerprint=FP)


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
