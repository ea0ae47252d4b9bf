"""Skewed RAG serving: LazyAttention (`lazy`) against Block-Attention (`block`), identical-
prefix caching (`prefix`), no reuse (`none`) and transformers `generate` on the flattened
prompt (what LangChain's HuggingFacePipeline and LlamaIndex's HuggingFaceLLM do), all on
the same model and device, with the same seeded requests.

Workload: a pool of documents; each request retrieves ``k`` distinct documents drawn from
a Zipf distribution of exponent ``alpha`` over document ranks (``alpha 0`` is uniform), in
random order, with a 32-64 token question and a fixed number of output tokens. Arrivals are
Poisson at ``--rates`` (requests/s) or closed-loop at ``--concurrency`` (``--rates 0``).

    # CPU, default model, small (what CI runs):
    python benchmarks/rag_serving.py --preset ci
    # H200, Llama-3.1-8B shapes with random bf16 weights:
    python benchmarks/rag_serving.py --preset h200 --tokenizer DIR --json out.json --plots DIR
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PRESETS = {
    "ci": dict(docs=12, doc_tokens=48, k=2, requests=6, output_tokens=3, budgets="0.6,1.0", rates="0",
               concurrency=2, alphas="2.1", systems="lazy,block,prefix,none,hf"),
    "h200": dict(docs=100, doc_tokens=2048, k=5, requests=96, output_tokens=32, budgets="0.2,0.33,1.0",
                 rates="0", concurrency=16, alphas="2.1,0", systems="lazy,block,prefix,none,hf",
                 random_8b=True),
}
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]


@dataclass
class Req:
    question: str
    doc_ids: list[int]


def make_text(tok, n_tokens: int, rng: random.Random) -> str:
    """Text of about ``n_tokens`` tokens of random words (deterministic given ``rng``)."""
    words = []
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) < n_tokens:
        words.extend(f"{rng.choice(WORDS)}{rng.randint(0, 9999)}" for _ in range(max(4, n_tokens // 8)))
    while len(words) > 1 and len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) > n_tokens:
        words.pop()
    return " ".join(words)


def zipf_sample(rng: random.Random, n_docs: int, k: int, alpha: float) -> list[int]:
    weights = [1.0 / (i + 1) ** alpha for i in range(n_docs)]
    chosen: list[int] = []
    while len(chosen) < k:
        i = rng.choices(range(n_docs), weights=weights)[0]
        if i not in chosen:
            chosen.append(i)
    rng.shuffle(chosen)
    return chosen


def workload(tok, args, alpha: float, seed: int):
    rng = random.Random(seed)
    docs = [make_text(tok, args.doc_tokens, rng) for _ in range(args.docs)]
    reqs = [Req(make_text(tok, rng.randint(32, 64), rng), zipf_sample(rng, args.docs, args.k, alpha))
            for _ in range(args.requests)]
    return docs, reqs


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def drive(run_one, reqs, rate: float, concurrency: int, seed: int):
    """Submit requests (Poisson at ``rate`` or closed loop) and collect per-request
    (ttft, tpot, output tokens, total)."""
    results: list = [None] * len(reqs)
    t0 = time.perf_counter()
    if rate > 0:
        threads = []
        for i, at in enumerate(arrivals(len(reqs), rate, seed)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=lambda i=i: results.__setitem__(i, run_one(reqs[i])))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
    else:
        nxt = iter(range(len(reqs)))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                results[i] = run_one(reqs[i])

        ws = [threading.Thread(target=worker) for _ in range(concurrency)]
        for w in ws:
            w.start()
        for w in ws:
            w.join()
    return results, time.perf_counter() - t0


class HFServer:
    """transformers ``generate`` on the flattened prompt, one request at a time (FIFO),
    the way an in-process HuggingFacePipeline serves a chain."""

    def __init__(self, model, tok, prompts, eos):
        from transformers.generation.streamers import BaseStreamer

        self.model, self.tok, self.prompts, self.lock = model, tok, prompts, threading.Lock()
        self.eos = eos
        self.BaseStreamer = BaseStreamer

    def run(self, question, chunks, max_new_tokens):
        from lazyllm import Chunk

        segs = self.prompts.build(question, [Chunk(c) for c in chunks], None)
        ids = [t for s in segs for t in s.ids]
        submit = time.perf_counter()
        stamps = []

        class Stamp(self.BaseStreamer):
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        dev = next(self.model.parameters()).device
        with self.lock, torch.inference_mode():
            out = self.model.generate(torch.tensor([ids], device=dev), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      streamer=Stamp(), pad_token_id=0,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev))
        end = time.perf_counter()
        n = out.shape[1] - len(ids)
        ttft = (stamps[1] if len(stamps) > 1 else end) - submit  # stamps[0] is the prompt
        return ttft, (end - submit - ttft) / max(n - 1, 1), n, end - submit, len(ids)


def kv_bytes_per_token(cfg, dtype) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kvh * head_dim * torch.empty((), dtype=dtype).element_size()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(math.ceil(q * len(xs))) - 1)] if xs else float("nan")


def run_system(system, hf, tok, docs, reqs, args, budget_frac, rate, alpha):
    from lazyllm import LazyLLM, LazyLLMError

    pool_bytes = args.docs * args.doc_tokens * kv_bytes_per_token(hf.config, next(hf.parameters()).dtype)
    if system == "hf":
        from lazyllm.engine.prompt import PromptBuilder

        server = HFServer(hf, tok, PromptBuilder(tok), None)
        server.run(reqs[0].question, [docs[i] for i in reqs[0].doc_ids], 2)  # warm-up
        res, wall = drive(lambda r: server.run(r.question, [docs[i] for i in r.doc_ids], args.output_tokens),
                          reqs, rate, args.concurrency, args.seed)
        prefilled = sum(x[4] for x in res)
        extra = dict(hit_rate=0.0, prefill_tokens=prefilled, peak_kv_gib=float("nan"), preemptions=0)
    else:
        budget = int(budget_frac * pool_bytes)
        llm = LazyLLM(model=hf, tokenizer=tok, reuse=system, kv_cache_bytes=max(budget, 1 << 20),
                      page_size=args.page_size)
        llm.engine.eos_ids = set()  # every request runs to its length: same work for every system
        # warm-up on part of the same workload: Triton compiles and CUDA-graph captures for
        # the shapes this run will see happen here, not inside the measured run
        warm = reqs[: min(len(reqs), 2 * args.concurrency)]

        def warm_one(r):
            try:
                llm.generate(r.question, chunks=[docs[i] for i in r.doc_ids], max_new_tokens=args.output_tokens)
            except LazyLLMError:
                pass

        drive(warm_one, warm, 0.0, args.concurrency, args.seed)
        llm.clear_cache()
        base = dict(llm.store.counters.__dict__)
        m0 = dict(llm.engine.metrics)
        llm.engine.metrics["peak_pages"] = 0

        def one(r):
            try:
                out = llm.generate(r.question, chunks=[docs[i] for i in r.doc_ids],
                                   max_new_tokens=args.output_tokens)
            except LazyLLMError as e:  # e.g. a budget too small for this system: reported, not fatal
                return ("error", str(e))
            return out.ttft_s, out.tpot_s, out.usage.completion_tokens, out.total_s, out.usage.prompt_tokens

        res, wall = drive(one, reqs, rate, args.concurrency, args.seed)
        c = llm.store.counters
        hits, misses = c.hits - base["hits"], c.misses - base["misses"]
        page_bytes = pool_bytes / max(args.docs * args.doc_tokens, 1) * args.page_size
        extra = dict(hit_rate=hits / max(hits + misses, 1),
                     prefill_tokens=llm.engine.metrics["prefill_tokens"] - m0["prefill_tokens"],
                     peak_kv_gib=llm.engine.metrics["peak_pages"] * page_bytes / 2**30,
                     preemptions=llm.engine.metrics["preemptions"] - m0["preemptions"])
        llm.close()
    failed = [x for x in res if x[0] == "error"]
    res = [x for x in res if x[0] != "error"]
    if not res:
        return dict(system=system, budget=budget_frac, rate=rate, alpha=alpha, requests=0, failed=len(failed),
                    error=failed[0][1], ttft_p50_ms=float("nan"), ttft_p95_ms=float("nan"), tpot_ms=float("nan"),
                    req_per_s=0.0, out_tok_per_s=0.0, wall_s=wall, **extra)
    ttft = [x[0] for x in res]
    out_tokens = sum(x[2] for x in res)
    return dict(system=system, budget=budget_frac, rate=rate, alpha=alpha, requests=len(res), failed=len(failed),
                ttft_p50_ms=statistics.median(ttft) * 1e3, ttft_p95_ms=pct(ttft, 0.95) * 1e3,
                tpot_ms=statistics.median(x[1] for x in res) * 1e3, req_per_s=len(res) / wall,
                out_tok_per_s=out_tokens / wall, wall_s=wall, **extra)


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    systems = sorted({r["system"] for r in rows})
    for x, y, name in (("rate", "ttft_p50_ms", "ttft_vs_rate.png"), ("budget", "req_per_s", "throughput_vs_budget.png"),
                       ("budget", "hit_rate", "hit_rate_vs_budget.png")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for s in systems:
            pts = sorted((r[x], r[y]) for r in rows if r["system"] == s)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=120)
        plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    ap.add_argument("--random-8b", action="store_true", help="random bf16 weights in Llama-3.1-8B shapes (GPU)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--alphas", default="2.1")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rates", default="0", help="Poisson rates in requests/s; 0 = closed loop")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--budgets", default="0.2,0.33,1.0", help="KV budget as a fraction of the document pool's KV")
    ap.add_argument("--systems", default="lazy,block,prefix,none,hf")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plots", default=None, help="folder for PNG plots")
    args = ap.parse_args(argv)
    if args.preset:
        defaults = ap.parse_args([])
        for key, val in PRESETS[args.preset].items():
            if getattr(args, key) == getattr(defaults, key, None):
                setattr(args, key, val)
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir, load_hf

    if args.random_8b:
        from engine import llama31_8b_config, random_model

        hf = random_model(llama31_8b_config(32))
        tok = AutoTokenizer.from_pretrained(args.tokenizer or str(default_model_dir()))
        name = "random Llama-3.1-8B shapes, bf16"
    else:
        dev = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto"
                                                                                  else args.device)
        hf, tok, name = load_hf(args.model, device=dev, dtype=torch.bfloat16 if dev.startswith("cuda")
                                else torch.float32)
    rows = []
    for alpha in [float(a) for a in args.alphas.split(",")]:
        docs, reqs = workload(tok, args, alpha, args.seed)
        for rate in [float(r) for r in args.rates.split(",")]:
            for system in args.systems.split(","):
                budgets = [1.0] if system == "hf" else [float(b) for b in args.budgets.split(",")]
                for b in budgets:
                    row = run_system(system, hf, tok, docs, reqs, args, b, rate, alpha)
                    rows.append(row)
                    print(f"  {system:6s} alpha={alpha} rate={rate} budget={b}: ttft p50 {row['ttft_p50_ms']:.1f} ms, "
                          f"{row['req_per_s']:.2f} req/s, hit rate {row['hit_rate']:.2f}", flush=True)
    dev_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\nRAG serving, {name} on {dev_name}, {args.docs} docs x {args.doc_tokens} tokens, k={args.k}, "
          f"{args.requests} requests, {args.output_tokens} output tokens, {time.strftime('%Y-%m-%d')}")
    print("| system | alpha | rate | KV budget | done/failed | TTFT p50 ms | TTFT p95 ms | TPOT ms | req/s | out tok/s "
          "| hit rate | prefilled tokens | peak KV GiB | preemptions |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['system']} | {r['alpha']} | {r['rate'] or 'closed'} | {r['budget']:.2f} | "
              f"{r['requests']}/{r['failed']} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p95_ms']:.1f} | {r['tpot_ms']:.1f} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | "
              f"{r['hit_rate']:.2f} | {r['prefill_tokens']} | {r['peak_kv_gib']:.2f} | {r['preemptions']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    if args.plots:
        plot(rows, args.plots)
    return rows


if __name__ == "__main__":
    main()
