"""Skewed RAG serving: LazyAttention (`lazy`) against Block-Attention (`block`), identical-
prefix caching (`prefix`), no reuse (`none`) and transformers `generate` on the flattened
prompt (`hf`, what LangChain's HuggingFacePipeline and LlamaIndex's HuggingFaceLLM do), all
on the same model and device, with the same seeded requests.

Workload: a pool of ``--docs`` documents of ``--doc-tokens`` tokens; each request retrieves
``--k`` distinct documents drawn from a Zipf distribution of exponent ``alpha`` over document
ranks (``alpha 0`` is uniform), in random order, with a 32-64 token question and a fixed
number of output tokens (EOS is ignored, so every system does the same work).

Arrivals: ``--rates`` in requests/s. A rate ``r > 0`` is a Poisson process (exponential
gaps) rescaled so that the last of the N requests arrives exactly at ``N / r``: a short run
then offers exactly its nominal rate. Rate ``0`` is a closed loop at ``--concurrency`` (each
client sends its next request when the last one finished): the saturation throughput.
``--rates`` and ``--budgets`` may differ per alpha: ``"2.1=2,4,8;0=1,2"``, and rates per
(alpha, budget): ``"2.1=2,4,8;0=1,2;2.1@0.12=0"``.

Measurement. Per system and KV budget one engine is built; per alpha it first serves
``--warm-requests`` requests of a separate warm-up stream (same documents and distribution)
at ``--warm-concurrency``, so that Triton compiles, CUDA-graph captures and the filling of the
cache happen before measuring. Each (alpha, rate) point then serves its own N requests
(seeded by seed, alpha and rate: every system sees the same ones) starting from the cache the
previous point left: the steady state of a server that runs this workload (``--cold`` clears
the cache before each point instead, counting every first use as a miss).

Metrics per point: TTFT p50/p95 (``ttft_s``: from the call to the first token),
TPOT (median), req/s and output tok/s over the wall time
(start to last completion), finish rate (completions per second: 1 / the least-squares slope
of the sorted completion times against their rank; the service rate, insensitive to the
latency of the first and last requests), **chunk hit rate** (chunk tokens served
from the cache / chunk tokens requested; the system prefix and the question are excluded, as
the prefix is always a hit and the question never is), prompt hit rate (cached prompt tokens /
prompt tokens, the prefix included), prefilled tokens, peak KV pool use, pages copied
re-rotated (block), evictions, preemptions, and for the engine's systems the point's **floor**
(``benchmarks/_common.py``'s ``floor``: its prefilled tokens at the dense per-token time plus its decode steps
at the weight-read time, both measured on the same engine in the same run), the point's
fraction of it, and where the rest of the wall went (prefill, decode, selection, host).

A system **sustains** a Poisson rate ``r`` when (1) every request completed, (2) its finish
rate is at least 90% of ``r`` (a stable queue drains as fast as it fills; an overloaded one
completes at its capacity, below ``r``) and (3) its TTFT p95 is at most ``--sustain-p95-factor``
(default 3) times its own TTFT p95 at the lowest rate of the same alpha and budget (the tail
does not explode as the queue builds up). The summary gives, per (alpha, budget): the highest
rate each of lazy and block sustains (with every lower swept rate sustained too); at block's
highest sustained rate, the lazy/block ratios of TTFT p50 (block / lazy) and of req/s (both
complete about what is offered there, so this one is about 1 by construction); the
sustained-throughput ratio (lazy's finish rate at its highest sustained rate / block's at its
own); the closed-loop (saturation) throughput and TTFT ratios; the chunk hit-rate ratio
lazy / block (pooled over the points). Per alpha with `hf`
rows: lazy against `hf` at the same rate (the largest budget lazy ran).

    # CPU, default model, small (what CI runs):
    python benchmarks/rag_serving.py --preset ci
    # H200, Llama-3.1-8B shapes with random bf16 weights: see benchmarks/gpu_run.sh serving
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass

import torch
from _common import floor, floor_line, llama31_8b_config, measure_rates, random_model, run_to_length

PRESETS = {
    "ci": dict(docs=12, doc_tokens=48, k=2, requests=6, output_tokens=3, budgets="0.6,1.0", rates="0",
               concurrency=2, alphas="2.1", systems="lazy,block,prefix,none,hf", warm_requests=2),
    # what benchmarks/gpu_run.sh serving runs
    "h200": dict(docs=100, doc_tokens=2048, k=5, requests=32, output_tokens=16, budgets="2.1=0.33,0.2,0.12;0=0.33",
                 rates="2.1=0,3,5,7,10,14;0=0,1.5,3;2.1@0.12=0", hf_rates="2.1=0;0=", concurrency=16,
                 alphas="2.1,0", systems="lazy,block,hf", random_8b=True, warm_requests=32, warm_concurrency=32,
                 deadline_s=420.0),
}
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]


@dataclass
class Req:
    question: str
    doc_ids: list[int]


def make_text(tok, n_tokens: int, rng: random.Random) -> str:
    """Text of at most (about) ``n_tokens`` tokens of random words (deterministic given
    ``rng``): the longest prefix of the drawn words that fits, found by bisection."""
    def count(ws):
        return len(tok(" ".join(ws), add_special_tokens=False)["input_ids"])

    words: list[str] = []
    while count(words) < n_tokens:
        words.extend(f"{rng.choice(WORDS)}{rng.randint(0, 9999)}" for _ in range(max(4, n_tokens // 8)))
    lo, hi = 1, len(words)  # the longest prefix with count <= n_tokens (at least one word)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(words[:mid]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def zipf_sample(rng: random.Random, n_docs: int, k: int, alpha: float) -> list[int]:
    weights = [1.0 / (i + 1) ** alpha for i in range(n_docs)]
    chosen: list[int] = []
    while len(chosen) < k:
        i = rng.choices(range(n_docs), weights=weights)[0]
        if i not in chosen:
            chosen.append(i)
    rng.shuffle(chosen)
    return chosen


def make_docs(tok, args) -> list[str]:
    rng = random.Random(args.seed)
    return [make_text(tok, args.doc_tokens, rng) for _ in range(args.docs)]


def make_requests(tok, args, alpha: float, stream: str, n: int) -> list[Req]:
    """``n`` requests of one stream (a measured point or the warm-up), seeded by the seed,
    alpha and stream name only: the same for every system."""
    rng = random.Random(f"{args.seed}/{alpha}/{stream}")
    return [Req(make_text(tok, rng.randint(32, 64), rng), zipf_sample(rng, args.docs, args.k, alpha))
            for _ in range(n)]


def arrivals(n: int, rate: float, seed) -> list[float]:
    """Poisson arrival times, rescaled so the n-th is at exactly ``n / rate``."""
    rng = random.Random(f"{seed}/arrivals")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    scale = (n / rate) / out[-1] if out else 1.0
    return [x * scale for x in out]


def drive(run_one, reqs, rate: float, concurrency: int, seed):
    """Submit requests (Poisson at ``rate`` or closed loop) and collect each ``run_one``
    result with its completion time (seconds from the start) as ``(result, done_at)``."""
    results: list = [None] * len(reqs)
    t0 = time.perf_counter()

    def call(i):
        try:
            res = run_one(reqs[i])
        except Exception as e:  # e.g. out of memory in transformers: reported as a failed request
            res = dict(error=repr(e))
        results[i] = (res, time.perf_counter() - t0)

    if rate > 0:
        threads = []
        for i, at in enumerate(arrivals(len(reqs), rate, seed)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=call, args=(i,))
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
                call(i)

        ws = [threading.Thread(target=worker) for _ in range(max(1, concurrency))]
        for w in ws:
            w.start()
        for w in ws:
            w.join()
    return results, time.perf_counter() - t0


def chunk_tokens_of(segments) -> int:
    return sum(len(ids) for kind, ids in segments if kind == "chunk")


def cached_chunk_tokens_of_prefix(segments, cached: int) -> int:
    """Chunk tokens inside the first ``cached`` prompt tokens (identical-prefix reuse)."""
    pos, out = 0, 0
    for kind, ids in segments:
        if kind == "chunk":
            out += max(0, min(cached, pos + len(ids)) - pos)
        pos += len(ids)
    return out


class HFServer:
    """transformers ``generate`` on the flattened prompt, one request at a time (FIFO),
    the way an in-process HuggingFacePipeline serves a chain."""

    def __init__(self, model, tok, prompts):
        from transformers.generation.streamers import BaseStreamer

        self.model, self.tok, self.prompts, self.lock = model, tok, prompts, threading.Lock()
        self.BaseStreamer = BaseStreamer

    def run(self, question, chunks, max_new_tokens):
        from lazyllm import Chunk

        segs = self.prompts.build(question, [Chunk(c) for c in chunks], None)
        ids = [t for s in segs for t in s.ids]
        n_chunk = sum(len(s.ids) for s in segs if s.kind == "chunk")
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
        return dict(ttft=ttft, tpot=(end - submit - ttft) / max(n - 1, 1), out=n, prompt=len(ids),
                    cached=0, chunk=n_chunk, cached_chunk=0)


def kv_bytes_per_token(cfg, dtype) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kvh * head_dim * torch.empty((), dtype=dtype).element_size()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(math.ceil(q * len(xs))) - 1)] if xs else float("nan")


def finish_rate(done: list[float], fallback: float) -> float:
    """Completions per second: 1 / the least-squares slope of the sorted completion times
    against their rank (all completions weigh in, not just the first and the last, whose
    latencies would add their noise to a short run)."""
    n = len(done)
    if n < 2:
        return fallback
    mi, mt = (n - 1) / 2, sum(done) / n
    cov = sum((i - mi) * (t - mt) for i, t in enumerate(done))
    var = sum((i - mi) ** 2 for i in range(n))
    return var / cov if cov > 0 else fallback


def engine_profile(m0: dict, m: dict, wall: float) -> dict:
    """Where a point's time went, from the engine's counters before (``m0``) and after
    (``m``): the engine thread's seconds in prefill and in decode steps as shares of the
    wall time, decode steps and their mean batch, the share of steps served by shared-chunk
    decode, and how many shared plans were built (a plan is rebuilt when the rows change)."""
    d = {k: m.get(k, 0) - m0.get(k, 0) for k in ("prefill_s", "decode_s", "decode_steps", "decode_tokens",
                                                 "shared_decode_steps", "shared_plans", "prefill_tokens")}
    steps = max(d["decode_steps"], 1)
    return dict(prefill_share=d["prefill_s"] / wall, decode_share=d["decode_s"] / wall,
                decode_steps=d["decode_steps"], mean_batch=d["decode_tokens"] / steps,
                ms_per_step=1e3 * d["decode_s"] / steps, shared_step_share=d["shared_decode_steps"] / steps,
                shared_plans=d["shared_plans"],
                prefill_ms_per_1k_tokens=1e6 * d["prefill_s"] / max(d["prefill_tokens"], 1))


def summarize_point(system, budget, rate, alpha, res, wall, extra) -> dict:
    failed = [x for x, _ in res if "error" in x]
    ok = [(x, t) for x, t in res if "error" not in x]
    row = dict(system=system, budget=budget, rate=rate, alpha=alpha, requests=len(ok), failed=len(failed),
               wall_s=wall, **extra)
    if failed:
        row["error"] = failed[0]["error"]
    if not ok:
        row.update(ttft_p50_ms=float("nan"), ttft_p95_ms=float("nan"), tpot_ms=float("nan"), req_per_s=0.0,
                   out_tok_per_s=0.0, finish_rate=0.0, hit_rate=0.0, prompt_hit_rate=0.0,
                   chunk_tokens=0, cached_chunk_tokens=0)
        return row
    xs = [x for x, _ in ok]
    ttft = [x["ttft"] for x in xs]
    done = sorted(t for _, t in ok)
    chunk, cached_chunk = sum(x["chunk"] for x in xs), sum(x["cached_chunk"] for x in xs)
    row.update(ttft_p50_ms=statistics.median(ttft) * 1e3, ttft_p95_ms=pct(ttft, 0.95) * 1e3,
               tpot_ms=statistics.median(x["tpot"] for x in xs) * 1e3, req_per_s=len(xs) / wall,
               out_tok_per_s=sum(x["out"] for x in xs) / wall,
               # Poisson only: a closed loop's clients finish in waves, its rate is req/s
               finish_rate=finish_rate(done, len(xs) / wall) if rate > 0 else len(xs) / wall,
               hit_rate=cached_chunk / max(chunk, 1), chunk_tokens=chunk, cached_chunk_tokens=cached_chunk,
               prompt_hit_rate=sum(x["cached"] for x in xs) / max(sum(x["prompt"] for x in xs), 1))
    return row


class LazyRunner:
    """One engine (system, budget), reused across alphas and rates."""

    def __init__(self, system, hf, tok, args, budget_frac, pool_bytes):
        from lazyllm import LazyLLM
        from lazyllm.kernels.options import KernelOptions

        self.system, self.args, self.budget = system, args, budget_frac
        # packets=None: the budgets are fractions of the corpus's own tokens and the systems are
        # compared as they reuse KV; a learned packet (shipped for the default model) would add
        # its tokens to every chunk of lazy and block only
        # `balanced`: lazy reuse with the balanced fidelity preset (selective recompute); a
        # `+mixed` variant (`lazy+mixed`) runs the same system with mixed steps on
        base, _, variant = system.partition("+")
        if variant not in ("", "mixed"):
            raise SystemExit(f"unknown system variant {system!r} (known: +mixed)")
        self.base = base
        # the reuse modes as they are (quality="isolated": nothing recomputed), or balanced's recompute
        kw = dict(quality="balanced") if base == "balanced" else dict(quality="isolated", reuse=base)
        if variant == "mixed":
            kw.update(mixed_steps=True, step_token_budget=args.step_token_budget)
        self.llm = LazyLLM(model=hf, tokenizer=tok, packets=None, warmup=args.warmup, **kw,
                           kv_cache_bytes=max(int(budget_frac * pool_bytes), 1 << 20), page_size=args.page_size,
                           kernel_options=KernelOptions(shared_decode=args.shared_decode))
        run_to_length(self.llm)  # every request runs to its length: same work for every system
        # the floor's rates, measured on this engine (two fresh chunks, dropped again)
        self.rates = measure_rates(self.llm, min(args.doc_tokens, 1024))
        self.llm.clear_cache()
        print(f"  {system}: {self.rates.line()}", flush=True)
        self.page_bytes = pool_bytes / max(args.docs * args.doc_tokens, 1) * self.llm.page_size

    def one(self, r, docs):
        from lazyllm import LazyLLMError

        try:
            out = self.llm.generate(r.question, chunks=[docs[i] for i in r.doc_ids],
                                    max_new_tokens=self.args.output_tokens)
        except LazyLLMError as e:  # e.g. a budget too small for this system: reported, not fatal
            return dict(error=str(e))
        segs = out.prompt_segments
        if self.base in ("lazy", "block", "balanced"):
            cached_chunk = out.usage.cached_chunk_tokens
        else:
            cached_chunk = cached_chunk_tokens_of_prefix(segs, out.usage.cached_tokens)
        return dict(ttft=out.ttft_s, tpot=out.tpot_s, out=out.usage.completion_tokens,
                    prompt=out.usage.prompt_tokens, cached=out.usage.cached_tokens, chunk=chunk_tokens_of(segs),
                    cached_chunk=cached_chunk)

    def warm(self, reqs, docs):
        """Compiles, graph captures and a filled cache, before measuring."""
        drive(lambda r: self.one(r, docs), reqs, 0.0, self.args.warm_concurrency, 0)

    def measure(self, reqs, docs, rate, alpha):
        a, llm = self.args, self.llm
        if a.cold:
            llm.clear_cache()
        m, c = llm.engine.metrics, llm.store.counters
        m0, c0 = dict(m), dict(c.__dict__)
        g0 = llm.engine.graph_stats()
        m.peak_pages = 0
        res, wall = drive(lambda r: self.one(r, docs), reqs, rate, a.concurrency, f"{a.seed}/{alpha}/{rate}")
        g1 = llm.engine.graph_stats()
        lookups = (c.hits - c0["hits"]) + (c.misses - c0["misses"])
        extra = dict(prefill_tokens=m["prefill_tokens"] - m0["prefill_tokens"],
                     peak_kv_gib=m["peak_pages"] * self.page_bytes / 2**30,
                     copied_gib=(m.get("copied_pages", 0) - m0.get("copied_pages", 0)) * self.page_bytes / 2**30,
                     evictions=c.evictions - c0["evictions"], preemptions=m["preemptions"] - m0["preemptions"],
                     # CUDA graphs captured during the point, and the seconds requests waited for them
                     graph_captures=sum(g1[k] - g0[k] for k in ("decode_graphs", "prefill_graphs")),
                     capture_s=g1["capture_s"] - g0["capture_s"],
                     # cache_stats' rate over segment lookups (the prefix included), as earlier runs
                     # reported it (then inflated: each re-planning of a waiting request counted)
                     store_lookup_hit_rate=(c.hits - c0["hits"]) / max(lookups, 1))
        extra["profile"] = engine_profile(m0, m, wall)
        extra["floor"] = floor(self.rates, m0, dict(m), wall)
        print(f"  {self.system} alpha={alpha:g} rate={rate:g}: " +
              ", ".join(f"{k} {v:.3g}" for k, v in extra["profile"].items()), flush=True)
        print(f"  {self.system} alpha={alpha:g} rate={rate:g}: {floor_line(extra['floor'])}", flush=True)
        return summarize_point(self.system, self.budget, rate, alpha, res, wall, extra)

    def close(self):
        self.llm.close()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def per_alpha(spec: str, alphas: list[float]) -> dict:
    """``"1,2"`` (every alpha) or ``"2.1=1,2;0=3"`` -> {alpha: [values]}; a key
    ``alpha@budget`` (``"2.1@0.12=0"``) overrides the alpha's values at that budget, under
    the key ``(alpha, budget)``."""
    if "=" not in spec:
        vals = [float(v) for v in spec.split(",") if v.strip()]
        return {a: vals for a in alphas}
    out: dict = {}
    for part in spec.split(";"):
        if part.strip():
            key, vals = part.split("=")
            k = tuple(float(x) for x in key.split("@")) if "@" in key else float(key)
            out[k] = [float(v) for v in vals.split(",") if v.strip()]
    missing = [a for a in alphas if a not in out]
    if missing:
        raise SystemExit(f"no values given for alpha {missing} in {spec!r}")
    return out


def mark_sustained(rows, factor: float) -> None:
    """Set ``sustained`` on every Poisson row (None on closed-loop rows); see the module
    docstring for the definition."""
    groups: dict = {}
    for r in rows:
        if r["rate"] > 0:
            groups.setdefault((r["system"], r["alpha"], r["budget"]), []).append(r)
    for r in rows:
        r["sustained"] = None
    for grp in groups.values():
        grp.sort(key=lambda r: r["rate"])
        base = grp[0]["ttft_p95_ms"]
        for r in grp:
            r["sustained"] = bool(r["failed"] == 0 and r["requests"] > 0 and r["finish_rate"] >= 0.9 * r["rate"]
                                  and r["ttft_p95_ms"] <= factor * base)


def _ratio(a, b):
    return a / b if b and not math.isnan(b) and not math.isnan(a) else float("nan")


def summarize(rows) -> list[dict]:
    """Per (alpha, budget) with lazy and block rows: the acceptance figures (see the module
    docstring); per alpha with hf rows: lazy against hf."""
    out = []
    keys = sorted({(r["alpha"], r["budget"]) for r in rows if r["system"] in ("lazy", "block")}, reverse=True)
    for alpha, budget in keys:
        sel = {s: [r for r in rows if r["system"] == s and r["alpha"] == alpha and r["budget"] == budget]
               for s in ("lazy", "block")}
        if not sel["lazy"] or not sel["block"]:
            continue
        s = dict(alpha=alpha, budget=budget)

        def best(system):  # the highest rate below which every swept rate is sustained
            out = None
            for r in sorted((r for r in sel[system] if r["rate"] > 0), key=lambda r: r["rate"]):
                if not r["sustained"]:
                    break
                out = r
            return out

        lb, bb = best("lazy"), best("block")
        s["lazy_max_sustained_rate"] = lb["rate"] if lb else None
        s["block_max_sustained_rate"] = bb["rate"] if bb else None
        if bb:
            lz = next((r for r in sel["lazy"] if r["rate"] == bb["rate"]), None)
            if lz:
                s["at_block_max"] = dict(rate=bb["rate"], lazy_ttft_p50_ms=lz["ttft_p50_ms"],
                                         block_ttft_p50_ms=bb["ttft_p50_ms"],
                                         ttft_p50_ratio=_ratio(bb["ttft_p50_ms"], lz["ttft_p50_ms"]),
                                         ttft_p95_ratio=_ratio(bb["ttft_p95_ms"], lz["ttft_p95_ms"]),
                                         req_per_s_ratio=_ratio(lz["req_per_s"], bb["req_per_s"]),
                                         hit_rate_ratio=_ratio(lz["hit_rate"], bb["hit_rate"]))
        if lb and bb:
            s["sustained_throughput_ratio"] = _ratio(lb["finish_rate"], bb["finish_rate"])
            s["sustained_rate_ratio"] = _ratio(lb["rate"], bb["rate"])
        cl = {k: next((r for r in v if r["rate"] == 0), None) for k, v in sel.items()}
        if cl["lazy"] and cl["block"]:
            s["closed_loop"] = dict(lazy_req_per_s=cl["lazy"]["req_per_s"], block_req_per_s=cl["block"]["req_per_s"],
                                    throughput_ratio=_ratio(cl["lazy"]["req_per_s"], cl["block"]["req_per_s"]),
                                    ttft_p50_ratio=_ratio(cl["block"]["ttft_p50_ms"], cl["lazy"]["ttft_p50_ms"]))
        pooled = {k: sum(r["cached_chunk_tokens"] for r in v) / max(sum(r["chunk_tokens"] for r in v), 1)
                  for k, v in sel.items()}
        s["lazy_hit_rate"], s["block_hit_rate"] = pooled["lazy"], pooled["block"]
        s["hit_rate_ratio"] = _ratio(pooled["lazy"], pooled["block"])
        out.append(s)
    for alpha in sorted({r["alpha"] for r in rows if r["system"] == "hf"}, reverse=True):
        for h in [r for r in rows if r["system"] == "hf" and r["alpha"] == alpha]:
            lz = [r for r in rows if r["system"] == "lazy" and r["alpha"] == alpha and r["rate"] == h["rate"]]
            if not lz:
                continue
            lz = max(lz, key=lambda r: r["budget"])
            out.append(dict(alpha=alpha, rate=h["rate"], vs="hf", lazy_budget=lz["budget"],
                            throughput_ratio=_ratio(lz["req_per_s"], h["req_per_s"]),
                            ttft_p50_ratio=_ratio(h["ttft_p50_ms"], lz["ttft_p50_ms"])))
    return out


def fmt(x, spec=".2f"):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_summary(summary) -> None:
    print("\nSummary (ratios are lazy's advantage: >1 favours lazy)")
    for s in summary:
        if s.get("vs") == "hf":
            print(f"- alpha {s['alpha']}, rate {s['rate'] or 'closed loop'}: lazy (budget {s['lazy_budget']}) vs hf: "
                  f"throughput {fmt(s['throughput_ratio'])}x, TTFT p50 {fmt(s['ttft_p50_ratio'])}x lower")
            continue
        line = (f"- alpha {s['alpha']}, budget {s['budget']}: block sustains up to "
                f"{fmt(s['block_max_sustained_rate'], 'g')} req/s, lazy up to "
                f"{fmt(s['lazy_max_sustained_rate'], 'g')} req/s")
        if "at_block_max" in s:
            a = s["at_block_max"]
            line += (f"; at {a['rate']:g} req/s: TTFT p50 {fmt(a['ttft_p50_ratio'])}x lower "
                     f"({a['lazy_ttft_p50_ms']:.0f} vs {a['block_ttft_p50_ms']:.0f} ms), "
                     f"req/s {fmt(a['req_per_s_ratio'])}x")
        if "sustained_throughput_ratio" in s:
            line += f"; sustained throughput {fmt(s['sustained_throughput_ratio'])}x"
        if "closed_loop" in s:
            c = s["closed_loop"]
            line += (f"; closed loop: throughput {fmt(c['throughput_ratio'])}x ({c['lazy_req_per_s']:.2f} vs "
                     f"{c['block_req_per_s']:.2f} req/s), TTFT p50 {fmt(c['ttft_p50_ratio'])}x lower")
        line += (f"; chunk hit rate {fmt(s['lazy_hit_rate'])} vs {fmt(s['block_hit_rate'])} "
                 f"({fmt(s['hit_rate_ratio'])}x)")
        print(line)


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    systems = sorted({r["system"] for r in rows})
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    # TTFT p50 against the offered rate, one panel per (alpha, budget); hollow markers: not sustained
    configs = sorted({(r["alpha"], r["budget"]) for r in rows if r["rate"] > 0 and r["system"] != "hf"},
                     key=lambda c: (-c[0], c[1]))
    n = max(1, len(configs))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    for ax, (alpha, budget) in zip(axes[0], configs):
        for s in systems:
            pts = sorted((r["rate"], r["ttft_p50_ms"], r["sustained"]) for r in rows if r["system"] == s
                         and r["rate"] > 0 and r["alpha"] == alpha and (r["budget"] == budget or s == "hf"))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[s], label=s)
            for x, y, ok in pts:
                ax.plot([x], [y], marker="o", color=colors[s], markerfacecolor=colors[s] if ok else "none")
        ax.set_yscale("log")
        ax.set_title(f"alpha {alpha:g}, KV budget {budget:g}", fontsize=9)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.legend(fontsize=8)
    if not configs:
        axes[0][0].text(0.5, 0.5, "no Poisson rates in this run", ha="center")
    fig.suptitle("TTFT p50 vs rate (hollow: rate not sustained)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ttft_vs_rate.png"), dpi=120)
    plt.close(fig)

    def by_budget(y, name, ylabel, title):
        fig, ax = plt.subplots(figsize=(5.2, 3.6))
        for s in systems:
            if s == "hf":
                continue
            for j, alpha in enumerate(sorted({r["alpha"] for r in rows}, reverse=True)):
                pts = []
                for b in sorted({r["budget"] for r in rows if r["system"] == s and r["alpha"] == alpha}):
                    grp = [r for r in rows if r["system"] == s and r["alpha"] == alpha and r["budget"] == b]
                    pts.append((b, y(grp)))
                pts = [p for p in pts if p[1] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^v"[j % 4], color=colors[s],
                            linestyle="-" if j == 0 else "--", label=f"{s}, alpha {alpha:g}")
        ax.set_xlabel("KV budget (fraction of the document pool)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=120)
        plt.close(fig)

    def throughput(grp):
        closed = [r for r in grp if r["rate"] == 0]
        if closed:
            return closed[0]["req_per_s"]
        ok = [r for r in grp if r["sustained"]]
        return max(r["finish_rate"] for r in ok) if ok else None

    def hit(grp):
        return sum(r["cached_chunk_tokens"] for r in grp) / max(sum(r["chunk_tokens"] for r in grp), 1)

    by_budget(throughput, "throughput_vs_budget.png", "req/s",
              "throughput vs KV budget (closed loop, else best sustained)")
    by_budget(hit, "hit_rate_vs_budget.png", "chunk hit rate", "chunk hit rate vs KV budget")


def print_table(rows) -> None:
    print("| system | alpha | rate | KV budget | done/failed | TTFT p50 ms | TTFT p95 ms | TPOT ms | req/s | finish/s "
          "| sustained | out tok/s | chunk hit rate | prompt hit rate | prefilled tokens | peak KV GiB | copied GiB "
          "| evictions | preemptions |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: | ---: |")
    for r in rows:
        sus = {None: "—", True: "yes", False: "no"}[r["sustained"]]
        print(f"| {r['system']} | {r['alpha']:g} | {r['rate'] or 'closed'} | {r['budget']:.2f} | "
              f"{r['requests']}/{r['failed']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | {r['tpot_ms']:.1f} | "
              f"{r['req_per_s']:.2f} | {r['finish_rate']:.2f} | {sus} | {r['out_tok_per_s']:.1f} | "
              f"{r['hit_rate']:.2f} | {r['prompt_hit_rate']:.2f} | {r['prefill_tokens']} | {fmt(r['peak_kv_gib'])} | "
              f"{fmt(r['copied_gib'])} | {r['evictions']} | {r['preemptions']} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    ap.add_argument("--random-8b", action="store_true", help="random bf16 weights in Llama-3.1-8B shapes (GPU)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer folder for --random-8b (default: the default model's; to carry one to a GPU "
                         "machine: python benchmarks/engine.py --save-tokenizer DIR)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--alphas", default="2.1")
    ap.add_argument("--requests", type=int, default=64, help="requests per measured point")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rates", default="0",
                    help="Poisson rates in requests/s, 0 = closed loop; per alpha: '2.1=2,4;0=1'")
    ap.add_argument("--hf-rates", default=None, help="the rates at which hf runs (default: every rate)")
    ap.add_argument("--concurrency", type=int, default=8, help="clients of the closed loop")
    ap.add_argument("--budgets", default="0.2,0.33,1.0",
                    help="KV budget as a fraction of the document pool's KV; per alpha: '2.1=0.2,0.33;0=0.33'")
    ap.add_argument("--systems", default="lazy,block,prefix,none,hf",
                    help="comma-separated: lazy, block, prefix, none (the engine's reuse modes), balanced "
                         "(lazy with quality='balanced'), hf (transformers generate); an engine system with "
                         "'+mixed' (lazy+mixed, balanced+mixed) runs with mixed_steps=True")
    ap.add_argument("--step-token-budget", type=int, default=2048,
                    help="tokens per mixed step of the '+mixed' systems (LazyLLM(step_token_budget=...))")
    ap.add_argument("--warm-requests", type=int, default=None, help="warm-up requests per alpha (2 x concurrency)")
    ap.add_argument("--warm-concurrency", type=int, default=None, help="(default: --concurrency)")
    ap.add_argument("--cold", action="store_true", help="clear the cache before each measured point")
    ap.add_argument("--sustain-p95-factor", type=float, default=3.0)
    ap.add_argument("--page-size", type=int, default=None, help="default: the engine's (64 on CUDA, 16 on CPU)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new point after this many seconds (the skipped ones are listed)")
    ap.add_argument("--shared-decode", action=argparse.BooleanOptionalAction, default=True,
                    help="shared-chunk decode where requests of a step hold the same pages (the engine's default); "
                         "--no-shared-decode: the per-request kernel only")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="LazyLLM(warmup=...): compile and capture everything at construction (the measured "
                         "points follow the warm-up stream either way)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plots", default=None, help="folder for PNG plots")
    args = ap.parse_args(argv)
    if args.preset:
        defaults = ap.parse_args([])
        for key, val in PRESETS[args.preset].items():
            if getattr(args, key) == getattr(defaults, key, None):
                setattr(args, key, val)
    if args.warm_requests is None:
        args.warm_requests = 2 * args.concurrency
    if args.warm_concurrency is None:
        args.warm_concurrency = args.concurrency
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir, load_hf

    t_start = time.perf_counter()
    if args.random_8b:
        hf = random_model(llama31_8b_config(32))
        tok = AutoTokenizer.from_pretrained(args.tokenizer or str(default_model_dir()))
        name = "random Llama-3.1-8B shapes, bf16"
    else:
        dev = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto"
                                                                                  else args.device)
        hf, tok, name = load_hf(args.model, device=dev, dtype=torch.bfloat16 if dev.startswith("cuda")
                                else torch.float32)
    alphas = [float(a) for a in args.alphas.split(",")]
    rates, budgets = per_alpha(args.rates, alphas), per_alpha(args.budgets, alphas)
    hf_rates = per_alpha(args.hf_rates, alphas) if args.hf_rates is not None else rates
    docs = make_docs(tok, args)
    points = {}
    for key, rs in list(rates.items()) + list(hf_rates.items()):
        a = key[0] if isinstance(key, tuple) else key
        if a in alphas:
            for r in rs:
                points.setdefault((a, r), make_requests(tok, args, a, f"rate{r:g}", args.requests))
    warm = {a: make_requests(tok, args, a, "warm", args.warm_requests) for a in alphas}
    print(f"model and workload ready in {time.perf_counter() - t_start:.1f} s", flush=True)
    pool_bytes = args.docs * args.doc_tokens * kv_bytes_per_token(hf.config, next(hf.parameters()).dtype)
    rows: list = []

    def save():  # after every point: a run cut short still leaves its figures
        if args.json:
            rs = [dict(r) for r in rows]
            mark_sustained(rs, args.sustain_p95_factor)
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "device": dev_name, "model": name, "rows": rs,
                           "summary": summarize(rs)}, f, indent=2)

    dev_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    systems = args.systems.split(",")
    budget_order = list(dict.fromkeys(b for a in alphas for b in budgets[a]))  # as given: most wanted first
    skipped: list = []  # points not started because --deadline-s had passed

    def late(what: list) -> bool:
        if args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s:
            skipped.extend(what)
            return True
        return False

    for b in budget_order:  # budget-major: lazy and block of one budget run back to back
        for system in [s for s in systems if s != "hf"]:
            todo = [(a, r) for a in alphas if b in budgets[a] for r in rates.get((a, b), rates[a])]
            if late([f"{system} alpha={a:g} budget={b} rate={r:g}" for a, r in todo]):
                continue
            runner = LazyRunner(system, hf, tok, args, b, pool_bytes)
            try:
                for a in alphas:
                    if b not in budgets[a]:
                        continue
                    mine = rates.get((a, b), rates[a])
                    if late([f"{system} alpha={a:g} budget={b} rate={r:g}" for r in mine]):
                        continue
                    t = time.perf_counter()
                    runner.warm(warm[a], docs)
                    print(f"  {system:6s} alpha={a:g} budget={b}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
                    for rate in mine:
                        if late([f"{system} alpha={a:g} budget={b} rate={rate:g}"]):
                            continue
                        t = time.perf_counter()
                        row = runner.measure(points[(a, rate)], docs, rate, a)
                        rows.append(row)
                        save()
                        print(f"  {system:6s} alpha={a:g} budget={b} rate={rate:g}: ttft p50 {row['ttft_p50_ms']:.1f} "
                              f"ms, {row['req_per_s']:.2f} req/s, chunk hit rate {row['hit_rate']:.2f} "
                              f"({time.perf_counter() - t:.1f} s)", flush=True)
            finally:
                runner.close()
    hf_todo = [(a, r) for a in alphas for r in hf_rates[a]]
    if "hf" in systems and hf_todo and not late([f"hf alpha={a:g} rate={r:g}" for a, r in hf_todo]):
        from lazyllm.inputs import PromptBuilder

        server = HFServer(hf, tok, PromptBuilder(tok))
        r0 = warm[alphas[0]][0]
        server.run(r0.question, [docs[i] for i in r0.doc_ids], 2)  # warm-up
        for a, rate in hf_todo:
            if late([f"hf alpha={a:g} rate={rate:g}"]):
                continue
            t = time.perf_counter()
            res, wall = drive(lambda r: server.run(r.question, [docs[i] for i in r.doc_ids], args.output_tokens),
                              points[(a, rate)], rate, args.concurrency, f"{args.seed}/{a}/{rate}")
            extra = dict(prefill_tokens=sum(x["prompt"] for x, _ in res if "error" not in x),
                         peak_kv_gib=float("nan"), copied_gib=float("nan"), evictions=0, preemptions=0,
                         store_lookup_hit_rate=0.0)
            row = summarize_point("hf", 1.0, rate, a, res, wall, extra)
            rows.append(row)
            save()
            print(f"  hf     alpha={a:g} rate={rate:g}: ttft p50 {row['ttft_p50_ms']:.1f} ms, "
                  f"{row['req_per_s']:.2f} req/s ({time.perf_counter() - t:.1f} s)", flush=True)
    mark_sustained(rows, args.sustain_p95_factor)
    summary = summarize(rows)
    print(f"\nRAG serving, {name} on {dev_name}, {args.docs} docs x {args.doc_tokens} tokens, k={args.k}, "
          f"{args.requests} requests per point, {args.output_tokens} output tokens, "
          f"{'cold' if args.cold else 'steady-state'} cache, {time.strftime('%Y-%m-%d')}, "
          f"{time.perf_counter() - t_start:.0f} s in all")
    print_table(rows)
    print_summary(summary)
    if skipped:
        print(f"\nSkipped (past --deadline-s {args.deadline_s:g}): " + "; ".join(skipped))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": dev_name, "model": name, "rows": rows, "summary": summary,
                       "skipped": skipped}, f, indent=2)
    if args.plots:
        plot(rows, args.plots)
    return rows, summary


if __name__ == "__main__":
    main()
