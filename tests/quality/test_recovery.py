"""Quality recovery options keep the cache reusable and compute what they promise."""
import random

import pytest
import torch

from lazyllm import LazyLLM
from tests.conftest import entry_kv, make_tiny
from tests.hf_reference import hf_generate

DOCS = [f"Record {i}: " + " ".join(f"item{i}_{j}" for j in range(9 + 5 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", seed=3)


@pytest.mark.parametrize("reuse", ["lazy", "block"])
@pytest.mark.parametrize("ctx", ["isolated", "prefix"])
def test_recomputing_every_chunk_token_is_full_attention(model, tokenizer, reuse, ctx):
    """With k past every chunk's length each chunk token is recomputed with full context,
    so the answer must be exactly full attention's."""
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx,
                  recompute_first_tokens=10_000, kv_cache_bytes=32 << 20, quality="isolated")
    rng = random.Random(0)
    for _ in range(2):
        docs = rng.sample(DOCS, 4)
        out = llm.generate("Which item is first?", chunks=docs, max_new_tokens=10)
        assert out.token_ids == hf_generate(model, out.prompt_token_ids, 10, llm.eos_token_ids)
    llm.close()


@pytest.mark.parametrize("k", [1, 4, 20])
def test_partial_recompute_is_position_independent_and_accounted(model, tokenizer, k):
    kw = dict(model=model, tokenizer=tokenizer, recompute_first_tokens=k, kv_cache_bytes=32 << 20, quality="isolated")
    cold = LazyLLM(**kw)
    ref = cold.generate("q?", chunks=DOCS[:3], max_new_tokens=8)
    warm = LazyLLM(**kw)
    warm.generate("other?", chunks=DOCS[2::-1], max_new_tokens=2)
    out = warm.generate("q?", chunks=DOCS[:3], max_new_tokens=8)
    assert out.token_ids == ref.token_ids
    chunk_lens = [len(ids) for kind, ids in out.prompt_segments if kind == "chunk"]
    recomputed = sum(min(k, n) for n in chunk_lens)
    assert out.usage.cached_chunk_tokens == sum(chunk_lens) - recomputed
    sc = warm.score("q?", chunks=DOCS[:3], continuation=out.token_ids)
    assert sc.prefilled_tokens == recomputed + len(out.prompt_segments[-1][1]) + len(out.token_ids) - 1
    # the recompute changes the answer's logits relative to no recovery
    plain = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    s0 = plain.score("q?", chunks=DOCS[:3], continuation=out.token_ids)
    assert s0.logprobs != sc.logprobs
    # shared chunk pages were not modified: a plain request still reads clean KV
    assert warm.cache_stats()["pinned_entries"] == 0
    for x in (cold, warm, plain):
        x.close()


def _chunk_kv(llm) -> dict:
    """A copy of the K/V of every cached chunk, by the chunk's key."""
    store = llm.engine.store
    return {key: tuple(t.clone() for t in entry_kv(store, e)) for key, e in store.entries.items() if e.kind == "chunk"}


def _assert_same_chunk_kv(a: dict, b: dict) -> None:
    assert a and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key][0], b[key][0]) and torch.equal(a[key][1], b[key][1])


def test_recompute_leaves_the_shared_cache_untouched(model, tokenizer):
    """A lazy request with recomputation must not write into shared chunk pages: every cached
    chunk's pages hold the same KV before and after it, which is what an engine without
    recovery caches for the chunk."""
    plain = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    plain.warm(DOCS[1:4])
    llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_first_tokens=6, kv_cache_bytes=32 << 20,
                  quality="isolated")
    llm.warm(DOCS[1:4])
    before = _chunk_kv(llm)
    out = llm.generate("q?", chunks=DOCS[1:4], max_new_tokens=8)
    assert out.usage.cached_chunk_tokens < sum(len(ids) for kind, ids in out.prompt_segments if kind == "chunk")
    _assert_same_chunk_kv(_chunk_kv(llm), before)
    _assert_same_chunk_kv(before, _chunk_kv(plain))
    plain.close()
    llm.close()


@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("block", "prefix")])
def test_selective_recompute_of_everything_is_full_attention(model, tokenizer, reuse, ctx):
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx, recompute_ratio=1.0,
                  kv_cache_bytes=32 << 20, quality="isolated")
    out = llm.generate("Which item is first?", chunks=DOCS[1:5], max_new_tokens=10)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 10, llm.eos_token_ids)
    llm.close()


def test_selective_recompute_counts_and_reuse(model, tokenizer):
    kw = dict(model=model, tokenizer=tokenizer, recompute_ratio=0.2, recompute_first_tokens=2,
              kv_cache_bytes=32 << 20, quality="isolated")
    cold = LazyLLM(**kw)
    ref = cold.generate("q?", chunks=DOCS[:4], max_new_tokens=8)
    warm = LazyLLM(**kw)
    warm.warm(DOCS[:4][::-1])
    out = warm.generate("q?", chunks=DOCS[:4], max_new_tokens=8)
    assert out.token_ids == ref.token_ids  # the selection depends only on the chunks' KV
    lens = [len(ids) for kind, ids in out.prompt_segments if kind == "chunk"]
    total = sum(lens)
    recomputed = total - out.usage.cached_chunk_tokens
    # at least the ratio's share, at most that plus the first-2 tokens of each chunk
    assert -(-total // 5) <= recomputed <= -(-total // 5) + 2 * len(lens)
    assert warm.engine.metrics["recovery_skipped"] == 0
    cold.close()
    warm.close()


@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("lazy", "prefix"), ("block", "prefix")])
def test_attention_selected_recompute_of_everything_is_full_attention(model, tokenizer, reuse, ctx):
    llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx, recompute_ratio=1.0,
                  recompute_selection="attention", kv_cache_bytes=32 << 20, quality="isolated")
    out = llm.generate("Which item is first?", chunks=DOCS[1:5], max_new_tokens=10)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 10, llm.eos_token_ids)
    llm.close()


@pytest.mark.parametrize("reuse", ["lazy", "block"])
def test_attention_selected_recompute_counts_and_reuse(model, tokenizer, reuse):
    kw = dict(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context="prefix", recompute_ratio=0.2,
              recompute_selection="attention", kv_cache_bytes=32 << 20, quality="isolated")
    cold = LazyLLM(**kw)
    ref = cold.generate("q?", chunks=DOCS[:4], max_new_tokens=8)
    warm = LazyLLM(**kw)
    warm.warm(DOCS[:4][::-1])
    out = warm.generate("q?", chunks=DOCS[:4], max_new_tokens=8)
    assert out.token_ids == ref.token_ids  # cached KV reused at other positions: same selection, same answer
    lens = [len(ids) for kind, ids in out.prompt_segments if kind == "chunk"]
    total = sum(lens)
    assert total - out.usage.cached_chunk_tokens == -(-total // 5)
    assert warm.engine.metrics["recovery_skipped"] == 0
    # the first pass wrote nothing into the shared cache: its chunks' pages hold what an engine
    # without recovery caches for the same requests
    plain = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context="prefix", kv_cache_bytes=32 << 20,
                    quality="isolated")
    plain.warm(DOCS[:4][::-1])
    plain.generate("q?", chunks=DOCS[:4], max_new_tokens=8)
    _assert_same_chunk_kv(_chunk_kv(warm), _chunk_kv(plain))
    for x in (cold, warm, plain):
        x.close()


def test_attention_selection_picks_what_the_question_attends_to(model, tokenizer):
    """The engine's selection scores are the question's attention mass over the cached KV:
    non-negative, summing to (layers x heads x question tokens) less the mass on the prefix
    and on the question itself."""
    llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=0.1, recompute_selection="attention",
                  kv_cache_bytes=32 << 20, quality="isolated")
    seen = {}
    real = llm.engine.recovery.question_attention

    def spy(r):
        d = real(r)
        seen["mass"] = d
        seen["n"] = sum(len(s.ids) for s in r.plan.spans)
        return d

    llm.engine.recovery.question_attention = spy
    out = llm.generate("q?", chunks=DOCS[:3], max_new_tokens=1)
    s = len(out.prompt_segments[-1][1])
    spec = llm.model.spec
    assert seen["mass"].shape == (seen["n"],)
    assert float(seen["mass"].min()) >= 0.0
    assert 0.0 < float(seen["mass"].sum()) < spec.num_layers * spec.num_heads * s
    llm.close()


def test_recompute_selection_is_validated(model, tokenizer):
    from lazyllm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        LazyLLM(model=model, tokenizer=tokenizer, recompute_selection="random", kv_cache_bytes=32 << 20,
                quality="isolated")


def test_key_deviation_is_zero_for_the_first_isolated_chunk_only(model, tokenizer):
    """In 'prefix' context the first chunk directly follows the prefix, so its cached
    keys equal full attention's (deviation ~0); later chunks' keys differ."""
    llm = LazyLLM(model=model, tokenizer=tokenizer, chunk_context="prefix", recompute_ratio=0.1,
                  recompute_selection="deviation", kv_cache_bytes=32 << 20, quality="isolated")
    seen = {}
    real = llm.engine.recovery.key_deviation

    def spy(r):
        d = real(r)
        seen["dev"], seen["lens"] = d, [len(s.ids) for s in r.plan.spans]
        return d

    llm.engine.recovery.key_deviation = spy
    llm.generate("q?", chunks=DOCS[:3], max_new_tokens=1)
    n0 = seen["lens"][0]
    assert float(seen["dev"][:n0].max()) < 1e-3
    assert float(seen["dev"][n0:].max()) > 1e-2
    llm.close()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_layer1_key_deviation_from_cached_layer0_equals_dense_probe(tokenizer, family):
    """The layer-1 probe runs only the wanted chunk tokens through layer 0 over the cached
    layer-0 K/V (exact: they depend on token and position only); it gives the deviations of
    the dense probe, which runs the whole prompt head, for every token and for a subset."""
    llm = LazyLLM(model=make_tiny(family, seed=5), tokenizer=tokenizer, chunk_context="prefix",
                  recompute_ratio=0.1, recompute_selection="deviation", kv_cache_bytes=32 << 20, quality="isolated")
    rec, seen = llm.engine.recovery, []
    real = rec.key_deviation

    def both(r, only=None):
        paged = real(r, only=only)
        sub = torch.arange(paged.numel())[1::3]
        paged_sub = real(r, only=sub[torch.randperm(len(sub))])  # any order of indices
        kept = type(rec.model).__dict__["probe_keys_paged"]
        del type(rec.model).probe_keys_paged  # the dense path (deeper probes, models without it)
        try:
            dense = real(r, only=only)
        finally:
            type(rec.model).probe_keys_paged = kept
        torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(paged_sub[sub], dense[sub], rtol=1e-4, atol=1e-4)
        others = torch.ones(paged.numel(), dtype=torch.bool)
        others[sub] = False
        assert not paged_sub[others].any()  # the tokens not asked for: 0
        seen.append(float(dense.max()))
        return paged

    rec.key_deviation = both
    llm.warm(DOCS[:3])
    llm.generate("q?", chunks=DOCS[2::-1], max_new_tokens=1)
    assert seen and seen[0] > 1e-2  # chunks away from home deviate: the comparison had something to compare
    llm.close()


def test_quality_presets_set_options_and_explicit_options_win(model, tokenizer):
    from lazyllm.errors import InvalidRequestError
    from lazyllm.presets import PRESETS

    kw = dict(model=model, tokenizer=tokenizer, kv_cache_bytes=8 << 20)
    for name, preset in PRESETS.items():
        llm = LazyLLM(quality=name, **kw)
        assert llm.quality == name
        assert llm.reuse == preset["reuse"] and llm.chunk_context == preset["chunk_context"]
        assert llm.recompute_first_tokens == preset.get("recompute_first_tokens", 0)
        assert llm.recompute_ratio == preset.get("recompute_ratio", 0.0)
        llm.close()
    llm = LazyLLM(quality="balanced", recompute_ratio=0.3, recompute_first_tokens=0, **kw)
    assert (llm.recompute_ratio, llm.recompute_first_tokens, llm.chunk_context) == (0.3, 0, "prefix")
    llm.close()
    plain = LazyLLM(**kw)  # no preset: the defaults, which are balanced's values
    assert (plain.reuse, plain.chunk_context, plain.recompute_first_tokens, plain.recompute_ratio,
            plain.recompute_selection) == ("lazy", "prefix", 4, 0.14, "two-stage")
    plain.close()
    with pytest.raises(InvalidRequestError, match="quality"):
        LazyLLM(quality="best", **kw)


@pytest.mark.parametrize("preset", ["default", "fast", "balanced", "balanced-attention", "block-ft"])
def test_one_shared_copy_serves_every_neighbour_and_position(model, tokenizer, preset):
    """Under each preset that reuses chunk KV, one physical copy of a chunk serves requests
    that place it at other positions next to other documents; recovery recomputes into
    private copies, so the shared pages stay bit-identical and answers match a cold engine."""
    kw = dict(model=model, tokenizer=tokenizer, kv_cache_bytes=32 << 20)
    if preset == "balanced-attention":
        kw.update(quality="balanced", recompute_selection="attention")
    elif preset != "default":
        kw.update(quality=preset)
    x = DOCS[3]
    llm = LazyLLM(**kw)
    llm.warm([x], system="Sys.")
    [(key, entry)] = [(k, e) for k, e in llm.store.entries.items() if e.kind == "chunk"]
    pages = list(entry.pages)
    k0, v0 = llm.store.pool.k[:, pages].clone(), llm.store.pool.v[:, pages].clone()
    requests = [("First?", [DOCS[0], x, DOCS[5]]), ("Second?", [x, DOCS[1]]), ("Third?", [DOCS[2], DOCS[4], x])]
    outs = [llm.generate(q, chunks=c, system="Sys.", max_new_tokens=6) for q, c in requests]
    e = llm.store.entries[key]
    assert e.pages == pages and e.hits >= len(requests)  # the same physical pages, hit by each request
    assert torch.equal(llm.store.pool.k[:, pages], k0) and torch.equal(llm.store.pool.v[:, pages], v0)
    assert len([k for k, e in llm.store.entries.items() if e.kind == "chunk" and e.num_tokens == entry.num_tokens
                and e.pages == pages]) == 1
    if llm.recompute_ratio or llm.recompute_first_tokens:
        assert any(o.usage.cached_chunk_tokens < sum(len(i) for k_, i in o.prompt_segments if k_ == "chunk")
                   for o in outs)
    for (q, c), out in zip(requests, outs):  # the same answer as an engine that computes everything cold
        cold = LazyLLM(**kw)
        assert cold.generate(q, chunks=c, system="Sys.", max_new_tokens=6).token_ids == out.token_ids
        cold.close()
    llm.close()


@pytest.mark.parametrize("selection", ["attention", "two-stage"])
def test_query_aware_selections(model, tokenizer, selection):
    """Everything selected is full attention; a partial selection recomputes its share."""
    llm = LazyLLM(model=model, tokenizer=tokenizer, chunk_context="prefix", recompute_ratio=1.0,
                  recompute_selection=selection, kv_cache_bytes=32 << 20, quality="isolated")
    out = llm.generate("Which item is first?", chunks=DOCS[1:5], max_new_tokens=10)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 10, llm.eos_token_ids)
    llm.close()
    llm = LazyLLM(model=model, tokenizer=tokenizer, chunk_context="prefix", recompute_ratio=0.25,
                  recompute_selection=selection, kv_cache_bytes=32 << 20, quality="isolated")
    llm.warm(DOCS[1:5])
    out = llm.generate("Which item is first?", chunks=DOCS[4:0:-1], max_new_tokens=4)
    total = sum(len(ids) for kind, ids in out.prompt_segments if kind == "chunk")
    assert total - out.usage.cached_chunk_tokens == -(-total // 4)
    llm.close()


@pytest.mark.parametrize("selection", ["deviation", "attention", "two-stage"])
def test_prefix_context_recomputes_nothing_of_the_chunk_at_home(model, tokenizer, selection):
    """With chunk_context='prefix' the chunk right after the prefix (every page at delta 0)
    already holds full attention's KV: neither the first tokens nor the selected ones are
    taken from it, the budget goes to the other chunks, and the answer is the same whether
    its chunks were cached in another order or not."""
    from lazyllm.engine.recovery.recompute import Recovery

    picked = []
    real = Recovery.apply

    def spy(self, r, chosen=None):
        spans = [(s.start, len(s.ids), all(e.delta == 0 for e in s.entries)) for s in r.plan.spans]
        rc = real(self, r, chosen)
        picked.append((spans, list(rc.job.positions)))
        return rc

    kw = dict(model=model, tokenizer=tokenizer, chunk_context="prefix", recompute_first_tokens=3,
              recompute_ratio=0.25, recompute_selection=selection, kv_cache_bytes=32 << 20, quality="isolated")
    cold = LazyLLM(**kw)
    ref = cold.generate("Which item is first?", chunks=DOCS[:3], system="Be brief.", max_new_tokens=6)
    warm = LazyLLM(**kw)
    warm.generate("other?", chunks=DOCS[2::-1], system="Be brief.", max_new_tokens=1)
    Recovery.apply = spy
    try:
        out = warm.generate("Which item is first?", chunks=DOCS[:3], system="Be brief.", max_new_tokens=6)
    finally:
        Recovery.apply = real
    assert out.token_ids == ref.token_ids
    (spans, positions), = picked
    (h0, n0, home0), *rest = spans
    assert home0 and not any(home for _, _, home in rest)
    assert not [p for p in positions if h0 <= p < h0 + n0]  # nothing of the chunk at home
    total = sum(n for _, n, _ in spans)
    in_chunks = [p for p in positions if any(s <= p < s + n for s, n, _ in rest)]
    for s, n, _ in rest:  # the first tokens of every other chunk
        assert set(range(s, s + min(3, n))) <= set(in_chunks)
    assert len(in_chunks) >= -(-total // 4)  # the whole ratio budget, spent on the other chunks
    assert out.usage.cached_chunk_tokens == total - len(in_chunks)
    cold.close()
    warm.close()


@pytest.mark.parametrize("ctx", ["isolated", "prefix"])
def test_recompute_job_holds_the_first_tokens_and_the_picks_at_their_cached_slots(model, tokenizer, ctx):
    """The recompute job ``apply`` builds (vectorized over the chunk tokens) is the one built
    token by token: each chunk's first k tokens (none of a chunk at home) and the top picks
    of the selection's score, in chunk order, each at its position and in its slot of the
    request's (privatized) table, then the question; the picked pages are private copies."""
    from lazyllm.config import register_selection

    k = 2
    scores = {}

    @register_selection(f"test-seeded-random-{ctx}")
    def seeded(rec, r, n_pick, exclude):
        g = torch.Generator().manual_seed(len(scores))
        s = torch.rand(sum(len(sp.ids) for sp in r.plan.spans), generator=g)
        s[::7] = float("-inf")  # never picked, even when the budget would reach them
        scores[r.id] = s
        return s

    llm = LazyLLM(model=model, tokenizer=tokenizer, chunk_context=ctx, recompute_first_tokens=k,
                  recompute_ratio=0.3, recompute_selection=f"test-seeded-random-{ctx}", kv_cache_bytes=32 << 20,
                      quality="isolated")
    rec, seen = llm.engine.recovery, []
    real = rec.apply

    def spy(r, chosen=None):
        rc = real(r, chosen)
        seen.append((r, list(r.plan.spans), rc.job, list(r.alloc.table), list(r.alloc.private_pages)))
        return rc

    rec.apply = spy
    llm.warm(DOCS[:4])
    llm.generate("Which item is first?", chunks=DOCS[3::-1], max_new_tokens=1)
    (r, spans, job, table, private), = seen
    ps = llm.engine.pool.page_size
    home = [rec.exact_at_home and all(e.delta == 0 for e in s.entries) for s in spans]
    total = sum(len(s.ids) for s in spans)
    away = sum(len(s.ids) for s, h in zip(spans, home) if not h)
    n_pick = min(away, -(-3 * total // 10))
    score = scores[r.id].clone()
    at_home = torch.cat([torch.full((len(s.ids),), h) for s, h in zip(spans, home)])
    score[at_home] = float("-inf")
    top = torch.topk(score, n_pick)
    flat = [(ci, i) for ci, s in enumerate(spans) for i in range(len(s.ids))]
    sel = [set() if h else set(range(min(k, len(s.ids)))) for s, h in zip(spans, home)]
    for j in top.indices[torch.isfinite(top.values)].tolist():
        sel[flat[j][0]].add(flat[j][1])
    ids, pos, slots = [], [], []
    for s, chosen in zip(spans, sel):
        for i in sorted(chosen):
            ids.append(s.ids[i])
            pos.append(s.start + i)
            page = table[s.first_entry + i // ps].page
            assert page in private  # a private copy, never the shared page
            slots.append(page * ps + i % ps)
    n_chunk = len(ids)
    assert 0 < n_chunk < total and any(home) == (ctx == "prefix")
    assert job.ids[:n_chunk] == ids and job.positions[:n_chunk] == pos and job.slots[:n_chunk] == slots
    assert len(job.ids) > n_chunk and job.positions[n_chunk] == spans[-1].start + len(spans[-1].ids)
    llm.close()


def test_selection_depth_sums_the_question_attention_over_the_first_layers(model, tokenizer):
    """``recompute_selection_depth`` stops the question's first pass after the leading
    fraction of the layers: its mass is that of the same pass over every layer less what the
    later layers add, and the engine passes the depth through."""
    docs, seen = DOCS[:3], {}
    for depth in (1.0, 0.5):
        llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=0.1, recompute_selection="attention",
                      recompute_selection_depth=depth, kv_cache_bytes=32 << 20, quality="isolated")
        rec = llm.engine.recovery
        L = llm.model.spec.num_layers
        assert rec.mass_layers == (L if depth == 1.0 else -(-L // 2)) and 1 <= rec.mass_layers <= L
        real = rec.question_attention
        rec.question_attention = lambda r, real=real, depth=depth: seen.setdefault(depth, real(r))
        llm.warm(docs)
        llm.generate("q?", chunks=docs[::-1], max_new_tokens=1)
        llm.close()
    full, half = seen[1.0], seen[0.5]
    assert full.shape == half.shape and float(half.min()) >= 0.0
    assert bool((full >= half - 1e-5).all())  # the later layers only add mass
    assert float(full.sum()) > float(half.sum()) * 1.05


@pytest.mark.parametrize("depth", [0.0, -0.5, 1.5, "half", float("nan")])
def test_selection_depth_is_validated(model, tokenizer, depth):
    from lazyllm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="recompute_selection_depth"):
        LazyLLM(model=model, tokenizer=tokenizer, recompute_selection_depth=depth, kv_cache_bytes=32 << 20,
                quality="isolated")


@pytest.mark.parametrize("selection", ["attention", "two-stage"])
def test_a_score_selects_without_seeing_its_continuation(model, tokenizer, selection):
    """The question's attention picks what is recomputed, and a score's continuation is no
    part of the question: the logits of the first continuation token (which depend only on
    the prompt and the recompute) are the same whatever continuation follows, and equal to
    those a generation starts from. Before, the continuation's tokens joined the question
    pass, so a fidelity report's teacher-forced scores recomputed what a generation never
    would."""
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="fast",
                  recompute_ratio=0.3, recompute_selection=selection)
    llm.warm(DOCS, progress=False)
    rng = random.Random(7)
    for _ in range(3):
        docs = rng.sample(DOCS, 4)
        a = [rng.randrange(100, 400) for _ in range(12)]
        b = [rng.randrange(100, 400) for _ in range(12)]
        sa = llm.score("Which item is first?", chunks=docs, continuation=a, return_logits=True)
        sb = llm.score("Which item is first?", chunks=docs, continuation=b, return_logits=True)
        torch.testing.assert_close(sa.logits[0], sb.logits[0], rtol=1e-5, atol=1e-5)
        gen = llm.generate("Which item is first?", chunks=docs, max_new_tokens=1)
        assert gen.token_ids[0] == int(sa.logits[0].argmax())
    llm.close()
