"""The host path of a request over cached chunks: what a caller's stopwatch sees against the
engine's own figures.

Single request: ``generate(question, chunks, max_new_tokens=1)`` over ``--chunks`` cached chunks
of ``--doc-tokens`` tokens with a ``--question-tokens`` question (a new one each time), ``--repeats``
times: the median wall time from the call to its return, the median ``ttft_s`` (from the call
to the first token) and the median ``engine_ttft_s`` (from the engine's receipt of the request);
and the median time the front door takes to build that request (``llm.inputs.generation``:
templating, tokenizing, chunk encodings and keys), without running it.

Hot loop: ``generate_batch`` of ``--requests`` requests, each over ``--chunks`` of ``--docs``
cached documents (seeded), ``--output-tokens`` tokens each (no end-of-sequence token), twice
with new questions. The first pass also captures the CUDA graphs of batch shapes the warm-up
leaves to first use (its req/s and captures are printed); of the second: req/s over the call's
wall time, the p50 of ``ttft_s`` and of ``engine_ttft_s``, and the loop's floor
(``benchmarks/_floor.py``: prefilled tokens at the dense per-token time plus decode steps at
the weight-read time, both measured in this run) with where the rest of the wall went.

    # CPU, the default model:
    python benchmarks/host_path.py
    # GPU, Llama-3.1-8B shapes with random bf16 weights:
    python benchmarks/host_path.py --random-8b --tokenizer DIR
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import llama31_8b_config, random_model, run_to_length, text_of_tokens  # noqa: E402
from benchmarks._floor import floor, floor_line, measure_rates  # noqa: E402


def _engine_ttft(out) -> float:
    """The engine-side TTFT (``ttft_s`` itself on a tree that reports only that one)."""
    return getattr(out, "engine_ttft_s", out.ttft_s)


def _p50(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def single(llm, docs: list[str], args) -> dict:
    """Medians of one ``generate(..., max_new_tokens=1)`` over the first ``--chunks`` docs."""
    chunks = docs[:args.chunks]
    rng = random.Random(args.seed)
    walls, ttfts, engine, builds = [], [], [], []
    for i in range(args.repeats + 2):  # the first two: warm-up
        q = text_of_tokens(llm, args.question_tokens, rng.randrange(1 << 30)) + "?"
        t0 = time.perf_counter()
        llm.inputs.generation(q, chunks, max_new_tokens=1, streaming=False)  # built, not submitted
        builds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = llm.generate(q, chunks, max_new_tokens=1)
        wall = time.perf_counter() - t0
        if i >= 2:
            walls.append(wall)
            ttfts.append(out.ttft_s)
            engine.append(_engine_ttft(out))
    return dict(build_ms=1e3 * _p50(builds[2:]), wall_ms=1e3 * _p50(walls), ttft_ms=1e3 * _p50(ttfts),
                engine_ttft_ms=1e3 * _p50(engine), wall_over_engine=_p50(walls) / _p50(engine))


def hot_loop(llm, docs: list[str], args, rates) -> dict:
    """``generate_batch`` of ``--requests`` requests over cached docs, twice (new questions each
    time): req/s, TTFT p50s and floor of the second pass; the first pass's req/s and the CUDA
    graphs it captured (the batch shapes the warm-up leaves to first use)."""
    rng = random.Random(args.seed + 1)
    m = llm.engine.metrics
    passes = []
    for _ in range(2):
        reqs = [dict(question=text_of_tokens(llm, args.question_tokens, rng.randrange(1 << 30)) + "?",
                     chunks=rng.sample(docs, args.chunks)) for _ in range(args.requests)]
        m0, g0 = dict(m), llm.engine.graph_stats()
        t0 = time.perf_counter()
        outs = llm.generate_batch(reqs, max_new_tokens=args.output_tokens)
        wall = time.perf_counter() - t0
        g1 = llm.engine.graph_stats()
        passes.append(dict(req_per_s=len(outs) / wall, wall_s=wall, ttft_p50_ms=1e3 * _p50([o.ttft_s for o in outs]),
                           engine_ttft_p50_ms=1e3 * _p50([_engine_ttft(o) for o in outs]),
                           graphs_captured=g1["decode_graphs"] + g1["prefill_graphs"] - g0["decode_graphs"]
                           - g0["prefill_graphs"], capture_s=g1["capture_s"] - g0["capture_s"],
                           floor=floor(rates, m0, dict(m), wall)))
    first, second = passes
    return dict(second, first_pass=first)


def _load(args):
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir, load_hf

    if args.random_8b:
        hf = random_model(llama31_8b_config(32))
        tok = AutoTokenizer.from_pretrained(args.tokenizer or str(default_model_dir()))
        return hf, tok, "random Llama-3.1-8B shapes, bf16"
    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    hf, tok, name = load_hf(args.model, device=dev, dtype=torch.bfloat16 if dev.startswith("cuda")
                            else torch.float32)
    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    return hf, tok, name


def main(argv=None) -> dict:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    ap.add_argument("--random-8b", action="store_true", help="random bf16 weights in Llama-3.1-8B shapes (GPU)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--doc-tokens", type=int, default=1024 if gpu else 620)
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--requests", type=int, default=128 if gpu else 32)
    ap.add_argument("--output-tokens", type=int, default=32 if gpu else 8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    from lazyllm import LazyLLM

    hf, tok, name = _load(args)
    llm = LazyLLM(model=hf, tokenizer=tok, packets=None, progress=False, quality="isolated")
    run_to_length(llm)
    docs = [text_of_tokens(llm, args.doc_tokens, 1000 + i) for i in range(args.docs)]
    llm.warm(docs, batch_size=4)
    rates = measure_rates(llm, min(args.doc_tokens, 1024))
    one, loop = single(llm, docs, args), hot_loop(llm, docs, args, rates)
    print(f"{name} on {llm.device}: {args.chunks} cached chunks of {args.doc_tokens} tokens")
    print(f"single generate (1 token, median of {args.repeats}): wall {one['wall_ms']:.2f} ms, ttft_s (from the "
          f"call) {one['ttft_ms']:.2f} ms, engine_ttft_s {one['engine_ttft_ms']:.2f} ms, wall / engine "
          f"{one['wall_over_engine']:.2f}x; building the request alone {one['build_ms']:.2f} ms")
    f1 = loop["first_pass"]
    print(f"hot loop ({args.requests} requests, {args.output_tokens} tokens), second pass: {loop['req_per_s']:.1f} "
          f"req/s, ttft_s p50 {loop['ttft_p50_ms']:.1f} ms, engine_ttft_s p50 {loop['engine_ttft_p50_ms']:.1f} ms; "
          f"first pass {f1['req_per_s']:.1f} req/s, ttft_s p50 {f1['ttft_p50_ms']:.1f} ms, {f1['graphs_captured']} "
          f"CUDA graphs captured ({f1['capture_s']:.2f} s)")
    print(rates.line())
    print(floor_line(loop["floor"]))
    result = dict(args=vars(args), model=name, device=str(llm.device), single=one, hot_loop=loop,
                  rates=vars(rates))
    llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
