"""Mixed steps (``LazyLLM(mixed_steps=True, step_token_budget=...)``, ``lazyllm/engine/scheduling/mixed.py``):
decode rows and prefill pieces in one forward under a token budget, long jobs prefilled in
pieces. Checked against the engine without them: the same greedy tokens (torch reference and
the Triton kernels in the interpreter), the same chunk KV in the cache pages, and a step trace
with decode and prefill rows together inside the budget."""
from __future__ import annotations

import threading

import pytest
import torch

from lazyllm import InvalidRequestError, LazyLLM
from tests.conftest import entry_kv, make_tiny
from tests.engine.test_concurrency import DOCS

LONG_DOC = "Report: " + " ".join(f"item{j} costs {j * 7 % 31} units" for j in range(40))
LONG_Q = "Considering " + " ".join(f"clause {j}" for j in range(30)) + ", which item is cheapest?"


def _pair(model, tokenizer, budget, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    off = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=64 << 20, **kw)
    on = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=64 << 20, mixed_steps=True,
                 step_token_budget=budget, **kw)
    assert on.engine.mixed is not None and off.engine.mixed is None
    on.engine.mixed.trace = []
    return off, on


def _clean(llm):
    s = llm.cache_stats()
    cached = sum(len(e.pages) for e in llm.store.entries.values())
    assert s["pinned_entries"] == 0 and not llm.engine.decode_state.rows and llm.engine.mixed.round is None
    assert s["free_pages"] + cached == s["pool_pages"]


def _batch(n_new):
    """Cold and cached chunks, a long chunk and a long question, several lengths."""
    return ([{"question": f"question {i}?", "chunks": [DOCS[i], DOCS[(3 * i + 1) % 16]], "max_new_tokens": n_new}
             for i in range(6)]
            + [{"question": LONG_Q, "chunks": [DOCS[0]], "max_new_tokens": n_new},
               {"question": "Which item?", "chunks": [LONG_DOC, DOCS[2]], "max_new_tokens": n_new}])


def _while_decoding(llm, batch, long_new=40):
    """One request that decodes ``long_new`` tokens, and ``batch`` submitted once it has
    its first token (so their prefills meet its decode steps); the long request's tokens
    and the batch's."""
    stream = llm.stream("Tell me everything.", chunks=DOCS[5:7], max_new_tokens=long_new)
    it = iter(stream)
    next(it)  # it is decoding now
    outs = {}
    t = threading.Thread(target=lambda: outs.setdefault("b", llm.generate_batch(batch)))
    t.start()
    for _ in it:
        pass
    t.join()
    return stream.output.token_ids, [o.token_ids for o in outs["b"]]


def _same_tokens_while_decoding(off, on, batch):
    """``on`` (mixed steps) answers ``batch`` and a long request, arriving while others
    decode, over cold chunks and then cached ones, with ``off``'s tokens."""
    ref_long = off.generate("Tell me everything.", chunks=DOCS[5:7], max_new_tokens=40).token_ids
    ref = [o.token_ids for o in off.generate_batch(batch)]
    for _ in range(2):  # cold chunks, then cached ones
        long, outs = _while_decoding(on, batch)
        assert long == ref_long and outs == ref


def _same_chunk_kv(off, on, tol):
    """Every cached entry of ``on`` holds ``off``'s tokens and KV."""
    assert set(off.store.entries) == set(on.store.entries)
    for key, e in off.store.entries.items():
        f = on.store.entries[key]
        assert e.num_tokens == f.num_tokens
        for a, b in zip(entry_kv(off.store, e), entry_kv(on.store, f)):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)


def _mixed_steps_ok(trace, budget, whole_jobs=False):
    """``whole_jobs``: jobs that are never cut (recomputation) may pass the budget."""
    assert trace, "no mixed step ran"
    assert whole_jobs or all(d + p <= budget for d, p in trace), trace
    assert any(d > 0 and p > 0 for d, p in trace), trace  # decode and prefill rows in one forward


@pytest.mark.parametrize("extra", [{}, {"recompute_first_tokens": 2}, {"reuse": "block"},
                                   {"chunk_context": "prefix"},
                                   {"context_temperature": 1.3, "context_lse_scale": 0.7}])
def test_mixed_steps_give_the_same_tokens(tokenizer, extra):
    """Requests arriving while another decodes, over cold then cached chunks (a long chunk
    and a long question cut into pieces): the tokens of the engine without mixed steps."""
    model = make_tiny("llama", seed=21)
    budget = 24
    off, on = _pair(model, tokenizer, budget, **extra)
    _same_tokens_while_decoding(off, on, _batch(8))
    _mixed_steps_ok(on.engine.mixed.trace, budget, whole_jobs="recompute_first_tokens" in extra)
    m = on.engine.metrics
    assert m["mixed_steps"] == len(on.engine.mixed.trace) and m["decode_steps"] > 0  # plain decode steps too
    _clean(on)
    off.close()
    on.close()


def test_mixed_steps_with_sampling_and_many_threads(tokenizer):
    """Sampled requests (seeded) from many threads: each one's tokens as without mixed steps."""
    from concurrent.futures import ThreadPoolExecutor

    model = make_tiny("qwen3", seed=5)
    off, on = _pair(model, tokenizer, 40)
    reqs = [(f"q{i}?", DOCS[i % 16:i % 16 + 2], 3 + i % 9) for i in range(24)]

    def run(llm, i):
        q, c, n = reqs[i]
        return llm.generate(q, chunks=c, max_new_tokens=n, temperature=0.8, seed=i).token_ids

    ref = [run(off, i) for i in range(len(reqs))]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda i: run(on, i), range(len(reqs))))
    assert got == ref
    assert on.engine.metrics["mixed_steps"] > 0
    _clean(on)
    off.close()
    on.close()


def test_chunked_prefill_writes_the_kv_of_one_pass(tokenizer):
    """A chunk and a question several budgets long, prefilled in pieces: the cache pages
    hold the KV of the one-pass prefill, and the answer is the same."""
    model = make_tiny("llama", seed=3)
    budget = 16
    off, on = _pair(model, tokenizer, budget)
    for llm in (off, on):
        llm.warm([LONG_DOC, DOCS[1]], system="Be brief.")
    trace = on.engine.mixed.trace
    assert len(trace) >= 4 and all(p <= budget for _, p in trace)
    assert len(on.store.entries) >= 3
    _same_chunk_kv(off, on, 1e-5)
    for llm in (off, on):  # a long question over them, prefilled in pieces with mixed steps
        llm.result = llm.generate(LONG_Q, chunks=[LONG_DOC, DOCS[1]], system="Be brief.", max_new_tokens=6)
    assert on.result.token_ids == off.result.token_ids
    assert on.result.usage.cached_tokens == off.result.usage.cached_tokens
    _clean(on)
    off.close()
    on.close()


def test_cancelled_while_prefilling_in_pieces(tokenizer):
    """A request cancelled while its prefill is spread over steps ends cancelled once its
    prefill is over, and leaves nothing pinned or held."""
    from lazyllm import RequestCancelled

    model = make_tiny("llama", seed=8)
    _, on = _pair(model, tokenizer, 8)
    stream = on.stream(LONG_Q, chunks=[LONG_DOC], max_new_tokens=50)

    class CancelAtFirstStep(list):  # the trace's append runs on the engine thread, in the step
        def append(self, x):
            super().append(x)
            stream.cancel()

    on.engine.mixed.trace = trace = CancelAtFirstStep()
    with pytest.raises(RequestCancelled):
        for _ in stream:
            pass
    assert len(trace) > 3  # its prefill went on after the cancellation
    assert on.generate("q?", chunks=DOCS[:2], max_new_tokens=3).token_ids
    _clean(on)
    on.close()


def test_triton_kernels_in_the_interpreter(tokenizer):
    """The Triton kernels (Triton's interpreter on CPU): mixed steps give the same tokens."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter path is for CPU-only machines")
    model = make_tiny("qwen3", seed=2)
    budget = 20
    off, on = _pair(model, tokenizer, budget, attention_backend="triton")
    batch = [{"question": "Which?", "chunks": [DOCS[1], DOCS[4]], "max_new_tokens": 3},
             {"question": "Why?", "chunks": [LONG_DOC[:200]], "max_new_tokens": 3}]
    ref_long = off.generate("Tell me everything.", chunks=DOCS[5:7], max_new_tokens=8).token_ids
    ref = [o.token_ids for o in off.generate_batch(batch)]
    long, outs = _while_decoding(on, batch, long_new=8)
    assert long == ref_long and outs == ref
    _mixed_steps_ok(on.engine.mixed.trace, budget)
    _clean(on)
    off.close()
    on.close()


def test_options_are_checked(tokenizer):
    model = make_tiny("llama", seed=1)
    for bad in ({"mixed_steps": 1}, {"step_token_budget": 0}, {"step_token_budget": 2.5}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            LazyLLM(model=model, tokenizer=tokenizer, **bad)
    llm = LazyLLM(model=model, tokenizer=tokenizer, quality="isolated")
    assert llm.config.mixed_steps is False and llm.config.step_token_budget == 2048 and llm.engine.mixed is None
    llm.close()
