"""The server fuzzed from its own OpenAPI document (``GET /openapi.json``) with schemathesis,
in process (ASGI: no socket, nothing leaves the process): every operation gets generated
bodies, valid and not, and every answer must be documented (status, content type, body
schema) and never a 500. A fixed small budget here (``--fuzz-examples`` per operation, the
default model's tokenizer over a tiny random model); the longer run is in docs/server.md."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import checks as st  # noqa: E402

from lazyllm.integrations.server import create_app  # noqa: E402
from tests.server.conftest import KEY, MODEL  # noqa: E402

# every answer documented and never a 500; bodies the schema refuses are refused; the key is
# enforced. (Not "every schema-valid body is accepted": a valid shape can still be refused for
# what a schema cannot say, e.g. a tool message answering no earlier call.)
CHECKS = [st.not_a_server_error, st.status_code_conformance, st.content_type_conformance,
          st.response_schema_conformance, st.response_headers_conformance, st.negative_data_rejection,
          st.ignored_auth]

pytestmark = pytest.mark.timeout(300)



def _embed(texts):
    return [[float(len(t)), 1.0] for t in texts]


@pytest.fixture(scope="module")
def fuzz_app(llm):
    from lazyllm.integrations.server.embeddings import Embedder

    return create_app(llm, api_key=KEY, model_name=MODEL, warmup=False, max_new_tokens_limit=4, default_max_tokens=4,
                      embedder=Embedder(_embed, name="len"))


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _fuzz(op, mode, examples: int, conversation: bool = False) -> None:
    """``examples`` generated requests to ``op``, each answer checked (``CHECKS``).
    ``conversation``: a chat body keeps every generated field but gets a valid model and
    conversation, so the fields reach the engine (a generated conversation is almost never
    one the server can answer, and would be refused before it)."""
    from hypothesis import given

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if conversation and isinstance(case.body, dict):
            case.body = {**case.body, "model": MODEL, "messages": ASK}
        case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS)

    run()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_every_answer_is_documented_and_never_500(fuzz_app, mode, pytestconfig):
    """Every operation of ``/openapi.json``, with bodies that follow the schema (``positive``)
    and that break it (``negative``): each answer's status, content type and body are the
    document's, and none is a 500."""
    from schemathesis.generation import GenerationMode

    api = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    ops = [r.ok() for r in api.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/embeddings", "/v1/models"}
    for op in ops:
        if mode == "negative" and not (len(op.body) or len(op.query) or len(op.path_parameters)):
            continue  # nothing to break: no body and no parameters
        _fuzz(op, GenerationMode(mode), pytestconfig.getoption("fuzz_examples"))


def test_generated_fields_over_a_valid_conversation(fuzz_app, pytestconfig):
    """Every generated chat field (sampling, stop, tools, response_format, logprobs, stream...)
    over a conversation the server can answer: documented answers, never a 500."""
    from schemathesis.generation import GenerationMode

    api = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    [op] = [r.ok() for r in api.get_all_operations() if r.ok().path == "/v1/chat/completions"]
    _fuzz(op, GenerationMode.POSITIVE, pytestconfig.getoption("fuzz_examples"), conversation=True)
