"""On the GPU: the engine with the Triton kernels against transformers (run on the H200;
deselected in CI, which has no GPU: `pytest -m gpu`)."""
import random

import pytest
import torch

from lazyllm import LazyLLM
from tests.conftest import FAMILIES, make_tiny
from tests.hf_reference import hf_generate, reference_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]

DOCS = [
    "The Eiffel Tower in Paris was completed in 1889 and is 330 metres tall.",
    "Mount Fuji is the highest mountain in Japan, rising 3,776 metres above sea level.",
    "The Great Wall of China stretches for more than 21,000 kilometres across northern China.",
    "Python was created by Guido van Rossum and first released in 1991. " * 3,
    "The Amazon river carries more water than any other river on Earth. " * 2,
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_cuda(request):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return make_tiny(request.param).to("cuda")


@pytest.mark.parametrize("reuse,ctx", [("lazy", "isolated"), ("lazy", "prefix"), ("block", "isolated"),
                                       ("block", "prefix")])
@pytest.mark.parametrize("page_size", [16, 64])
def test_triton_engine_matches_transformers_4d_mask(tiny_cuda, tokenizer, reuse, ctx, page_size):
    llm = LazyLLM(model=tiny_cuda, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx, page_size=page_size,
                  kv_cache_bytes=256 << 20, attention_backend="triton", quality="isolated")
    assert llm.attention_backend == "triton"
    rng = random.Random(0)
    for _ in range(3):
        docs = rng.sample(DOCS, 4)
        out = llm.generate("Which was completed in 1889?", chunks=docs, system="Be brief.", max_new_tokens=12)
        ref = reference_tokens(tiny_cuda, out.prompt_segments, reuse, ctx, 12, llm.eos_token_ids)
        assert out.token_ids == ref
    llm.close()


@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_dim_128_prefill_kernel_in_engine_matches_torch_backend(tokenizer, dtype, gluon, monkeypatch):
    """Head dim 128 in 16-bit with pages of 64 takes the default prefill kernel for chunks
    and suffixes of more than 64 query rows: on Hopper the warp-specialized Gluon kernel (the
    engine vouches for finite pages; its key-range threshold lowered, these prompts being
    short), else, or with Gluon switched off, the Triton loop on the query's rotary halves.
    Greedy tokens equal those of the torch attention backend on the same weights, for lazy
    and block reuse."""
    from lazyllm.kernels.loader import triton_kernels

    ta = triton_kernels().launcher

    if gluon and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon prefill runs on Hopper GPUs only")
    halves, gluon_calls = [], []
    config = ta._prefill_config
    monkeypatch.setattr(ta, "_prefill_config", lambda *a: halves.append(a[-1]) or config(*a))
    if gluon:
        from lazyllm.kernels.triton import gluon_prefill as gp

        real = gp.paged_prefill_gluon
        monkeypatch.setattr(gp, "paged_prefill_gluon", lambda *a, **k: gluon_calls.append(1) or real(*a, **k))
        monkeypatch.setattr(ta, "_GLUON_MIN_KEYS", 0)  # these prompts are short: route them anyway
    else:
        monkeypatch.setattr(ta, "_gluon_supported", lambda *a: False)
    model = make_tiny("llama3-rope", head_dim=128, hidden_size=256, intermediate_size=256).to("cuda", dtype)
    docs = [d * 4 for d in DOCS]  # 60+ tokens per chunk: prefill rows > 64 (2 query heads per KV head)
    for reuse in ("lazy", "block"):
        outs = []
        for backend in ("triton", "torch"):
            # warmup=False: the routing seen above is the one of this test's requests, not the warm-up's
            llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, page_size=64, kv_cache_bytes=256 << 20,
                          attention_backend=backend, warmup=False, quality="isolated")
            outs.append([llm.generate("Which was completed in 1889? Answer in one sentence, please, and explain "
                                      "why the tower was built at all.", chunks=c, max_new_tokens=10).token_ids
                         for c in (docs[:3], docs[1:4][::-1])])
            llm.close()
        assert outs[0] == outs[1], reuse
    assert any(halves), "the engine never chose the rotary-halves prefill"
    if gluon:
        assert gluon_calls, "the engine never launched the Gluon prefill"


@pytest.mark.parametrize("reuse", ["none", "prefix"])
def test_triton_engine_full_modes_match_generate(tiny_cuda, tokenizer, reuse):
    llm = LazyLLM(model=tiny_cuda, tokenizer=tokenizer, reuse=reuse, kv_cache_bytes=256 << 20,
                  attention_backend="triton", quality="isolated")
    for docs in (DOCS[:3], DOCS[:4]):
        out = llm.generate("Which was completed in 1889?", chunks=docs, max_new_tokens=12)
        assert out.token_ids == hf_generate(tiny_cuda, out.prompt_token_ids, 12, llm.eos_token_ids)
    llm.close()


@pytest.mark.parametrize("dtype,invariant", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, True)])
def test_256_concurrent_requests_equal_solo_on_gpu(tokenizer, dtype, invariant):
    """No cross-talk: 256 requests from 32 threads give each request's solo tokens. In
    16-bit floats this needs ``batch_invariant=True`` (cuBLAS picks GEMM kernels by batch
    size); float32 holds without it."""
    from tests.engine.test_concurrency import _requests, _run_concurrently

    model = make_tiny("llama", seed=21).to("cuda", dtype)
    reqs = _requests(256, seed=1)
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=256 << 20, attention_backend="triton",
                  batch_invariant=invariant, quality="isolated")
    solo = [llm.generate(q, chunks=c, max_new_tokens=n).token_ids for q, c, n in reqs]
    llm.clear_cache()
    assert _run_concurrently(llm, reqs, 32) == solo
    g = llm.engine.graph_stats()
    assert g["decode_graphs"] > 0 and g["capture_s"] > 0  # decode ran through CUDA graphs
    llm.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_invariant_8b_layer_shapes_equal_solo(tokenizer, overlap):
    """Llama-3.1-8B-shaped layers (4 of them, random bf16 weights), ``batch_invariant=True``:
    greedy tokens of 64 requests over shared chunks, run from 32 threads at once, equal each
    request run alone (with random weights, near-ties are common: a strict check)."""
    import transformers

    from tests.engine.test_concurrency import _requests, _run_concurrently

    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    reqs = _requests(64, seed=5)
    # overlapped decode (the default on CUDA) or one step at a time
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=2 << 30, batch_invariant=True,
                  overlap_decode=overlap, quality="isolated")
    llm.engine.output.eos_ids = set()  # random weights: every request runs to its length
    solo = [llm.generate(q, chunks=c, max_new_tokens=n).token_ids for q, c, n in reqs]
    llm.clear_cache()
    steps_before = llm.engine.metrics["decode_steps"]
    got = _run_concurrently(llm, reqs, 32)
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(got, solo)) if a != b]
    assert not bad, f"{len(bad)} of {len(reqs)} differ, e.g. {bad[:2]}"
    # decode really batched (the steps of the concurrent run only)
    assert llm.engine.metrics["decode_steps"] - steps_before < sum(n for _, _, n in reqs) // 2
    llm.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_decode_step_matches_plain_forward(dtype):
    """A single-token step with the compiled fused kernels (its projections as split-K GEMVs
    whose partial sums the next kernel adds up) against the plain torch forward, on
    Llama-3.1-8B-shaped layers (2 of them, random weights): logits and the written K/V agree
    to the dtype's accuracy, and the GEMV really ran."""
    import transformers

    from lazyllm.kernels import fused
    from lazyllm.model.attention import AttentionMetadata
    from lazyllm.model.llama import LlamaFamilyModel
    from tests.conftest import forward_pair

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(1)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    plain = LlamaFamilyModel(hf, fused_kernels=False)
    fast = LlamaFamilyModel(hf)
    assert fast.fused is fused
    ps, n_ctx = 64, 300
    shape = (2, 8, ps, 8, 128)
    k0 = (0.5 * torch.randn(shape, device="cuda")).to(dtype)
    v0 = (0.5 * torch.randn(shape, device="cuda")).to(dtype)
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(
        positions=torch.tensor([n_ctx], **i32), cu_seqlens_q=torch.tensor([0, 1], **i32),
        slot_mapping=torch.tensor([5 * ps + n_ctx % ps], device="cuda"),
        block_table=torch.tensor([[3, 0, 6, 2, 5]], **i32), block_pos=torch.tensor([[0, 64, 128, 192, 256]], **i32),
        block_delta=torch.tensor([[7, -3, 0, 11, 0]], **i32),
        block_len=torch.tensor([[64, 64, 64, 64, n_ctx % ps + 1]], **i32), max_seqlen_q=1)
    ids = torch.tensor([123], device="cuda")
    (a, b), kv, calls = forward_pair(fused, (plain, fast), ids, meta, k0, v0)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # q/k/v, output, gate/up, down
    want = [sh for sh in shapes if fused.GEMV_CONFIGS.get(sh, fused.GEMV_DEFAULT) is not None]
    assert want and calls == want * 2, calls
    assert (a - b).abs().max() <= 0.05 * a.abs().max(), (a - b).abs().max()
    torch.testing.assert_close(kv[1][0], kv[0][0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(kv[1][1], kv[0][1], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("page_size", [16, 64])
def test_gemma_sliding_window_engine_on_triton(tokenizer, page_size):
    """Gemma 3 (tiny, window 24: the prompts run far past it) on the Triton kernels with the
    fused layer kernels and CUDA graphs, token for token against transformers: full attention
    (reuse none and prefix) against ``generate``, lazy reuse in isolated and prefix chunk
    context against the windowed reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_tiny("gemma3", seed=1, window=24).to("cuda")
    for reuse, ctx in (("none", "isolated"), ("prefix", "isolated"), ("lazy", "isolated"), ("lazy", "prefix")):
        llm = LazyLLM(model=model, tokenizer=tokenizer, reuse=reuse, chunk_context=ctx, page_size=page_size,
                      kv_cache_bytes=256 << 20, attention_backend="triton", quality="isolated")
        assert llm.model.graph_capturable and llm.model.fused is not None and llm.model.windows == [24, None, 24]
        rng = random.Random(2)
        for _ in range(2):
            docs = rng.sample(DOCS, 4)
            out = llm.generate("Which was completed in 1889?", chunks=docs, max_new_tokens=12)
            assert out.usage.prompt_tokens > 3 * 24
            if reuse in ("none", "prefix"):
                ref = hf_generate(model, out.prompt_token_ids, 12, llm.eos_token_ids)
            else:
                ref = reference_tokens(model, out.prompt_segments, reuse, ctx, 12, llm.eos_token_ids, window=24)
            assert out.token_ids == ref, (reuse, ctx)
        assert llm.engine.graph_stats()["decode_graphs"] > 0
        llm.close()


def _family_config(family: str):
    """Two layers of Qwen3-8B's or Gemma-3-4B's shapes (a local and a global layer for
    Gemma), with a small vocabulary."""
    import transformers

    if family == "qwen3":
        return transformers.Qwen3Config(vocab_size=32000, hidden_size=4096, intermediate_size=12288,
                                        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                        tie_word_embeddings=False)
    return transformers.Gemma3TextConfig(
        vocab_size=32000, hidden_size=2560, intermediate_size=10240, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=40,
        layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_families_match_plain_forward(family, dtype):
    """Qwen3-8B and Gemma-3-4B layer shapes (2 layers, random weights) with the compiled fused
    kernels (q/k norms in the RoPE + K/V write; Gemma's sandwich norms and gelu-tanh) against
    the plain torch forward: a single-token step (split-K GEMVs) and a 37-token prefill, over
    a window on Gemma's local layer; logits and the written K/V agree to the dtype's accuracy."""
    import transformers

    from lazyllm.kernels import fused
    from lazyllm.model.attention import AttentionMetadata, make_backend
    from lazyllm.model.llama import LlamaFamilyModel
    from tests.conftest import forward_pair

    torch.manual_seed(1)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(_family_config(family), dtype=dtype).eval()
    backend = make_backend("triton", torch.device("cuda"))
    plain = LlamaFamilyModel(hf, attention=backend, fused_kernels=False)
    fast = LlamaFamilyModel(hf, attention=backend)
    assert fast.fused is fused and fast.graph_capturable
    s = plain.spec
    ps, n_ctx = 64, 300
    shape = (2, 8, ps, s.num_kv_heads, s.head_dim)
    k0 = (0.5 * torch.randn(shape, device="cuda")).to(dtype)
    v0 = (0.5 * torch.randn(shape, device="cuda")).to(dtype)
    i32 = dict(dtype=torch.int32, device="cuda")
    table = dict(block_table=torch.tensor([[3, 0, 6, 2, 5]], **i32),
                 block_pos=torch.tensor([[0, 64, 128, 192, 256]], **i32),
                 block_delta=torch.tensor([[7, -3, 0, 11, 0]], **i32))
    for n_new in (1, 37):
        pos = torch.arange(n_ctx - n_new + 1, n_ctx + 1, **i32)
        meta = AttentionMetadata(
            positions=pos, cu_seqlens_q=torch.tensor([0, n_new], **i32),
            slot_mapping=(5 * ps + pos % ps).long() if n_new == 1 else (torch.tensor(
                [e * ps for e in (3, 0, 6, 2, 5)], device="cuda")[pos // ps] + pos % ps).long(),
            block_len=torch.tensor([[64, 64, 64, 64, n_ctx % ps + 1]], **i32), max_seqlen_q=n_new, **table)
        ids = torch.randint(0, 32000, (n_new,), device="cuda")
        (a, b), kv, calls = forward_pair(fused, (plain, fast), ids, meta, k0, v0)
        assert bool(calls) == (n_new == 1)
        assert (a - b).abs().max() <= 0.05 * a.abs().max(), (n_new, (a - b).abs().max())
        torch.testing.assert_close(kv[1][0], kv[0][0], atol=0.05, rtol=0.02)
        torch.testing.assert_close(kv[1][1], kv[0][1], atol=0.05, rtol=0.02)


def test_recompute_pass_over_256_tokens_runs_from_a_graph_as_eager(tiny_cuda, tokenizer):
    """A recompute pass of hundreds of tokens at scattered positions (the question plus the
    chosen chunk tokens) replays a prefill graph of a bucket above 256 and answers as the
    eager forward does."""
    long_docs = [d * 6 for d in DOCS[:4]]
    outs = []
    for cuda_graphs in (True, False):
        llm = LazyLLM(model=tiny_cuda, tokenizer=tokenizer, chunk_context="prefix", recompute_first_tokens=10_000,
                      kv_cache_bytes=256 << 20, attention_backend="triton", cuda_graphs=cuda_graphs, quality="isolated")
        graphs = llm.engine.runner.prefill_graphs
        llm.warm(long_docs, system="Be brief.")
        outs.append(llm.generate("Which was completed in 1889?", chunks=long_docs[::-1], system="Be brief.",
                                 max_new_tokens=6))
        assert outs[-1].usage.prompt_tokens - outs[-1].usage.cached_tokens > 256
        assert any(k[0] > 256 for k in graphs.graphs) == cuda_graphs, sorted(graphs.graphs)
        llm.close()
    assert outs[0].token_ids == outs[1].token_ids


def test_layer1_key_deviation_from_cached_layer0_equals_dense_probe_on_triton(tiny_cuda, tokenizer):
    """Two-stage selection's key deviation for its shortlist only, from the cached layer-0
    K/V through the Triton prefill kernel, equals the dense probe over the whole prompt."""
    llm = LazyLLM(model=tiny_cuda, tokenizer=tokenizer, chunk_context="prefix", recompute_ratio=0.2,
                  recompute_selection="two-stage", kv_cache_bytes=256 << 20, attention_backend="triton",
                      quality="isolated")
    rec, seen = llm.engine.recovery, []
    real = rec.key_deviation

    def both(r, only=None):
        paged = real(r, only=only)
        kept = type(rec.model).__dict__["probe_keys_paged"]
        del type(rec.model).probe_keys_paged
        try:
            dense = real(r, only=only)
        finally:
            type(rec.model).probe_keys_paged = kept
        torch.testing.assert_close(paged, dense, rtol=2e-3, atol=2e-3 * float(dense.abs().max()))
        seen.append(int((dense > 0).sum()))
        return paged

    rec.key_deviation = both
    docs = DOCS[:4]
    llm.warm(docs, system="Be brief.")
    llm.generate("Which was completed in 1889?", chunks=docs[::-1], system="Be brief.", max_new_tokens=2)
    assert seen and seen[0] > 0
    llm.close()


@pytest.mark.parametrize("depth", [1.0, 0.25])
def test_fused_attention_mass_equals_unfused_layers(tiny_cuda, tokenizer, monkeypatch, depth):
    """The question's mass pass runs on the forward's fused kernels; it gives the mass of
    the unfused layers (``PagedPass`` with ``mass``), over every layer or the first ones."""
    from lazyllm.engine.recovery.recompute import Recovery

    seen = []
    orig = Recovery.question_attention

    def both(self, r):
        model = self.model
        fused = orig(self, r).clone()
        kept, model.fused = model.fused, None
        try:
            plain = orig(self, r)
        finally:
            model.fused = kept
        assert kept is not None, "the model runs without the fused kernels: nothing compared"
        torch.testing.assert_close(fused, plain, rtol=2e-2, atol=2e-2 * float(plain.abs().max()))
        seen.append(fused.numel())
        return fused

    monkeypatch.setattr(Recovery, "question_attention", both)
    # warmup=False: the patched pass above runs on this test's request only, not on the warm-up's;
    # eager steps: both passes run the model's layers, not a graph
    llm = LazyLLM(model=tiny_cuda, tokenizer=tokenizer, chunk_context="prefix", recompute_ratio=0.2,
                  recompute_selection="attention", recompute_selection_depth=depth, kv_cache_bytes=256 << 20,
                  attention_backend="triton", warmup=False, cuda_graphs=False, quality="isolated")
    docs = DOCS[:4]
    llm.warm(docs, system="Be brief.")
    # one token: no decode graph is captured after the unfused pass (on CUDA the model never
    # runs unfused; the comparison only needs the question's pass)
    llm.generate("Which was completed in 1889?", chunks=docs[::-1], system="Be brief.", max_new_tokens=1)
    assert seen
    llm.close()


@pytest.mark.parametrize("selection,depth", [("attention", 1.0), ("two-stage", 1.0), ("two-stage", 0.25)])
def test_question_attention_pass_from_cuda_graph_equals_eager(tiny_cuda, tokenizer, selection, depth, monkeypatch):
    """Attention-guided recompute selection runs the question's first pass (the attention
    mass over the cached chunks) from a CUDA graph; it gives the mass of the eager pass (an
    engine with ``cuda_graphs=False``, same request)."""
    from lazyllm.engine.recovery.recompute import Recovery

    seen: dict[bool, list] = {True: [], False: []}
    orig = Recovery.question_attention

    def record(self, r):
        mass = orig(self, r)
        graphs = self.runner.prefill_graphs
        seen[graphs.enabled].append((mass.clone(), any(k[2] == self.mass_layers for k in graphs.graphs)))
        return mass

    monkeypatch.setattr(Recovery, "question_attention", record)
    docs = DOCS[:4]
    for cuda_graphs in (True, False):
        llm = LazyLLM(model=tiny_cuda, tokenizer=tokenizer, chunk_context="prefix", recompute_ratio=0.2,
                      recompute_selection=selection, recompute_selection_depth=depth, kv_cache_bytes=256 << 20,
                      attention_backend="triton", cuda_graphs=cuda_graphs,
                      warmup=False, quality="isolated")  # the recorded pass is this test's request only
        llm.warm(docs, system="Be brief.")
        out = llm.generate("Which was completed in 1889?", chunks=docs[::-1], system="Be brief.", max_new_tokens=4)
        chunk_tokens = sum(len(ids) for kind, ids in out.prompt_segments if kind == "chunk")
        assert out.usage.cached_chunk_tokens < chunk_tokens  # some chunk tokens were recomputed
        llm.close()
    (from_graph, captured), = seen[True]
    (eager, eager_captured), = seen[False]
    assert captured and not eager_captured, "the mass pass did not run from a graph on one side only"
    torch.testing.assert_close(from_graph, eager, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("selection", ["deviation", "attention", "two-stage"])
def test_round_selection_equals_per_request_on_triton(tiny_cuda, tokenizer, selection):
    """Recovery's selection for a whole round (one question pass, one probe, one read) picks
    each request's own tokens on the CUDA kernels: at least 95% of them (float sums over a
    batch may order near-equal scores differently), every pass whole and split in groups."""
    from tests.quality.test_recovery import DOCS as RECORDS
    from tests.quality.test_recovery_round import _requests, check_rounds, record_rounds

    llm = LazyLLM(model=tiny_cuda, tokenizer=tokenizer, chunk_context="prefix", recompute_first_tokens=2,
                  recompute_ratio=0.2, recompute_selection=selection, kv_cache_bytes=256 << 20,
                  attention_backend="triton", quality="isolated")
    rounds = record_rounds(llm, regroup=True)
    llm.warm(RECORDS[:6])
    llm.generate_batch(_requests(6, 1))
    check_rounds(rounds, 6, agree=0.95)
    llm.close()
