"""Overlapped decode (``LazyLLM(overlap_decode=...)``, ``Engine.async_decode``; by default on
where decode runs from CUDA graphs, off on CPU): step n + 1 is launched with step n's picks
as its input before the host reads step n. On CPU every op is
synchronous, so these tests check the bookkeeping (token feedback by row, dropped tokens of
requests that stop, length limits, preemption, sampled rows) against the one-step-at-a-
time engine, token for token."""
from lazyllm import LazyLLM
from tests.conftest import make_tiny
from tests.engine.test_concurrency import DOCS, _requests, _run_concurrently


def _pair(model, tokenizer, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    sync = LazyLLM(model=model, tokenizer=tokenizer, overlap_decode=False, **kw)
    over = LazyLLM(model=model, tokenizer=tokenizer, overlap_decode=True, **kw)
    assert over.engine.async_decode and not sync.engine.async_decode
    return sync, over


def test_overlap_decode_option(tokenizer):
    """The default follows the CUDA graphs (none on CPU: off); a bool is taken as given;
    anything else is refused."""
    import pytest

    from lazyllm import InvalidRequestError

    model = make_tiny("llama", seed=2)
    llm = LazyLLM(model=model, tokenizer=tokenizer, quality="isolated")
    assert llm.engine.async_decode is False and not llm.engine.graphs.enabled
    llm.close()
    for bad in ("yes", 1, 0.5):
        with pytest.raises(InvalidRequestError, match="overlap_decode"):
            LazyLLM(model=model, tokenizer=tokenizer, overlap_decode=bad, quality="isolated")


def _clean(llm):
    s = llm.cache_stats()
    cached = sum(len(e.pages) for e in llm.store.entries.values())
    assert s["pinned_entries"] == 0 and not llm.engine.decode_state.rows
    assert s["free_pages"] + cached == s["pool_pages"]


def test_concurrent_requests_equal_one_step_at_a_time(tokenizer):
    model = make_tiny("llama", seed=21)
    reqs = _requests(96, seed=3)
    sync, over = _pair(model, tokenizer, kv_cache_bytes=64 << 20)
    ref = [sync.generate(q, chunks=c, max_new_tokens=n).token_ids for q, c, n in reqs]
    assert _run_concurrently(over, reqs, 24) == ref
    m = over.engine.metrics
    assert m["overlapped_steps"] > 0.3 * m["decode_steps"]  # the overlap really ran
    solo = [over.generate(q, chunks=c, max_new_tokens=n).token_ids for q, c, n in reqs[:8]]
    assert solo == ref[:8]
    _clean(over)
    sync.close()
    over.close()


def test_lengths_eos_and_stop_strings(tokenizer):
    """Requests of many lengths in one batch: each gets exactly its max_new_tokens (the
    step that reaches a limit is not overlapped), and a request that stops on a stop string
    or EOS has its one extra token dropped."""
    model = make_tiny("llama", seed=4)
    sync, over = _pair(model, tokenizer)
    probe = sync.generate("q?", chunks=DOCS[:2], max_new_tokens=12)
    stop_text = probe.text[len(probe.text) // 2: len(probe.text) // 2 + 2]
    eos = probe.token_ids[5]
    batch = [{"question": "q?", "chunks": DOCS[:2], "max_new_tokens": n} for n in (1, 2, 3, 7, 12)]
    batch += [{"question": "q?", "chunks": DOCS[:2], "max_new_tokens": 12, "stop": [stop_text]}]
    for llm in (sync, over):
        llm.engine.output.eos_ids = set(sync.engine.output.eos_ids)
    outs_sync = sync.generate_batch(batch)
    outs = over.generate_batch(batch)
    assert [o.token_ids for o in outs] == [o.token_ids for o in outs_sync]
    assert [o.text for o in outs] == [o.text for o in outs_sync]
    assert [len(o.token_ids) for o in outs[:5]] == [1, 2, 3, 7, 12]
    assert outs[5].finish_reason == "stop" and stop_text not in outs[5].text
    for llm in (sync, over):  # a token of the answer as EOS: every request stops there
        llm.engine.output.eos_ids = {eos}
    a, b = sync.generate_batch(batch[2:5]), over.generate_batch(batch[2:5])
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    assert [o.finish_reason for o in b] == [o.finish_reason for o in a]
    _clean(over)
    sync.close()
    over.close()


def test_sampled_requests_fall_back_and_streams_match(tokenizer):
    """A sampled request in the batch overlaps like the greedy ones (its token is drawn on
    the device from its seed and token index), with the same tokens as one step at a time;
    streamed text and cancelled streams behave as without overlap."""
    model = make_tiny("llama", seed=8)
    sync, over = _pair(model, tokenizer)
    batch = [{"question": "q?", "chunks": DOCS[:3], "max_new_tokens": 10},
             {"question": "q2?", "chunks": DOCS[1:3], "max_new_tokens": 14, "temperature": 1.3, "seed": 3},
             {"question": "q3?", "chunks": DOCS[:1], "max_new_tokens": 9}]
    assert [o.token_ids for o in over.generate_batch(batch)] == [o.token_ids for o in sync.generate_batch(batch)]
    ref = sync.generate("q?", chunks=DOCS[:3], max_new_tokens=10).text
    assert "".join(over.stream("q?", chunks=DOCS[:3], max_new_tokens=10)) == ref
    it = over.stream("q?", chunks=DOCS[:3], max_new_tokens=50)
    next(it)
    it.close()
    assert over.generate("q?", chunks=DOCS[:3], max_new_tokens=3).usage.completion_tokens == 3
    _clean(over)
    sync.close()
    over.close()


def test_decode_step_log_with_overlap(tokenizer):
    model = make_tiny("llama", seed=1)
    _, over = _pair(model, tokenizer)
    over.generate_batch([{"question": f"q{i}?", "chunks": DOCS[:2]} for i in range(3)], max_new_tokens=20)
    sizes = [b for b, dt in over.engine.decode_step_log]
    assert 3 in sizes and all(dt > 0 for _, dt in over.engine.decode_step_log)
    over.close()


def test_randomized_mix_equals_one_step_at_a_time(tokenizer):
    """Seeded random mixes from 16 threads: lengths 1-14, stop strings, seeded sampling, a
    pool small enough to preempt; every output (tokens, text, finish reason) equals the
    one-step engine's, and the pool ends clean."""
    import random as _random

    model = make_tiny("llama", seed=9)
    probe = LazyLLM(model=model, tokenizer=tokenizer, quality="isolated")
    words = probe.generate("q?", chunks=DOCS[:2], max_new_tokens=14).text.split()
    probe.close()
    spec = make_tiny("llama", seed=9).config
    head_dim = spec.hidden_size // spec.num_attention_heads
    page_bytes = 2 * spec.num_hidden_layers * 16 * spec.num_key_value_heads * head_dim * 4
    for seed in (1, 2):
        rng = _random.Random(seed)
        batch = []
        for i in range(40):
            req = {"question": f"question {i} {rng.randint(0, 9)}?", "chunks": rng.sample(DOCS, rng.randint(1, 3)),
                   "max_new_tokens": rng.randint(1, 14)}
            if rng.random() < 0.25 and words:
                req["stop"] = [rng.choice(words)]
            if rng.random() < 0.2:
                req.update(temperature=1.2, seed=rng.randint(0, 99))
            batch.append(req)
        outs = {}
        for overlap in (False, True):
            # batch-invariant numerics: 16 threads submit, so which requests share a step depends on
            # timing, and a near-tie under a sampled draw must not flip with the batch it landed in
            llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=90 * page_bytes, overlap_decode=overlap,
                          quality="isolated", batch_invariant=True)
            got = [None] * len(batch)

            def work(i, llm=llm, got=got, batch=batch):
                kw = dict(batch[i])
                got[i] = llm.generate(kw.pop("question"), **kw)

            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(16) as ex:
                list(ex.map(work, range(len(batch))))
            outs[overlap] = [(o.token_ids, o.text, o.finish_reason) for o in got]
            if overlap:
                assert llm.engine.metrics["overlapped_steps"] > 0
            assert llm.cache_stats()["evictions"] > 0  # the pool was under pressure (seed 1 also preempts)
            _clean(llm)
            llm.close()
        assert outs[True] == outs[False]
