"""Shared-chunk decode in the engine: requests of one decode step that hold the same chunks
(in different orders, at different positions) read each shared page once, and generate
exactly what they generate one at a time and what full semantics define.

On CPU the Triton backend runs the real kernels in Triton's interpreter (no CUDA graphs);
the plan, its upload into the fixed-size buffers and the kernels are the ones a GPU runs.
"""
from __future__ import annotations

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.kernels.options import KernelOptions
from tests.conftest import make_tiny
from tests.hf_reference import reference_tokens

pytest.importorskip("triton", reason="triton is not installed")

DOCS = [
    "The Eiffel Tower in Paris was completed in 1889 and is 330 metres tall.",
    "Mount Fuji is the highest mountain in Japan, rising 3,776 metres above sea level.",
    "The Great Wall of China stretches for more than 21,000 kilometres across northern China.",
    "Python was created by Guido van Rossum and first released in 1991.",
]
NEW = 6


def _llm(model, tok, min_batch: int = 1, **kw):
    """An engine whose shared path takes batches from ``min_batch`` rows (these tests' batches
    are a few requests; the engine's own threshold is ``ModelRunner.SHARED_MIN_BATCH``)."""
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=32 << 20, attention_backend="triton", page_size=16,
                  **kw)
    llm.engine.runner.SHARED_MIN_BATCH = min_batch
    return llm


def _batch():
    # three requests over the same three documents in three orders (each chunk at three
    # positions), one with two of them and one of its own, one with a document no other holds
    return [dict(question="Which was completed in 1889?", chunks=[DOCS[0], DOCS[1], DOCS[2]]),
            dict(question="Which is in Japan?", chunks=[DOCS[2], DOCS[0], DOCS[1]]),
            dict(question="How long is the wall?", chunks=[DOCS[1], DOCS[2], DOCS[0]]),
            dict(question="Who made Python?", chunks=[DOCS[3], DOCS[0]]),
            dict(question="Anything?", chunks=[DOCS[3]])]


@pytest.fixture(scope="module")
def model():
    if torch.cuda.is_available():
        pytest.skip("the interpreter path is for CPU-only machines")
    return make_tiny("llama", seed=7)


def test_shared_decode_matches_one_at_a_time_and_the_reference(model, tokenizer):
    llm = _llm(model, tokenizer)
    llm.warm(DOCS)  # every chunk cached: the batch's requests decode together over shared pages
    outs = llm.generate_batch(_batch(), max_new_tokens=NEW)
    m = llm.engine.metrics
    assert m["shared_decode_steps"] > 0 and m["shared_plans"] >= 1
    assert m["shared_plans"] < m["decode_steps"]  # a plan lives while the rows stay the same
    for out in outs:
        ref = reference_tokens(model, out.prompt_segments, "lazy", "isolated", NEW, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()

    off = _llm(model, tokenizer, kernel_options=KernelOptions(shared_decode=False))
    off.warm(DOCS)
    outs_off = off.generate_batch(_batch(), max_new_tokens=NEW)
    assert off.engine.metrics["shared_decode_steps"] == 0
    assert [o.token_ids for o in outs_off] == [o.token_ids for o in outs]
    off.close()


def test_shared_plan_follows_rows_that_leave_and_grow(model, tokenizer):
    """Requests finishing at different steps (the rows move) and decoding past the pages the
    plan covered (a new plan) keep their tokens exact."""
    llm = _llm(model, tokenizer)
    llm.engine.runner.SHARED_EXTEND = 1  # a new plan every page of growth
    llm.engine.runner.SHARED_MIN_SAVED = 0.0  # the shared path whatever it saves
    llm.warm(DOCS[:3])
    lengths = (2, 5, 40, 40)
    reqs = [dict(question=f"Question {i}?", chunks=[DOCS[i % 3], DOCS[(i + 1) % 3]], max_new_tokens=n)
            for i, n in enumerate(lengths)]
    outs = llm.generate_batch(reqs)
    m = llm.engine.metrics
    assert m["shared_decode_steps"] > 0
    grown = min(len(o.token_ids) for o in outs[2:])  # the two long rows share a chunk
    assert m["shared_plans"] >= 2 + grown // 16  # rows leaving, and the long rows' new pages
    for out, n in zip(outs, lengths):
        ref = reference_tokens(model, out.prompt_segments, "lazy", "isolated", n, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()


def test_little_sharing_keeps_the_per_request_kernel(model, tokenizer):
    """Requests over their own documents share only the system prompt's page: not worth the
    shared path (``ModelRunner.SHARED_MIN_SAVED``), the step runs the per-request kernel."""
    llm = _llm(model, tokenizer)
    reqs = [dict(question=f"Q{i}?", chunks=[DOCS[i] * 8], system="A shared system prompt.")
            for i in range(3)]
    llm.generate_batch(reqs, max_new_tokens=3)
    m = llm.engine.metrics
    assert m["shared_plans"] >= 1 and m["shared_decode_steps"] == 0
    llm.close()


def test_a_small_batch_keeps_the_per_request_kernel(model, tokenizer):
    """Fewer decoding rows than ``ModelRunner.SHARED_MIN_BATCH``, however much they share: no
    plan is made and every step runs the per-request kernel (the grouped kernel did not pay
    for itself below 16 rows on the H100); the answers are the shared path's."""
    from lazyllm.engine.running.model_runner import ModelRunner

    llm = _llm(model, tokenizer, min_batch=ModelRunner.SHARED_MIN_BATCH)
    llm.warm(DOCS)
    batch = _batch()
    assert len(batch) < ModelRunner.SHARED_MIN_BATCH
    outs = llm.generate_batch(batch, max_new_tokens=NEW)
    m = llm.engine.metrics
    assert m["decode_steps"] > 0 and m["shared_plans"] == 0 and m["shared_decode_steps"] == 0
    llm.close()
    shared = _llm(model, tokenizer)
    shared.warm(DOCS)
    assert [o.token_ids for o in shared.generate_batch(batch, max_new_tokens=NEW)] == [o.token_ids for o in outs]
    assert shared.engine.metrics["shared_decode_steps"] > 0
    shared.close()


def test_a_plan_larger_than_the_buffers_falls_back():
    """A plan that does not fit the fixed-size buffers is not uploaded (bucket 0: the step
    runs the per-request kernel); one that fits is laid out with its unused items zeroed."""
    from lazyllm.engine.running.cuda_graphs import SharedPlanBuffers
    from lazyllm.kernels.grouping import plan_groups

    rows = [[(p, 16 * c, 0, 16) for c, p in enumerate(range(8))] + [(100 + b, 128, 0, 3)] for b in range(6)]
    plan = plan_groups(rows, members_per_item=2, pages_per_item=2)
    small = SharedPlanBuffers(4, 16, 2, 16, torch.device("cpu"), members_per_item=2, pages_per_item=2,
                              slots_per_row=2)
    assert not small.fits(plan) and small.upload(plan) == 0
    buf = SharedPlanBuffers(8, 16, 2, 16, torch.device("cpu"), members_per_item=2, pages_per_item=2)
    bucket = buf.upload(plan)
    assert bucket >= plan.n_items and bucket == buf.bucket(plan.n_items)
    items = buf.views.items[:bucket]
    assert torch.equal(items[:plan.n_items], torch.from_numpy(plan.items))
    assert int(items[plan.n_items:].abs().sum()) == 0
    m = buf.meta(6, bucket)
    assert m.plan.own.shape[0] == 6 and torch.equal(m.plan.parts, torch.from_numpy(plan.parts))
