"""Shared-chunk decode from CUDA graphs (the engine's CPU checks of shared decode are in
``tests/engine/test_shared_decode.py``, whose requests this uses)."""
from __future__ import annotations

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.kernels.options import KernelOptions
from tests.conftest import make_tiny
from tests.engine.test_shared_decode import DOCS, _batch


@pytest.mark.gpu
def test_shared_decode_on_gpu_with_cuda_graphs(tokenizer):
    """CUDA-graph decode over shared pages: the same tokens as the per-request kernel, and
    the steps really went through the shared path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = make_tiny("llama", seed=7).to("cuda")  # float32: the two kernels agree to rounding
    outs = {}
    for on in (True, False):
        llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=256 << 20,
                      kernel_options=KernelOptions(shared_decode=on), quality="isolated")
        llm.engine.runner.SHARED_MIN_BATCH = 1  # 15 rows: below the engine's own threshold
        llm.warm(DOCS)
        outs[on] = [o.token_ids for o in llm.generate_batch(_batch() * 3, max_new_tokens=24)]
        m = llm.engine.metrics
        assert (m["shared_decode_steps"] > 0) is on
        assert llm.engine.graphs.graphs and all(len(k) == 3 for k in llm.engine.graphs.graphs)
        llm.close()
    assert outs[True] == outs[False]

