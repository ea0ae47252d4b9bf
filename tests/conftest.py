import contextlib
import json
import os
import sys

import pytest
import torch

torch.manual_seed(0)

FAMILIES = {
    "llama": {},
    "llama3-rope": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 128}},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma3": {},
}


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module, loaded by path once (``benchmarks._common.sibling``:
    the benchmarks folder stays off ``sys.path``, so a script's name never stands in for an
    installed module), so a test and a benchmark that loads its sibling share one copy."""
    from benchmarks._common import sibling

    return sibling(name)


PAD_ENTRY = (0, 0, 0, 0)  # a padding table entry: length 0, naming page 0 (never written)


def paged_batch(seqs, *, page_size: int, hkv: int, group: int, d: int, rotary_dim: int | None = None,
                place_padding, dtype=torch.float32, seed: int = 0, spare_pages: int = 2) -> dict:
    """The keyword arguments of a paged attention call on a random varlen batch, over one page
    pool whose unwritten slots hold NaN (so a read of one shows in the result).

    ``seqs``: per sequence ``(segments, n_queries)``, ``segments`` a list of
    ``(start_pos, length, delta)`` key runs, each on pages of its own (shuffled over the pool;
    ``spare_pages`` beyond those needed); the queries sit at the last ``n_queries`` positions of
    the last segment (from 0 with no segment). ``place_padding(gen, entries)`` inserts padding
    entries (``PAD_ENTRY``) into each table row, and may reorder it, drawing from the batch's
    ``random.Random`` ``gen``. ``inv_freq`` covers ``rotary_dim`` (default ``d``)."""
    import random

    gen = random.Random(seed)
    torch.manual_seed(seed)
    n_pages = sum(-(-n // page_size) for segs, _ in seqs for _, n, _ in segs) + spare_pages
    k = torch.full((n_pages, page_size, hkv, d), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    free = list(range(1, n_pages))  # page 0: never written, named by padding entries
    gen.shuffle(free)
    rows, qpos, cu = [], [], [0]
    for segs, nq in seqs:
        entries = []
        for start, length, delta in segs:
            for off in range(0, length, page_size):
                p, n = free.pop(), min(page_size, length - off)
                k[p, :n] = torch.randn(n, hkv, d).to(dtype)
                v[p, :n] = torch.randn(n, hkv, d).to(dtype)
                entries.append((p, start + off, delta, n))
        place_padding(gen, entries)
        rows.append(entries)
        end = segs[-1][0] + segs[-1][1] if segs else nq
        qpos += range(end - nq, end)
        cu.append(cu[-1] + nq)
    shape = (len(seqs), max(len(r) for r in rows) + 1)
    bt, bpos, bdelta, blen = (torch.zeros(shape, dtype=torch.int32) for _ in range(4))
    for b, entries in enumerate(rows):
        for j, e in enumerate(entries):
            bt[b, j], bpos[b, j], bdelta[b, j], blen[b, j] = e
    rd = d if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    return dict(q=torch.randn(cu[-1], hkv * group, d).to(dtype), q_pos=torch.tensor(qpos, dtype=torch.int64),
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), k_cache=k, v_cache=v, block_table=bt,
                block_pos=bpos, block_delta=bdelta, block_len=blen, inv_freq=inv_freq, sm_scale=d ** -0.5)


def entry_kv(store, e) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V a cache entry ``e`` of ``store`` holds: ``(layers, tokens, kv heads, head
    dim)`` each, its tokens only (not the rest of its last page)."""
    return tuple(pool[:, e.pages].flatten(1, 2)[:, :e.num_tokens] for pool in (store.pool.k, store.pool.v))


def make_tiny(family: str, seed: int = 0, window: int | None = None, **overrides):
    """A small random model of a supported family, with weights scaled up so its greedy
    choices are decisive (near-ties would make exact-token comparisons flaky);
    ``overrides`` replace config fields (e.g. ``head_dim``)."""
    import transformers

    model_type = {"llama3-rope": "llama"}.get(family, family)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma3": transformers.Gemma3TextConfig}[model_type]
    kw = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
              tie_word_embeddings=False, initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if model_type == "mistral":
        kw["sliding_window"] = None
    if model_type == "gemma3":  # local and global layers with their own RoPE; a window past the test prompts
        kw.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                  sliding_window=window or 4096, query_pre_attn_scalar=16, tie_word_embeddings=True,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    kw.update(FAMILIES[family])
    kw.update(overrides)
    cfg = cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


@pytest.fixture(scope="session")
def default_llm_parts():
    """(hf_model, tokenizer) of the embedded default model, loaded once."""
    from lazyllm.model.loader import load_hf

    model, tok, _ = load_hf(None, device="cpu", dtype=torch.float32)
    return model, tok


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (from LAZYLLM_TEST_TOKENIZER when set, e.g. on the GPU
    machine, where the default model's weights are not carried)."""
    from transformers import AutoTokenizer

    path = os.environ.get("LAZYLLM_TEST_TOKENIZER")
    if not path:
        from lazyllm.model.loader import default_model_dir

        path = str(default_model_dir())
    return AutoTokenizer.from_pretrained(path)


JUPYTER_KERNEL = "lazyllm-test-python"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A Jupyter kernel that is this interpreter, whatever kernelspecs the machine has: a
    kernelspec pointing at ``sys.executable`` in a temporary Jupyter path, so it works in a fresh
    virtual environment with only ``ipykernel`` installed. Offline: any HTTP(S) request goes to
    a closed local port."""
    spec = tmp_path / "jupyter" / "kernels" / JUPYTER_KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lazyllm tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # offline: any HTTP(S) request (a model download, telemetry) goes to a closed local port
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.setenv("no_proxy", "")
    return JUPYTER_KERNEL


def pytest_addoption(parser):
    group = parser.getgroup("lazyllm")
    # the CI budget of tests/api/test_call_sequences_stateful.py; raise both for a longer search
    group.addoption("--stateful-examples", type=int, default=12,
                    help="call sequences the stateful API test tries (default 12, the same ones each run: CI's "
                         "budget; above 20, new random sequences each run)")
    group.addoption("--stateful-steps", type=int, default=10, help="calls per sequence in the stateful API test")
    # the CI budget of tests/server/test_server_fuzz.py (docs/server.md gives the longer run)
    group.addoption("--fuzz-examples", type=int, default=25,
                    help="generated requests per operation in the server's schema fuzz test (default 25: CI's budget)")


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def forward_pair(fused_module, models, ids, meta, k0, v0):
    """Run ``ids`` through each of ``models`` (``LlamaFamilyModel``) over its own copy of the
    caches ``k0``/``v0``, recording the weight shape of every ``gemv_parts`` call that
    ``fused_module`` (a copy of ``kernels/fused.py``) receives. Returns ``(logits, caches,
    gemv_shapes)``, one entry per model for the first two."""
    shapes = []
    orig = fused_module.gemv_parts

    def spy(x, weight, *a, **k):
        shapes.append(tuple(weight.shape))
        return orig(x, weight, *a, **k)

    fused_module.gemv_parts = spy
    try:
        caches = [(k0.clone(), v0.clone()) for _ in models]
        logits = [m.forward(ids, meta, *kv) for m, kv in zip(models, caches)]
    finally:
        fused_module.gemv_parts = orig
    return logits, caches, shapes


@contextlib.contextmanager
def loopback_server(app, startup_s: float = 20.0):
    """Serve the ASGI ``app`` with uvicorn on a free 127.0.0.1 port, in a thread; yields its
    base URL and stops the server on exit."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + startup_s
    while not srv.started:
        assert time.monotonic() < deadline and t.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=10)
