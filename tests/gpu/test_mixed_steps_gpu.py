"""Mixed steps on CUDA (the CPU checks are in ``tests/engine/test_mixed_steps.py``, whose
requests this uses): the compiled Triton kernels, decode steps from CUDA graphs between the
mixed steps, overlapped decode on."""
from __future__ import annotations

import pytest
import torch

from lazyllm import LazyLLM
from tests.conftest import make_tiny
from tests.engine.test_mixed_steps import LONG_DOC, _batch, _mixed_steps_ok, _same_chunk_kv, _same_tokens_while_decoding


@pytest.mark.gpu
def test_mixed_steps_on_gpu_give_the_same_tokens_and_kv(tokenizer):
    """float32 tiny model (answers batch-independent): the tokens and the chunk KV of the
    engine without mixed steps, with decode and prefill rows in the same forwards."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = make_tiny("llama", seed=21).to("cuda")
    budget = 48
    off = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=256 << 20, quality="isolated")
    on = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=256 << 20, mixed_steps=True,
                 step_token_budget=budget, quality="isolated")
    assert on.engine.async_decode and on.engine.graphs.enabled
    on.engine.mixed.trace = []
    _same_tokens_while_decoding(off, on, _batch(8))
    _mixed_steps_ok(on.engine.mixed.trace, budget)
    assert on.engine.metrics["decode_steps"] > 0 and on.engine.graphs.graphs  # graph decode steps between
    for llm in (off, on):
        llm.warm([LONG_DOC * 3])
    _same_chunk_kv(off, on, 1e-4)
    off.close()
    on.close()
