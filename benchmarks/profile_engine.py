"""Where the engine's time goes on the GPU (Llama-3.1-8B shapes, random bf16 weights).

Prints, for a warm-cache request (TTFT) and for decode at batch 1 and 64: wall time per
step, GPU busy time per step, and the top CUDA kernels, so host overhead and slow kernels
can be told apart.

    python benchmarks/profile_engine.py --tokenizer DIR [--layers 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import llama31_8b_config, random_model, text_of_tokens  # noqa: E402


def summarize(prof, label, steps, wall_s):
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
           or getattr(e, "self_device_time_total", 0) > 0]
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in rows)
    print(f"\n== {label}: {steps} steps, wall {wall_s * 1e3 / steps:.2f} ms/step, "
          f"GPU busy {gpu_us / 1e3 / steps:.2f} ms/step")
    for e in rows[:14]:
        t = getattr(e, "self_device_time_total", 0)
        if t <= 0:
            break
        print(f"  {t / 1e3 / steps:8.3f} ms/step  x{e.count // max(steps, 1):<5d} {e.key[:90]}")
    del evs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokenizer", required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from lazyllm import LazyLLM

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model = random_model(llama31_8b_config(args.layers))
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=48 << 30)
    llm.engine.eos_ids = set()
    chunks = [text_of_tokens(llm, 510, seed=i) for i in range(8)]
    q = text_of_tokens(llm, 50, seed=99)
    llm.generate("warm " + q, chunks=chunks[::-1], max_new_tokens=2)
    for i in range(3):
        llm.generate(f"{i} {q}", chunks=chunks, max_new_tokens=1)
    # warm TTFT
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        outs = [llm.generate(f"p{i} {q}", chunks=chunks, max_new_tokens=1) for i in range(5)]
        wall = time.perf_counter() - t
    print("warm TTFT ms:", [round(o.ttft_s * 1e3, 2) for o in outs])
    summarize(prof, "warm prefill (request wall incl. tokenization)", 5, wall)
    # engine-side timing of one warm request, without the caller's tokenization
    req = llm._request("x " + q, chunks, None, max_new_tokens=1)
    t = time.perf_counter()
    llm.engine.submit(req)
    llm._wait(req)
    print(f"engine-side warm request: {(time.perf_counter() - t) * 1e3:.2f} ms")
    for batch in (1, 64):
        reqs = [{"question": f"{b} {q}", "chunks": chunks} for b in range(batch)]
        llm.generate_batch(reqs, max_new_tokens=4)
        steps = 24
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            before = llm.engine.metrics["decode_steps"]
            t = time.perf_counter()
            outs = llm.generate_batch(reqs, max_new_tokens=steps)
            wall = time.perf_counter() - t
            n = llm.engine.metrics["decode_steps"] - before
        print(f"batch {batch}: tpot {sorted(o.tpot_s for o in outs)[len(outs) // 2] * 1e3:.2f} ms")
        summarize(prof, f"decode batch {batch} (whole generate_batch incl. prefill)", n, wall)
        # graph replay alone
        g = llm.engine.graphs
        keys = [k for k in g.graphs if k[0] == g.batch_bucket(batch)]
        if keys:
            graph, _ = g.graphs[max(keys)]
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            graph.replay()
            torch.cuda.synchronize()
            ev[0].record()
            for _ in range(20):
                graph.replay()
            ev[1].record()
            torch.cuda.synchronize()
            print(f"graph replay alone, bucket {max(keys)}: {ev[0].elapsed_time(ev[1]) / 20:.2f} ms")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(10):
                    graph.replay()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            summarize(prof, f"graph replay alone, batch bucket {max(keys)[0]}, width {max(keys)[1]}", 10, wall)


if __name__ == "__main__":
    main()
