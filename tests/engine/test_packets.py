"""Learned chunk packets in the engine: the KV the engine caches for a chunk with its packet is
what transformers computes with the packet embeddings put in (4-D mask, explicit positions),
reuse with packets stays order- and position-independent, keys and fingerprints separate
packet versions, and a packet of another model is refused."""
import random

import pytest
import torch

from lazyllm import InvalidRequestError, LazyLLM
from lazyllm.cache.store import chunk_key
from lazyllm.model.identity import model_id
from lazyllm.model.llama import LlamaFamilyModel
from lazyllm.model.packets import Packets, load_packets
from lazyllm.quality.packet_training import embed_with_packets
from tests.conftest import make_tiny
from tests.hf_reference import semantic_mask

DOCS = [
    "The Eiffel Tower in Paris was completed in 1889 and is 330 metres tall.",
    "Mount Fuji is the highest mountain in Japan, rising 3,776 metres above sea level.",
    "The Great Wall of China stretches for more than 21,000 kilometres across northern China.",
    "Python was created by Guido van Rossum and first released in 1991.",
]
QUESTION = "Which of these was completed in 1889?"
SYSTEM = "You are a concise assistant."
NEW = 8


def random_packets(model, k_header=3, k_trailer=2, seed=0, scale=1.0) -> Packets:
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    std = float(model.get_input_embeddings().weight.detach().std()) * scale
    mid = model_id(LlamaFamilyModel(model, fuse=False, fused_kernels=False))
    return Packets(torch.randn(k_header, hidden, generator=g) * std, torch.randn(k_trailer, hidden, generator=g) * std,
                   mid)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def tiny(request):
    return make_tiny(request.param)


def _llm(model, tok, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20, **kw)


@torch.inference_mode()
def _reference_greedy(model, segments, rows, base, n_new, eos):
    """Greedy tokens of transformers over the request's logical sequence (packet ids
    included), packet rows put in as input embeddings, the isolated-chunk 4-D mask."""
    ids = [t for _, s in segments for t in s]
    out = []
    for _ in range(n_new):
        n = len(ids)
        segs = list(segments[:-1]) + [("suffix", list(segments[-1][1]) + out)]
        mask = semantic_mask(segs, "lazy", "isolated")
        h = embed_with_packets(model, torch.tensor(ids), rows, base)
        logits = model(inputs_embeds=h, attention_mask=mask[None, None], position_ids=torch.arange(n)[None]).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in eos:
            break
        ids.append(tok)
    return out


def test_packet_kv_equals_transformers_with_packet_embeddings(tiny, tokenizer):
    p = random_packets(tiny)
    llm = _llm(tiny, tokenizer, packets=p)
    llm.warm(DOCS[:2])
    base = llm.model.embed_rows
    head, tail = p.ids(base)
    for doc in DOCS[:2]:
        ids = head + llm.prompts.encode(llm.prompts.chunk_text(llm_chunk(doc))) + tail
        e = llm.store.entries[chunk_key(llm.fingerprint, "isolated", ids)]
        assert e.num_tokens == len(ids)
        pos = torch.arange(e.stored_pos, e.stored_pos + len(ids))
        with torch.inference_mode():
            out = tiny(inputs_embeds=embed_with_packets(tiny, torch.tensor(ids), p.rows, base),
                       position_ids=pos[None], use_cache=True)
        pool = llm.store.pool
        for li, layer in enumerate(out.past_key_values.layers):
            k = pool.k[li, e.pages].flatten(0, 1)[:len(ids)]
            v = pool.v[li, e.pages].flatten(0, 1)[:len(ids)]
            torch.testing.assert_close(k, layer.keys[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, layer.values[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
    # without the packet rows the reference differs: the comparison above can fail
    with torch.inference_mode():
        plain = tiny(inputs_embeds=embed_with_packets(tiny, torch.tensor(ids), torch.zeros_like(p.rows), base),
                     position_ids=pos[None], use_cache=True)
    assert not torch.allclose(pool.v[0, e.pages].flatten(0, 1)[:len(ids)],
                              plain.past_key_values.layers[0].values[0].transpose(0, 1), atol=1e-3)
    llm.close()


def llm_chunk(text):
    from lazyllm import Chunk

    return Chunk(text)


@pytest.mark.parametrize("reuse", ["lazy", "block"])
def test_packets_answers_match_reference_in_any_order(tiny, tokenizer, reuse):
    """Generated tokens equal transformers' with the packets put in, for documents reused in
    other orders and positions; the packets change the answer's logits (the check can fail)."""
    p = random_packets(tiny, scale=3.0)
    llm = _llm(tiny, tokenizer, packets=p, reuse=reuse)
    rng = random.Random(0)
    llm.warm(DOCS)
    for _ in range(2):
        docs = rng.sample(DOCS, 3)
        out = llm.generate(QUESTION, chunks=docs, system=SYSTEM, max_new_tokens=NEW)
        assert out.usage.cached_tokens > 0
        segs = [(k, list(ids)) for k, ids in out.prompt_segments]
        head, tail = p.ids(llm.model.embed_rows)
        assert all(ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail for k, ids in segs if k == "chunk")
        ref = _reference_greedy(tiny, segs, p.rows, llm.model.embed_rows, NEW, llm.eos_token_ids)
        assert out.token_ids == ref
    plain = _llm(tiny, tokenizer, packets=None, reuse=reuse)
    a = llm.score(QUESTION, chunks=DOCS[:3], system=SYSTEM, continuation=out.token_ids, return_logits=True)
    b = plain.score(QUESTION, chunks=DOCS[:3], system=SYSTEM, continuation=out.token_ids, return_logits=True)
    assert not torch.allclose(a.logits, b.logits, atol=1e-3)
    llm.close()
    plain.close()


def test_packet_reuse_is_position_and_order_independent(tiny, tokenizer):
    """A chunk's cached KV with its packet serves any order: the same logits as when every
    chunk is computed fresh for that order."""
    p = random_packets(tiny)
    warm = _llm(tiny, tokenizer, packets=p)
    warm.warm(list(reversed(DOCS)))
    order = [DOCS[2], DOCS[0], DOCS[3]]
    cont = [5, 17, 29, 41]
    a = warm.score(QUESTION, chunks=order, system=SYSTEM, continuation=cont, return_logits=True)
    cold = _llm(tiny, tokenizer, packets=p)
    b = cold.score(QUESTION, chunks=order, system=SYSTEM, continuation=cont, return_logits=True)
    assert a.usage.cached_chunk_tokens > 0 and b.usage.cached_chunk_tokens == 0
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    warm.close()
    cold.close()


def test_keys_and_fingerprints_separate_packet_versions(tiny, tokenizer, tmp_path):
    p1, p2 = random_packets(tiny, seed=1), random_packets(tiny, seed=2)
    a, b, none = _llm(tiny, tokenizer, packets=p1), _llm(tiny, tokenizer, packets=p2), _llm(tiny, tokenizer)
    assert len({a.fingerprint, b.fingerprint, none.fingerprint}) == 3
    assert a.model_fingerprint == b.model_fingerprint == none.model_fingerprint
    for llm in (a, b, none):
        llm.warm(DOCS[:1])
    keys = [set(llm.resident_chunk_keys()) for llm in (a, b, none)]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2])
    # the disk tier: KV written under one packet is not read under another
    da = _llm(tiny, tokenizer, packets=p1, kv_disk_dir=tmp_path)
    da.warm(DOCS[:2])
    da.close()
    db = _llm(tiny, tokenizer, packets=p2, kv_disk_dir=tmp_path)
    assert db.warm(DOCS[:2])["computed_tokens"] > 0
    db.close()
    da2 = _llm(tiny, tokenizer, packets=p1, kv_disk_dir=tmp_path)
    out = da2.generate(QUESTION, chunks=DOCS[:2], max_new_tokens=1)
    assert out.usage.cached_tokens > 0  # read back from disk under the same packet
    da2.close()
    for llm in (a, b, none):
        llm.close()


def test_packet_file_round_trip_and_wrong_model(tiny, tokenizer, tmp_path):
    p = random_packets(tiny)
    path = p.save(tmp_path / "p.safetensors")
    q = load_packets(path)
    assert torch.equal(q.rows, p.rows) and q.model == p.model and q.digest == p.digest
    llm = _llm(tiny, tokenizer, packets=str(path))
    assert llm.packets.digest == p.digest
    llm.close()
    other = make_tiny("llama", seed=7)
    with pytest.raises(InvalidRequestError, match="another model"):
        _llm(other, tokenizer, packets=path)
    with pytest.raises(InvalidRequestError, match="reuse"):
        _llm(tiny, tokenizer, packets=p, reuse="none")
    (tmp_path / "bad.safetensors").write_bytes(b"not a packet")
    with pytest.raises(InvalidRequestError):
        _llm(tiny, tokenizer, packets=tmp_path / "bad.safetensors")
    with pytest.raises(InvalidRequestError, match="hidden"):
        Packets(torch.zeros(2, 8), torch.zeros(2, 9), "x")


def test_auto_packets_off_for_models_without_a_shipped_packet(tiny, tokenizer):
    llm = _llm(tiny, tokenizer)
    assert llm.packets is None and llm.fingerprint == llm.model_fingerprint
    llm.close()



@pytest.mark.slow
def test_default_model_uses_its_shipped_packet(default_llm_parts):
    """``LazyLLM()``'s default packet: the shipped file for the default model, used in the
    chunk-caching modes with isolated chunks, not in full attention or under another chunk
    context; ``packets=None`` turns it off."""
    from lazyllm.model.packets import SHIPPED_DIR, shipped_packets

    model, tok = default_llm_parts
    files = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert files, "no packet shipped for the default model"
    llm = _llm(model, tok)
    p = shipped_packets(llm.model, "isolated")
    assert p is not None and llm.packets is not None and llm.packets.digest == p.digest
    assert llm.fingerprint != llm.model_fingerprint
    out = llm.generate("How tall is the Eiffel Tower?", chunks=DOCS[:2], max_new_tokens=4)
    assert out.usage.prompt_tokens > 0
    llm.close()
    for kw in ({"packets": None}, {"quality": "exact"}, {"chunk_context": "prefix"}):
        other = _llm(model, tok, **kw)
        assert other.packets is None, kw
        other.close()
