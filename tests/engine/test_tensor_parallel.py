"""Tensor parallelism on CPU (gloo, worker processes started by the library): the same tokens
as one process, in float32; bad settings rejected before any process starts; no process left
after close()."""
import multiprocessing
import os
import signal
import types

import pytest
import torch

from lazyllm import CacheCapacityError, InvalidRequestError, LazyLLM
from lazyllm.model.tensor_parallel import MULTICAST_OFF_ENV
from tests.conftest import make_tiny

DOCS = [f"Document {i}: " + " ".join(f"fact{i}_{j}" for j in range(12 + 3 * i)) for i in range(6)]


def _llm(model, tok, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    kw.setdefault("kv_cache_bytes", 32 << 20)
    return LazyLLM(model=model, tokenizer=tok, **kw)


def _session(llm, n_new=8):
    """Cold request, a warm one over the same chunks in another order (lazy reuse), a batch."""
    out = [llm.generate("Which fact comes first?", chunks=DOCS[:3], max_new_tokens=n_new)]
    out.append(llm.generate("And the last one?", chunks=[DOCS[2], DOCS[4], DOCS[0]], max_new_tokens=n_new))
    out += llm.generate_batch([{"question": "One?", "chunks": DOCS[1:3]}, {"question": "Two?", "chunks": DOCS[3:6]}],
                              max_new_tokens=n_new)
    return out


def _tp_children() -> list:
    """The library's tensor-parallel workers still alive (other tests' processes aside)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("lazyllm-tp")]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("family,cfg,kw", [
    ("llama", {"attention_bias": True}, dict(reuse="lazy")),  # o_proj's bias added once, on rank 0
    ("llama", {}, dict(reuse="block", recompute_first_tokens=2)),  # re-rotated copies on every rank
    ("gemma3", {}, dict(reuse="block")),  # tied head, two RoPE bases (per-layer copies), sandwich norms
    ("qwen2", {"vocab_size": 49153}, dict(reuse="lazy")),  # q/k/v biases; a vocabulary the ranks split unevenly
])
def test_tiny_tensor_parallel_equals_one_process(tokenizer, family, cfg, kw):
    model = make_tiny(family, seed=1, **cfg)
    one = _llm(model, tokenizer, **kw)
    ref = _session(one)
    cont = ref[0].token_ids
    ref_score = one.score("Which fact comes first?", chunks=DOCS[:3], continuation=cont, return_logits=True)
    one.close()
    tp = _llm(model, tokenizer, tensor_parallel=2, **kw)
    try:
        assert tp.model.spec.num_kv_heads == 1 and tp.model.spec.num_heads == 2  # this rank's heads
        pids = tp._tp.pids()
        assert len(pids) == 1 and all(not _gone(p) for p in pids)
        for k, v in MULTICAST_OFF_ENV.items():  # what the spawned workers inherited
            assert os.environ[k] == v
        got = _session(tp)
        score = tp.score("Which fact comes first?", chunks=DOCS[:3], continuation=cont, return_logits=True)
    finally:
        tp.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    # the vocabulary-parallel head's logits, gathered on rank 0: the full vocabulary, the same values
    assert score.logits.shape == ref_score.logits.shape == (len(cont), model.config.vocab_size)
    torch.testing.assert_close(score.logits, ref_score.logits, rtol=1e-4, atol=1e-4)
    assert got[1].usage.cached_tokens == ref[1].usage.cached_tokens > 0  # the warm request reused chunks
    if kw["reuse"] == "block":
        assert tp.engine.metrics["copied_pages"] > 0  # re-rotated copies ran on every rank
    # close() leaves no worker behind
    assert _tp_children() == []
    assert all(_gone(p) for p in pids)
    assert not torch.distributed.is_initialized()


def test_default_model_tensor_parallel_3(default_llm_parts):
    model, tok = default_llm_parts  # SmolLM2-135M: 9 heads, 3 KV heads: N in {1, 3}
    one = _llm(model, tok, packets=None)  # tensor_parallel runs without the shipped packet
    ref = _session(one, n_new=6)
    one.close()
    # by name: every rank loads the checkpoint itself
    tp = LazyLLM(device="cpu", dtype="float32", kv_cache_bytes=32 << 20, tensor_parallel=3, progress=False,
                 quality="isolated")
    try:
        got = _session(tp, n_new=6)
    finally:
        tp.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert _tp_children() == []


@pytest.mark.parametrize("n", [0, -1, True, "2", 2.0])
def test_bad_tensor_parallel_values(tokenizer, n):
    with pytest.raises(InvalidRequestError, match="tensor_parallel"):
        _llm(make_tiny("llama"), tokenizer, tensor_parallel=n)


def test_tensor_parallel_not_dividing_heads_rejected_before_start(tokenizer, default_llm_parts):
    with pytest.raises(InvalidRequestError, match=r"does not divide the model's KV heads \(2\)"):
        _llm(make_tiny("llama"), tokenizer, tensor_parallel=4)  # 2 KV heads, 4 heads
    model, tok = default_llm_parts
    with pytest.raises(InvalidRequestError, match=r"KV heads \(3\).*in \[1, 3\]"):
        _llm(model, tok, tensor_parallel=2)
    with pytest.raises(InvalidRequestError, match="recompute_ratio is not supported with tensor_parallel"):
        _llm(model, tok, tensor_parallel=3, recompute_ratio=0.1)
    assert _tp_children() == []
    assert not torch.distributed.is_initialized()


def test_more_ranks_than_gpus_rejected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = types.SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
    stub = types.SimpleNamespace(tensor_parallel=4, device=torch.device("cuda", 0))
    with pytest.raises(InvalidRequestError, match="tensor_parallel=4 needs 4 GPUs; 2 present"):
        LazyLLM._check_tensor_parallel(stub, cfg)
    stub.tensor_parallel = 2
    LazyLLM._check_tensor_parallel(stub, cfg)


def test_worker_gone_fails_requests_and_close_is_clean(tokenizer):
    tp = _llm(make_tiny("llama"), tokenizer, tensor_parallel=2)
    try:
        assert len(tp.generate("q?", chunks=DOCS[:2], max_new_tokens=3).token_ids) == 3
        pid = tp._tp.pids()[0]
        os.kill(pid, signal.SIGKILL)
        tp._tp.procs[0].join(10)
        with pytest.raises(Exception, match="Connection closed by peer|broken"):
            tp.generate("another?", chunks=DOCS[2:4], max_new_tokens=3, timeout=60)
        with pytest.raises(Exception, match="tensor-parallel group is broken"):
            tp.generate("again?", max_new_tokens=3, timeout=60)
    finally:
        tp.close()
    assert _tp_children() == []
    assert not torch.distributed.is_initialized()


def test_failure_after_start_stops_the_workers(tokenizer):
    with pytest.raises(CacheCapacityError):
        _llm(make_tiny("llama"), tokenizer, tensor_parallel=2, kv_cache_bytes=1)
    assert _tp_children() == []
    assert not torch.distributed.is_initialized()
