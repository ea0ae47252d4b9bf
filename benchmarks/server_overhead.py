"""Server overhead: the time of one chat completion through ``lazyllm serve``'s HTTP app (uvicorn
on 127.0.0.1, a keep-alive client) minus the in-process ``LazyLLM.generate`` of the same request;
with ``--streams N``, the request rate of N concurrent streams over HTTP against N in process.

The server runs in a process of its own (as ``lazyllm serve`` does) over the same model as the
in-process engine. Each repeat runs the in-process call and the HTTP request back to back, in
alternating order, both warm (documents cached, ``max_new_tokens=1``), so the engine time is the
same and the difference is the server's: HTTP, JSON, validation, the worker-thread hand-off. Reports the
median of the per-pair differences, and the medians of each side.

    .venv/bin/python benchmarks/server_overhead.py                 # tiny random model (engine ~ms)
    .venv/bin/python benchmarks/server_overhead.py --model default # the embedded SmolLM2-135M
    # GPU, Llama-3.1-8B shapes (random bf16 weights): 32 concurrent streams, in process and over HTTP
    python3 benchmarks/server_overhead.py --model random-8b --tokenizer DIR --streams 32

``--streams N``: ``--requests`` requests, each over ``--k`` of ``--docs`` cached documents of
``--doc-tokens`` tokens (seeded) with a new ~40-token question and ``--max-tokens`` output tokens
(random weights: no end-of-sequence token, every request runs to its length), run by N client
threads that each stream one request at a time: ``LazyLLM.stream`` in process, then SSE chat
completions against the server (its own process, same model and options). Both sides run one
untimed pass of other requests over the same documents first. Prints req/s, output tokens/s,
time to first token (p50, the client's stopwatch) and the HTTP/in-process rate ratio.

``health``: the event loop under load: ``/health`` latency while ``lazyllm serve`` streams many
answers, and how long a near-limit body (7.9 MiB, under the 8 MiB default) delays other
requests. The server runs in a process of its own on 127.0.0.1 (the embedded default model on
CPU unless ``--model``); this process opens ``--streams`` concurrent streaming chat completions
(documents shared between them, ``--max-tokens`` each) and probes ``/health`` every 10 ms
meanwhile. Then it posts the near-limit body while probing again. Prints the probe latencies
(median, p99, max) of both phases, the streams' wall time and the body's time to be refused.

    .venv/bin/python benchmarks/server_overhead.py health --streams 32 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx
import torch
import uvicorn
from _common import sibling

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
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20, quality="isolated")


def random_8b_llm(tokenizer: str | None) -> LazyLLM:
    """Llama-3.1-8B shapes with random bf16 weights on CUDA; no end-of-sequence token."""
    from _common import llama31_8b_config, load_tokenizer, random_model, run_to_length

    # no warm-up: the untimed pass compiles and captures what the measured one runs
    llm = LazyLLM(model=random_model(llama31_8b_config(32)), tokenizer=load_tokenizer(tokenizer), packets=None,
                  kv_cache_bytes=16 << 30, progress=False, warmup=False, quality="isolated")
    run_to_length(llm)
    return llm


def build(model: str, tokenizer: str | None = None) -> LazyLLM:
    if model == "random-8b":
        return random_8b_llm(tokenizer)
    torch.set_num_threads(1)
    if model == "tiny":
        return tiny_llm()
    return LazyLLM(None if model == "default" else model, device="cpu", progress=False, quality="isolated")


def serve(model: str, port: int, tokenizer: str | None = None) -> None:
    """The server, in a process of its own (as ``lazyllm serve`` runs)."""
    llm = build(model, tokenizer)
    uvicorn.run(create_app(llm, model_name="m"), host="127.0.0.1", port=port, log_level="warning",
                access_log=False)


def _rate(n_streams: int, jobs: list, run_one) -> dict:
    """``jobs`` run by a closed loop of ``n_streams`` clients (``rag_serving.drive``), each
    ``run_one`` returning ``(TTFT s, output tokens)``: req/s, output tokens/s, TTFT p50."""
    results, wall = sibling("rag_serving").drive(run_one, jobs, 0.0, n_streams, seed=0)
    res = [r for r, _ in results]
    failed = [r for r in res if isinstance(r, dict)]  # drive reports an exception as {"error": ...}
    assert not failed, f"{len(failed)} requests failed: {failed[0]}"
    return dict(wall_s=wall, req_per_s=len(res) / wall, tok_per_s=sum(n for _, n in res) / wall,
                ttft_p50_ms=1e3 * statistics.median(t for t, _ in res))


def streams(args, llm: LazyLLM, port: int) -> dict:
    """N concurrent streams in process, then over HTTP: the request rates side by side."""
    from _common import text_of_tokens

    docs = [text_of_tokens(llm, args.doc_tokens, 1000 + i) for i in range(args.docs)]
    rng = random.Random(0)

    def jobs(n):
        return [(text_of_tokens(llm, 40, rng.randrange(1 << 30)) + "?", rng.sample(docs, args.k)) for _ in range(n)]

    def local(job):
        q, chunks = job
        t0, first = time.perf_counter(), None
        s = llm.stream(q, chunks, max_new_tokens=args.max_tokens)
        for _ in s:
            first = first or time.perf_counter() - t0
        return first, s.output.usage.completion_tokens

    pool = httpx.Limits(max_connections=2 * args.streams, max_keepalive_connections=2 * args.streams)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=pool)

    def remote(job):
        q, chunks = job
        body = {"model": "m", "messages": [{"role": "user", "content": q}], "documents": chunks,
                "max_tokens": args.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        t0, first, n = time.perf_counter(), None, 0
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if first is None and any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                    first = time.perf_counter() - t0
                if ev.get("usage"):
                    n = ev["usage"]["completion_tokens"]
        return first, n

    out = {}
    for name, fn in (("in process", local), ("HTTP (SSE)", remote)):
        _rate(args.streams, jobs(args.requests), fn)  # untimed: the documents cached, kernels and graphs ready
        out[name] = _rate(args.streams, jobs(args.requests), fn)
    client.close()
    a, b = out["in process"], out["HTTP (SSE)"]
    print(f"model: {args.model} ({llm.model_name}) on {llm.device}; {args.streams} concurrent streams, "
          f"{args.requests} requests of {args.k} cached documents of {args.doc_tokens} tokens, a ~40-token question, "
          f"{args.max_tokens} output tokens")
    print(f"{'path':<12} {'req/s':>8} {'tokens/s':>9} {'TTFT p50 ms':>12} {'wall s':>7}")
    for name, r in out.items():
        print(f"{name:<12} {r['req_per_s']:>8.1f} {r['tok_per_s']:>9.0f} {r['ttft_p50_ms']:>12.1f} {r['wall_s']:>7.2f}")
    print(f"in process / HTTP request rate: {a['req_per_s'] / b['req_per_s']:.2f}x")
    return out


def main() -> None:
    if sys.argv[1:2] == ["health"]:
        return health(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="server_overhead.py health --help: /health latency under load")
    ap.add_argument("--model", default="tiny",
                    help="tiny (random 2-layer), default (embedded SmolLM2), random-8b (GPU) or a path")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for random-8b (default: the default model's)")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--streams", type=int, default=0, help="concurrent streams: measure request rates instead")
    ap.add_argument("--requests", type=int, default=128, help="--streams: requests per measured pass")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = build(args.model, args.tokenizer)  # the in-process engine; the server builds the same one in its process
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(args.model, port, args.tokenizer),
                                                        daemon=True)
    proc.start()
    deadline = time.monotonic() + 600
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health").raise_for_status()
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.is_alive(), "the server did not start"
            time.sleep(0.1)
    try:
        if args.streams:
            out = streams(args, llm, port)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(dict(args=vars(args), results=out), fh, indent=2)
        else:
            overhead(args, llm, port)
    finally:
        proc.terminate()
        proc.join(timeout=10)
        llm.close()


def overhead(args, llm: LazyLLM, port: int) -> None:
    """One warm request at a time, in process and over HTTP, interleaved: the server's overhead."""
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


# -- health: /health latency under load ----------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, streams: int, device: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lazyllm.serve", *([model] if model else []), "--port", str(port),
           "--device", device, "--no-progress", "--no-access-log", "--log-level", "warning", "--model-name", "m",
           "--max-concurrency", str(max(streams * 2, 8))]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start within 300 s")


async def probe(client: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        r = await client.get("/health")
        out.append(time.perf_counter() - t)
        assert r.status_code == 200
        await asyncio.sleep(0.01)


async def one_stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> int:
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "documents": DOCS[i % 3:i % 3 + 3],
            "messages": [{"role": "user", "content": f"Where is item {i}?"}]}
    n = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
    return n


def summary(name: str, xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return (f"{name}: {len(xs)} probes, median {1e3 * statistics.median(xs):.1f} ms, p99 {1e3 * p99:.1f} ms, "
            f"max {1e3 * xs[-1]:.1f} ms")


async def run(url: str, streams: int, max_tokens: int) -> None:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client, \
            httpx.AsyncClient(base_url=url, timeout=60) as prober:
        await one_stream(client, 0, 2)  # warm
        stop, waits = asyncio.Event(), []
        task = asyncio.create_task(probe(prober, stop, waits))
        t = time.perf_counter()
        events = await asyncio.gather(*(one_stream(client, i, max_tokens) for i in range(streams)))
        wall = time.perf_counter() - t
        stop.set()
        await task
        print(f"{streams} concurrent streams x {max_tokens} tokens: {wall:.1f} s, {sum(events)} events")
        print(summary("/health under the streams", waits))

        doc = "word " * ((79 << 20) // 50)
        big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Summarize."}],
                          "documents": [doc]}).encode()
        stop, waits = asyncio.Event(), []
        task = asyncio.create_task(probe(prober, stop, waits))
        await asyncio.sleep(0.2)
        t = time.perf_counter()
        r = await client.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"})
        took = time.perf_counter() - t
        await asyncio.sleep(0.2)
        stop.set()
        await task
        code = r.json().get("error", {}).get("code")
        print(f"a {len(big) / 2**20:.1f} MiB body: answered {r.status_code} ({code}) in {1e3 * took:.0f} ms")
        print(summary("/health during that body", waits))


def health(argv) -> None:
    """``health``: /health latency under streams and a near-limit body (see the docstring)."""
    ap = argparse.ArgumentParser(prog="server_overhead.py health", description="/health latency under load")
    ap.add_argument("--model", default=None, help="model path or hub id (default: the embedded default model)")
    ap.add_argument("--device", default="cpu", help="the server's device (default cpu; 'cuda' on a GPU machine)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streaming requests")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed answer")
    a = ap.parse_args(argv)
    port = free_port()
    proc = start_server(a.model, port, a.streams, a.device)
    try:
        asyncio.run(run(f"http://127.0.0.1:{port}", a.streams, a.max_tokens))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
