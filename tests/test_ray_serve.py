"""Replicas on Ray Serve: the document-affinity policy as pure functions (fake replica
stats, no cluster), the router's chunk keys against the engine's, and one end-to-end run
on a local Ray instance with two replicas of a tiny random model."""
from __future__ import annotations

import os
import random
import time

import pytest

from lazyllm import Chunk, LazyLLM

rs = pytest.importorskip("lazyllm.integrations.ray_serve", reason="needs the ray_serve module")
from lazyllm.integrations.ray_serve import (  # noqa: E402
    BloomFilter,
    ChunkKeyer,
    rank_replicas,
    rendezvous_owner,
    replica_stats,
)


def key(i: int) -> bytes:
    import hashlib

    return hashlib.blake2b(str(i).encode(), digest_size=20).digest()


def holds_set(keys):
    s = set(keys)
    return lambda k: k in s


# -- Bloom filter -------------------------------------------------------------------------

def test_bloom_has_no_false_negatives_and_few_false_positives():
    keys = [key(i) for i in range(4096)]
    f = BloomFilter.for_keys(keys)
    assert all(k in f for k in keys)
    others = [key(i) for i in range(10_000, 20_000)]
    fp = sum(k in f for k in others) / len(others)
    assert fp < 0.01
    g = BloomFilter.from_stats(f.to_stats())
    assert all(k in g for k in keys[:100])
    assert len(f.to_stats()["data"]) <= 8192  # 4096 keys in 8 KiB: compact enough for the stats channel


def test_bloom_of_nothing_holds_nothing():
    f = BloomFilter.for_keys([])
    assert key(1) not in f


# -- the policy -----------------------------------------------------------------------------

def test_routes_to_the_replica_holding_most_chunk_tokens_whatever_the_order():
    a, b, c = key(1), key(2), key(3)
    holds = {"r0": holds_set([a]), "r1": holds_set([b, c]), "r2": holds_set([])}
    q = {"r0": 0, "r1": 1, "r2": 0}
    for chunks in ([(a, 100), (b, 60), (c, 60)], [(c, 60), (a, 100), (b, 60)]):
        d = rank_replicas(chunks, holds, q)
        assert d.reason == "affinity"
        assert d.ranks[0] == ["r1"]  # 120 held tokens against 100, despite a longer queue
        assert d.held_tokens == {"r0": 100, "r1": 120, "r2": 0}
        assert [r[0] for r in d.ranks] == ["r1", "r0", "r2"]  # every replica ranked: spill-over


def test_scores_by_tokens_not_by_number_of_chunks():
    a, b, c = key(1), key(2), key(3)
    holds = {"r0": holds_set([a]), "r1": holds_set([b, c])}
    d = rank_replicas([(a, 500), (b, 10), (c, 10)], holds, {"r0": 0, "r1": 0})
    assert d.ranks[0] == ["r0"]


def test_falls_back_to_two_random_replicas_when_queues_are_unbalanced():
    a = key(1)
    holds = {"r0": holds_set([a]), "r1": holds_set([]), "r2": holds_set([])}
    d = rank_replicas([(a, 100)], holds, {"r0": 9, "r1": 0, "r2": 1}, imbalanced_threshold=4,
                      rng=random.Random(0))
    assert d.reason == "imbalanced"
    assert len(d.ranks) == 1 and len(d.ranks[0]) == 2 and len(set(d.ranks[0])) == 2
    # at the threshold it is still balanced
    d = rank_replicas([(a, 100)], holds, {"r0": 4, "r1": 0, "r2": 1}, imbalanced_threshold=4)
    assert d.reason == "affinity" and d.ranks[0] == ["r0"]
    # a warm request never falls back: ownership matters more than a queue there
    d = rank_replicas([(a, 100)], holds, {"r0": 9, "r1": 0, "r2": 1}, imbalanced_threshold=4,
                      allow_fallback=False)
    assert d.ranks[0] == ["r0"]


def test_unknown_queue_lengths_do_not_trigger_the_fallback():
    a = key(1)
    holds = {"r0": holds_set([a]), "r1": holds_set([])}
    d = rank_replicas([(a, 100)], holds, {"r0": None, "r1": 0})
    assert d.reason == "affinity" and d.ranks[0] == ["r0"]


def test_cold_documents_go_to_their_rendezvous_owner():
    ids = ["r0", "r1", "r2", "r3"]
    holds = {r: holds_set([]) for r in ids}
    owners = {}
    for i in range(200):
        k = key(i)
        d = rank_replicas([(k, 50)], holds, {r: 0 for r in ids}, rng=random.Random(i))
        assert d.reason == "owner"
        assert d.ranks[0] == [rendezvous_owner(k, ids)]  # the same wherever the router runs
        owners[k] = d.ranks[0][0]
    counts = {r: sum(o == r for o in owners.values()) for r in ids}
    assert min(counts.values()) > 25  # spread over the replicas
    # removing a replica moves only the keys it owned
    moved = sum(owners[k] != rendezvous_owner(k, ids[:3]) for k in owners if owners[k] != "r3")
    assert moved == 0


def test_held_tokens_beat_cold_ownership_and_ties_go_to_the_shorter_queue():
    a, b = key(1), key(2)
    holds = {"r0": holds_set([a]), "r1": holds_set([a])}
    d = rank_replicas([(a, 10), (b, 1000)], holds, {"r0": 3, "r1": 1})
    assert d.held_tokens == {"r0": 10, "r1": 10}
    owner = rendezvous_owner(b, ["r0", "r1"])
    assert d.ranks[0] == [owner]  # equal held tokens: the owner of the cold chunk
    d = rank_replicas([(a, 10)], holds, {"r0": 3, "r1": 1})
    assert d.ranks[0] == ["r1"]


def test_a_request_without_chunks_uses_power_of_two_choices():
    holds = {"r0": holds_set([]), "r1": holds_set([]), "r2": holds_set([])}
    d = rank_replicas([], holds, {"r0": 0, "r1": 0, "r2": 0})
    assert d.reason == "no-chunks" and len(d.ranks[0]) == 2


# -- keys the router computes = keys the engine stores ------------------------------------------

@pytest.fixture(scope="module")
def tiny_llm(tokenizer):
    from conftest import make_tiny

    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=1 << 22)
    yield llm
    llm.close()


@pytest.mark.parametrize("context", ["isolated", "prefix"])
def test_router_keys_are_the_engine_keys(tokenizer, context):
    from conftest import make_tiny

    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=1 << 22, chunk_context=context)
    try:
        docs = ["The Eiffel Tower is 330 metres tall.", Chunk("Mount Fuji is 3776 metres high.", id="fuji")]
        llm.generate("How tall?", chunks=docs, system="Be brief.", max_new_tokens=2)
        keyer = ChunkKeyer(tokenizer, llm.fingerprint, llm.chunk_context)
        mine = keyer.keys([rs.as_chunk(d, i) for i, d in enumerate(docs)], "Be brief.")
        assert {k for k, _ in mine} == set(llm.resident_chunk_keys())
        assert keyer.keys([Chunk(docs[0])], "Be brief.")[0] == mine[0]  # cached per text
        stats = replica_stats(llm)
        f = BloomFilter.from_stats(stats["bloom"])
        assert all(k in f for k, _ in mine)
        assert stats["fingerprint"] == llm.fingerprint and stats["chunks"] == 2
    finally:
        llm.close()


def test_resident_chunk_keys_most_recent_first_and_bounded(tiny_llm):
    tiny_llm.clear_cache()
    tiny_llm.warm(["first document", "second document"])
    tiny_llm.generate("q?", chunks=["first document"], max_new_tokens=1)
    keys = tiny_llm.resident_chunk_keys()
    assert len(keys) == 2
    assert tiny_llm.resident_chunk_keys(limit=1) == keys[:1]
    keyer = ChunkKeyer(tiny_llm.tokenizer, tiny_llm.fingerprint)
    assert keys[0] == keyer.keys([Chunk("first document")])[0][0]


# -- end to end on a local Ray instance ----------------------------------------------------------

def _tiny_factory():
    """Built inside each replica (tests/ is on the workers' PYTHONPATH)."""
    from conftest import make_tiny
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir

    tok = AutoTokenizer.from_pretrained(os.environ.get("LAZYLLM_TEST_TOKENIZER") or str(default_model_dir()))
    return LazyLLM(model=make_tiny("llama"), tokenizer=tok, kv_cache_bytes=1 << 22)


@pytest.mark.timeout(240)
def test_two_replicas_a_request_goes_where_its_documents_are():
    ray = pytest.importorskip("ray", reason="Ray Serve is the optional `ray` extra")
    serve = pytest.importorskip("ray.serve", reason="Ray Serve is the optional `ray` extra")
    from lazyllm.integrations.ray_serve import ServeRequest, build_http_app, warm

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}})
    try:
        import socket

        with socket.socket() as so:  # a free loopback port for the HTTP proxy
            so.bind(("127.0.0.1", 0))
            port = so.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_http_app(llm_factory=_tiny_factory, num_replicas=2, num_cpus=0.5, stats_period_s=0.5,
                             torch_threads=1, name="tiny", model_name="tiny")
        serve.run(app, name="tiny", route_prefix="/")
        handle = serve.get_deployment_handle("tiny", app_name="tiny")
        docs = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(30)) for i in range(5)]
        # precompute four documents: each goes to its owner; then a request over one of
        # them and a cold one must go to the replica holding it, and reuse its KV
        placed = warm(handle, docs[:4])
        assert all(p["computed_tokens"] > 0 for p in placed)
        owners = [p["replica"] for p in placed]
        time.sleep(1.5)  # a few stats periods: the replicas' Bloom filters reach the router
        for i in (3, 1, 0, 2):
            out = handle.generate.remote(ServeRequest("Which words?", [docs[4], docs[i]],
                                                      sampling={"max_new_tokens": 2})).result(timeout_s=60)
            assert out["replica"] == owners[i]
            assert out["cached_tokens"] > 0 and out["cached_chunk_tokens"] > 0
        # streaming goes through the same router
        parts = list(handle.options(stream=True).stream.remote(
            ServeRequest("Again?", [docs[0]], sampling={"max_new_tokens": 2})))
        assert "done" in parts[-1] and parts[-1]["done"]["cached_chunk_tokens"] > 0
        # and behind the OpenAI-compatible HTTP API, documents as chunks
        import httpx

        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Which words?"}],
                             "documents": [docs[2]], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        bad = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={"messages": []})
        assert bad.status_code == 400 and "error" in bad.json()
        print(f"owners {owners}; end to end {time.perf_counter() - t0:.1f} s")
    finally:
        serve.shutdown()
        ray.shutdown()
