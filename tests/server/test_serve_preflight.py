"""``lazyllm serve`` flags that cannot work with the model or with each other, refused as
usage errors in under 2 s, before the model loads: a default max_tokens above the limit or
the context, a KV pool smaller than one page, a packet file that is not there, a tensor
parallel degree the model's heads cannot take."""
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import lazyllm  # noqa: E402
from lazyllm.integrations.server import cli  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model folder as far as the checks read it: the default model's shape (9 heads, 3 KV
    heads), no weights (loading it would fail the test anyway)."""
    import transformers

    folder = tmp_path_factory.mktemp("model")
    transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, max_position_embeddings=8192).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("flags,needle", [
    (["--default-max-tokens", "10000"], "above --max-tokens-limit 4096"),
    (["--default-max-tokens", "9000", "--max-tokens-limit", "9500"], "context of 8192"),
    (["--kv-cache-bytes", "10"], "smaller than one KV page"),
    (["--packets", "/no/such/packet.safetensors"], "no such packet file"),
    (["--tensor-parallel", "2"], "does not divide"),
])
def test_flag_refused_before_the_model_loads(model_dir, flags, needle, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(lazyllm, "LazyLLM", no_load)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        cli.main([model_dir, "--port", "1", *flags])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err
    assert elapsed < 2.0, elapsed
