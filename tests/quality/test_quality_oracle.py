"""The quality benchmark's oracle recompute selections (an upper bound, measurement only):
they read full attention's KV and attention, leave the engine's own selections alone, and
recomputing everything with them is full attention. On a tiny random model (seconds)."""
import sys

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.errors import InvalidRequestError
from tests.conftest import load_benchmark, make_tiny
from tests.hf_reference import hf_generate

quality = load_benchmark("quality")
oracle = sys.modules["benchmarks.fidelity.oracle"]  # its log, which quality._oracle_log_start renews
DOCS = [f"Record {i}: " + " ".join(f"item{i}_{j}" for j in range(9 + 5 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", seed=3)


@pytest.fixture(scope="module", autouse=True)
def installed():
    quality.install_oracle_selection()
    quality.install_oracle_selection()  # idempotent
    yield
    quality._oracle_log_start(False)


def test_selection_names(model, tokenizer):
    from lazyllm.engine.recovery import recompute as recovery

    assert recovery.SELECTIONS.count("oracle-kv") == 1
    for sel in ("deviation", "attention", "two-stage", *quality.ORACLE_SELECTIONS):
        LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=0.1, recompute_selection=sel,
                kv_cache_bytes=8 << 20, quality="isolated").close()
    with pytest.raises(InvalidRequestError):
        LazyLLM(model=model, tokenizer=tokenizer, recompute_selection="oracle-random", kv_cache_bytes=8 << 20,
                quality="isolated")


def test_recovery_names_parse_to_oracle_kwargs():
    opts = quality.available_options()
    settings, skipped = quality.build_settings(["lazy"], ["prefix"], ["first-4+oracle-kv-0.2", "oracle-attn-0.1",
                                                                      "two-0.15"], opts)
    kw = {s.name: s.kwargs for s in settings}
    assert not skipped
    assert kw["lazy/prefix/first-4+oracle-kv-0.2"]["recompute_selection"] == "oracle-kv"
    assert kw["lazy/prefix/first-4+oracle-kv-0.2"]["recompute_first_tokens"] == 4
    assert kw["lazy/prefix/first-4+oracle-kv-0.2"]["recompute_ratio"] == 0.2
    assert kw["lazy/prefix/oracle-attn-0.1"]["recompute_selection"] == "oracle-attn"
    assert kw["lazy/prefix/two-0.15"]["recompute_selection"] == "two-stage"


def test_dense_forward_matches_probe_keys_and_mass_sums(model, tokenizer):
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=8 << 20, quality="isolated")
    m = llm.engine.recovery.model
    ids = torch.tensor(tokenizer.encode(" ".join(DOCS[:2])), dtype=torch.long)
    ks, vs, mass = quality.full_context_kv(m, ids, query_from=5)
    for layer in range(len(ks)):
        torch.testing.assert_close(ks[layer], m.probe_keys(ids, layer))
    # every row's probabilities sum to 1 per layer and head
    per_row = torch.full((len(ids) - 5,), float(m.spec.num_layers * m.spec.num_heads))
    assert mass.shape == (m.spec.num_layers, len(ids) - 5, len(ids))
    torch.testing.assert_close(mass.sum((0, -1)), per_row)
    for r in range(mass.shape[1]):  # causal: nothing past the query row
        assert float(mass[:, r, 5 + r + 1:].abs().sum()) == 0.0
    llm.close()


@pytest.mark.parametrize("sel", ["oracle-kv", "oracle-kvattn", "oracle-effect"])
def test_kv_oracle_sees_no_deviation_in_the_first_prefix_chunk(model, tokenizer, sel):
    """In 'prefix' context the first chunk's cached K/V are full attention's at every
    layer: its KV deviation is ~0; later chunks' is not."""
    quality._oracle_log_start(True)
    llm = LazyLLM(model=model, tokenizer=tokenizer, chunk_context="prefix", recompute_ratio=0.1,
                  recompute_selection=sel, kv_cache_bytes=8 << 20, quality="isolated")
    llm.score("Which item is first?", chunks=DOCS[:3], continuation=[5, 6, 7])
    llm.close()
    (e,) = oracle.ORACLE_LOG
    n0 = e["lens"][0]
    assert e["scored"] and e["key"] == (sel, 0.1, 0)
    assert float(e["kv"][:n0].max()) < 1e-6
    assert float(e["kv"][n0:].max()) > 1e-3
    assert float(e["answer_mass"].min()) >= 0.0 and float(e["answer_mass"].sum()) > 0.0
    summ = quality.oracle_summary(oracle.ORACLE_LOG)
    assert summ["requests"] == 1 and summ["picks"] == -(-sum(e["lens"]) // 10)
    assert 0.0 <= summ["in_first_chunk"] <= 1.0 and 0.0 <= summ["overlap_question_attention"] <= 1.0
    quality._oracle_log_start(False)


@pytest.mark.parametrize("sel", quality.ORACLE_SELECTIONS)
@pytest.mark.parametrize("ctx", ["isolated", "prefix"])
def test_oracle_recompute_of_everything_is_full_attention(model, tokenizer, sel, ctx):
    llm = LazyLLM(model=model, tokenizer=tokenizer, chunk_context=ctx, recompute_ratio=1.0,
                  recompute_selection=sel, kv_cache_bytes=8 << 20, quality="isolated")
    llm.warm(DOCS[2:5])
    out = llm.generate("Which item is first?", chunks=DOCS[4:1:-1], max_new_tokens=8)
    assert out.token_ids == hf_generate(model, out.prompt_token_ids, 8, llm.eos_token_ids)
    llm.close()
