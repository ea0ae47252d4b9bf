"""The event loop under load: ``/health`` latency while ``lazyllm serve`` streams many answers,
and how long a near-limit body (7.9 MiB, under the 8 MiB default) delays other requests.

``lazyllm serve`` runs in a process of its own on 127.0.0.1 (the embedded default model on
CPU unless ``--model``); this process opens ``--streams`` concurrent streaming chat
completions (documents shared between them, ``--max-tokens`` each) and probes ``/health``
every 10 ms meanwhile. Then it posts the near-limit body while probing again. Prints the
probe latencies (median, p99, max) of both phases, the streams' wall time and the body's
time to be refused.

    .venv/bin/python benchmarks/server_health.py                      # 32 streams, default model
    .venv/bin/python benchmarks/server_health.py --streams 64 --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

DOCS = [f"Document {i}: the {w} is kept in room {i * 7}, next to the {v}." for i, (w, v) in enumerate(
    zip(["lamp", "chair", "table", "clock", "vase", "piano"], ["door", "window", "shelf", "bed", "desk", "sofa"]))]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path or hub id (default: the embedded default model)")
    ap.add_argument("--device", default="cpu", help="the server's device (default cpu; 'cuda' on a GPU machine)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streaming requests")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed answer")
    a = ap.parse_args()
    port = free_port()
    proc = start_server(a.model, port, a.streams, a.device)
    try:
        asyncio.run(run(f"http://127.0.0.1:{port}", a.streams, a.max_tokens))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
