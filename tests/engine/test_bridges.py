"""Bridge packets: a packet whose trailer is recomputed per request, attending across chunks.

The engine's answer equals transformers' over the request's logical sequence with the packet
embeddings put in and a 4-D mask in which chunk tokens see only their own chunk while the
bridge (trailer) rows see everything before them; the chunk bodies stay cached, shared and
order-independent; bridge and cached-trailer packets never share KV; the training layout
(``student_layout``) computes the same function."""
import random

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.model.packets import Packets, load_packets
from lazyllm.quality.packet_training import embed_with_packets, student_layout, student_logits
from tests.conftest import make_tiny
from tests.engine.test_packets import DOCS, QUESTION, SYSTEM, random_packets


def _bridge(p: Packets) -> Packets:
    return Packets(p.header, p.trailer, p.model, dict(p.info), bridge=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request):
    return make_tiny(request.param, seed=11)


def _llm(model, tok, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20, **kw)


def _reference_mask(segments, n_answer: int, k_trailer: int) -> torch.Tensor:
    """Isolated chunks, except that each chunk's last ``k_trailer`` tokens (the bridge) attend
    causally to everything before them; written out independently of ``student_layout``."""
    rows = []  # per token: (segment, may read across segments)
    for si, (kind, ids) in enumerate(segments):
        for i in range(len(ids)):
            across = kind != "chunk" or i >= len(ids) - k_trailer
            rows.append((si, across))
    rows += [(len(segments) - 1, True)] * n_answer
    n = len(rows)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for a, (sa, across) in enumerate(rows):
        for b in range(a + 1):
            mask[a, b] = across or rows[b][0] == sa
    return mask


@torch.inference_mode()
def _reference_logits(model, segments, answer, rows, base, k_trailer):
    ids = torch.tensor([t for _, s in segments for t in s] + list(answer[:-1]))
    n = ids.shape[0]
    mask = _reference_mask(segments, len(answer) - 1, k_trailer)
    out = model(inputs_embeds=embed_with_packets(model, ids, rows, base), attention_mask=mask[None, None],
                position_ids=torch.arange(n)[None])
    return out.logits[0, n - len(answer):].float()


@pytest.mark.parametrize("reuse", ["lazy", "block"])
def test_bridge_logits_equal_transformers_with_bridge_rows_across_chunks(tiny, tokenizer, reuse):
    p = _bridge(random_packets(tiny, k_header=2, k_trailer=3, scale=3.0))
    llm = _llm(tiny, tokenizer, packets=p, reuse=reuse)
    llm.warm(DOCS)  # the bodies come from the cache, encoded at other positions
    cont = [7, 19, 23, 5]
    base = llm.model.embed_rows
    for docs in ([DOCS[2], DOCS[0], DOCS[3]], [DOCS[1], DOCS[2]]):
        sc = llm.score(QUESTION, chunks=docs, system=SYSTEM, continuation=cont, return_logits=True)
        segs = [(k, list(ids)) for k, ids in sc.prompt_segments]
        assert sc.usage.cached_chunk_tokens > 0
        ref = _reference_logits(tiny, segs, cont, p.rows, base, p.k_trailer)
        torch.testing.assert_close(sc.logits, ref, rtol=1e-4, atol=1e-4)
    # the same packet with a cached trailer computes another function: the check can fail
    cached = _llm(tiny, tokenizer, packets=random_packets(tiny, k_header=2, k_trailer=3, scale=3.0), reuse=reuse)
    other = cached.score(QUESTION, chunks=docs, system=SYSTEM, continuation=cont, return_logits=True)
    assert not torch.allclose(other.logits, sc.logits, atol=1e-3)
    llm.close()
    cached.close()


def test_training_layout_computes_the_engine_function(tiny, tokenizer):
    """``student_layout`` (a recomputed copy of each bridge token beside its cached one)
    gives the same logits as the plain reference mask, and so as the engine."""
    p = _bridge(random_packets(tiny, k_header=2, k_trailer=2, scale=3.0))
    llm = _llm(tiny, tokenizer, packets=p)
    sc = llm.score(QUESTION, chunks=DOCS[:3], system=SYSTEM, continuation=[3, 9, 27], return_logits=True)
    base = llm.model.embed_rows
    segs = [(k, list(ids)) for k, ids in sc.prompt_segments]
    head, tail = p.ids(base)
    raw = [(k, ids[len(head):len(ids) - len(tail)] if k == "chunk" else ids) for k, ids in segs]
    lay = student_layout(raw, [3, 9, 27], p.k_header, p.k_trailer, base, bridge=True)
    assert int(lay.bridge_rows.sum()) == 3 * p.k_trailer
    with torch.no_grad():
        got = student_logits(tiny, lay.ids, lay.mask, p.rows, base, 3, positions=lay.positions)
    torch.testing.assert_close(got, sc.logits, rtol=1e-4, atol=1e-4)
    llm.close()


def test_layout_mask_keeps_cached_tokens_free_of_request_state():
    """No cached chunk token reads another chunk or a recomputed copy; the question reads the
    recomputed copy, never the cached token it replaces; a recomputed copy reads earlier
    chunks."""
    segs = [("prefix", [1, 2]), ("chunk", [10, 11, 12]), ("chunk", [20, 21]), ("suffix", [30, 31])]
    lay = student_layout(segs, [40, 41], 1, 2, 100, bridge=True, recompute=[[1], []])
    n_base_chunks = 2 + (3 + 3) + (2 + 3)
    cached = torch.zeros(len(lay.ids), dtype=torch.bool)
    cached[2:n_base_chunks] = True
    copies = ~cached & (lay.positions < n_base_chunks) & (torch.arange(len(lay.ids)) >= n_base_chunks)
    assert int(copies.sum()) == 1 + 2 * 2  # token 1 of chunk 0, and both chunks' 2-token bridges
    assert not (lay.mask[cached][:, copies]).any()
    chunk0 = torch.zeros(len(lay.ids), dtype=torch.bool)
    chunk0[2:8] = True
    assert not lay.mask[8:n_base_chunks][:, chunk0].any()  # chunk 1's cached tokens never see chunk 0
    q = torch.zeros(len(lay.ids), dtype=torch.bool)
    q[-3:] = True
    replaced = cached & torch.isin(lay.positions, lay.positions[copies])
    assert not lay.mask[q][:, replaced].any() and lay.mask[q][:, copies].all()
    last_copy = copies.nonzero().max()
    assert lay.mask[last_copy][chunk0 & ~replaced].all()  # chunk 1's bridge reads chunk 0


def test_bridge_reuse_is_order_independent_and_leaves_the_cache_untouched(tiny, tokenizer):
    p = _bridge(random_packets(tiny, k_header=2, k_trailer=2))
    warm = _llm(tiny, tokenizer, packets=p)
    warm.warm(DOCS)
    pool = warm.store.pool
    snap = {key: (pool.k[:, e.pages].clone(), pool.v[:, e.pages].clone()) for key, e in warm.store.entries.items()}
    rng = random.Random(3)
    cont = [5, 17, 29]
    for _ in range(3):
        order = rng.sample(DOCS, 3)
        a = warm.score(QUESTION, chunks=order, system=SYSTEM, continuation=cont, return_logits=True)
        cold = _llm(tiny, tokenizer, packets=p)
        b = cold.score(QUESTION, chunks=order, system=SYSTEM, continuation=cont, return_logits=True)
        assert a.usage.cached_chunk_tokens > 0 and b.usage.cached_chunk_tokens == 0
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        cold.close()
    for key, (k, v) in snap.items():
        e = warm.store.entries[key]
        assert torch.equal(pool.k[:, e.pages], k) and torch.equal(pool.v[:, e.pages], v)
    warm.close()


def test_bridge_and_cached_trailer_packets_never_share_kv(tiny, tokenizer, tmp_path):
    p = random_packets(tiny, k_header=2, k_trailer=2)
    b = _bridge(p)
    assert p.digest != b.digest and b.bridge_tokens == 2 and p.bridge_tokens == 0
    a_llm, b_llm = _llm(tiny, tokenizer, packets=p), _llm(tiny, tokenizer, packets=b)
    assert a_llm.fingerprint != b_llm.fingerprint
    for llm in (a_llm, b_llm):
        llm.warm(DOCS[:2])
    assert not set(a_llm.resident_chunk_keys()) & set(b_llm.resident_chunk_keys())
    q = load_packets(b.save(tmp_path / "b.safetensors"))
    assert q.bridge and q.digest == b.digest
    assert not load_packets(p.save(tmp_path / "p.safetensors")).bridge
    a_llm.close()
    b_llm.close()
