"""On the GPU: the batched sampler and token masks through CUDA-graph decode (run on the H200;
deselected in CI: `pytest -m gpu`). Sampled and constrained rows overlap their steps; the
tokens equal one step at a time and the eager engine's; the sampler's distribution on the
device passes the same chi-square test as on CPU."""
import numpy as np
import pytest
import torch

from lazyllm import LazyLLM
from tests.conftest import make_tiny
from tests.engine.test_concurrency import DOCS
from tests.engine.test_constrained_decode import AllowedSet, FixedSequence, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]


def _specs():
    return [(dict(question="a?", chunks=DOCS[:2], max_new_tokens=16, temperature=0.9, seed=1, top_p=0.9), None),
            (dict(question="b?", chunks=DOCS[2:4], max_new_tokens=10, temperature=1.2, seed=2, top_k=50),
             AllowedSet(range(200, 900))),
            (dict(question="c?", chunks=DOCS[1:3], max_new_tokens=14), AllowedSet(range(3000, 3100), length=9)),
            (dict(question="d?", max_new_tokens=12), None),
            (dict(question="e?", chunks=DOCS[:1], max_new_tokens=12), FixedSequence([5, 77, 5, 901])),
            (dict(question="f?", chunks=DOCS[3:5], max_new_tokens=11, temperature=0.7, seed=9), None)]


def test_graph_decode_with_sampled_and_constrained_rows(tokenizer):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_tiny("llama", seed=5).to("cuda")
    got = {}
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=256 << 20, attention_backend="triton",
                      cuda_graphs=graphs, overlap_decode=overlap, quality="isolated")
        llm.engine.output.eos_ids = set()
        specs = _specs()
        outs = _run(llm, specs)
        got[graphs, overlap] = [o.token_ids for o in outs]
        assert set(outs[1].token_ids) <= set(range(200, 900)) and len(outs[1].token_ids) == 10
        assert set(outs[2].token_ids) <= set(range(3000, 3100)) and len(outs[2].token_ids) == 9
        assert outs[4].token_ids == [5, 77, 5, 901] and outs[4].finish_reason == "stop"
        assert specs[1][1].seen == outs[1].token_ids
        assert (llm.engine.graph_stats()["decode_graphs"] > 0) == graphs
        assert (llm.engine.metrics["overlapped_steps"] > 0) == overlap
        # greedy rows of a batch with sampled and constrained rows equal their solo runs
        assert llm.generate("d?", max_new_tokens=12).token_ids == outs[3].token_ids
        llm.close()
    assert got[True, True] == got[True, False] == got[False, False]


def test_device_sampler_follows_the_filtered_softmax():
    from lazyllm.engine.running.sampler import Sampler
    from tests.engine.test_sampler import CHI2_9999, LOGITS, _AllowedSet, _chi2, _expected, _row

    sampler = Sampler(torch.device("cuda"))
    B, steps = 2000, 10
    logits = torch.from_numpy(np.tile(LOGITS, (B, 1))).cuda()
    allowed = np.array([i % 3 != 1 for i in range(len(LOGITS))])
    for cfg, mask in ((dict(temperature=1.0), False), (dict(temperature=1.3, top_p=0.6), False),
                      (dict(temperature=1.0, top_k=6, top_p=0.8), False), (dict(temperature=2.0, top_p=0.95), True)):
        cons = _AllowedSet(np.flatnonzero(allowed).tolist()) if mask else None
        rows = [_row(seed=7 + i, constraint=cons, **cfg) for i in range(B)]
        counts = np.zeros(len(LOGITS), dtype=np.int64)
        for t in range(steps):
            for r in rows:
                r.state.generated = [0] * t
            counts += np.bincount(sampler.pick(logits, rows).cpu().numpy(), minlength=len(LOGITS))
        p = _expected(LOGITS, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0),
                      allowed if mask else None)
        stat, df = _chi2(counts, p)
        assert stat < CHI2_9999[df], (cfg, stat, counts, p)
