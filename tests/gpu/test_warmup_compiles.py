"""Ready means fast, on CUDA: after ``LazyLLM``'s warm-up, a mixed workload (cold and cached
chunks, questions of many lengths, batches of every size, greedy, sampled and constrained
picks, scoring, streams) compiles no Triton kernel: every specialization it launches was
compiled, and its CUDA graphs captured, before the first request. An empty Triton cache
(``TRITON_CACHE_DIR``), so nothing comes from an earlier process."""
from __future__ import annotations

import importlib.util
import logging
import random

import pytest
import torch

from lazyllm import LazyLLM
from tests.conftest import make_tiny

WORDS = ["lamp", "chair", "river", "stone", "cloud", "paper", "glass", "seed", "bridge", "tower", "field", "clock"]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 999)}" for _ in range(n_words))


def _workload(llm: LazyLLM, seed: int = 0) -> None:
    """Requests of many shapes, as a RAG server meets them."""
    rng = random.Random(seed)
    docs = [_text(rng, rng.choice([10, 30, 80, 200])) for _ in range(24)]
    llm.warm(docs[:8])
    sampling = [dict(), dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=1.0, top_k=20, seed=2)]
    for size in (1, 3, 7, 20, 45):
        batch = [dict(question=_text(rng, rng.choice([5, 30, 90, 200])),
                      chunks=rng.sample(docs, rng.randint(0, 4)), max_new_tokens=rng.randint(2, 24),
                      **rng.choice(sampling)) for _ in range(size)]
        llm.generate_batch(batch)
    llm.generate(_text(rng, 300), chunks=docs[:3], max_new_tokens=4)  # a question past the prefill graphs
    if importlib.util.find_spec("xgrammar") is not None:  # a grammar's masks (the warm-up masks without one)
        llm.generate("Answer in JSON.", chunks=docs[:2], max_new_tokens=8, response_format={"type": "json_object"})
    llm.score("Which stone?", chunks=docs[3:5], continuation=" the stone is near the river")
    assert sum(1 for _ in llm.stream("Where?", chunks=docs[5:9], max_new_tokens=6)) >= 1


@pytest.fixture(scope="module")
def empty_triton_cache(tmp_path_factory):
    """One empty Triton cache for the module: the first configuration compiles everything
    into it, the next ones only what they add (kernels already in the process compile and
    count nowhere)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton")))
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(quality="isolated"), dict(), dict(quality="isolated", reuse="block")],
                         ids=["lazy", "balanced", "block"])
def test_no_kernel_compiles_after_ready(tokenizer, empty_triton_cache, caplog, kw):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # head_dim 128 and bf16, as the 8B models: the launch configurations they get
    model = make_tiny("llama", hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=128).to("cuda", torch.bfloat16)
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=512 << 20, progress=False, **kw)
    try:
        report = llm.warmup()
        assert report["skipped"] is None and report["decode_graphs"] > 0 and report["prefill_graphs"] > 0
        assert llm.ready and llm.cache_stats()["kernels_compiled_after_ready"] == 0
        with caplog.at_level(logging.WARNING, logger="lazyllm"):
            _workload(llm)
        late = [r.getMessage() for r in caplog.records if "after the engine was ready" in r.getMessage()]
        assert llm.cache_stats()["kernels_compiled_after_ready"] == 0, late
    finally:
        llm.close()
