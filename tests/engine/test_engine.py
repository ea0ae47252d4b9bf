"""Engine behaviour: reuse across orders, streaming, batching, sampling, budgets, bad input."""
import asyncio
import random

import pytest
import torch

import lazyllm
from lazyllm import (
    CacheCapacityError,
    Chunk,
    ContextLengthError,
    InvalidRequestError,
    LazyLLM,
    ModelLoadError,
    UnsupportedModelError,
)
from tests.conftest import make_tiny

DOCS = [f"Document {i}: " + " ".join(f"fact{i}_{j}" for j in range(12 + 3 * i)) for i in range(8)]


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny("llama", seed=1)


def _llm(model, tok, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    kw.setdefault("kv_cache_bytes", 32 << 20)
    return LazyLLM(model=model, tokenizer=tok, **kw)


@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("lazy", "prefix"), ("block", "isolated"),
                                       ("block", "prefix")])
def test_position_independence_warm_equals_cold(tiny_model, tokenizer, reuse, ctx):
    rng = random.Random(7)
    question, chunks = "Which fact comes first?", rng.sample(DOCS, 4)
    cold = _llm(tiny_model, tokenizer, reuse=reuse, chunk_context=ctx)
    ref = cold.generate(question, chunks=chunks, max_new_tokens=10)
    assert ref.usage.cached_tokens == 0
    warm = _llm(tiny_model, tokenizer, reuse=reuse, chunk_context=ctx)
    for _ in range(3):  # same chunks in other orders, with other neighbours
        others = rng.sample(DOCS, 2) + chunks
        rng.shuffle(others)
        warm.generate("Something else?", chunks=others, max_new_tokens=3)
    out = warm.generate(question, chunks=chunks, max_new_tokens=10)
    assert out.token_ids == ref.token_ids
    chunk_tokens = sum(len(ids) for kind, ids in out.prompt_segments if kind == "chunk")
    prefix_tokens = len(out.prompt_segments[0][1])
    assert out.usage.cached_tokens == chunk_tokens + prefix_tokens
    assert out.prompt_segments == ref.prompt_segments
    cold.close()
    warm.close()


def test_prefix_mode_reuses_identical_prefix_only(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer, reuse="prefix")
    a = llm.generate("q1?", chunks=DOCS[:3], max_new_tokens=2)
    b = llm.generate("q2?", chunks=DOCS[:3], max_new_tokens=2)
    c = llm.generate("q1?", chunks=[DOCS[1], DOCS[0], DOCS[2]], max_new_tokens=2)
    ps = llm.store.pool.page_size
    assert a.usage.cached_tokens == 0
    assert b.usage.cached_tokens > 0 and b.usage.cached_tokens % ps == 0
    # reordering changes the prefix right after the system header: little or nothing reused
    assert c.usage.cached_tokens < b.usage.cached_tokens
    llm.close()


def test_none_mode_reuses_nothing(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer, reuse="none")
    llm.generate("q?", chunks=DOCS[:2], max_new_tokens=2)
    assert llm.generate("q?", chunks=DOCS[:2], max_new_tokens=2).usage.cached_tokens == 0
    llm.close()


def test_stream_equals_generate_and_batch_equals_solo(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    qs = [("first?", DOCS[:3]), ("second?", DOCS[2:5]), ("third?", [DOCS[4], DOCS[0]])]
    solo = [llm.generate(q, chunks=c, max_new_tokens=8) for q, c in qs]
    streamed = "".join(llm.stream(qs[0][0], chunks=qs[0][1], max_new_tokens=8))
    assert streamed == solo[0].text
    batch = llm.generate_batch([{"question": q, "chunks": c} for q, c in qs], max_new_tokens=8)
    assert [o.token_ids for o in batch] == [o.token_ids for o in solo]
    outs = asyncio.run(_gather(llm, qs))
    assert [o.token_ids for o in outs] == [o.token_ids for o in solo]
    llm.close()


async def _gather(llm, qs):
    return await asyncio.gather(*(llm.agenerate(q, chunks=c, max_new_tokens=8) for q, c in qs))


def test_astream(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    ref = llm.generate("q?", chunks=DOCS[:2], max_new_tokens=6).text

    async def run():
        return "".join([d async for d in llm.astream("q?", chunks=DOCS[:2], max_new_tokens=6)])

    assert asyncio.run(run()) == ref
    llm.close()


def test_sampling_seed_topk_topp(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    kw = dict(chunks=DOCS[:2], max_new_tokens=12)
    greedy = llm.generate("q?", **kw)
    a = llm.generate("q?", temperature=1.5, seed=5, **kw)
    b = llm.generate("q?", temperature=1.5, seed=5, **kw)
    c = llm.generate("q?", temperature=1.5, seed=6, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids or a.token_ids != greedy.token_ids
    assert llm.generate("q?", temperature=1.5, top_k=1, seed=9, **kw).token_ids == greedy.token_ids
    assert llm.generate("q?", temperature=1.5, top_p=1e-6, seed=9, **kw).token_ids == greedy.token_ids
    llm.close()


def test_sampled_request_batched_with_a_greedy_one_keeps_sampling(tiny_model, tokenizer):
    """In a decode batch that mixes greedy and sampled requests, the sampled one still
    samples (with its own seed), as it does alone."""
    llm = _llm(tiny_model, tokenizer)
    kw = dict(chunks=DOCS[:2], max_new_tokens=12)
    solo = llm.generate("q?", temperature=1.5, seed=5, **kw)
    greedy = llm.generate("q?", **kw)
    assert solo.token_ids != greedy.token_ids  # the seed really samples something else
    mixed = llm.generate_batch([{"question": "q?"}, {"question": "q?", "temperature": 1.5, "seed": 5}], **kw)
    assert mixed[0].token_ids == greedy.token_ids
    assert mixed[1].token_ids == solo.token_ids
    llm.close()


def test_stop_strings_and_max_new_tokens(default_llm_parts):
    model, tok = default_llm_parts
    llm = _llm(model, tok)
    q = "Write a short sentence about the sea."
    full = llm.generate(q, max_new_tokens=40)
    assert full.usage.completion_tokens <= 40
    assert len(full.text) > 12, full.text
    mid = len(full.text) // 2
    stop = full.text[mid:mid + 3]
    cut = full.text.find(stop)
    out = llm.generate(q, max_new_tokens=40, stop=[stop])
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    assert out.usage.completion_tokens < full.usage.completion_tokens
    assert "".join(llm.stream(q, max_new_tokens=40, stop=stop)) == out.text
    one = llm.generate("Hi", max_new_tokens=1)
    assert one.usage.completion_tokens == 1 and one.finish_reason in ("length", "stop")
    llm.close()


def test_warm_then_query_reuses(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    w = llm.warm(DOCS[:5], system="sys")
    assert w["computed_tokens"] > 0 and w["cached_tokens"] == 0
    assert llm.warm(DOCS[:5], system="sys")["computed_tokens"] == 0
    out = llm.generate("q?", chunks=DOCS[4::-1], system="sys", max_new_tokens=2)
    assert out.usage.cached_tokens == out.usage.prompt_tokens - len(out.prompt_segments[-1][1])
    s = llm.cache_stats()
    for key in ("hits", "misses", "hit_rate", "reused_tokens", "resident_bytes", "evictions"):
        assert key in s
    assert s["hits"] > 0 and s["resident_bytes"] > 0 and s["pinned_entries"] == 0
    llm.close()


def test_small_budget_evicts_and_outputs_stay_identical(tiny_model, tokenizer):
    big = _llm(tiny_model, tokenizer)
    spec = big.model.spec
    page_bytes = 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4
    small = _llm(tiny_model, tokenizer, kv_cache_bytes=40 * page_bytes)
    rng = random.Random(3)
    for i in range(8):
        chunks = rng.sample(DOCS, 3)
        assert small.generate(f"q{i}?", chunks=chunks, max_new_tokens=5).token_ids == \
            big.generate(f"q{i}?", chunks=chunks, max_new_tokens=5).token_ids
    s = small.cache_stats()
    assert s["evictions"] > 0 and s["pinned_entries"] == 0
    assert s["free_pages"] + sum(len(e.pages) for e in small.store.entries.values()) == s["pool_pages"]
    big.close()
    small.close()


def test_budget_smaller_than_one_request_is_a_clear_error(tiny_model, tokenizer):
    spec = make_tiny("llama").config
    page_bytes = 2 * spec.num_hidden_layers * 16 * spec.num_key_value_heads * spec.head_dim * 4
    llm = _llm(tiny_model, tokenizer, kv_cache_bytes=4 * page_bytes)
    with pytest.raises(CacheCapacityError):
        llm.generate("q?", chunks=DOCS, max_new_tokens=4)
    assert llm.generate("q?", max_new_tokens=2).usage.completion_tokens >= 1  # still serving
    llm.close()


def test_stream_abandoned_midway_frees_pages(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    before = llm.cache_stats()["free_pages"]
    it = llm.stream("q?", chunks=DOCS[:3], max_new_tokens=50)
    next(it)
    it.close()
    out = llm.generate("q?", chunks=DOCS[:3], max_new_tokens=3)  # the engine keeps serving
    assert out.usage.completion_tokens == 3
    s = llm.cache_stats()
    cached = sum(len(e.pages) for e in llm.store.entries.values())
    assert s["pinned_entries"] == 0 and s["free_pages"] + cached == s["pool_pages"]
    assert before == s["pool_pages"]
    llm.close()


BAD_REQUESTS = [
    dict(question=""), dict(question="   "), dict(question=None), dict(question=42),
    dict(chunks="a single string"), dict(chunks=[""]), dict(chunks=["ok", "  \n"]), dict(chunks=[3]),
    dict(chunks=[Chunk("a", id="x"), Chunk("b", id="x")]),
    dict(temperature=-1.0), dict(temperature="hot"), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
    dict(max_new_tokens=0), dict(max_new_tokens=-5), dict(max_new_tokens=2.5), dict(max_new_tokens=10**9),
    dict(seed="x"), dict(chunks=["tiny"] * 5000),
    dict(stop=5), dict(stop=[""]), dict(stop=["ok", 3]), dict(question="bad \ud800 surrogate"),
    dict(system=7), dict(timeout=-1),
]


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[str(b)[:40] for b in BAD_REQUESTS])
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(tiny_model, tokenizer, bad):
    llm = _llm(tiny_model, tokenizer)
    args = dict(question="fine?", chunks=["a document"], max_new_tokens=2)
    args.update(bad)
    q = args.pop("question")
    with pytest.raises(InvalidRequestError):
        llm.generate(q, **args)
    assert llm.generate("fine?", chunks=["a document"], max_new_tokens=2).usage.completion_tokens >= 1
    llm.close()


def test_request_longer_than_context(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    long_chunk = "word " * 5000  # > 4096 positions of the tiny config
    with pytest.raises(ContextLengthError):
        llm.generate("q?", chunks=[long_chunk])
    assert llm.generate("q?", max_new_tokens=1).usage.completion_tokens == 1
    llm.close()


def test_bad_constructor_arguments(tiny_model, tokenizer):
    with pytest.raises(InvalidRequestError):
        LazyLLM(model=tiny_model, tokenizer=tokenizer, reuse="sometimes", quality="isolated")
    with pytest.raises(InvalidRequestError):
        LazyLLM(model=tiny_model, tokenizer=tokenizer, chunk_context="everything", quality="isolated")
    with pytest.raises(InvalidRequestError):
        LazyLLM(model=tiny_model, tokenizer=tokenizer, kv_cache_bytes=-1, quality="isolated")
    with pytest.raises(InvalidRequestError):
        LazyLLM(model=tiny_model, quality="isolated")
    with pytest.raises(ModelLoadError):
        LazyLLM("/no/such/model/dir", quality="isolated")
    with pytest.raises(ModelLoadError):
        LazyLLM("./missing.gguf", quality="isolated")


def test_unsupported_architecture_names_supported_ones(tokenizer):
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(UnsupportedModelError, match="llama"):
        LazyLLM(model=model, tokenizer=tokenizer, quality="isolated")


def test_timeout_cancels(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    with pytest.raises(lazyllm.RequestCancelled):
        llm.generate("q?", chunks=DOCS, max_new_tokens=3000, timeout=0.05)
    assert llm.generate("q?", max_new_tokens=1).usage.completion_tokens == 1
    assert llm.cache_stats()["pinned_entries"] == 0
    llm.close()


def test_dtype_and_device_resolution():
    from lazyllm.api import _resolve_device, _resolve_dtype

    assert _resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert _resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert _resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(InvalidRequestError):
        _resolve_dtype("int8", torch.device("cpu"))
    if not torch.cuda.is_available():
        assert _resolve_device("auto").type == "cpu"
        with pytest.raises(InvalidRequestError):
            _resolve_device("cuda")


def test_fused_projections_compute_the_same(tokenizer):
    from lazyllm.model.llama import LlamaFamilyModel

    for family in ("qwen2", "llama"):  # with and without qkv bias
        model = make_tiny(family, seed=11)
        ref = _llm(model, tokenizer).generate("q?", chunks=DOCS[:2], max_new_tokens=8)
        llm = _llm(model, tokenizer)
        llm.model = LlamaFamilyModel(model, fuse=True)
        eng = llm.engine  # every part that runs the model
        for part in (eng, eng.runner, eng.runner.graphs, eng.runner.prefill_graphs, eng.recovery):
            part.model = llm.model
        assert "wqkv" in llm.model.layers[0]
        assert llm.generate("q?", chunks=DOCS[:2], max_new_tokens=8).token_ids == ref.token_ids
        # the transformers model still works on the re-pointed weights
        assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == llm.model.layers[0]["wqkv"].data_ptr()


@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("lazy", "prefix"), ("none", "isolated"),
                                       ("prefix", "isolated"), ("block", "isolated")])
def test_score_matches_transformers_teacher_forcing(tiny_model, tokenizer, reuse, ctx):
    """score() gives the log-probs the reference model assigns to a continuation."""
    from tests.hf_reference import reference_tokens

    llm = _llm(tiny_model, tokenizer, reuse=reuse, chunk_context=ctx)
    gen = llm.generate("q?", chunks=DOCS[:3], max_new_tokens=6)
    cont = gen.token_ids
    sc = llm.score("q?", chunks=DOCS[:3], continuation=cont, return_logits=True)
    assert sc.logits.shape == (len(cont), tiny_model.config.vocab_size)
    # greedy continuation: every token is the argmax of its teacher-forced logits
    assert sc.logits.argmax(-1).tolist() == cont
    assert all(lp <= 0 for lp in sc.logprobs)
    assert sc.prompt_segments == gen.prompt_segments
    # the cache was warm from generate(): chunked modes reuse all but the suffix
    if reuse in ("lazy", "block"):
        assert sc.usage.cached_tokens == sc.usage.prompt_tokens - len(sc.prompt_segments[-1][1])
    ref = reference_tokens(tiny_model, gen.prompt_segments, reuse, ctx, 6, llm.eos_token_ids)
    assert ref == cont
    with pytest.raises(InvalidRequestError):
        llm.score("q?", chunks=DOCS[:1], continuation=[])
    with pytest.raises(InvalidRequestError):
        llm.score("q?", chunks=DOCS[:1], continuation=[10**9])
    llm.close()


def test_score_logprobs_against_transformers_full_attention(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer, reuse="none")
    cont = tokenizer("some continuation text", add_special_tokens=False)["input_ids"]
    sc = llm.score("q?", chunks=DOCS[:2], continuation=cont)
    ids = sc.prompt_segments
    prompt = [t for _, seg in ids for t in seg]
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([prompt + cont])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(sc.logprobs), logp, atol=1e-4, rtol=1e-4)
    llm.close()


@pytest.mark.parametrize("reuse", ["prefix", "lazy", "block", "none"])
def test_score_repeated_computes_every_continuation_logit(tiny_model, tokenizer, reuse):
    """Scoring one prompt again finds the first call's pages cached, continuation tokens
    included (identical-prefix reuse stores them): the logits of every continuation token
    are still computed, and the log-probabilities do not change."""
    llm = _llm(tiny_model, tokenizer, reuse=reuse)
    cont = " It was lit in 1887 and again in 1901, by the keeper who lived in the tower alone."
    first = llm.score("q?", DOCS[:2], continuation=cont)
    again = [llm.score("q?", DOCS[:2], continuation=cont) for _ in range(2)]
    for sc in again:
        assert len(sc.logprobs) == len(first.logprobs) > llm.config.page_size
        torch.testing.assert_close(torch.tensor(sc.logprobs), torch.tensor(first.logprobs), atol=1e-5, rtol=0)
    if reuse != "none":  # the repeat did reuse the cache
        assert again[0].usage.cached_tokens > 0
    # a generation over the same prompt after the scores still reuses and serves
    assert llm.generate("q?", DOCS[:2], max_new_tokens=3).usage.completion_tokens == 3
    llm.close()


def test_prefix_reuse_scores_equal_full_attention_at_page_boundaries(tiny_model, tokenizer):
    """Identical-prefix reuse scores a continuation as full attention does when the whole
    prompt is already cached (by a generation, then by the earlier scores of it), the prompt
    ending just before, on and just after a page boundary. A prompt filling its last page
    exactly is the case to watch: every prompt page is cached, yet the prompt's last token
    must still be computed (its logits score the first continuation token); the pages
    before it are reused."""
    pre = _llm(tiny_model, tokenizer, reuse="prefix")
    ref = _llm(tiny_model, tokenizer, reuse="none")
    ps = pre.config.page_size

    def question(k):  # each " x" is one more prompt token
        return "q" + " x" * k + "?"

    base = ref.score(question(0), DOCS[:2], continuation=[5]).usage.prompt_tokens
    edge = (base // ps + 1) * ps  # the first page boundary past the shortest prompt
    for n in (edge - 1, edge, edge + 1, edge + ps):
        q = question(n - base)
        gen = pre.generate(q, DOCS[:2], max_new_tokens=3)
        assert gen.usage.prompt_tokens == n
        for cont in (" It was lit in 1887 and again in 1901, by the keeper.", gen.token_ids[:1], gen.token_ids):
            want = ref.score(q, DOCS[:2], continuation=cont)
            for _ in range(2):  # after the generation, then after a score of the same prompt
                got = pre.score(q, DOCS[:2], continuation=cont)
                assert got.usage.cached_tokens == (n - 1) // ps * ps, (n, cont)
                torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4,
                                           rtol=0, msg=lambda m, n=n: f"prompt of {n} tokens, page size {ps}: {m}")
    pre.close()
    ref.close()


def test_incremental_detokenizer_matches_full_decode(tokenizer):
    from lazyllm.engine.detokenizer import Detokenizer

    rng = random.Random(0)
    texts = ["Hello wörld — ünïcode 日本語テキスト, emojis 🎉🚀 and more.", "a b c  d\n\nnew line\ttab end"]
    texts.append(tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(200)],
                                  skip_special_tokens=True))
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        d = Detokenizer(tokenizer, ())
        assert "".join(d.add(t) for t in ids) + d.finish() == tokenizer.decode(ids, skip_special_tokens=True)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stop = full[len(full) // 2: len(full) // 2 + 3]
        d = Detokenizer(tokenizer, (stop,))
        streamed = "".join(d.add(t) for t in ids) + d.finish()
        assert d.stopped and streamed == full[:full.find(stop)]


def test_a_failing_prefill_fails_only_its_request(tiny_model, tokenizer):
    """A request whose forward raises (as a CUDA OOM would) fails alone; the requests it
    was batched with are retried and answer normally."""
    llm = _llm(tiny_model, tokenizer)
    qs = [f"question number {i}?" for i in range(5)]
    solo = [llm.generate(q, chunks=DOCS[:2], max_new_tokens=4).token_ids for q in qs]
    bad = llm.inputs.generation("zebra zebra?", DOCS[:2], None, max_new_tokens=4)
    others = {t for q in qs + ["go?"] for t in llm.inputs.generation(q, DOCS[:2], None).prompt_ids}
    poison = torch.tensor(sorted(set(bad.prompt_ids) - others))
    assert poison.numel() > 0
    real_forward = llm.model.forward

    def forward(input_ids, *a, **k):
        if bool(torch.isin(input_ids, poison).any()):
            raise RuntimeError("simulated out of memory")
        return real_forward(input_ids, *a, **k)

    llm.model.forward = forward
    reqs = [llm.inputs.generation(q, DOCS[:2], None, max_new_tokens=4) for q in qs[:2]]
    reqs += [llm.inputs.generation(q, DOCS[:2], None, max_new_tokens=4) for q in qs[2:]]
    import threading

    from lazyllm.engine.engine import _Call

    gate = threading.Event()
    llm.engine.submit(_Call(gate.wait))  # hold the engine thread while the batch is queued
    for r in reqs[:2] + [bad] + reqs[2:]:
        llm.engine.submit(r)
    gate.set()
    outs = [llm._wait(r).token_ids for r in reqs]
    with pytest.raises(RuntimeError, match="simulated"):
        llm._wait(bad)
    assert outs == solo
    assert llm.engine.metrics["prefill_retries"] >= 5  # the batch was split and retried
    assert llm.cache_stats()["pinned_entries"] == 0
    llm.close()


def test_stream_close_returns_once_pages_are_released(tiny_model, tokenizer):
    """close() on a stream mid-way waits until the engine has retired the request: while the
    engine thread is held, close() does not return; once it runs, cache_stats() read right
    after close() shows nothing pinned and every page back in the pool."""
    import threading

    from lazyllm.engine.engine import _Call

    llm = _llm(tiny_model, tokenizer)
    llm.engine.output.eos_ids = set()  # random weights: run every request to its length
    for _ in range(3):
        it = llm.stream("q?", chunks=DOCS[:3], max_new_tokens=300)
        next(it)
        entered, gate = threading.Event(), threading.Event()
        llm.engine.submit(_Call(lambda entered=entered, gate=gate: (entered.set(), gate.wait())))  # hold it
        assert entered.wait(30)
        closer = threading.Thread(target=it.close)
        closer.start()
        closer.join(0.3)
        assert closer.is_alive()  # the pages are still held: close() must not have returned
        gate.set()
        closer.join(30)
        assert not closer.is_alive()
        s = llm.cache_stats()
        cached = sum(len(e.pages) for e in llm.store.entries.values())
        assert s["pinned_entries"] == 0 and s["free_pages"] + cached == s["pool_pages"]
    unstarted = llm.stream("q?", chunks=DOCS[:2])
    unstarted.close()  # never submitted: returns at once, nothing to release
    assert llm.cache_stats()["pinned_entries"] == 0
    llm.close()


def test_stream_exposes_final_output_and_chunk_usage(tiny_model, tokenizer):
    llm = _llm(tiny_model, tokenizer)
    llm.generate("q?", chunks=DOCS[:2], max_new_tokens=2)
    ts = llm.stream("other?", chunks=DOCS[1::-1], max_new_tokens=5)
    text = "".join(ts)
    out = ts.output
    assert out is not None and out.text == text and out.usage.completion_tokens == 5
    chunk_tokens = sum(len(ids) for kind, ids in out.prompt_segments if kind == "chunk")
    assert out.usage.cached_chunk_tokens == chunk_tokens
    assert out.usage.cached_tokens == chunk_tokens + len(out.prompt_segments[0][1])
    llm.close()


def test_process_exits_cleanly_without_close(tmp_path):
    """A script that never calls close() must still exit 0 (the engine thread is stopped
    at interpreter exit)."""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "from lazyllm import LazyLLM\n"
        "from tests.conftest import make_tiny\n"
        "from transformers import AutoTokenizer\n"
        "import os\n"
        "tok = AutoTokenizer.from_pretrained(os.environ['TOK'])\n"
        "llm = LazyLLM(model=make_tiny('llama'), tokenizer=tok, kv_cache_bytes=8 << 20)\n"
        "print(llm.generate('q?', chunks=['a doc'], max_new_tokens=3).usage.completion_tokens)\n")
    import os

    from lazyllm.model.loader import default_model_dir

    tok = os.environ.get("LAZYLLM_TEST_TOKENIZER") or str(default_model_dir())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for _ in range(3):
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=root,
                           env={**os.environ, "TOK": tok, "PYTHONPATH": root}, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip().endswith("3")


def test_decode_step_log_records_batch_sizes(tiny_model, tokenizer):
    """Each decode step logs (batch, seconds): the engine benchmark reads the step time at
    an exact batch size from it."""
    llm = _llm(tiny_model, tokenizer)
    llm.engine.output.eos_ids = set()
    llm.engine.decode_step_log.clear()
    outs = llm.generate_batch([{"question": f"q{i}?", "chunks": DOCS[i:i + 2]} for i in range(3)],
                              max_new_tokens=5)
    assert all(len(o.token_ids) == 5 for o in outs)
    log = list(llm.engine.decode_step_log)
    assert log and all(1 <= b <= 3 and dt > 0 for b, dt in log)
    assert sum(b for b, _ in log) == 3 * 4  # the first token of each comes from its prefill
    llm.close()


def test_batch_invariant_mode_matches_transformers(tokenizer):
    """``batch_invariant=True`` (fixed-size GEMM row blocks) keeps the model's function:
    greedy tokens of a full-attention request equal transformers' ``generate``; bad values
    are refused."""
    from tests.hf_reference import hf_generate

    model = make_tiny("llama", seed=3)
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse="none", batch_invariant=True, quality="isolated")
    assert llm.model.batch_invariant
    out = llm.generate("What is the capital?", chunks=["Paris is the capital of France."], max_new_tokens=8)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 8, llm.eos_token_ids)
    llm.close()
    with pytest.raises(InvalidRequestError):
        LazyLLM(model=model, tokenizer=tokenizer, batch_invariant="yes", quality="isolated")


def test_graph_stats_reports_captures(tiny_model, tokenizer):
    """``Engine.graph_stats``: no graphs on CPU (the counts a serving benchmark reads per point)."""
    llm = _llm(tiny_model, tokenizer)
    llm.generate("q?", chunks=DOCS[:2], max_new_tokens=3)
    assert llm.engine.graph_stats() == {"decode_graphs": 0, "prefill_graphs": 0, "capture_s": 0.0}
    llm.close()
