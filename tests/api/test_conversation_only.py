"""A conversation alone is a request: ``generate``, ``stream`` and ``agenerate`` take
``messages=`` without a positional question, as OpenAI's chat API takes only messages."""
import asyncio

import pytest

from lazyllm import InvalidRequestError, LazyLLM
from tests.conftest import make_tiny

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def llm(tokenizer):
    engine = LazyLLM(model=make_tiny("llama", seed=2), tokenizer=tokenizer, kv_cache_bytes=16 << 20, quality="isolated")
    yield engine
    engine.close()


def test_messages_without_a_question(llm):
    ref = llm.generate(None, messages=MESSAGES, max_new_tokens=4)
    out = llm.generate(messages=MESSAGES, max_new_tokens=4)
    assert out.token_ids == ref.token_ids and out.usage.completion_tokens == 4
    # the same request as the question form: the last user turn is the question
    assert out.prompt_segments == llm.generate("Name a colour.", system="Be brief.", max_new_tokens=4).prompt_segments
    stream = llm.stream(messages=MESSAGES, max_new_tokens=4)
    assert "".join(stream) == out.text
    assert asyncio.run(llm.agenerate(messages=MESSAGES, max_new_tokens=4)).token_ids == out.token_ids


def test_neither_question_nor_messages_is_a_clear_error(llm):
    with pytest.raises(InvalidRequestError, match="question, or the conversation as messages="):
        llm.generate(max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="messages="):
        llm.stream(max_new_tokens=2)
