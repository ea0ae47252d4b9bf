"""Quality recovery options keep the cache reusable and compute what they promise."""
import random

import pytest

from lazyllm import LazyLLM
from tests.conftest import make_tiny
from tests.hf_reference import hf_generate

DOCS = [f"Record {i}: " + " ".join(f"item{i}_{j}" for j in range(9 + 5 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", seed=3)


@pytest.mark.parametrize("reuse", ["lazy", "block"])
@pytest.mark.parametrize("ctx", ["isolated", "prefix"])
def test_recomputing_every_chunk_token_is_full_attention(model, tokenizer, reuse, ctx):
    """With k past every chunk's length each chunk token is recomputed with full context,
    so the answer must be exactly full attention's."""
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx,
                  recompute_first_tokens=10_000, kv_cache_bytes=32 << 20)
    rng = random.Random(0)
    for _ in range(2):
        docs = rng.sample(DOCS, 4)
        out = llm.generate("Which item is first?", chunks=docs, max_new_tokens=10)
        assert out.token_ids == hf_generate(model, out.prompt_token_ids, 10, llm.eos_token_ids)
    llm.close()


@pytest.mark.parametrize("k", [1, 4, 20])
def test_partial_recompute_is_position_independent_and_accounted(model, tokenizer, k):
    kw = dict(model=model, tokenizer=tokenizer, recompute_first_tokens=k, kv_cache_bytes=32 << 20)
    cold = LazyLLM(**kw)
    ref = cold.generate("q?", chunks=DOCS[:3], max_new_tokens=8)
    warm = LazyLLM(**kw)
    warm.generate("other?", chunks=DOCS[2::-1], max_new_tokens=2)
    out = warm.generate("q?", chunks=DOCS[:3], max_new_tokens=8)
    assert out.token_ids == ref.token_ids
    chunk_lens = [len(ids) for kind, ids in out.prompt_segments if kind == "chunk"]
    recomputed = sum(min(k, n) for n in chunk_lens)
    assert out.usage.cached_chunk_tokens == sum(chunk_lens) - recomputed
    sc = warm.score("q?", chunks=DOCS[:3], continuation=out.token_ids)
    assert sc.prefilled_tokens == recomputed + len(out.prompt_segments[-1][1]) + len(out.token_ids) - 1
    # the recompute changes the answer's logits relative to no recovery
    plain = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=32 << 20)
    s0 = plain.score("q?", chunks=DOCS[:3], continuation=out.token_ids)
    assert s0.logprobs != sc.logprobs
    # shared chunk pages were not modified: a plain request still reads clean KV
    assert warm.cache_stats()["pinned_entries"] == 0
    for x in (cold, warm, plain):
        x.close()


def test_recompute_leaves_the_shared_cache_untouched(model, tokenizer):
    """A lazy request with recomputation must not write into shared chunk pages: a later
    request without recovery on the same engine's cache gives the no-recovery answer."""
    plain = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=32 << 20)
    ref = plain.generate("q?", chunks=DOCS[1:4], max_new_tokens=8)
    llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_first_tokens=6, kv_cache_bytes=32 << 20)
    llm.generate("q?", chunks=DOCS[1:4], max_new_tokens=8)
    llm.engine.recompute_first_tokens = 0
    assert llm.generate("q?", chunks=DOCS[1:4], max_new_tokens=8).token_ids == ref.token_ids
    plain.close()
    llm.close()
