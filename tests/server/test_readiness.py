"""Liveness and readiness of the server: ``/health`` answers while the warm-up runs,
``/ready`` and ``/health?ready`` answer 503 until it finished and 200 after; ``/metrics``
carries the kernels compiled after ready; ``--no-warmup`` reaches the engine's options."""
import threading

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import loopback_server, make_tiny  # noqa: E402

from lazyllm import LazyLLM  # noqa: E402
from lazyllm.engine.warmup import compiles as cw  # noqa: E402
from lazyllm.integrations.server import create_app  # noqa: E402
from lazyllm.integrations.server.backends import LocalBackend  # noqa: E402
from lazyllm.integrations.server.cli import build_parser, engine_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class SlowWarmup(LocalBackend):
    """A backend whose warm-up waits until the test lets it finish (or fails when told to)."""

    def __init__(self, llm, fail: bool = False):
        super().__init__(llm)
        self.release, self.started, self.fail = threading.Event(), threading.Event(), fail

    def warmup(self):
        self.started.set()
        assert self.release.wait(30)
        if self.fail:
            raise RuntimeError("out of memory while capturing")
        return super().warmup()


@pytest.fixture(scope="module")
def llm(tokenizer):
    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=8 << 20, warmup=False,
                  quality="isolated")
    yield llm
    llm.close()


def _status(url, path):
    return httpx.get(url + path, timeout=10).status_code


@pytest.mark.parametrize("fail", [False, True], ids=["warms", "fails"])
def test_ready_only_after_warm_up_while_health_stays_up(llm, fail, caplog):
    backend = SlowWarmup(llm, fail=fail)
    with loopback_server(create_app(backend)) as url:
        assert backend.started.wait(10)
        assert _status(url, "/health") == 200
        assert _status(url, "/ready") == 503 and _status(url, "/health?ready") == 503
        assert httpx.get(url + "/ready", timeout=10).json()["status"] == "warming up"
        # requests are served meanwhile (slower, on a GPU): readiness is for load balancers
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": backend.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200
        backend.release.set()
        for _ in range(200):
            if _status(url, "/ready") == 200:
                break
            threading.Event().wait(0.05)
        # a failed warm-up is logged and the server serves without it
        assert _status(url, "/ready") == 200 and _status(url, "/health?ready=1") == 200
        assert _status(url, "/health?ready=0") == 200
    assert ("warm-up failed" in caplog.text) is fail


def test_ready_at_once_without_warm_up(llm):
    backend = SlowWarmup(llm)
    with loopback_server(create_app(backend, warmup=False)) as url:
        assert _status(url, "/ready") == 200
    assert not backend.started.is_set()


def test_metrics_count_kernels_compiled_after_ready(llm):
    assert llm.ready
    with loopback_server(create_app(llm, warmup=False)) as url:
        def late():
            text = httpx.get(url + "/metrics", timeout=10).text
            line = next(x for x in text.splitlines() if x.startswith("lazyllm_kernels_compiled_after_ready_total"))
            return float(line.split()[-1])

        before = late()
        assert before == llm.cache_stats()["kernels_compiled_after_ready"]
        cw.COMPILES.hook(key="k", repr="_merge_splits[...]", fn=None, compile={}, is_manual_warmup=False,
                         already_compiled=False)  # one compile event, as Triton's hook reports it
        assert late() == before + 1


def test_no_warmup_flag_reaches_the_engine_options():
    p = build_parser()
    assert engine_config(p.parse_args([])).warmup is True
    assert engine_config(p.parse_args(["--no-warmup"])).warmup is False
    assert "--warmup" not in p.format_help().replace("--no-warmup", "")
