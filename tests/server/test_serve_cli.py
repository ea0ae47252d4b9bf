"""``lazyllm serve`` as a user meets it: every engine option a flag with help, bad flags
answered as usage errors before the model loads, a hub id failing fast offline, model ids
from paths, quiet loading with --no-progress, friendly messages for missing extras, and a
quality preset served end to end with the same tokens as in process."""
import dataclasses
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lazyllm import LazyLLM  # noqa: E402
from lazyllm.config import EngineConfig  # noqa: E402
from lazyllm.integrations.server.cli import build_parser, build_server, check_args, model_id  # noqa: E402
from tests.conftest import loopback_server, make_tiny  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _usage_error(argv, capsys) -> str:
    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        check_args(parser, parser.parse_args(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err, err
    return err


def test_every_engine_option_is_a_flag_and_every_flag_has_help():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    for f in dataclasses.fields(EngineConfig):
        if f.name != "kernel_options":  # a Python object, not a command-line value
            assert f.name in dests, f.name
    for a in parser._actions:
        assert a.help and len(a.help) > 10, a.option_strings
    text = parser.format_help()  # what --help prints
    for a in parser._actions:
        assert all(o in text for o in a.option_strings), a.option_strings


@pytest.mark.parametrize("argv,needle", [
    (["--port", "99999"], "1-65535"),
    (["--port", "0"], "1-65535"),
    (["--page-size", "3"], "page_size"),
    (["--page-size", "x"], "integer"),
    (["--dtype", "float8"], "invalid choice"),
    (["--quality", "best"], "invalid choice"),
    (["--recompute-ratio", "2"], "recompute_ratio"),
    (["--reuse", "prefix", "--kv-disk-dir", "/tmp/kv"], "kv_disk_dir"),
    (["--max-concurrency", "0"], ">= 1"),
    (["--overlap-decode", "maybe"], "on or off"),
    (["/no/such/folder/model.gguf"], "does not exist"),
])
def test_bad_flags_are_usage_errors_before_loading(argv, needle, capsys):
    t = time.perf_counter()
    assert needle in _usage_error(argv, capsys)
    assert time.perf_counter() - t < 5  # nothing was loaded


def test_a_hub_id_fails_fast_when_the_hub_cannot_serve_it(capsys, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t = time.perf_counter()
    err = _usage_error(["lazyllm-tests/no-such-model-here"], capsys)
    assert time.perf_counter() - t < 20, "before: about 50 s of retries offline"
    assert "no-such-model-here" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in _usage_error(["lazyllm-tests/no-such-model-here"], capsys)


def test_a_busy_port_fails_before_the_model_loads(capsys, monkeypatch):
    import socket

    from lazyllm.integrations.server import cli

    monkeypatch.setattr(cli, "build_server", lambda *a: pytest.fail("the model loaded before the port was checked"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            cli.main(["--port", str(port)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "Traceback" not in err, err


def test_model_ids_from_paths_are_the_file_stem(tmp_path):
    gguf = tmp_path / "SmolLM2-135M.Q8_0.gguf"
    gguf.write_bytes(b"")
    assert model_id(str(gguf)) == "SmolLM2-135M.Q8_0"
    assert model_id(str(tmp_path)) == tmp_path.name
    assert model_id("org/model") == "org/model" and model_id(None) is None


def test_no_progress_silences_the_weight_loading_bar(capfd):
    import torch

    from lazyllm.model.loader import load_hf

    load_hf(None, device="cpu", dtype=torch.float32, progress=False)
    out, err = capfd.readouterr()
    assert "Loading" not in err + out and "it/s" not in err + out, err


def test_a_missing_extra_names_the_install_command(monkeypatch, capsys):
    from lazyllm.cli import main

    for name in [m for m in sys.modules if m.startswith("lazyllm.integrations.server")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` raises ImportError
    assert main(["serve", "--help"]) == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[server]"' in err and "lazyattention" in err and "Traceback" not in err


@pytest.mark.parametrize("module,missing,extra", [
    ("lazyllm.integrations.langchain", "langchain_core", "langchain"),
    ("lazyllm.integrations.llama_index", "llama_index.core", "llama-index"),
    ("lazyllm.integrations.chroma", "chromadb", "chroma"),
])
def test_missing_integration_extras_name_their_install_command(module, missing, extra, monkeypatch):
    import importlib

    from lazyllm.extras import MissingExtraError

    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(MissingExtraError, match=rf'pip install -e "\.\[{extra}\]"'):
        importlib.import_module(module)


def test_missing_ray_and_matplotlib_name_their_extras(monkeypatch):
    from lazyllm.extras import MissingExtraError
    from lazyllm.integrations import ray_serve
    from lazyllm.quality import FidelityReport

    monkeypatch.setitem(sys.modules, "ray.serve", None)
    with pytest.raises(MissingExtraError, match=r'"\.\[ray\]"'):
        ray_serve.build_app()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r'"\.\[bench\]"'):
        FidelityReport(rows=[], target={}).plot()


@pytest.mark.parametrize("preset", ["fast", "balanced", "exact"])
def test_each_quality_preset_is_served_with_the_in_process_tokens(preset, tmp_path, tokenizer):
    """``lazyllm serve <folder> --quality <preset>``: the preset in /v1/models and
    /metrics, its options as in process, and the same answer as
    ``LazyLLM(<folder>, quality=<preset>)``."""
    import httpx

    folder = tmp_path / "tiny-llama"
    make_tiny("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    parser = build_parser()
    args = parser.parse_args([str(folder), "--quality", preset, "--device", "cpu", "--no-progress",
                              "--kv-cache-bytes", str(16 << 20)])
    app, llm = build_server(args, check_args(parser, args))
    docs = [f"Document {i}: " + " ".join(f"fact{i}x{j}" for j in range(40)) for i in range(3)]
    ref_llm = LazyLLM(str(folder), quality=preset, device="cpu", kv_cache_bytes=16 << 20, progress=False)
    try:
        opts = ("reuse", "chunk_context", "recompute_first_tokens", "recompute_ratio", "recompute_selection")
        assert llm.quality == preset
        assert [getattr(llm.config, o) for o in opts] == [getattr(ref_llm.config, o) for o in opts]
        assert (llm.recompute_ratio > 0) == (preset == "balanced")
        with loopback_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            card = http.get("/v1/models").json()["data"][0]
            assert card["id"] == "tiny-llama" and card["quality"] == preset
            assert card["recompute_ratio"] == ref_llm.recompute_ratio
            assert f'quality="{preset}"' in http.get("/metrics").text
            for q in ("Which facts?", "Name the second document."):
                ref_llm.warm(docs)  # cached chunks, as the server's after its first request
                ref = ref_llm.generate(q, docs[::-1], max_new_tokens=12)
                for _ in range(2):  # cold, then with the documents cached
                    r = http.post("/v1/chat/completions", json={
                        "model": "tiny-llama", "messages": [{"role": "user", "content": q}],
                        "documents": docs[::-1], "max_tokens": 12})
                    assert r.status_code == 200, r.text
                    body = r.json()
                    assert body["choices"][0]["message"]["content"] == ref.text
                    assert body["usage"]["completion_tokens"] == ref.usage.completion_tokens
            # a request may name the server's preset, not another
            ok = http.post("/v1/chat/completions", json={"model": "tiny-llama", "quality": preset,
                                                         "messages": [{"role": "user", "content": "Hi?"}]})
            assert ok.status_code == 200, ok.text
    finally:
        llm.close()
        ref_llm.close()
