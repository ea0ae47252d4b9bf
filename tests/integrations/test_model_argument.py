"""The model argument means one thing in both adapters: a model that is named (``model=``,
``model_name=``, or ``model_name_or_path=`` in LangChain) is the model that runs, or a clear error;
never the embedded default in its place; metadata report the model that runs; and an argument an
adapter does not know is refused rather than dropped."""
from __future__ import annotations

import pytest
import torch

from lazyllm import InvalidRequestError, LazyLLM, ModelLoadError
from lazyllm.integrations.langchain import ChatLazyLLM, LazyLLMText
from lazyllm.integrations.llama_index import LlamaIndexLLM
from tests.conftest import make_tiny

KV = 16 << 20
TINY_HIDDEN = 64  # make_tiny's width; the embedded default model's is 576


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny checkpoint on disk, loadable by its path like any model folder."""
    path = tmp_path_factory.mktemp("tiny-model")
    make_tiny("llama", seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _langchain(tiny_dir, arg):
    return ChatLazyLLM(**{arg: tiny_dir}, device="cpu", dtype=torch.float32, kv_cache_bytes=KV, max_tokens=2)


def _llama_index(tiny_dir, arg):
    return LlamaIndexLLM(**{arg: tiny_dir}, device="cpu", engine_kwargs={"kv_cache_bytes": KV, "dtype": torch.float32},
                         max_new_tokens=2)


@pytest.mark.parametrize("make,arg", [(_langchain, "model"), (_langchain, "model_name"),
                                      (_langchain, "model_name_or_path"), (_llama_index, "model"),
                                      (_llama_index, "model_name")])
def test_a_named_model_is_the_model_that_runs(tiny_dir, make, arg):
    adapter = make(tiny_dir, arg)
    engine = adapter.llm if isinstance(adapter, ChatLazyLLM) else adapter.lazyllm
    try:
        assert engine.model_name == tiny_dir
        assert engine.model.spec.hidden_size == TINY_HIDDEN  # not the embedded default
        if isinstance(adapter, ChatLazyLLM):
            msg = adapter.invoke("Hello")
            assert msg.response_metadata["model_name"] == tiny_dir
            assert adapter._identifying_params["model_name"] == tiny_dir
        else:
            assert adapter.metadata.model_name == tiny_dir
            assert adapter.complete("Hello").raw.usage.completion_tokens <= 2
    finally:
        engine.close()


@pytest.mark.parametrize("make", [
    lambda name: ChatLazyLLM(model=name, kv_cache_bytes=KV),
    lambda name: ChatLazyLLM(model_name=name, kv_cache_bytes=KV),
    lambda name: LazyLLMText(model_name=name, kv_cache_bytes=KV),
    lambda name: LlamaIndexLLM(model=name, engine_kwargs={"kv_cache_bytes": KV}),
    lambda name: LlamaIndexLLM(model_name=name, engine_kwargs={"kv_cache_bytes": KV}),
], ids=["langchain-model", "langchain-model_name", "langchain-text", "llama_index-model", "llama_index-model_name"])
def test_a_model_that_cannot_load_is_an_error_naming_it(tmp_path, make):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="no-such-model"):
        make(missing)


def test_a_name_and_an_engine_that_disagree_are_refused(tiny_dir, default_llm_parts):
    model, tok = default_llm_parts
    engine = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=KV, quality="isolated")
    try:
        for make in (lambda **kw: ChatLazyLLM(llm=engine, **kw), lambda **kw: LlamaIndexLLM(llm=engine, **kw)):
            for kw in ({"model": tiny_dir}, {"model_name": tiny_dir}):
                with pytest.raises(ValueError, match="runs"):  # InvalidRequestError (pydantic wraps it)
                    make(**kw)
            adapter = make(model_name=engine.model_name)  # its own name is fine
            assert adapter.model_name == engine.model_name
        with pytest.raises(InvalidRequestError, match="two different models"):
            LlamaIndexLLM(model=tiny_dir, model_name="other")
        with pytest.raises(ValueError, match="two different models"):
            ChatLazyLLM(model=tiny_dir, model_name_or_path="other")
    finally:
        engine.close()


@pytest.mark.parametrize("cls", [ChatLazyLLM, LazyLLMText, LlamaIndexLLM])
def test_an_unknown_argument_is_refused(cls, default_llm_parts):
    model, tok = default_llm_parts
    engine = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=KV, quality="isolated")
    try:
        with pytest.raises(ValueError, match="repetition_penalty"):
            cls(llm=engine, repetition_penalty=1.1)
    finally:
        engine.close()


def test_a_server_is_sent_the_model_named():
    """With ``base_url`` the name is the ``model`` id sent to the server, under either spelling
    (nothing is contacted until a call)."""
    url = "http://127.0.0.1:9/v1"
    for chat in (ChatLazyLLM(base_url=url, model="served-id"), ChatLazyLLM(base_url=url, model_name="served-id")):
        assert chat.llm.model == "served-id" and chat.model_name == "served-id"
    for index_llm in (LlamaIndexLLM(base_url=url, model="served-id", context_window=512),
                      LlamaIndexLLM(base_url=url, model_name="served-id", context_window=512)):
        assert index_llm.lazyllm.model == "served-id" and index_llm.metadata.model_name == "served-id"
