"""The engine computes exactly what docs/design.md defines ("What a request means"): checked
against transformers."""
import random

import pytest
import torch

from lazyllm import Chunk, LazyLLM
from tests.conftest import FAMILIES, make_tiny
from tests.hf_reference import hf_generate, reference_tokens

DOCS = [
    "The Eiffel Tower in Paris was completed in 1889 and is 330 metres tall.",
    "Mount Fuji is the highest mountain in Japan, rising 3,776 metres above sea level.",
    "The Great Wall of China stretches for more than 21,000 kilometres across northern China.",
    "Python was created by Guido van Rossum and first released in 1991.",
    "The Amazon river carries more water than any other river on Earth.",
]
QUESTION = "Which of these was completed in 1889?"
SYSTEM = "You are a concise assistant."
NEW = 12


def _llm(model, tok, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    # the reuse modes' own semantics, without the learned packet shipped for the default model
    # (tests/engine/test_packets.py holds packets to the reference with their embeddings put in)
    kw.setdefault("packets", None)
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20, **kw)


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request):
    return request.param, make_tiny(request.param)


@pytest.mark.parametrize("reuse", ["none", "prefix"])
def test_full_attention_modes_match_transformers_generate(tiny, tokenizer, reuse):
    _, model = tiny
    llm = _llm(model, tokenizer, reuse=reuse)
    for order in (DOCS[:3], DOCS[1:4]):  # the second request can reuse a prefix in 'prefix' mode
        out = llm.generate(QUESTION, chunks=order, system=SYSTEM, max_new_tokens=NEW)
        ref = hf_generate(model, out.prompt_token_ids, NEW, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()


@pytest.mark.parametrize("reuse", ["lazy", "block"])
@pytest.mark.parametrize("ctx", ["isolated", "prefix"])
def test_chunked_modes_match_transformers_with_4d_mask(tiny, tokenizer, reuse, ctx):
    _, model = tiny
    llm = _llm(model, tokenizer, reuse=reuse, chunk_context=ctx)
    rng = random.Random(1)
    for _ in range(2):  # second round hits the cache with chunks at new positions
        docs = rng.sample(DOCS, 3)
        out = llm.generate(QUESTION, chunks=docs, system=SYSTEM, max_new_tokens=NEW)
        ref = reference_tokens(model, out.prompt_segments, reuse, ctx, NEW, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()


def test_chunked_semantics_differ_from_full_attention(tokenizer):
    """Guard against a reference that cannot fail: the isolated mask changes the logits."""
    from tests.hf_reference import semantic_mask

    model = make_tiny("llama")
    llm = _llm(model, tokenizer, reuse="lazy")
    out = llm.generate(QUESTION, chunks=DOCS[:3], max_new_tokens=1)
    ids = torch.tensor([out.prompt_token_ids])
    iso = semantic_mask(out.prompt_segments, "lazy", "isolated")
    full = semantic_mask(out.prompt_segments, "none", "isolated")
    with torch.inference_mode():
        a = model(input_ids=ids, attention_mask=iso[None, None]).logits[0, -1]
        b = model(input_ids=ids, attention_mask=full[None, None]).logits[0, -1]
    assert not torch.allclose(a, b, atol=1e-3)
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("reuse", ["none", "prefix"])
def test_default_model_full_modes_match_generate(default_llm_parts, reuse):
    model, tok = default_llm_parts
    llm = _llm(model, tok, reuse=reuse)
    out = llm.generate(QUESTION, chunks=DOCS[:3], system=SYSTEM, max_new_tokens=16)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 16, llm.eos_token_ids)
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("lazy", "prefix"), ("block", "isolated")])
def test_default_model_chunked_modes_match_4d_mask(default_llm_parts, reuse, ctx):
    model, tok = default_llm_parts
    llm = _llm(model, tok, reuse=reuse, chunk_context=ctx)
    llm.generate("Warm-up question?", chunks=[DOCS[2], DOCS[0]], system=SYSTEM, max_new_tokens=2)
    out = llm.generate(QUESTION, chunks=DOCS[:3], system=SYSTEM, max_new_tokens=16)
    assert out.usage.cached_tokens > 0
    ref = reference_tokens(model, out.prompt_segments, reuse, ctx, 16, llm.eos_token_ids)
    assert out.token_ids == ref
    llm.close()


def test_prompt_segments_are_the_logical_sequence(tokenizer):
    model = make_tiny("llama")
    llm = _llm(model, tokenizer)
    chunks = ["alpha beta", Chunk("gamma delta", id="g")]
    out = llm.generate("what?", chunks=chunks, system="sys", max_new_tokens=2)
    kinds = [k for k, _ in out.prompt_segments]
    assert kinds == ["prefix", "chunk", "chunk", "suffix"]
    text = tokenizer.decode(out.prompt_token_ids)
    assert text.index("sys") < text.index("alpha beta") < text.index("gamma delta") < text.index("what?")
    assert out.usage.prompt_tokens == len(out.prompt_token_ids)
    assert out.chunk_ids == [None, "g"]
    llm.close()


@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("lazy", "prefix"), ("block", "isolated")])
def test_triton_backend_on_cpu_interpreter_matches_transformers(tokenizer, reuse, ctx):
    """attention_backend='triton' on CPU runs the real kernels in Triton's interpreter."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the interpreter path is for CPU-only machines")
    model = make_tiny("qwen3", seed=2)
    llm = _llm(model, tokenizer, reuse=reuse, chunk_context=ctx, attention_backend="triton")
    assert llm.attention_backend == "triton"
    for docs in (DOCS[:2], DOCS[1::-1]):
        out = llm.generate("Which?", chunks=docs, max_new_tokens=4)
        ref = reference_tokens(model, out.prompt_segments, reuse, ctx, 4, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()


def test_graph_capturable_follows_the_attention(tokenizer):
    """The engine captures CUDA graphs only where no layer's attention reads the batch layout
    on the host: not with the torch backend; with the Triton kernels, sliding-window layers
    (Gemma 3) included."""
    llama, gemma = make_tiny("llama", seed=3), make_tiny("gemma3", seed=3)
    for model, backend, capturable in ((llama, "triton", True), (llama, "torch", False), (gemma, "triton", True),
                                       (gemma, "torch", False)):
        llm = _llm(model, tokenizer, attention_backend=backend)
        assert llm.model.graph_capturable is capturable, (backend, capturable)
        llm.close()
