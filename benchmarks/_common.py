"""What the benchmark scripts share: the tokenizer, the Llama-3.1-8B-shaped random model (and
its tiny smoke-run version), texts of a given token count, decode step timings, and loading a
sibling script by path.

A script imports it as ``benchmarks._common`` after putting the repository root (the folder
above ``benchmarks/``) on ``sys.path``; sibling scripts are loaded by path under private names,
so no script's file name can stand in for an installed module.
"""
from __future__ import annotations

import importlib.util
import os
import random
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def sibling(name: str):
    """``benchmarks/<name>.py`` as a module, loaded by path once (under a name that cannot
    shadow an installed module)."""
    key = f"_lazyllm_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(HERE, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses look their module up while the file runs
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


def tokenizer_dir(path: str | None = None) -> str:
    """``path``, or the packaged default model's folder (its tokenizer is the one benchmarks
    over random weights use)."""
    if path:
        return path
    from lazyllm.model.loader import default_model_dir

    return str(default_model_dir())


def load_tokenizer(path: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(path))


def device_name(device: str = "cuda") -> str:
    return torch.cuda.get_device_name() if str(device).startswith("cuda") else "cpu"


def llama31_8b_config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128001,
    )


def shrink_to_tiny(cfg, vocab: int, layers: int = 2):
    """``cfg`` made a small model for smoke runs on CPU (hidden 64, 4 query and 2 KV heads of
    16, ``vocab`` tokens, at most ``layers`` layers); returns it."""
    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 64, 128, 4, 2
    cfg.head_dim, cfg.vocab_size = 16, vocab
    cfg.num_hidden_layers = min(cfg.num_hidden_layers, layers)
    return cfg


def random_model(cfg, device="cuda", dtype=torch.bfloat16):
    """A transformers Llama of ``cfg`` with random weights (speed does not depend on them)."""
    import transformers

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def text_of_tokens(llm, n: int, seed: int) -> str:
    """A text that the tokenizer turns into about ``n`` tokens (chunk segments add 2)."""
    rng = random.Random(seed)
    words = []
    while True:
        words.extend(f"{rng.choice(['alpha', 'beta', 'gamma', 'delta', 'omega'])}{rng.randint(0, 999)}"
                     for _ in range(16))
        if llm.count_tokens(" ".join(words)) >= n:
            break
    while llm.count_tokens(" ".join(words)) > n:
        words.pop()
    return " ".join(words)


def run_to_length(llm) -> None:
    """No end-of-sequence token: with random weights every request runs to its length, so each
    one does the same work."""
    llm.engine.output.eos_ids = set()


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes/s, read plus write) of one GiB on the GPU."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(20):
        y.copy_(x)
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (ev[0].elapsed_time(ev[1]) / 1e3)


def gemm_floor_ms(engine_model, tokens: int, reps: int = 20) -> float:
    """The engine's own projection GEMMs of one forward over ``tokens`` rows (every layer's
    fused q/k/v, output, fused gate/up and down weights, then the LM head for one row), alone:
    no attention, norm or activation, replayed from one CUDA graph. The time a forward cannot
    beat with these GEMMs (cuBLAS through ``torch.nn.functional.linear``)."""
    import torch.nn.functional as F

    names = ("wqkv", "wo", "wgu", "wd")
    ws = [w[n] for w in engine_model.layers for n in names]
    xs = {k: torch.randn(tokens, k, device=ws[0].device, dtype=ws[0].dtype) for k in {w.shape[1] for w in ws}}
    head_x = torch.randn(1, engine_model.lm_head.shape[1], device=ws[0].device, dtype=ws[0].dtype)

    def chain():
        for w in ws:
            F.linear(xs[w.shape[1]], w)
        F.linear(head_x, engine_model.lm_head)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    graph.replay()
    ev[0].record()
    for _ in range(reps):
        graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / reps


def step_ms(llm, batch: int) -> tuple[float, int]:
    """Median time (ms) of the logged decode steps that had exactly ``batch`` requests
    decoding, and how many there were."""
    steps = [dt for b, dt in list(llm.engine.decode_step_log) if b == batch]
    return (statistics.median(steps) * 1e3 if steps else float("nan")), len(steps)
