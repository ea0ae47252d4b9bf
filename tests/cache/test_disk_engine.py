"""The engine with the persistent chunk-KV tier: reloaded KV gives the fresh answer."""
import os

from lazyllm import LazyLLM
from tests.conftest import make_tiny

DOCS = [f"Fact sheet {i}: " + " ".join(f"v{i}_{j}" for j in range(20 + 7 * i)) for i in range(4)]


def _llm(model, tok, d, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=16 << 20, kv_disk_dir=d, **kw)


def test_kv_survives_restart_and_bad_files_are_recomputed(tmp_path, tokenizer):
    model = make_tiny("llama", seed=8)
    fresh = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=16 << 20, quality="isolated")
    ref = fresh.generate("q?", chunks=DOCS, max_new_tokens=8)
    first = _llm(model, tokenizer, tmp_path)
    first.generate("other?", chunks=DOCS[::-1], max_new_tokens=2)
    first.close()  # waits for the background writes
    files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    assert len(files) == len(DOCS) + 1  # every chunk and the shared prefix
    # restart: everything comes from disk
    second = _llm(model, tokenizer, tmp_path)
    out = second.generate("q?", chunks=DOCS, max_new_tokens=8)
    assert out.token_ids == ref.token_ids
    assert out.usage.cached_chunk_tokens == sum(len(ids) for k, ids in out.prompt_segments if k == "chunk")
    assert second.engine.metrics["disk_hits"] == len(DOCS) + 1
    second.close()
    # flip one byte in the tensor data of one file: that chunk is recomputed, answer unchanged
    victim = tmp_path / files[0]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10
    victim.write_bytes(bytes(data))
    third = _llm(model, tokenizer, tmp_path)
    out3 = third.generate("q?", chunks=DOCS, max_new_tokens=8)
    assert out3.token_ids == ref.token_ids
    assert third.engine.metrics["disk_hits"] == len(DOCS)
    assert sum(third.engine.disk.stats()["rejections"].values()) == 1
    third.close()
    # another model never reads these files (its keys differ), and answers its own way
    other = make_tiny("llama", seed=9)
    fourth = _llm(other, tokenizer, tmp_path)
    fourth.generate("q?", chunks=DOCS, max_new_tokens=2)
    assert fourth.engine.metrics["disk_hits"] == 0
    fourth.close()
    fresh.close()


def test_engines_with_different_contexts_share_a_directory(tmp_path, tokenizer):
    """Each chunk context keys its own prefix files, so neither rejects the other's."""
    model = make_tiny("llama", seed=8)
    for ctx in ("isolated", "prefix"):
        llm = _llm(model, tokenizer, tmp_path, chunk_context=ctx)
        llm.generate("q?", chunks=DOCS[:2], max_new_tokens=2)
        llm.close()
    again = _llm(model, tokenizer, tmp_path, chunk_context="isolated")
    again.generate("q?", chunks=DOCS[:2], max_new_tokens=2)
    assert again.engine.metrics["disk_hits"] == 3  # the prefix and both chunks
    assert sum(again.engine.disk.stats()["rejections"].values()) == 0
    again.close()
