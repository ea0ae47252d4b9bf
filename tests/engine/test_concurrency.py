"""Many requests at once: no cross-talk, identical outputs under pool pressure."""
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from lazyllm import LazyLLM
from tests.conftest import make_tiny

DOCS = [f"Note {i}: " + " ".join(f"w{i}x{j}" for j in range(10 + (7 * i) % 23)) for i in range(16)]


def _requests(n, seed):
    rng = random.Random(seed)
    return [(f"question {i} about {rng.randint(0, 99)}?", rng.sample(DOCS, rng.randint(1, 4)),
             rng.randint(2, 10)) for i in range(n)]


def _run_concurrently(llm, reqs, threads):
    results = [None] * len(reqs)

    def work(i):
        q, c, n = reqs[i]
        results[i] = llm.generate(q, chunks=c, max_new_tokens=n).token_ids

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, range(len(reqs))))
    return results


def test_256_requests_from_32_threads_equal_solo(tokenizer):
    model = make_tiny("llama", seed=21)
    reqs = _requests(256, seed=1)
    solo_llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=64 << 20, quality="isolated")
    solo = [solo_llm.generate(q, chunks=c, max_new_tokens=n).token_ids for q, c, n in reqs]
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=64 << 20, quality="isolated")
    assert _run_concurrently(llm, reqs, 32) == solo
    assert llm.engine.metrics["decode_steps"] < sum(n for _, _, n in reqs)  # decode really batched
    s = llm.cache_stats()
    assert s["pinned_entries"] == 0 and not llm.engine.decode_state.rows


@pytest.mark.slow
def test_default_model_concurrent_equals_solo(default_llm_parts):
    model, tok = default_llm_parts
    reqs = _requests(48, seed=2)
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=128 << 20, quality="isolated")
    solo = [llm.generate(q, chunks=c, max_new_tokens=n).token_ids for q, c, n in reqs]
    llm.clear_cache()
    assert _run_concurrently(llm, reqs, 16) == solo


@pytest.mark.parametrize("overlap", [False, True])
def test_pool_pressure_preempts_and_outputs_stay_identical(tokenizer, overlap):
    """A pool too small for the batch: requests wait, get preempted and recomputed, and every
    output equals its solo run; ``overlap``: with the overlapped decode (Engine.async_decode)."""
    model = make_tiny("qwen3", seed=5)
    reqs = [(f"long answer {i}?", DOCS[i:i + 2], 60) for i in range(10)]
    big = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=64 << 20, quality="isolated")
    solo = [big.generate(q, chunks=c, max_new_tokens=n).token_ids for q, c, n in reqs]
    spec = big.model.spec
    page_bytes = 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4
    small = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=60 * page_bytes, overlap_decode=overlap,
                    quality="isolated")
    assert _run_concurrently(small, reqs, 10) == solo
    m = small.engine.metrics
    assert m["preemptions"] > 0 or small.cache_stats()["evictions"] > 0
    assert (m["overlapped_steps"] > 0) == overlap
    s = small.cache_stats()
    assert s["pinned_entries"] == 0
    cached = sum(len(e.pages) for e in small.store.entries.values())
    assert s["free_pages"] + cached == s["pool_pages"]
