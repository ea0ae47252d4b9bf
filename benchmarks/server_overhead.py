"""Server overhead: the time of one chat completion through ``lazyllm serve``'s HTTP app (uvicorn
on 127.0.0.1, a keep-alive client) minus the in-process ``LazyLLM.generate`` of the same request.

The server runs in a process of its own (as ``lazyllm serve`` does) over the same model as the
in-process engine. Each repeat runs the in-process call and the HTTP request back to back, in
alternating order, both warm (documents cached, ``max_new_tokens=1``), so the engine time is the
same and the difference is the server's: HTTP, JSON, validation, the worker-thread hand-off. Reports the
median of the per-pair differences, and the medians of each side.

    .venv/bin/python benchmarks/server_overhead.py                 # tiny random model (engine ~ms)
    .venv/bin/python benchmarks/server_overhead.py --model default # the embedded SmolLM2-135M
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import time

import httpx
import torch
import uvicorn

from lazyllm import LazyLLM
from lazyllm.integrations.server import create_app

DOCS = [f"Document {i}: the {w} is kept in room {i * 7}, next to the {v}." for i, (w, v) in enumerate(
    zip(["lamp", "chair", "table", "clock", "vase", "piano"], ["door", "window", "shelf", "bed", "desk", "sofa"]))]


def tiny_llm() -> LazyLLM:
    import transformers

    from lazyllm.model.loader import default_model_dir

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20)


def build(model: str) -> LazyLLM:
    torch.set_num_threads(1)
    if model == "tiny":
        return tiny_llm()
    return LazyLLM(None if model == "default" else model, device="cpu", progress=False)


def serve(model: str, port: int) -> None:
    """The server, in a process of its own (as ``lazyllm serve`` runs)."""
    llm = build(model)
    uvicorn.run(create_app(llm, model_name="m"), host="127.0.0.1", port=port, log_level="warning",
                access_log=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (random 2-layer), default (embedded SmolLM2) or a path")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    llm = build(args.model)  # the in-process engine; the server builds the same one in its process
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(args.model, port), daemon=True)
    proc.start()
    deadline = time.monotonic() + 300
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health").raise_for_status()
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.is_alive(), "the server did not start"
            time.sleep(0.1)

    question, system = "Where is the lamp?", "Answer from the documents."
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "documents": DOCS, "max_tokens": 1}
    stream_body = dict(body, stream=True, stream_options={"include_usage": True})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def in_process() -> float:
        t = time.perf_counter()
        llm.generate(question, DOCS, system, max_new_tokens=1)
        return time.perf_counter() - t

    def http() -> float:
        t = time.perf_counter()
        r = client.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
        r.raise_for_status()
        return time.perf_counter() - t

    def http_stream() -> float:
        t = time.perf_counter()
        with client.stream("POST", "/v1/chat/completions", json=stream_body) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass
        return time.perf_counter() - t

    rows = []
    for name, fn in (("HTTP, non-streaming", http), ("HTTP, streaming (SSE)", http_stream)):
        for _ in range(args.warmup):
            in_process(), fn()
        local, remote, diff = [], [], []
        for i in range(args.repeats):
            if i % 2:
                a, b = in_process(), fn()
            else:
                b, a = fn(), in_process()
            local.append(a)
            remote.append(b)
            diff.append(b - a)
        rows.append((name, statistics.median(local), statistics.median(remote), statistics.median(diff),
                     statistics.quantiles(diff, n=10)[8]))
    out = llm.generate(question, DOCS, system, max_new_tokens=1)
    print(f"model: {args.model} ({llm.model_name}), {len(DOCS)} cached documents, prompt {out.usage.prompt_tokens} "
          f"tokens ({out.usage.cached_tokens} cached), max_tokens=1, {args.repeats} pairs, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'path':<24} {'in-process ms':>14} {'server ms':>10} {'overhead ms (median)':>21} {'p90':>7}")
    for name, a, b, d, p90 in rows:
        print(f"{name:<24} {a * 1e3:>14.2f} {b * 1e3:>10.2f} {d * 1e3:>21.2f} {p90 * 1e3:>7.2f}")
    client.close()
    proc.terminate()
    proc.join(timeout=10)
    llm.close()


if __name__ == "__main__":
    main()
