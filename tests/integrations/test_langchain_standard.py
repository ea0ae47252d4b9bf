"""LangChain's standard test suites for ``ChatLazyLLM`` (langchain-tests).

Both suites run offline against the embedded default model, shared by every test through
one ``LazyLLM`` (each test builds its own ``ChatLazyLLM`` around it, as the suites
require), with few new tokens so the whole file stays fast on two CPU cores. What is
declared, what is switched off and which cases are xfailed (with the evidence) is in
tests/standard_suite.py, shared with the suite on ``ChatOpenAI`` against ``lazyllm serve``.
Serialization is skipped by the suite itself: an in-process engine is not
``lc_serializable``.
"""
from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from lazyllm import LazyLLM
from lazyllm.integrations.langchain import ChatLazyLLM, documents_to_messages
from tests.standard_suite import Capabilities, IntegrationCases

# The suites' async tests are plain ``async def``s, written for pytest-asyncio's "auto"
# mode; this module-wide mark runs them in strict mode too. (Overriding them to mark
# them one by one would trip the suites' no-override check.) Sync tests ignore the mark.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function .*> is marked with '@pytest.mark.asyncio'"),
]

_ENGINE: dict[str, LazyLLM] = {}


@pytest.fixture(scope="module", autouse=True)
def shared_engine(default_llm_parts):
    model, tok = default_llm_parts
    _ENGINE["llm"] = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20, quality="isolated")
    yield _ENGINE["llm"]
    _ENGINE.pop("llm").close()


class _Config:
    @property
    def chat_model_class(self) -> type[ChatLazyLLM]:
        return ChatLazyLLM

    @property
    def chat_model_params(self) -> dict:
        # max_new_tokens (the alias of max_tokens), so that a test passing max_tokens itself overrides it
        return {"llm": _ENGINE["llm"], "max_new_tokens": 64}


class TestChatLazyLLMUnit(_Config, Capabilities, ChatModelUnitTests):
    pass


class TestChatLazyLLMIntegration(_Config, IntegrationCases, ChatModelIntegrationTests):
    # JSON mode without tools is folded into the RAG template (keeps_turns), as through the
    # server: the default model then leaves out the punchline, as through ChatOpenAI and
    # RemoteLazyLLM (``IntegrationCases.model_choice``).
    def documents_request(self, docs, question):
        """Documents as messages (``documents_to_messages``): they travel as chunks."""
        return documents_to_messages(docs, question), {}
