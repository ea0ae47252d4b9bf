"""Loading from a folder, a GGUF file and the default model; clear errors otherwise."""
import pytest

from lazyllm import LazyLLM
from lazyllm.model.loader import default_gguf_path, default_model_dir
from tests.conftest import make_tiny


def test_load_from_local_folder_matches_in_memory_model(tmp_path, tokenizer):
    model = make_tiny("qwen2", seed=4)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    # transformers picks the tokenizer class from the folder's config: compare like with like
    a = LazyLLM(model=model, tokenizer=AutoTokenizer.from_pretrained(tmp_path), kv_cache_bytes=16 << 20,
                quality="isolated")
    b = LazyLLM(str(tmp_path), device="cpu", kv_cache_bytes=16 << 20, quality="isolated")
    assert a.fingerprint == b.fingerprint
    q = dict(chunks=["one doc", "another doc"], max_new_tokens=6)
    assert a.generate("q?", **q).token_ids == b.generate("q?", **q).token_ids
    a.close()
    b.close()


def test_fingerprint_differs_between_checkpoints(tokenizer):
    a = LazyLLM(model=make_tiny("llama", seed=1), tokenizer=tokenizer, kv_cache_bytes=8 << 20, quality="isolated")
    b = LazyLLM(model=make_tiny("llama", seed=2), tokenizer=tokenizer, kv_cache_bytes=8 << 20, quality="isolated")
    assert a.fingerprint != b.fingerprint


@pytest.mark.slow
def test_gguf_file_and_cached_default_agree(default_llm_parts):
    model, tok = default_llm_parts
    assert (default_model_dir() / "model.safetensors").exists()
    a = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=32 << 20, quality="isolated")
    b = LazyLLM(str(default_gguf_path()), device="cpu", kv_cache_bytes=32 << 20, quality="isolated")
    q = dict(chunks=["Paris is the capital of France."], max_new_tokens=8)
    assert a.generate("What is the capital of France?", **q).token_ids == \
        b.generate("What is the capital of France?", **q).token_ids
    assert a.fingerprint == b.fingerprint


def test_safe_defaults_no_remote_code_and_no_network(tmp_path, tokenizer, monkeypatch):
    """trust_remote_code is off unless asked for, and local loading never needs the network
    (with the hub forced offline, a local folder and the default model still load)."""
    import inspect

    import huggingface_hub

    assert inspect.signature(LazyLLM.__init__).parameters["trust_remote_code"].default is False
    calls = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(OSError("network")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = make_tiny("llama", seed=6)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LazyLLM(str(tmp_path), device="cpu", kv_cache_bytes=8 << 20, quality="isolated")
    assert llm.generate("q?", max_new_tokens=1).usage.completion_tokens == 1
    llm.close()
    assert calls == []
