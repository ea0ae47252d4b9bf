"""Context calibration (APE-style: the documents' logits over a temperature, their
log-sum-exp scaled) through the engine: the question's prefill and every decode step read
the documents calibrated, on the torch reference and on the Triton kernels alike, and the
cached chunk KV stays shared."""
from __future__ import annotations

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.errors import InvalidRequestError
from tests.conftest import make_tiny

DOCS = [
    "The Eiffel Tower in Paris was completed in 1889 and is 330 metres tall.",
    "Mount Fuji is the highest mountain in Japan, rising 3,776 metres above sea level.",
    "Python was created by Guido van Rossum and first released in 1991.",
]
Q = "Which was completed in 1889?"
CAL = dict(context_temperature=1.3, context_lse_scale=0.7)


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", seed=11)


def _llm(model, tok, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=32 << 20, chunk_context="prefix", **kw)


def test_calibration_changes_what_the_question_reads(model, tokenizer):
    base = _llm(model, tokenizer)
    cal = _llm(model, tokenizer, **CAL)
    same = _llm(model, tokenizer, context_temperature=1.0, context_lse_scale=1.0)
    a = base.score(Q, chunks=DOCS, continuation=[5, 6, 7], return_logits=True).logits
    b = cal.score(Q, chunks=DOCS, continuation=[5, 6, 7], return_logits=True).logits
    c = same.score(Q, chunks=DOCS, continuation=[5, 6, 7], return_logits=True).logits
    assert torch.equal(a, c)  # 1 and 1 is off
    assert (a - b).abs().max() > 1e-3
    for llm in (base, cal, same):
        llm.close()


def test_decode_steps_are_calibrated_like_the_prefill(model, tokenizer):
    """Greedy tokens from decode steps (the documents' range kept per decode row) equal the
    argmax of a teacher-forced prefill of the same tokens (the range on the prefill job)."""
    llm = _llm(model, tokenizer, **CAL)
    llm.warm(DOCS)
    out = llm.generate(Q, chunks=DOCS, max_new_tokens=10)
    assert len(out.token_ids) > 1
    sc = llm.score(Q, chunks=DOCS, continuation=out.token_ids, return_logits=True)
    assert sc.logits.argmax(-1).tolist() == out.token_ids
    # the chunks were read from the cache, one shared copy: calibration never writes KV
    assert out.usage.cached_tokens > 0 and llm.cache_stats()["entries"] == len(DOCS) + 1
    llm.close()


def test_triton_kernels_match_the_reference_through_the_engine(model, tokenizer):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter path is for CPU-only machines")
    ref = _llm(model, tokenizer, **CAL)
    tri = _llm(model, tokenizer, attention_backend="triton", page_size=16, **CAL)
    reqs = [dict(question=Q, chunks=DOCS), dict(question="Where is Fuji?", chunks=DOCS[::-1]),
            dict(question="Who made Python?", chunks=DOCS[1:])]
    a = ref.generate_batch(reqs, max_new_tokens=6)
    b = tri.generate_batch(reqs, max_new_tokens=6)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # calibrated decode steps take the per-request kernel: no shared-chunk plan is made
    assert tri.engine.metrics["shared_decode_steps"] == 0 and tri.engine.runner.shared is None
    for llm in (ref, tri):
        llm.close()


@pytest.mark.parametrize("kw", [dict(context_temperature=0), dict(context_temperature=-1.0),
                                dict(context_lse_scale=float("nan")), dict(context_lse_scale="x"),
                                dict(context_temperature=True), dict(context_lse_scale=float("inf"))])
def test_bad_calibration_is_rejected(model, tokenizer, kw):
    with pytest.raises(InvalidRequestError):
        _llm(model, tokenizer, **kw)


def test_calibration_with_tensor_parallel_is_rejected(model, tokenizer):
    with pytest.raises(InvalidRequestError, match="tensor_parallel"):
        _llm(model, tokenizer, tensor_parallel=2, **CAL)
