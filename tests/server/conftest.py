"""Fixtures of the HTTP server tests: one tiny random model per module (``llm``), ``lazyllm
serve``'s app over it on a real uvicorn server on 127.0.0.1 (``server``, its base URL) and an
authorized client (``http``). A module gives the app its limits by overriding ``app_options``.

(The helpers are imported from ``tests.conftest`` here and used below; test modules and Ray
workers that import ``conftest`` by name find them in either file.)
"""
import pytest

from tests.conftest import loopback_server, make_tiny

KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def app_options() -> dict:
    """``create_app``'s keyword arguments besides the key and the model name."""
    return {}


@pytest.fixture(scope="module")
def llm(tokenizer):
    from lazyllm import LazyLLM

    # isolated chunks, nothing recomputed, and no preset named (the server's refusals name it)
    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=32 << 20, chunk_context="isolated",
                  recompute_first_tokens=0, recompute_ratio=0.0)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm, app_options):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from lazyllm.integrations.server import create_app

    app = create_app(llm, api_key=KEY, model_name=MODEL, **app_options)
    with loopback_server(app) as url:
        yield url


@pytest.fixture()
def http(server):
    import httpx

    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c
