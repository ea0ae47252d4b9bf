"""A request that waits for KV pages is planned again at every engine step; its cache
lookups must be counted once (when it is admitted), not once per attempt."""
import pytest


@pytest.mark.slow
def test_waiting_request_lookups_count_once():
    from lazyllm import LazyLLM
    from lazyllm.cache.store import PagePool

    llm0 = LazyLLM(progress=False, quality="isolated")
    spec = llm0.model.spec
    page = PagePool.page_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, llm0.dtype)

    def doc(s):
        return " ".join(f"w{s}x{i}" for i in range(60))

    reqs = [dict(question="what is it?", chunks=[doc(i), doc(i + 10)]) for i in range(2)]
    out = llm0.generate(**reqs[0], max_new_tokens=8)
    pages = sum(-(-len(ids) // 16) for _, ids in out.prompt_segments) + 1
    llm0.close()
    # room for one request at a time: the second waits, re-planned every step, until the first ends
    llm = LazyLLM(model=llm0.hf_model, tokenizer=llm0.tokenizer, kv_cache_bytes=page * pages, quality="isolated")
    llm.engine.output.eos_ids = set()
    try:
        outs = llm.generate_batch(reqs, max_new_tokens=8)
        assert outs[1].ttft_s > outs[0].total_s * 0.9  # it did wait
        st = llm.cache_stats()
        assert (st["hits"], st["misses"]) == (1, 5)  # the shared prefix hit once; 1 + 4 segments computed
        assert st["hit_rate"] == pytest.approx(1 / 6)
    finally:
        llm.close()
