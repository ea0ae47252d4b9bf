"""Property-based test of the public API over call sequences: random sequences of ``generate``,
``stream`` abandoned midway, ``score``, ``warm``, ``generate_batch``, tool calls,
``response_format``, ``clear_cache`` and bad input, under every quality preset, on a tiny model.

A single-call test does not see a bug that needs an earlier call to set up the cache (a
repeated ``score`` once crashed on the pages its first call had cached). After every step the
machine checks the contracts: only lazyllm's documented error types for bad input, results of
the documented shape, greedy answers and scores that do not depend on what the cache held,
and cache statistics that add up (no request pins a page once it returned, every page is free
or held by a cache entry, counters never go back).

The budget is small in CI. A longer run: ``pytest tests/api/test_call_sequences_stateful.py
--stateful-examples 400`` (``--stateful-steps`` sets the calls per sequence; see
tests/conftest.py).
"""
from __future__ import annotations

import math
import time

import jsonschema
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from lazyllm import ContextLengthError, InvalidRequestError, LazyLLM
from tests.conftest import make_tiny

PRESETS = ["default", "isolated", "fast", "balanced", "exact", "block-ft"]
DOCS = [f"Document {i}: " + " ".join(f"fact{i}_{j}" for j in range(10 + 4 * i)) for i in range(6)]
QUESTIONS = ["Which fact comes first?", "Summarize the documents.", "q?"]
SYSTEMS = [None, "Answer briefly."]
# the long one spans more than a KV page, so a cached prompt can end inside it
CONTINUATIONS = [" It was lit in 1887 and again in 1901, by the keeper who lived alone in the tower." * 3, " Yes."]
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a fact up", "parameters": {
    "type": "object", "properties": {"fact": {"type": "string", "maxLength": 12}}, "required": ["fact"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
# the errors bad input may raise; anything else escaping a public call is a bug
INPUT_ERRORS = (InvalidRequestError, ContextLengthError)
FINISH = {"stop", "length", "tool_calls"}

chunk_lists = st.lists(st.integers(0, len(DOCS) - 1), max_size=4, unique=True)
requests = st.fixed_dictionaries({"question": st.sampled_from(QUESTIONS), "chunks": chunk_lists,
                                  "system": st.sampled_from(SYSTEMS)})


@pytest.fixture(scope="module")
def engines(tokenizer):
    """One engine per preset over one tiny model, shared by the sequences (each clears the
    caches first)."""
    model = make_tiny("llama", seed=1)
    made = {p: LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=8 << 20,
                       **({} if p == "default" else {"quality": p})) for p in PRESETS}
    yield made
    for llm in made.values():
        llm.close()


class CallSequences(RuleBasedStateMachine):
    def __init__(self, engines: dict[str, LazyLLM], answers: dict, scores: dict):
        super().__init__()
        self.engines, self.answers, self.scores = engines, answers, scores
        for llm in engines.values():  # each sequence starts from an empty cache (and shrinks alone)
            llm.clear_cache()
        self.last_stats = {p: llm.cache_stats() for p, llm in engines.items()}
        self.last = None  # the last call, which ``repeat`` makes again (a bug may need the cache it left)

    def _again(self, rule_fn, **args) -> None:
        self.last = (rule_fn, args)

    @staticmethod
    def _chunks(req: dict) -> list[str]:
        return [DOCS[i] for i in req["chunks"]]

    def _check_output(self, out, max_new_tokens: int) -> None:
        assert out.finish_reason in FINISH, out.finish_reason
        u = out.usage
        assert 0 <= u.cached_tokens <= u.prompt_tokens and u.completion_tokens == len(out.token_ids)
        assert u.completion_tokens <= max_new_tokens
        assert out.finish_reason != "length" or u.completion_tokens == max_new_tokens

    @rule(preset=st.sampled_from(PRESETS), req=requests, n=st.integers(1, 6), sampled=st.booleans())
    def generate(self, preset, req, n, sampled):
        self._again(CallSequences.generate, preset=preset, req=req, n=n, sampled=sampled)
        llm = self.engines[preset]
        kw = dict(temperature=1.0, seed=7) if sampled else {}
        out = llm.generate(req["question"], self._chunks(req), req["system"], max_new_tokens=n, **kw)
        self._check_output(out, n)
        key = (preset, req["question"], tuple(req["chunks"]), req["system"], n, sampled)
        # the cache changes the cost, never the answer: a repeated request gives the same tokens
        assert self.answers.setdefault(key, out.token_ids) == out.token_ids, key

    @rule(preset=st.sampled_from(PRESETS), req=requests, take=st.integers(0, 3))
    def stream_abandoned(self, preset, req, take):
        self._again(CallSequences.stream_abandoned, preset=preset, req=req, take=take)
        stream = self.engines[preset].stream(req["question"], self._chunks(req), req["system"], max_new_tokens=8)
        it = iter(stream)
        for _ in range(take):
            if next(it, None) is None:
                break
        stream.close()

    @rule(preset=st.sampled_from(PRESETS), req=requests, cont=st.sampled_from(CONTINUATIONS))
    def score(self, preset, req, cont):
        self._again(CallSequences.score, preset=preset, req=req, cont=cont)
        sc = self.engines[preset].score(req["question"], self._chunks(req), req["system"], continuation=cont)
        assert len(sc.logprobs) == len(sc.token_ids) > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in sc.logprobs)
        key = (preset, req["question"], tuple(req["chunks"]), req["system"], cont)
        first = self.scores.setdefault(key, sc.logprobs)
        assert max(abs(a - b) for a, b in zip(first, sc.logprobs)) < 1e-4, key

    @rule(preset=st.sampled_from(PRESETS), chunks=chunk_lists, system=st.sampled_from(SYSTEMS))
    def warm(self, preset, chunks, system):
        self._again(CallSequences.warm, preset=preset, chunks=chunks, system=system)
        llm = self.engines[preset]
        res = llm.warm([DOCS[i] for i in chunks], system)
        assert res["chunks"] == len(chunks)
        if llm.engine.planner.caches_chunks:
            assert res["computed_tokens"] >= 0 and res["cached_tokens"] >= 0

    @rule(preset=st.sampled_from(PRESETS), reqs=st.lists(requests, min_size=1, max_size=4))
    def generate_batch(self, preset, reqs):
        self._again(CallSequences.generate_batch, preset=preset, reqs=reqs)
        outs = self.engines[preset].generate_batch(
            [dict(question=r["question"], chunks=self._chunks(r), system=r["system"]) for r in reqs], max_new_tokens=3)
        assert len(outs) == len(reqs)
        for out in outs:
            self._check_output(out, 3)

    @rule(preset=st.sampled_from(PRESETS), req=requests, choice=st.sampled_from(["auto", "required", "none", "lookup"]))
    def tools(self, preset, req, choice):
        self._again(CallSequences.tools, preset=preset, req=req, choice=choice)
        out = self.engines[preset].generate(req["question"], self._chunks(req), req["system"], tools=[TOOL],
                                            tool_choice=choice, max_new_tokens=24)
        self._check_output(out, 24)
        if out.finish_reason == "tool_calls":
            assert choice != "none" and out.tool_calls
            for call in out.tool_calls:
                assert call.name == "lookup"
                jsonschema.validate(call.arguments, TOOL["function"]["parameters"])
        if choice in ("required", "lookup"):  # a call is forced: it ends as a call or is cut
            assert out.finish_reason in ("tool_calls", "length"), out

    @rule(preset=st.sampled_from(PRESETS), req=requests, fmt=st.sampled_from(["schema", "choice"]))
    def response_format(self, preset, req, fmt):
        self._again(CallSequences.response_format, preset=preset, req=req, fmt=fmt)
        rf = SCHEMA if fmt == "schema" else ["yes", "no", "maybe"]
        out = self.engines[preset].generate(req["question"], self._chunks(req), req["system"], response_format=rf,
                                            max_new_tokens=24)
        self._check_output(out, 24)
        if out.finish_reason == "stop":
            if fmt == "schema":
                jsonschema.validate(out.parsed, SCHEMA)
            else:
                assert out.parsed in rf
        else:
            assert out.parsed is None

    @rule(preset=st.sampled_from(PRESETS), bad=st.sampled_from(["empty", "no question", "huge", "tokens", "nul"]))
    def bad_input(self, preset, bad):
        llm = self.engines[preset]
        call = {"empty": lambda: llm.generate("", max_new_tokens=2),
                "no question": lambda: llm.generate(max_new_tokens=2),
                "huge": lambda: llm.generate("q", max_new_tokens=10 ** 6),
                "tokens": lambda: llm.score("q", continuation=[-1]),
                "nul": lambda: llm.warm(["a\x00b"])}[bad]
        with pytest.raises(INPUT_ERRORS):
            call()

    @precondition(lambda self: self.last is not None)
    @rule()
    def repeat(self):
        """The last call again, on the cache it left."""
        fn, args = self.last
        fn(self, **args)

    @rule(preset=st.sampled_from(PRESETS))
    def clear_cache(self, preset):
        assert self.engines[preset].clear_cache() >= 0
        assert self.engines[preset].cache_stats()["pinned_entries"] == 0

    @invariant()
    def cache_stats_add_up(self):
        for preset, llm in self.engines.items():
            s = _settled_stats(llm)
            page_bytes = s["pool_bytes"] // s["pool_pages"]
            # idle: nothing pinned, and every page is free or held by a cache entry (none leaked)
            assert s["pinned_entries"] == 0, (preset, s)
            assert s["free_pages"] * page_bytes + s["resident_bytes"] == s["pool_bytes"], (preset, s)
            assert s["resident_tokens"] <= s["resident_bytes"] // page_bytes * s["page_size"]
            lookups = s["hits"] + s["misses"]
            assert s["hit_rate"] == (s["hits"] / lookups if lookups else 0.0)
            before = self.last_stats[preset]
            for k in ("hits", "misses", "reused_tokens", "computed_tokens", "evictions", "evicted_tokens"):
                assert s[k] >= before[k], (preset, k, before[k], s[k])
            self.last_stats[preset] = s


def _settled_stats(llm: LazyLLM, wait_s: float = 2.0) -> dict:
    """The cache statistics once the engine has released the pages of the request that just
    returned (it frees them on its own thread right after the last event)."""
    deadline = time.monotonic() + wait_s
    while True:
        s = llm.cache_stats()
        page_bytes = s["pool_bytes"] // s["pool_pages"]
        if s["free_pages"] * page_bytes + s["resident_bytes"] == s["pool_bytes"] or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


def test_call_sequences_keep_the_contracts(engines, pytestconfig):
    answers, scores = {}, {}  # across sequences: the same request on the same engine, the same answer
    run_state_machine_as_test(
        lambda: CallSequences(engines, answers, scores),
        settings=settings(max_examples=pytestconfig.getoption("stateful_examples"),
                          stateful_step_count=pytestconfig.getoption("stateful_steps"), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                          derandomize=pytestconfig.getoption("stateful_examples") <= 20))
    for llm in engines.values():  # every engine still serves
        assert llm.generate("q?", [DOCS[0]], max_new_tokens=2).usage.completion_tokens == 2


# -- what the sequences found, each pinned down on its own


@pytest.mark.parametrize("preset", PRESETS)
def test_warm_refuses_bad_input_in_every_mode(engines, preset):
    """``warm`` skips its work in the full-attention modes, but not the check of its input."""
    llm = engines[preset]
    with pytest.raises(InvalidRequestError, match="NUL"):
        llm.warm(["a\x00b"])
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.warm(["fine", " "])
