"""The benchmark tools' shared harness: where they run from, the tokenizer, the random-weight
model shapes (Llama-3.1-8B, Qwen3-8B, Gemma-3-4B, and a tiny smoke-run version), texts of a
given token count, the one warm-TTFT timing (``timed``/``warm_ttft``), decode step timings, the
floor of a serving loop (``measure_rates``/``floor``), JSON output, and loading a sibling tool.

Where they run from: a tool is run by path (``python benchmarks/NAME.py``, from any folder), so
its own folder is first on ``sys.path`` and its first import, ``from _common import ...``, finds
this file, which puts the repository root on ``sys.path`` (this is the one place that does) so
that ``lazyllm`` is this tree's. The module is also ``benchmarks._common`` (one copy under both
names: tests import it so, and ``sibling`` loads a tool by path under a private name, so no
tool's file name can stand in for an installed module).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.modules.setdefault("benchmarks._common", sys.modules[__name__])
sys.modules.setdefault("_common", sys.modules[__name__])


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


def demo_docs() -> dict:
    """The demo's six documents (``examples/corpus.py``'s ``DOCS``), loaded by path."""
    spec = importlib.util.spec_from_file_location("_lazyllm_demo_corpus", os.path.join(ROOT, "examples", "corpus.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.DOCS


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


def qwen3_8b_config(layers: int):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=151643, eos_token_id=151645,
    )


def gemma3_4b_config(layers: int):
    """Gemma 3 4B's text model: 5 local layers (window 1024, RoPE base 10k) to 1 global
    (base 1M, linear scaling 8)."""
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )


MODELS = ("llama", "qwen3", "gemma3")
NAMES = {"llama": "Llama-3.1-8B", "qwen3": "Qwen3-8B", "gemma3": "Gemma-3-4B"}
CONFIGS = {"llama": llama31_8b_config, "qwen3": qwen3_8b_config, "gemma3": gemma3_4b_config}


def random_causal_lm(cfg, device: str, dtype: torch.dtype):
    """A transformers causal LM of ``cfg`` (any family) with random weights, built on ``device``
    in ``dtype``."""
    import transformers

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


class Warnings(logging.Handler):
    """Collects the ``lazyllm`` logger's warnings while installed (a slow fallback logs one)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# -- the warm-TTFT timing: every tool times a request's first token with these two ----------------

class Clock:
    """When each token is handed out (``OutputProcessor.emit``, on the engine thread), and its
    request: the first two marks after a call are its first and second token. Installed once
    per engine (``clock``); it reads only long-standing engine attributes, so it times older
    trees the same way."""

    def __init__(self, llm):
        self.marks: list[tuple[float, object]] = []
        out = llm.engine.output
        emit = out.emit

        def timed_emit(r, tok):
            done = emit(r, tok)
            self.marks.append((time.perf_counter(), r))
            return done

        out.emit = timed_emit
        out._bench_clock = self


def clock(llm) -> Clock:
    """``llm``'s ``Clock``, installed on first use."""
    return getattr(llm.engine.output, "_bench_clock", None) or Clock(llm)


def timed(llm, question: str, chunks, sync=None, **kw) -> tuple[dict, object]:
    """One ``generate`` of ``question`` over ``chunks`` (``kw``: its other arguments), timed
    (ms): ``engine_ms`` from the engine's receipt of the built request to the first token and
    ``call_ms`` from the call (both by the ``Clock``), ``engine2_ms``/``call2_ms`` the same to
    the second token when there is one, ``wall_ms`` the whole call, and the output's own
    ``ttft_ms``/``engine_ttft_ms`` (an older tree without ``engine_ttft_s``: ``ttft_s``).
    ``sync``: called before the clock starts (a device synchronize). Returns the row and the
    output."""
    c = clock(llm)
    if sync is not None:
        sync()
    c.marks.clear()
    t0 = time.perf_counter()
    out = llm.generate(question, chunks=chunks, **kw)
    wall = time.perf_counter() - t0
    (e1, r), second = c.marks[0], c.marks[1][0] if len(c.marks) > 1 else None
    row = {"engine_ms": (e1 - r.submit_time) * 1e3, "call_ms": (e1 - t0) * 1e3, "wall_ms": wall * 1e3,
           "ttft_ms": out.ttft_s * 1e3, "engine_ttft_ms": (getattr(out, "engine_ttft_s", None) or out.ttft_s) * 1e3}
    if second is not None:
        row.update(engine2_ms=(second - r.submit_time) * 1e3, call2_ms=(second - t0) * 1e3)
    return row, out


def warm_ttft(llm, requests, sync=None, **kw) -> tuple[dict, list]:
    """``timed`` over ``requests`` (``(question, chunks)`` pairs, each its own call), one
    output token unless ``kw`` says otherwise: the median of each figure (``*_ms``) and every
    reading of the first two (``ttft_all_ms``, ``engine_all_ms``); and the outputs."""
    kw.setdefault("max_new_tokens", 1)
    rows, outs = [], []
    for question, chunks in requests:
        row, out = timed(llm, question, chunks, sync=sync, **kw)
        rows.append(row)
        outs.append(out)
    res = {k: statistics.median(r[k] for r in rows) for k in rows[0] if all(k in r for r in rows)}
    res.update({k.replace("_ms", "_all_ms"): [r[k] for r in rows] for k in ("ttft_ms", "engine_ms")})
    return res, outs


class Turns:
    """Two processes, ``old`` and ``new``, taking turns through a counter file in ``folder``:
    slot ``s`` runs when the counter reads ``s``; ``stop`` ends both."""

    def __init__(self, folder: str, side: str, timeout_s: float = 600.0):
        os.makedirs(folder, exist_ok=True)
        self.folder, self.side, self.timeout_s = folder, side, timeout_s
        self.path = os.path.join(folder, "turn")

    def _read(self) -> str:
        try:
            with open(self.path) as fh:
                return fh.read().strip()
        except FileNotFoundError:
            return ""

    def _write(self, text: str) -> None:
        tmp = f"{self.path}.{self.side}"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, self.path)

    def _until(self, ok) -> bool:
        end = time.perf_counter() + self.timeout_s
        while not ok():
            if time.perf_counter() > end:
                raise TimeoutError(f"{self.side}: the other side never took its turn")
            time.sleep(0.002)
        return True

    def ready(self) -> None:
        """Both sides built and warmed up (no timed work overlaps the other's warm-up)."""
        if self.side == "old":
            self._write("0")
        open(os.path.join(self.folder, f"ready_{self.side}"), "w").close()
        self._until(lambda: all(os.path.exists(os.path.join(self.folder, f"ready_{s}")) for s in ("old", "new")))

    def slot(self, item: int) -> int:
        """Item ``item``'s slot for this side: old first in even passes of the list, new first
        in odd ones (``item`` counts across passes: pass * items + index)."""
        first = "old" if (item // self.items) % 2 == 0 else "new"
        return 2 * item + (self.side != first)

    def wait(self, slot: int) -> bool:
        """Wait for ``slot``; False once the other side stopped."""
        self._until(lambda: self._read() in (str(slot), "stop"))
        return self._read() != "stop"

    def done(self, slot: int, stop: bool = False) -> None:
        self._write("stop" if stop else str(slot + 1))


def write_json(path: str | None, results) -> None:
    """``results`` as indented JSON at ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=2, default=str)


# -- the floor of a serving loop, and where the rest of its wall time went ------------------------
# A loop cannot finish faster than the model's own work: the tokens it prefilled at the dense
# per-token prefill time, plus its decode steps at the time one step takes to read the weights.
# Both rates are measured in the same run (``measure_rates``): the per-token time from fresh
# chunks prefilled by ``warm()`` (the fastest of three, each from the call to the device's end of
# its work), the step time from the weights' bytes over the device's copy bandwidth. ``floor``
# compares a loop's wall time with that, and splits the wall into the engine thread's prefill and
# decode steps, the recompute selection, and the rest (host: tokenizing, building requests,
# planning, waking callers, Python between steps).

@dataclass
class Rates:
    """The device's dense prefill time per token and weight-read time per decode step (s)."""

    prefill_token_s: float
    step_s: float

    def line(self) -> str:
        return (f"floor rates: dense prefill {1e6 * self.prefill_token_s:.1f} us/token, weight read "
                f"{1e3 * self.step_s:.2f} ms/step")


def _bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Copy bandwidth of ``device`` (bytes read plus written per second), median of 5."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return 2 * nbytes / times[len(times) // 2]


def weight_bytes(hf) -> int:
    """Bytes a decode step reads: every parameter but an untied input embedding (one row is
    read per token)."""
    emb = hf.get_input_embeddings().weight
    out = hf.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    return total if tied else total - emb.numel() * emb.element_size()


def measure_rates(llm, tokens: int = 1024, seed: int = 12345, samples: int = 3) -> Rates:
    """``Rates`` of ``llm``'s engine: fresh chunks of about ``tokens`` tokens prefilled alone
    (after one of the same size, so that kernels are compiled), each timed from the call to
    the device's end of its work (``warm`` returns once the engine has launched it; the
    engine's own ``prefill_s`` is host time, which can end before the device's work does); the
    fastest of ``samples``; and the weights' read time."""
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    m = llm.engine.metrics
    llm.warm([text_of_tokens(llm, tokens, seed)])
    best = float("inf")
    for i in range(samples):
        text = text_of_tokens(llm, tokens, seed + 1 + i)
        t0 = m["prefill_tokens"]
        sync()
        start = time.perf_counter()
        llm.warm([text])
        sync()
        best = min(best, (time.perf_counter() - start) / max(m["prefill_tokens"] - t0, 1))
    return Rates(best, weight_bytes(llm.hf_model) / _bandwidth(llm.device))


def floor(rates: Rates, m0, m1, wall_s: float) -> dict:
    """The floor of a loop that ran ``wall_s`` seconds between the engine counters ``m0`` and
    ``m1`` (mappings of ``EngineMetrics``), its fraction of the wall, and the wall split into
    prefill, decode, selection and host seconds."""
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in ("prefill_tokens", "decode_steps", "prefill_s", "decode_s",
                                                  "selection_s")}
    floor_s = d["prefill_tokens"] * rates.prefill_token_s + d["decode_steps"] * rates.step_s
    host = wall_s - d["prefill_s"] - d["decode_s"]
    return dict(floor_s=floor_s, of_floor=floor_s / wall_s if wall_s > 0 else float("nan"), wall_s=wall_s,
                prefill_s=d["prefill_s"], decode_s=d["decode_s"], selection_s=d["selection_s"], host_s=host,
                prefill_tokens=d["prefill_tokens"], decode_steps=d["decode_steps"])


def floor_line(f: dict) -> str:
    """One printed line of ``floor``'s figures."""
    return (f"floor {f['floor_s']:.3f} s ({f['prefill_tokens']} prefilled tokens, {f['decode_steps']} decode "
            f"steps): the loop ran at {100 * f['of_floor']:.0f}% of it; wall {f['wall_s']:.3f} s = prefill "
            f"{f['prefill_s']:.3f} + decode {f['decode_s']:.3f} + host {f['host_s']:.3f} s "
            f"(selection inside prefill: {f['selection_s']:.3f} s)")
