"""Gemma 3 (the packaged base model's architecture): per-layer RoPE, sliding windows,
sandwich norms, scaled embeddings — against transformers."""
import random

import pytest

from lazyllm import LazyLLM
from tests.conftest import make_tiny
from tests.hf_reference import hf_generate, reference_tokens

DOCS = [f"Passage {i}: " + " ".join(f"g{i}_{j}" for j in range(12 + 4 * i)) for i in range(5)]


@pytest.mark.parametrize("reuse", ["none", "prefix"])
def test_sliding_window_full_attention_matches_generate(tokenizer, reuse):
    """A window of 24 tokens, prompts of ~150: the local layers must mask by distance."""
    model = make_tiny("gemma3", seed=1, window=24)
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, kv_cache_bytes=16 << 20)
    assert llm.model.windows == [24, None, 24] and len(llm.model.inv_freqs) == 2
    for docs in (DOCS[:3], DOCS[1:4]):
        out = llm.generate("Which passage?", chunks=docs, max_new_tokens=10)
        assert out.usage.prompt_tokens > 24
        assert out.token_ids == hf_generate(model, out.prompt_token_ids, 10, llm.eos_token_ids)
    llm.close()


@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("lazy", "prefix"), ("block", "isolated"),
                                       ("block", "prefix")])
def test_gemma_chunked_modes_match_reference(tokenizer, reuse, ctx):
    model = make_tiny("gemma3", seed=2)
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx, kv_cache_bytes=16 << 20)
    rng = random.Random(3)
    for _ in range(2):
        docs = rng.sample(DOCS, 3)
        out = llm.generate("Which passage?", chunks=docs, max_new_tokens=10)
        ref = reference_tokens(model, out.prompt_segments, reuse, ctx, 10, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()


def test_gemma_recovery_everything_is_full_attention(tokenizer):
    model = make_tiny("gemma3", seed=4, window=24)
    llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=1.0, kv_cache_bytes=16 << 20)
    out = llm.generate("Which passage?", chunks=DOCS[:3], max_new_tokens=8)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 8, llm.eos_token_ids)
    llm.close()
