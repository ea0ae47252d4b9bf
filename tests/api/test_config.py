"""``EngineConfig``: every engine option validated in one place, presets resolved into it,
the running configuration on ``llm.config``, and the recovery selection registry."""
import dataclasses
import inspect
import math
from pathlib import Path

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.config import EngineConfig, options_markdown, register_selection, selection_names
from lazyllm.errors import InvalidRequestError
from lazyllm.kernels.options import KernelOptions
from lazyllm.presets import DEFAULT_PRESET, PRESETS, QUALITY_OPTIONS
from tests.conftest import make_tiny

DOCS = [f"Record {i}: " + " ".join(f"item{i}_{j}" for j in range(9 + 5 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", seed=3)


def test_defaults_are_the_documented_ones():
    c = EngineConfig()
    assert {k: getattr(c, k) for k in QUALITY_OPTIONS} == QUALITY_OPTIONS
    assert (c.device, c.dtype, c.page_size, c.kv_cache_bytes, c.attention_backend) == ("auto", None, None, None, "auto")
    assert (c.tensor_parallel, c.batch_invariant, c.overlap_decode, c.packets) == (1, False, None, "auto")
    assert c.calibration == (1.0, 1.0) and c.recompute_first_tokens > 0 and c.recompute_ratio > 0
    # LazyLLM()'s default is the balanced preset's configuration, the rule's choice on real prose
    assert DEFAULT_PRESET == "balanced" and c == EngineConfig.resolve(DEFAULT_PRESET).replace(quality=None)
    assert c != EngineConfig.resolve("isolated").replace(quality=None)


def test_lazyllm_takes_exactly_the_config_fields_with_their_defaults():
    """``LazyLLM``'s keyword arguments are the engine options as declared in ``EngineConfig``
    (the model arguments aside): the same names, in the same order, with the same defaults,
    except that an option a preset sets defaults to ``None`` ("not given")."""
    params = list(inspect.signature(LazyLLM.__init__).parameters.values())[1:]
    assert [p.name for p in params[:3]] == ["model_name_or_path", "model", "tokenizer"]
    fields = dataclasses.fields(EngineConfig)
    assert [p.name for p in params[3:]] == [f.name for f in fields]
    for p, f in zip(params[3:], fields):
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, p.name
        assert p.default == (None if f.name in QUALITY_OPTIONS else f.default), p.name


def test_lazyllm_docstring_and_guide_table_are_made_from_the_fields():
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    for name in names:
        assert f"    {name}" in LazyLLM.__doc__ or f", {name}" in LazyLLM.__doc__, name
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    assert options_markdown() in guide, "regenerate the option table of docs/guide.md (options_markdown())"


def test_every_field_documents_itself_for_flags():
    for f in dataclasses.fields(EngineConfig):
        assert isinstance(f.metadata.get("help"), str) and f.metadata["help"], f.name
        if "choices" in f.metadata:  # the default is one of the choices a flag offers
            assert f.default in f.metadata["choices"], f.name
    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(EngineConfig)}
    assert choices["reuse"] == ("lazy", "block", "prefix", "none")
    assert choices["chunk_context"] == ("isolated", "prefix")
    assert set(PRESETS) < set(choices["quality"])


def test_frozen():
    c = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.reuse = "block"


BAD = [
    ("reuse", "lazzy"), ("chunk_context", "global"), ("attention_backend", "cuda"),
    ("recompute_selection", "random"), ("quality", "best"), ("device", "gpu:x"), ("dtype", "int8"),
    ("dtype", torch.int32), ("context_temperature", 0), ("context_temperature", -1.0),
    ("context_lse_scale", math.nan), ("context_lse_scale", "x"), ("context_temperature", True),
    ("context_lse_scale", math.inf), ("page_size", 48), ("page_size", 0), ("page_size", True),
    ("recompute_first_tokens", -1), ("recompute_first_tokens", 2.0), ("recompute_ratio", 1.5),
    ("recompute_ratio", -0.1), ("kv_cache_bytes", 0), ("kv_cache_bytes", 1.5), ("kv_disk_bytes", 0),
    ("max_batch_tokens", 0), ("tensor_parallel", 0), ("tensor_parallel", "2"), ("batch_invariant", 1),
    ("trust_remote_code", "yes"), ("progress", None), ("overlap_decode", "on"), ("kernel_options", {}),
    ("kv_disk_dir", 3), ("warmup", "yes"),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_each_bad_option_is_named(name, value):
    with pytest.raises(InvalidRequestError, match=name if name not in ("device", "dtype") else
                       {"device": "invalid device", "dtype": "unsupported dtype"}[name]):
        EngineConfig(**{name: value})


def test_every_bad_option_in_one_error():
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(reuse="x", page_size=3, recompute_ratio=2.0)
    msg = str(e.value)
    assert all(n in msg for n in ("reuse", "page_size", "recompute_ratio")) and msg.count(";") == 2


@pytest.mark.parametrize("kw,needle", [
    (dict(tensor_parallel=2, recompute_ratio=0.1), "recompute_ratio is not supported with tensor_parallel"),
    (dict(tensor_parallel=2, kv_disk_dir="/tmp/x"), "kv_disk_dir is not supported with tensor_parallel"),
    (dict(tensor_parallel=2, context_temperature=0.5), "calibration is not supported with tensor_parallel"),
    (dict(reuse="prefix", kv_disk_dir="/tmp/x"), "kv_disk_dir needs reuse"),
    (dict(reuse="none", packets="p.safetensors"), "packets need reuse"),
    (dict(quality="block-ft", packets="p.safetensors"), "block-ft"),
])
def test_combinations(kw, needle):
    # through resolve: a preset is the option values it sets (block-ft: prompt_layout)
    with pytest.raises(InvalidRequestError, match=needle):
        EngineConfig.resolve(**kw)


def test_numbers_are_normalized():
    c = EngineConfig(recompute_ratio=1, context_temperature=2, context_lse_scale=1)
    assert (type(c.recompute_ratio), type(c.context_temperature)) == (float, float)
    assert c == EngineConfig(recompute_ratio=1.0, context_temperature=2.0)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_resolve(name):
    c = EngineConfig.resolve(name)
    assert c.quality == name
    for k, v in {**QUALITY_OPTIONS, **PRESETS[name]}.items():
        assert getattr(c, k) == v, k


def test_explicit_options_win_and_none_means_not_given():
    c = EngineConfig.resolve("balanced", recompute_ratio=0.3, recompute_first_tokens=0, reuse=None, page_size=32)
    assert (c.recompute_ratio, c.recompute_first_tokens, c.reuse, c.chunk_context) == (0.3, 0, "lazy", "prefix")
    assert c.recompute_selection == "two-stage" and c.page_size == 32
    # outside the preset's options None is a value: packets=None is "no packets", not "auto"
    assert EngineConfig.resolve(packets=None).packets is None
    assert EngineConfig.resolve().packets == "auto"


def test_resolve_rejects_unknown_names():
    with pytest.raises(InvalidRequestError, match="quality"):
        EngineConfig.resolve("best")
    with pytest.raises(InvalidRequestError, match="unknown engine option.*reuze"):
        EngineConfig.resolve(reuze="lazy")
    with pytest.raises(InvalidRequestError, match="recompute_ratio"):
        EngineConfig.resolve("balanced", recompute_ratio=7)


def test_llm_config_is_the_running_configuration(model, tokenizer):
    opts = KernelOptions(num_splits=2)
    llm = LazyLLM(model=model, tokenizer=tokenizer, quality="balanced", kv_cache_bytes=8 << 20,
                  kernel_options=opts, packets=None)
    c = llm.config
    assert isinstance(c, EngineConfig) and llm.engine.config is c
    # the load-time choices filled in
    assert (c.device, c.dtype, c.attention_backend, c.page_size) == ("cpu", "float32", "torch", 16)
    assert (c.quality, c.recompute_ratio, c.kv_cache_bytes, c.kernel_options) == ("balanced", 0.14, 8 << 20, opts)
    assert (llm.reuse, llm.chunk_context, llm.recompute_first_tokens, llm.page_size) == ("lazy", "prefix", 4, 16)
    # handed down: the planner's policy, recovery's options
    assert llm.engine.planner.policy.name == "lazy" and llm.engine.planner.chunk_context == "prefix"
    rec = llm.engine.recovery
    assert (rec.first_tokens, rec.ratio, rec.selection) == (4, 0.14, "two-stage")
    again = LazyLLM(model=model, tokenizer=tokenizer, **c.as_kwargs())
    assert again.config == c
    for x in (llm, again):
        x.close()


def test_bad_option_raises_before_loading(model, tokenizer):
    with pytest.raises(InvalidRequestError, match="page_size.*; reuse|reuse.*; page_size"):
        LazyLLM(model=model, tokenizer=tokenizer, reuse="x", page_size=3, quality="isolated")


def test_registered_selection_is_used(model, tokenizer):
    calls = []

    @register_selection("test-last-tokens")
    def last_tokens(rec, r, n_pick, exclude):
        n = sum(len(s.ids) for s in r.plan.spans)
        calls.append((n, n_pick))
        return torch.arange(n, dtype=torch.float32)  # later tokens score higher

    register_selection("test-last-tokens")(last_tokens)  # the same function again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_selection("test-last-tokens")(lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        register_selection("deviation")(last_tokens)
    from lazyllm.engine.recovery import recompute as recovery

    assert "test-last-tokens" in selection_names() and selection_names() == recovery.SELECTIONS
    llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=0.25, recompute_selection="test-last-tokens",
                  kv_cache_bytes=8 << 20, packets=None, quality="isolated")
    out = llm.generate("Which?", chunks=DOCS[:2], max_new_tokens=2)
    [(n, n_pick)] = calls
    assert n_pick == math.ceil(0.25 * n) and out.usage.prompt_tokens > n
    assert llm.engine.metrics["recovery_skipped"] == 0
    llm.close()


def test_tensor_parallel_without_a_preset_runs_isolated_and_says_so(caplog):
    """The default recomputes, which tensor parallelism does not run yet: with no preset and no
    quality option named, a tensor-parallel configuration is ``isolated``'s, with a warning;
    asking for the recompute is still refused."""
    import logging

    with caplog.at_level(logging.WARNING, logger="lazyllm"):
        c = EngineConfig.resolve(tensor_parallel=2)
    assert c.quality == "isolated" and (c.recompute_ratio, c.recompute_first_tokens) == (0.0, 0)
    assert any("tensor_parallel=2" in r.getMessage() and "isolated" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidRequestError, match="recompute_ratio"):  # an option named: the others the default's
        EngineConfig.resolve(tensor_parallel=2, chunk_context="prefix")
    with pytest.raises(InvalidRequestError, match="recompute_ratio is not supported with tensor_parallel"):
        EngineConfig.resolve("balanced", tensor_parallel=2)
    assert EngineConfig.resolve(tensor_parallel=1) == EngineConfig()


def test_a_packet_without_a_preset_runs_isolated_chunks():
    """Packets are trained for isolated chunks without recompute: given one and no preset or
    quality option, the configuration is ``isolated``'s; naming an option keeps the defaults."""
    c = EngineConfig.resolve(packets="my.packets.safetensors")
    assert c.quality == "isolated" and c.chunk_context == "isolated" and c.recompute_ratio == 0.0
    assert EngineConfig.resolve(packets=None) == EngineConfig(packets=None)
    assert EngineConfig.resolve(packets="auto") == EngineConfig()
    kept = EngineConfig.resolve(packets="my.packets.safetensors", chunk_context="isolated")
    assert kept.quality is None and kept.recompute_ratio == EngineConfig().recompute_ratio


def test_page_size_is_chosen_in_one_place():
    import torch

    from lazyllm.config import resolve_page_size

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_page_size(None, cuda, "triton") == 64
    assert resolve_page_size(None, cuda, "torch") == resolve_page_size(None, cpu, "torch") == 16
    assert resolve_page_size(32, cuda, "triton") == 32
