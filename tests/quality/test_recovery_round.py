"""Recovery's selection for a whole round (``lazyllm/engine/recovery/rounds.py``) picks, for
every request, the tokens the per-request selection picks for it alone: each of the engine's
selections, the torch reference and the Triton kernels (Triton's interpreter on CPU), with
the round's passes split by ``max_batch_tokens`` or not, chunks at home excluded."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.engine.recovery.rounds import batched_selection, batches, select_round
from lazyllm.engine.running.model_runner import budget_groups
from lazyllm.engine.step import Recomputation
from tests.conftest import make_tiny
from tests.quality.test_recovery import DOCS

QUESTIONS = ["Which item is first?", "q?", "Name every record that lists item3_4 and item2_1, please.",
             "Why?", "Which record is the longest one of all?", "Count."]


def _requests(n=6, new=2, k=5):
    """``n`` requests of at most ``k`` chunks each, ``new`` tokens each."""
    orders = [[0, 1, 2], [3, 1], [2, 5, 4, 0], [1], [4, 3, 2, 1, 0], [5, 2]]
    return [{"question": q, "chunks": [DOCS[i] for i in o[:k]], "system": "Be brief.", "max_new_tokens": new}
            for q, o in zip(QUESTIONS[:n], orders[:n])]


def record_rounds(llm, regroup: bool) -> list:
    """Patch ``llm``'s recovery so that every round also selects request by request and
    together (``regroup``: also with every pass split in groups of 16 tokens); returns the
    list each round appends ``(alone, [together...], budgets)`` to."""
    rec = llm.engine.recovery
    real, rounds = rec.apply_round, []

    def spy(reqs):
        live = [r for r in reqs if r.plan is not None and r.plan.spans]
        rec._memo = {}
        try:
            alone = {r.id: np.sort(rec._pick(r, *rec.budget(r))) for r in live}
            together = [select_round(rec, live)]
            kept = rec.runner.max_batch_tokens
            rec.runner.max_batch_tokens = 16
            try:
                together += [select_round(rec, live)] if regroup else []
            finally:
                rec.runner.max_batch_tokens = kept
        finally:
            rec._memo = None
        rounds.append((alone, together, [rec.budget(r) for r in live]))
        return real(reqs)

    rec.apply_round = spy
    return rounds


def check_rounds(rounds: list, n: int, agree: float = 1.0) -> None:
    """Every round's picks together are each request's own (at least ``agree`` of them: a
    device's float sums may order near-equal scores differently), the batch met in one
    round, and some chunk sat at home."""
    biggest = max(rounds, key=lambda x: len(x[0]))
    assert len(biggest[0]) >= n - 1  # the batch met in one round (one request has no chunk away)
    for alone, together, _ in rounds:
        for picks in together:
            assert {i for i, a in alone.items() if len(a)} == set(picks)  # the same requests pick
            for i, got in picks.items():
                assert len(got) == len(alone[i])
                if agree == 1.0:
                    np.testing.assert_array_equal(np.sort(got), alone[i])
                else:
                    assert len(np.intersect1d(got, alone[i])) >= agree * len(got)
    assert [b for *_, budgets in rounds for b in budgets if b[0].any()]  # a chunk at home, excluded
    assert sum(len(a) for alone, *_ in rounds for a in alone.values()) > 10


# the interpreter is slow: there, the selection that runs both the question pass and the probe
@pytest.mark.parametrize("selection,backend", [("deviation", "torch"), ("attention", "torch"),
                                               ("two-stage", "torch"), ("two-stage", "triton")])
def test_round_picks_equal_each_requests_own(tokenizer, selection, backend):
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("the interpreter path is for CPU-only machines")
    n = 3 if backend == "triton" else 6
    llm = LazyLLM(model=make_tiny("llama", seed=3), tokenizer=tokenizer, chunk_context="prefix",
                  recompute_first_tokens=2, recompute_ratio=0.2, recompute_selection=selection,
                  attention_backend=backend, kv_cache_bytes=32 << 20, quality="isolated")
    rounds = record_rounds(llm, regroup=backend == "torch")
    llm.warm(DOCS[:n])
    llm.generate_batch(_requests(n, 1, k=2 if backend == "triton" else 5))
    check_rounds(rounds, n)
    llm.close()


def test_round_answers_equal_per_request_selection(tokenizer):
    """End to end: an engine whose rounds select together answers every request as one that
    selects request by request."""
    kw = dict(model=make_tiny("llama", seed=3), tokenizer=tokenizer, quality="balanced", kv_cache_bytes=32 << 20)
    together, alone = LazyLLM(**kw), LazyLLM(**kw)
    per_request = alone.engine.recovery

    def one_by_one(reqs):
        recs = {r.id: per_request.apply(r) for r in reqs}
        return {i: rc for i, rc in recs.items() if rc is not None}

    per_request.apply_round = one_by_one
    for llm in (together, alone):
        llm.warm(DOCS)
    a = [o.token_ids for o in together.generate_batch(_requests())]
    b = [o.token_ids for o in alone.generate_batch(_requests())]
    assert a == b
    assert together.engine.metrics.recovery_skipped == 0
    together.close()
    alone.close()


def test_recovery_decides_and_leaves_the_plan_as_the_planner_made_it(tokenizer):
    """Recovery writes nothing of a request's plan: ``apply_round`` returns each request's
    ``Recomputation`` (frozen) and every field of the plan, its job and copies included, is
    as the planner made it; the round's ``PrefillBatch`` runs recovery's job after the
    planner's copies and recovery's, and the counts the result reports move by what the
    recomputation says (``PrefillPlan.recomputed``)."""
    llm = LazyLLM(model=make_tiny("llama", seed=3), tokenizer=tokenizer, recompute_first_tokens=2,
                  recompute_ratio=0.2, kv_cache_bytes=32 << 20, quality="isolated")
    engine, rec = llm.engine, llm.engine.recovery
    real_round, real_before = rec.apply_round, engine.before_own
    planned, recs, batches_ = {}, {}, []

    def spy(reqs):
        before = {r.id: (r, copy.deepcopy(r.plan), r.plan.job, r.plan.copies) for r in reqs}
        out = real_round(reqs)
        for r, plan, job, copies in before.values():
            assert r.plan == plan and r.plan.job is job and r.plan.copies is copies  # untouched
        planned.update(before)
        recs.update(out)
        return out

    def before_own(reqs):
        batches_.append(real_before(reqs))
        return batches_[-1]

    rec.apply_round, engine.before_own = spy, before_own
    llm.warm(DOCS[:4])
    outs = llm.generate_batch(_requests(2, 2, k=4))
    assert len(recs) == 2
    for rid, rc in recs.items():
        r, plan, job, copies = planned[rid]
        assert isinstance(rc, Recomputation) and rc.computed >= rc.reused > 0 and rc.copies
        with pytest.raises(dataclasses.FrozenInstanceError):
            rc.job = job
        batch = next(b for b in batches_ if r in b.reqs)
        i = batch.reqs.index(r)
        assert batch.jobs[i] is rc.job and rc.job is not job and batch.copies[i] == tuple(copies) + rc.copies
        out, = [o for o in outs if o.prompt_segments == [(s.kind, list(s.ids)) for s in r.segments]]
        assert out.usage.cached_chunk_tokens == plan.cached_chunk_tokens - rc.reused
        assert out.usage.cached_tokens == plan.cached_tokens - rc.reused
    llm.close()


def test_user_selections_run_per_request_and_groups_keep_the_budget(tokenizer):
    assert batched_selection("two-stage") == "two-stage" and batched_selection("deviation") == "deviation"
    from lazyllm.config import register_selection

    @register_selection("test-round-user")
    def mine(rec, r, n_pick, exclude):
        return torch.zeros(sum(len(s.ids) for s in r.plan.spans))

    assert batched_selection("test-round-user") is None
    model = make_tiny("llama", seed=3)
    llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=0.2, recompute_selection="test-round-user",
                  kv_cache_bytes=32 << 20, quality="isolated")
    rec = llm.engine.recovery
    assert not batches(rec)
    rec.selection = "two-stage"
    assert batches(rec)
    rec.probe_layer = 0  # a dense probe: request by request
    assert not batches(rec)
    rec.selection = "attention"
    assert batches(rec)
    llm.close()
    assert budget_groups([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert budget_groups([], 10) == []


def test_warm_up_runs_a_rounds_question_pass(tokenizer):
    """Recovery's warm-up runs the batched question pass a large round makes (many sequences:
    on CUDA the mass kernels then run with their key range unsplit, a variant the
    single-request graphs never compile), over tables on and off 16 entries; its K/V go to
    the scratch page only, and a selection without a question pass runs none."""
    seen = []
    for selection in ("two-stage", "deviation"):
        llm = LazyLLM(model=make_tiny("llama", seed=3), tokenizer=tokenizer, chunk_context="prefix",
                      recompute_ratio=0.2, recompute_selection=selection, kv_cache_bytes=32 << 20, quality="isolated")
        model, rec = llm.engine.recovery.model, llm.engine.recovery
        real = model.attention_mass

        def spy(ids, meta, k, v, layers=None, real=real, selection=selection):
            seen.append((selection, int(meta.cu_seqlens_q.numel()) - 1, int(meta.block_table.shape[1]), layers))
            return real(ids, meta, k, v, layers=layers)

        model.attention_mass = spy
        free = llm.cache_stats()["free_pages"]
        assert rec.warm_launches()
        assert llm.cache_stats()["free_pages"] == free
        assert llm.generate("q?", chunks=DOCS[:2], max_new_tokens=1).token_ids  # the engine still answers
        llm.close()
    layers = make_tiny("llama", seed=3).config.num_hidden_layers  # the default depth: every layer
    batched = {(s[0], s[2], s[3]) for s in seen if s[1] >= 160}
    assert batched == {("two-stage", 16, layers), ("two-stage", 17, layers)}
