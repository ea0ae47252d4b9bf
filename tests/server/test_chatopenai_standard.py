"""LangChain's standard integration suite (langchain-tests) on ``ChatOpenAI`` pointed at
``lazyllm serve``'s app, with the client settings docs/server.md gives: ``base_url``,
``api_key``, ``model`` (the served id), ``stream_usage=True`` and documents in
``extra_body``. The embedded default model on CPU, few new tokens. What is declared, what is
switched off and which cases are xfailed (with the evidence) is in tests/standard_suite.py,
shared with the suites on ``ChatLazyLLM`` in process and remote, as is the server.
"""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("langchain_openai")

from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from tests.standard_suite import KEY, MODEL, SERVER, ServedCases, served  # noqa: E402, F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function .*> is marked with '@pytest.mark.asyncio'"),
]


class TestChatOpenAIAgainstLazyLLMServer(ServedCases, ChatModelIntegrationTests):
    # through ChatOpenAI every structured-output case runs to max_tokens (tests/standard_suite.py)
    model_choice = ServedCases.model_choice | {
        f"test_structured_output{a}[{t}]" for a in ("", "_async") for t in ("typeddict", "json_schema")} | {
        "test_structured_output_pydantic_2_v1", "test_structured_output_optional_param"}

    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        # an async client of its own per model: langchain-openai shares a default one across
        # instances, whose connections outlive each test's event loop
        return {"model": MODEL, "base_url": SERVER["url"], "api_key": KEY, "max_tokens": 64,
                "stream_usage": True, "temperature": 0, "max_retries": 0, "timeout": 120,
                "http_async_client": httpx.AsyncClient(timeout=120)}

    def documents_request(self, docs, question):
        """Documents in the server's ``documents`` extension (``extra_body``)."""
        return [HumanMessage(question)], {"extra_body": {"documents": docs}}
