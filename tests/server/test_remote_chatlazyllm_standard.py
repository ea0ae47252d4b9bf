"""LangChain's standard integration suite (langchain-tests) on the remote ``ChatLazyLLM``
(``base_url=``) against ``lazyllm serve``'s app over the embedded default model: tools,
``tool_choice``, structured output and JSON mode declared and exercised through the server,
as for ``ChatOpenAI`` (tests/server/test_chatopenai_standard.py) and for ``ChatLazyLLM`` in
process. The model-choice xfails and their evidence, and the server, are in
tests/standard_suite.py."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("langchain_core")

from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from lazyllm.integrations.langchain import ChatLazyLLM, documents_to_messages  # noqa: E402
from tests.standard_suite import KEY, MODEL, SERVER, ServedCases, served  # noqa: E402, F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function .*> is marked with '@pytest.mark.asyncio'"),
]


class TestRemoteChatLazyLLM(ServedCases, ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatLazyLLM]:
        return ChatLazyLLM

    @property
    def chat_model_params(self) -> dict:
        return {"base_url": SERVER["url"], "api_key": KEY, "model_name": MODEL, "max_new_tokens": 64}

    def documents_request(self, docs, question):
        """Documents as messages (``documents_to_messages``): they travel in ``documents``."""
        return documents_to_messages(docs, question), {}
